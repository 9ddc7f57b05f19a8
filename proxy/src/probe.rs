//! `proxy probe`: connect to an address a bounded number of times, from inside a cgroup (and
//! optionally a network namespace), and report which backend answered each connection and what
//! `getpeername` showed. Backends identify themselves by the first line they send (a banner).
//!
//! The demo and the integration tests use it; operators can use it to see how a service's
//! connections spread over its hosts.

use std::{
    collections::BTreeMap,
    io::{self, BufRead as _, BufReader},
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
    /// Per-connection timeout for connect and for reading the banner.
    pub timeout: Duration,
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
            Err(err) => *report.errors.entry(error_name(&err)).or_default() += 1,
        }
    }
    report.elapsed_ms = started.elapsed().as_millis();
    report
}

fn probe_tcp(opts: &ProbeOptions) -> io::Result<(SocketAddr, String)> {
    let stream = TcpStream::connect_timeout(&opts.target, opts.timeout)?;
    stream.set_read_timeout(Some(opts.timeout))?;
    let peer = stream.peer_addr()?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line)?;
    Ok((peer, banner(&line)))
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
    out.flush()
}
