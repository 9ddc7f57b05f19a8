//! `proxy status`: a readable table of services, clusters, hosts, health and weights, read from
//! a running daemon's admin interface (`/routing`, the daemon's own view; `/clusters?format=json`
//! is Envoy's schema, which has no services and no routable flag).

use std::{
    io::{Read, Write},
    net::TcpStream,
    os::unix::net::UnixStream,
    time::Duration,
};

use anyhow::{Context as _, bail};
use proxy_core::config::AdminAddress;
use serde::Deserialize;

#[derive(Deserialize)]
struct Cluster {
    name: String,
    services: Vec<String>,
    hosts: Vec<Host>,
}

#[derive(Deserialize)]
struct Host {
    address: String,
    health_flags: String,
    weight: u32,
    priority: u32,
    routable: bool,
}

/// The largest answer read from the admin interface (256 MiB).
const MAX_ANSWER: usize = 256 << 20;

/// Fetches the daemon's clusters and prints them, as a table or (`json`) as the daemon's
/// `/routing` document on one line; the answer must come within `timeout`.
pub fn run(
    admin: &AdminAddress,
    timeout: Duration,
    json: bool,
    out: &mut impl std::io::Write,
) -> anyhow::Result<()> {
    let body = get(admin, "/routing", timeout)?;
    let document: serde_json::Value = serde_json::from_str(&body).context("parsing /routing")?;
    let clusters = Vec::<Cluster>::deserialize(&document).context("reading /routing")?;
    if json {
        serde_json::to_writer(&mut *out, &document)?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(
        out,
        "{:<28} {:<14} {:<24} {:>4} {:>8} {:<9} HEALTH",
        "SERVICE", "CLUSTER", "HOST", "PRIO", "WEIGHT", "ROUTABLE"
    )?;
    for cluster in &clusters {
        let services = if cluster.services.is_empty() {
            "-".to_owned()
        } else {
            cluster.services.join(", ")
        };
        if cluster.hosts.is_empty() {
            writeln!(out, "{services:<28} {:<14} (no hosts)", cluster.name)?;
        }
        for (i, h) in cluster.hosts.iter().enumerate() {
            let svc = if i == 0 { services.as_str() } else { "" };
            let routable = if h.routable { "yes" } else { "no" };
            writeln!(
                out,
                "{svc:<28} {:<14} {:<24} {:>4} {:>8} {routable:<9} {}",
                cluster.name, h.address, h.priority, h.weight, h.health_flags
            )?;
        }
    }
    Ok(())
}

/// The longest timeout honoured (a larger one could not make a deadline).
fn max_timeout() -> Duration {
    Duration::from_secs(365 * 24 * 3600)
}

/// How long connecting to the admin interface may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A connection to the admin interface, over TCP or a unix socket.
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn connect(addr: &AdminAddress) -> std::io::Result<Self> {
        match addr {
            AdminAddress::Tcp(tcp) => {
                TcpStream::connect_timeout(tcp, CONNECT_TIMEOUT).map(Self::Tcp)
            }
            // A local connect does not wait: it succeeds or is refused at once.
            AdminAddress::Unix(path) => UnixStream::connect(path).map(Self::Unix),
        }
    }

    fn set_read_timeout(&self, timeout: Duration) -> std::io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_read_timeout(Some(timeout)),
            Self::Unix(s) => s.set_read_timeout(Some(timeout)),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Self::Tcp(s) => s.flush(),
            Self::Unix(s) => s.flush(),
        }
    }
}

/// One GET, read to its end within `timeout` and at most [`MAX_ANSWER`] bytes.
fn get(addr: &AdminAddress, path: &str, timeout: Duration) -> anyhow::Result<String> {
    get_bounded(addr, path, timeout, MAX_ANSWER)
}

fn get_bounded(
    addr: &AdminAddress,
    path: &str,
    timeout: Duration,
    max: usize,
) -> anyhow::Result<String> {
    let (status, head, body) = request(addr, "GET", path, timeout, max)?;
    if status != 200 {
        bail!("GET {path}: {}", head.lines().next().unwrap_or_default());
    }
    Ok(body)
}

/// What `proxy reload` reports: the daemon's answer, and whether the file was invalid.
pub enum Reloaded {
    /// Applied (or no change).
    Done(String),
    /// The file does not validate; nothing changed.
    Invalid(String),
    /// Refused for another reason (needs a restart, failed to apply); nothing changed.
    Refused(String),
}

/// `POST /reload` on the daemon at `addr`.
pub fn reload(addr: &AdminAddress, timeout: Duration) -> anyhow::Result<Reloaded> {
    let (status, head, body) = request(addr, "POST", "/reload", timeout, 1 << 20)?;
    let body = body.trim_end().to_owned();
    Ok(match status {
        200 => Reloaded::Done(body),
        400 => Reloaded::Invalid(body),
        409 | 500 | 503 | 504 => Reloaded::Refused(body),
        _ => bail!(
            "POST /reload: {}: {body}",
            head.lines().next().unwrap_or_default()
        ),
    })
}

/// The `Host` of a request to `addr`: the TCP admin answers only requests that name it.
pub(crate) fn host(addr: &AdminAddress) -> String {
    match addr {
        AdminAddress::Tcp(tcp) => tcp.to_string(),
        AdminAddress::Unix(_) => "localhost".to_owned(),
    }
}

/// What to say when connecting to `addr` failed.
fn connect_hint(addr: &AdminAddress) -> String {
    let hint = match addr {
        AdminAddress::Unix(_) => {
            "is the daemon running, with this control socket? it is root's (mode 0600); pass \
             --admin unix:/run/proxy/<instance>.admin for another instance, or --admin ip:port \
             for the read-only TCP admin"
        }
        AdminAddress::Tcp(_) => "is the daemon running, with this admin.address? (--admin)",
    };
    format!("connecting to the admin interface at {addr} ({hint})")
}

/// One request, read to its end within `timeout` and at most `max` bytes: the status code,
/// the head and the body.
fn request(
    addr: &AdminAddress,
    method: &str,
    path: &str,
    timeout: Duration,
    max: usize,
) -> anyhow::Result<(u16, String, String)> {
    let deadline = std::time::Instant::now() + timeout.min(max_timeout());
    let mut stream = Stream::connect(addr).with_context(|| connect_hint(addr))?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nhost: {}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
        host(addr)
    )?;
    let mut raw = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            bail!("{method} {path}: no complete answer within {timeout:?} (--timeout)");
        }
        stream.set_read_timeout(left)?;
        let n = match stream.read(&mut chunk) {
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                bail!("{method} {path}: no complete answer within {timeout:?} (--timeout)")
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).with_context(|| format!("{method} {path}")),
        };
        if n == 0 {
            break;
        }
        if raw.len() + n > max {
            bail!("{method} {path}: the answer is larger than {max} bytes");
        }
        raw.extend_from_slice(&chunk[..n]);
    }
    let response = String::from_utf8(raw).context("the answer is not UTF-8")?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .with_context(|| {
            format!(
                "{method} {path}: not an HTTP answer: {:?}",
                head.lines().next().unwrap_or_default()
            )
        })?;
    Ok((status, head.to_owned(), body.to_owned()))
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    /// A server that answers every connection with `answer`, then keeps it open.
    fn server(answer: Vec<u8>) -> AdminAddress {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = listener.accept() {
                let _ = s.write_all(&answer);
                std::thread::sleep(Duration::from_secs(3));
            }
        });
        AdminAddress::Tcp(addr)
    }

    #[test]
    fn an_answer_that_never_ends_times_out_as_a_whole() {
        let addr = server(b"HTTP/1.1 200 OK\r\n\r\n[".to_vec());
        let started = std::time::Instant::now();
        let err = get(&addr, "/clusters", Duration::from_millis(300)).unwrap_err();
        assert!(
            err.to_string().contains("no complete answer within"),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn an_answer_over_the_bound_is_refused() {
        let mut answer = b"HTTP/1.1 200 OK\r\n\r\n".to_vec();
        answer.extend(std::iter::repeat_n(b'x', 10_000));
        let addr = server(answer);
        let err = get_bounded(&addr, "/clusters", Duration::from_secs(2), 1000).unwrap_err();
        assert!(err.to_string().contains("larger than 1000 bytes"), "{err}");
    }
}
