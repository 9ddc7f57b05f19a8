//! Clients and servers for the kernel tests: bounded connect and datagram loops, a resetting
//! server, and a framed exchange with digests for data-integrity checks.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    path::{Path, PathBuf},
    process::Command,
    thread::JoinHandle,
    time::{Duration, Instant},
};

use super::{InCgroup, Netns, sh};

/// What a client loop saw.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct LoopReport {
    /// Answers per banner (the first line the server sent).
    pub banners: std::collections::BTreeMap<String, u32>,
    /// Addresses the socket reported as its peer (getpeername, or recvfrom's source for UDP).
    pub peers: std::collections::BTreeSet<String>,
    /// Failures by error.
    pub errors: std::collections::BTreeMap<String, u32>,
}

impl LoopReport {
    /// Successful exchanges.
    pub fn ok(&self) -> u32 {
        self.banners.values().sum()
    }

    /// Failed exchanges.
    pub fn failed(&self) -> u32 {
        self.errors.values().sum()
    }

    /// Parses a child's JSON result.
    pub fn parse(text: &str) -> Self {
        serde_json::from_str(text).unwrap_or_else(|e| panic!("bad loop report {text:?}: {e}"))
    }

    fn record(&mut self, outcome: std::io::Result<(SocketAddr, String)>) {
        match outcome {
            Ok((peer, banner)) => {
                self.peers.insert(peer.to_string());
                *self.banners.entry(banner).or_default() += 1;
            }
            Err(e) => *self.errors.entry(errno_name(&e)).or_default() += 1,
        }
    }
}

/// An error as its errno name when it has one.
pub fn errno_name(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EPERM) => "EPERM".to_owned(),
        Some(libc::ECONNREFUSED) => "ECONNREFUSED".to_owned(),
        Some(libc::ECONNRESET) => "ECONNRESET".to_owned(),
        Some(libc::EADDRNOTAVAIL) => "EADDRNOTAVAIL".to_owned(),
        _ => e.to_string(),
    }
}

/// TCP: connect to `target`, read the banner line, close; `count` times or until `within` has
/// passed, whichever comes first. For a child made with [`InCgroup::spawn`].
pub fn tcp_loop(target: SocketAddr, count: u32, within: Duration) -> LoopReport {
    let deadline = Instant::now() + within;
    let mut report = LoopReport::default();
    for _ in 0..count {
        if Instant::now() >= deadline {
            break;
        }
        report.record(tcp_once(target));
    }
    report
}

/// `count` connects to `target`, one after the other, stopping at the first that fails. Bounded
/// without a clock: each connect ends within its own timeouts (2 s to connect, 10 s for the
/// banner), so the loop ends after `count` of them or at a failure, however slow the machine.
pub fn tcp_loop_to_first_failure(target: SocketAddr, count: u32) -> LoopReport {
    let mut report = LoopReport::default();
    for _ in 0..count {
        let result = tcp_once(target);
        let failed = result.is_err();
        report.record(result);
        if failed {
            break;
        }
    }
    report
}

fn tcp_once(target: SocketAddr) -> std::io::Result<(SocketAddr, String)> {
    let mut stream = TcpStream::connect_timeout(&target, Duration::from_secs(2))?;
    let connected = Instant::now();
    // Long enough for a connection whose final ACK the server dropped: only the server's
    // SYN-ACK retransmits (1, 3 and 7 s after the first) complete it, as the client sends
    // nothing. A fresh-clone run lost one of 50 connects to a 5 s timeout. A data-path error
    // is a refusal or a wrong banner, never a late one.
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let peer = stream.peer_addr()?;
    let mut text = String::new();
    // A failure after the connect names its phase, the host and the socket's own end, so that
    // it can be told from a refused connect and looked for in the host's counters.
    stream.read_to_string(&mut text).map_err(|e| {
        let local = stream.local_addr().ok();
        std::io::Error::new(
            e.kind(),
            format!(
                "reading the banner of {peer} from {}, {:?} after the connect: {}; the \
                 namespace's sockets on that port: {}",
                local.map_or_else(|| "?".to_owned(), |a| a.to_string()),
                connected.elapsed(),
                errno_name(&e),
                local.map_or_else(String::new, |a| sockets_of_port(a.port()))
            ),
        )
    })?;
    Ok((
        peer,
        text.lines().next().unwrap_or("(no banner)").to_owned(),
    ))
}

/// The TCP sockets of this namespace with `port` at either end (`ss`), one line each: after a
/// failed exchange they say whether the server's end exists and in which state.
fn sockets_of_port(port: u16) -> String {
    let filter = format!("( sport = :{port} or dport = :{port} )");
    Command::new("ss")
        .args(["-tanoie", &filter])
        .output()
        .map_or_else(
            |e| format!("(ss: {e})"),
            |o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .skip(1)
                    .map(str::trim)
                    .collect::<Vec<_>>()
                    .join(" | ")
            },
        )
}

/// Unconnected UDP: `sendto(target)` and `recvfrom` on one socket, `count` times; the peer
/// recorded is recvfrom's source address.
pub fn udp_sendto_loop(target: SocketAddr, count: u32) -> LoopReport {
    udp_sendto_loop_within(target, count, None)
}

/// Like [`udp_sendto_loop`], but stops after `within` too when given (whichever comes first):
/// for a loop that only matters while something else happens for that long.
pub fn udp_sendto_loop_within(
    target: SocketAddr,
    count: u32,
    within: Option<Duration>,
) -> LoopReport {
    let deadline = within.and_then(|w| Instant::now().checked_add(w));
    let any: SocketAddr = if target.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    }
    .parse()
    .expect("literal");
    let socket = UdpSocket::bind(any).expect("binding a UDP client");
    socket
        .set_read_timeout(Some(Duration::from_secs(1)))
        .expect("timeout");
    let mut report = LoopReport::default();
    let mut buf = [0u8; 512];
    for _ in 0..count {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let outcome = socket.send_to(b"probe\n", target).and_then(|_| {
            let (n, from) = socket.recv_from(&mut buf)?;
            Ok((from, String::from_utf8_lossy(&buf[..n]).trim().to_owned()))
        });
        report.record(outcome);
    }
    report
}

/// A TCP server that answers `count` connections with a reset (SO_LINGER 0, then close), or
/// stops after `within`.
pub fn reset_on_accept(listener: &TcpListener, count: u32, within: Duration) {
    use std::os::fd::AsRawFd as _;
    listener.set_nonblocking(true).expect("nonblocking");
    let deadline = Instant::now() + within;
    let mut done = 0;
    while done < count && Instant::now() < deadline {
        let Ok((conn, _)) = listener.accept() else {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        };
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: a valid socket fd and a linger struct that outlives the call.
        unsafe {
            libc::setsockopt(
                conn.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&raw const linger).cast(),
                size_of::<libc::linger>() as libc::socklen_t,
            );
        }
        drop(conn);
        done += 1;
    }
}

/// Widens the ephemeral port range inside `netns` (for loops of many connections).
pub fn widen_port_range(netns: &Netns) {
    sh(Command::new("ip").args([
        "netns",
        "exec",
        netns.name(),
        "sysctl",
        "-q",
        "-w",
        "net.ipv4.ip_local_port_range=1024 65535",
    ]));
}

/// Deterministic test data: `len` bytes from a xorshift generator seeded with `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A 64-bit FNV-1a digest, to compare what was sent with what arrived.
pub fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Sends `data` with an 8-byte length prefix.
pub fn send_framed(stream: &mut TcpStream, data: &[u8]) -> std::io::Result<()> {
    stream.write_all(&(data.len() as u64).to_be_bytes())?;
    for chunk in data.chunks(64 * 1024) {
        stream.write_all(chunk)?;
    }
    stream.flush()
}

/// Receives one length-prefixed message and returns its digest and length.
pub fn recv_framed(stream: &mut TcpStream) -> std::io::Result<(u64, usize)> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut len = [0u8; 8];
    let mut eagain = read_exact_until(stream, &mut len, deadline)?;
    let mut data = vec![0u8; u64::from_be_bytes(len) as usize];
    eagain += read_exact_until(stream, &mut data, deadline)?;
    if eagain > 0 {
        eprintln!(
            "note: a blocking read returned EAGAIN {eagain} time(s) before its timeout \
             (the sockmap receive path; ARCHITECTURE.md, Splicing)"
        );
    }
    Ok((digest(&data), data.len()))
}

/// `read_exact` on a blocking socket that reads on through EAGAIN until `deadline`, returning how
/// many times it saw one. A socket in a sockmap can get EAGAIN from a blocking read on a wake-up
/// without data (the kernel's `tcp_bpf_recvmsg_parser`); that is documented socket behaviour under
/// splicing, while these tests check the bytes.
fn read_exact_until(
    stream: &mut TcpStream,
    mut buf: &mut [u8],
    deadline: Instant,
) -> std::io::Result<u64> {
    let mut eagain = 0;
    while !buf.is_empty() {
        match stream.read(buf) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                eagain += 1;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(eagain)
}

/// One connection between two processes inside `cgroup` and `netns`: a server bound at `listen`
/// and a client dialling `dial` (a service address or the server itself). The client sends
/// `size` bytes, the server checks their digest and sends `size` other bytes back. Returns
/// whether each direction arrived intact, (client -> server, server -> client).
pub fn framed_exchange(
    cgroup: &Path,
    netns: &Netns,
    listen: SocketAddr,
    dial: SocketAddr,
    size: usize,
) -> (bool, bool) {
    let server = InCgroup::spawn(Some(cgroup), netns, move || {
        let listener = TcpListener::bind(listen).expect("binding the exchange server");
        listener.set_nonblocking(true).expect("nonblocking");
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut conn = loop {
            match listener.accept() {
                Ok((conn, _)) => break conn,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
                Err(e) => panic!("no client: {e}"),
            }
        };
        conn.set_nonblocking(false).expect("blocking");
        conn.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        let (d, n) = recv_framed(&mut conn).expect("receiving from the client");
        send_framed(&mut conn, &pattern(2, size)).expect("sending to the client");
        let mut rest = Vec::new();
        let _ = conn.read_to_end(&mut rest);
        format!("{d} {n}")
    });
    let client = InCgroup::spawn(Some(cgroup), netns, move || {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut conn = loop {
            match TcpStream::connect(dial) {
                Ok(conn) => break conn,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("connecting to {dial}: {e}"),
            }
        };
        conn.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        send_framed(&mut conn, &pattern(1, size)).expect("sending to the server");
        let (d, n) = recv_framed(&mut conn).expect("receiving from the server");
        format!("{d} {n}")
    });
    let got_client = client.wait(Duration::from_secs(60));
    let got_server = server.wait(Duration::from_secs(60));
    let expect = |seed| format!("{} {size}", digest(&pattern(seed, size)));
    (got_server == expect(1), got_client == expect(2))
}

/// Runs `f` on a thread that entered `netns` (outside any test cgroup) and returns its handle.
pub fn in_netns<T: Send + 'static>(
    netns: &Netns,
    f: impl FnOnce() -> T + Send + 'static,
) -> JoinHandle<T> {
    in_netns_at(netns.path(), f)
}

/// [`in_netns`] by the namespace's path (for a drop handler that only kept the path).
pub fn in_netns_at<T: Send + 'static>(
    path: PathBuf,
    f: impl FnOnce() -> T + Send + 'static,
) -> JoinHandle<T> {
    std::thread::spawn(move || {
        proxy::enter_netns(&path).expect("entering the test namespace");
        f()
    })
}
