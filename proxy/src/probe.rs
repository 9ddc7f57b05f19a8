//! `proxy probe`: connect to an address a bounded number of times, from inside a cgroup (and
//! optionally a network namespace), and report which backend answered each connection and what
//! `getpeername` showed. Backends identify themselves by the first line they send (a banner);
//! servers that send none are probed with a plain connect or an HTTP GET instead ([`Expect`]).
//!
//! The demo and the integration tests use it; operators can use it to see how a service's
//! connections spread over its hosts.

use std::{
    collections::BTreeMap,
    io::{self, BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    path::Path,
    time::{Duration, Instant},
};

use serde::Serialize;

/// What to probe and from where.
#[derive(Clone, Debug)]
pub struct ProbeOptions {
    /// The address to connect to (normally a service VIP).
    pub target: SocketAddr,
    /// Number of connections, one after another.
    pub count: u32,
    /// UDP: send one datagram per connected socket and read one back.
    pub udp: bool,
    /// Per-connection timeout for connect and for reading the answer.
    pub timeout: Duration,
    /// What makes a TCP connection a success (UDP always waits for a datagram back).
    pub expect: Expect,
}

/// What a TCP probe waits for after it connected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Expect {
    /// The first line the server sends, which names the backend (the demo's and the tests'
    /// servers send one). A server that closes without a line counts as "(no banner)".
    #[default]
    Banner,
    /// Nothing: the connect itself is the success (for servers that wait for the client).
    Connect,
    /// An HTTP response to `GET /`: the status line, reported as "HTTP <code>".
    Http,
}

/// The outcome of a probe run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ProbeReport {
    /// Connections per backend banner (`"(no banner)"` when the peer sent nothing).
    pub backends: BTreeMap<String, u32>,
    /// Distinct addresses `getpeername` returned.
    pub peers: Vec<String>,
    /// Failed connections by error text.
    pub errors: BTreeMap<String, u32>,
    /// Failed connections in all.
    pub failed: u32,
    /// Total wall time of the run, in milliseconds.
    pub elapsed_ms: u128,
}

/// Moves this process into `cgroup` (a cgroup v2 directory). Call before starting any threads.
pub fn join_cgroup(cgroup: &Path) -> io::Result<()> {
    let procs = cgroup.join("cgroup.procs");
    std::fs::write(&procs, std::process::id().to_string())
        .map_err(|e| io::Error::new(e.kind(), format!("joining {}: {e}", procs.display())))
}

/// Runs the probe.
pub fn run(opts: &ProbeOptions) -> ProbeReport {
    let started = Instant::now();
    let mut report = ProbeReport::default();
    for _ in 0..opts.count {
        let outcome = if opts.udp {
            probe_udp(opts)
        } else {
            probe_tcp(opts)
        };
        match outcome {
            Ok((peer, banner)) => {
                let peer = peer.to_string();
                if !report.peers.contains(&peer) {
                    report.peers.push(peer);
                }
                *report.backends.entry(banner).or_default() += 1;
            }
            Err(err) => {
                report.failed += 1;
                *report.errors.entry(error_name(&err)).or_default() += 1;
            }
        }
    }
    report.elapsed_ms = started.elapsed().as_millis();
    report
}

fn probe_tcp(opts: &ProbeOptions) -> io::Result<(SocketAddr, String)> {
    let mut stream = TcpStream::connect_timeout(&opts.target, opts.timeout)?;
    stream.set_read_timeout(Some(opts.timeout))?;
    stream.set_write_timeout(Some(opts.timeout))?;
    let peer = stream.peer_addr()?;
    let mut line = String::new();
    match opts.expect {
        Expect::Connect => Ok((peer, "(connected)".to_owned())),
        Expect::Banner => {
            // At most one line of at most 4 KiB: a hostile server cannot make the probe buffer
            // without bound.
            BufReader::new((&stream).take(4096)).read_line(&mut line)?;
            Ok((peer, banner(&line)))
        }
        Expect::Http => {
            let request = format!(
                "GET / HTTP/1.1\r\nHost: {}\r\nUser-Agent: proxy-probe\r\nConnection: close\r\n\r\n",
                opts.target
            );
            stream.write_all(request.as_bytes())?;
            BufReader::new((&stream).take(4096)).read_line(&mut line)?;
            http_status(&line).map(|code| (peer, format!("HTTP {code}")))
        }
    }
}

/// The status code of an HTTP/1 status line.
fn http_status(line: &str) -> io::Result<u16> {
    let mut words = line.split_ascii_whitespace();
    let version = words.next().unwrap_or_default();
    let code = words.next().and_then(|c| c.parse::<u16>().ok());
    match code {
        Some(code) if version.starts_with("HTTP/1.") && (100..=999).contains(&code) => Ok(code),
        _ if line.is_empty() => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "closed without an HTTP response",
        )),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not an HTTP/1 response",
        )),
    }
}

/// The probe's exit status: 0 when every connection succeeded, 1 when any failed.
pub fn exit_status(report: &ProbeReport) -> u8 {
    u8::from(report.failed > 0)
}

fn probe_udp(opts: &ProbeOptions) -> io::Result<(SocketAddr, String)> {
    let bind: SocketAddr = if opts.target.is_ipv4() {
        "0.0.0.0:0".parse().expect("literal")
    } else {
        "[::]:0".parse().expect("literal")
    };
    let socket = UdpSocket::bind(bind)?;
    socket.connect(opts.target)?;
    socket.set_read_timeout(Some(opts.timeout))?;
    socket.send(b"probe\n")?;
    let mut buf = [0u8; 512];
    let n = socket.recv(&mut buf)?;
    let peer = socket.peer_addr()?;
    Ok((peer, banner(&String::from_utf8_lossy(&buf[..n]))))
}

fn banner(line: &str) -> String {
    let line = line.trim();
    if line.is_empty() {
        "(no banner)".to_owned()
    } else {
        line.to_owned()
    }
}

fn error_name(err: &io::Error) -> String {
    match err.raw_os_error() {
        Some(libc::EPERM) => "EPERM".to_owned(),
        Some(libc::ECONNREFUSED) => "ECONNREFUSED".to_owned(),
        Some(libc::ENETUNREACH) => "ENETUNREACH".to_owned(),
        Some(libc::ETIMEDOUT) => "ETIMEDOUT".to_owned(),
        Some(libc::EHOSTUNREACH) => "EHOSTUNREACH".to_owned(),
        _ if err.kind() == io::ErrorKind::WouldBlock || err.kind() == io::ErrorKind::TimedOut => {
            "timeout".to_owned()
        }
        _ if err.kind() == io::ErrorKind::UnexpectedEof
            || err.kind() == io::ErrorKind::InvalidData =>
        {
            err.to_string()
        }
        _ => err.to_string(),
    }
}

/// Writes the report as a table for people.
pub fn print_table(report: &ProbeReport, out: &mut impl io::Write) -> io::Result<()> {
    let total: u32 = report.backends.values().sum::<u32>() + report.errors.values().sum::<u32>();
    writeln!(out, "{:<24} {:>8} {:>8}", "backend", "conns", "share")?;
    for (name, n) in &report.backends {
        let share = 100.0 * f64::from(*n) / f64::from(total.max(1));
        writeln!(out, "{name:<24} {n:>8} {share:>7.1}%")?;
    }
    for (name, n) in &report.errors {
        writeln!(out, "{:<24} {n:>8}", format!("error {name}"))?;
    }
    writeln!(out, "getpeername showed: {}", report.peers.join(", "))?;
    if report.failed > 0
        && report.errors.keys().all(|e| e == "timeout")
        && report.backends.is_empty()
    {
        writeln!(
            out,
            "every connection timed out: if the server sends nothing first, probe with --expect connect or --expect http"
        )?;
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use std::{io::Read as _, net::TcpListener, thread};

    use super::*;

    /// A loopback server that answers each connection with `reply` (nothing: it reads and keeps
    /// the connection open until the client goes), for `n` connections.
    fn server(reply: &'static [u8], n: usize) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        thread::spawn(move || {
            for stream in listener.incoming().take(n) {
                let mut stream = stream.unwrap();
                if !reply.is_empty() {
                    let _ = stream.write_all(reply);
                }
                // Until the client closes (or 5 s at most).
                stream
                    .set_read_timeout(Some(Duration::from_secs(5)))
                    .unwrap();
                let _ = stream.read(&mut [0; 1024]);
            }
        });
        addr
    }

    fn probe(target: SocketAddr, expect: Expect, count: u32) -> ProbeReport {
        run(&ProbeOptions {
            target,
            count,
            udp: false,
            timeout: Duration::from_millis(300),
            expect,
        })
    }

    #[test]
    fn a_silent_server_is_a_timeout_for_banners_and_a_success_for_connect() {
        let silent = server(b"", 4);
        let report = probe(silent, Expect::Banner, 2);
        assert_eq!(report.failed, 2);
        assert_eq!(report.errors.get("timeout"), Some(&2));
        assert_eq!(exit_status(&report), 1);
        let mut table = Vec::new();
        print_table(&report, &mut table).unwrap();
        assert!(
            String::from_utf8(table)
                .unwrap()
                .contains("--expect connect")
        );
        let report = probe(silent, Expect::Connect, 2);
        assert_eq!(report.failed, 0, "{report:?}");
        assert_eq!(report.backends.get("(connected)"), Some(&2));
        assert_eq!(report.peers, [silent.to_string()]);
        assert_eq!(exit_status(&report), 0);
    }

    #[test]
    fn http_reports_the_status_and_refuses_what_is_not_http() {
        let web = server(
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n",
            1,
        );
        let report = probe(web, Expect::Http, 1);
        assert_eq!(report.backends.get("HTTP 503"), Some(&1), "{report:?}");
        let banner = server(b"backend-a\n", 1);
        let report = probe(banner, Expect::Http, 1);
        assert_eq!(
            report.errors.get("not an HTTP/1 response"),
            Some(&1),
            "{report:?}"
        );
        assert_eq!(exit_status(&report), 1);
    }

    #[test]
    fn banners_name_backends_and_a_refused_connect_fails_the_run() {
        let banner = server(b"backend-a\n", 1);
        let report = probe(banner, Expect::Banner, 1);
        assert_eq!(report.backends.get("backend-a"), Some(&1));
        // A port nobody listens on: take one and close it.
        let closed = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let report = probe(closed, Expect::Banner, 3);
        assert_eq!(report.errors.get("ECONNREFUSED"), Some(&3));
        assert_eq!(exit_status(&report), 1);
    }
}
