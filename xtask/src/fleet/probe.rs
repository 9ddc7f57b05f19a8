//! How the harness sees a node's kernel: a probe process per node, inside the node's cgroup and
//! namespace, connects to a service's VIP as an application would (the node's connect4 program
//! rewrites it) and reads which backend answered. And the backends: accept-and-close servers in
//! the hub that say their own address.
//!
//! The probe speaks lines on stdin/stdout. `wait ADDR EXPECT TIMEOUT_MS`, EXPECT being
//! `up=BACKEND_IP` or `down` (the connect fails): the probe tries once; if that already
//! matches it answers `already`, else `armed` and then polls every interval until it matches
//! (`seen NS`, CLOCK_MONOTONIC of the first matching try) or the time is up (`timeout`).
//! `loop ...` starts a connect loop in the background (see [`super::connect_loop`]) and
//! `stop` ends it with its counts; waits may run while it loops.

use std::{
    io::{BufRead as _, Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::{
    connect_loop,
    net::{self, Net},
    sys,
};

/// What a probe waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// A connect reaches this backend.
    Up(Ipv4Addr),
    /// A connect fails (refused: no routable host; unreachable: the VIP is not published).
    Down,
}

impl Expect {
    pub fn word(&self) -> String {
        match self {
            Self::Up(ip) => format!("up={ip}"),
            Self::Down => "down".to_owned(),
        }
    }

    pub fn parse(word: &str) -> anyhow::Result<Self> {
        match word.strip_prefix("up=") {
            Some(ip) => Ok(Self::Up(
                ip.parse().with_context(|| format!("bad backend {ip:?}"))?,
            )),
            None if word == "down" => Ok(Self::Down),
            None => bail!("expected up=IP or down, got {word:?}"),
        }
    }

    pub(super) fn holds(&self, seen: Option<&str>) -> bool {
        match (self, seen) {
            (Self::Down, None) => true,
            (Self::Up(ip), Some(text)) => text == ip.to_string(),
            _ => false,
        }
    }
}

/// One try: the backend's answer, or None when the connect fails.
fn try_once(addr: SocketAddr) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    Some(text.trim().to_owned())
}

/// A request line: `wait ADDR EXPECT TIMEOUT_MS`.
pub fn parse_wait(line: &str) -> anyhow::Result<(SocketAddr, Expect, Duration)> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let [cmd, addr, expect, ms] = words[..] else {
        bail!("expected `wait ADDR EXPECT TIMEOUT_MS`, got {line:?}");
    };
    if cmd != "wait" {
        bail!("unknown probe command {cmd:?}");
    }
    let addr = addr
        .parse()
        .with_context(|| format!("bad address {addr:?}"))?;
    let ms: u64 = ms.parse().with_context(|| format!("bad timeout {ms:?}"))?;
    Ok((addr, Expect::parse(expect)?, Duration::from_millis(ms)))
}

/// The probe's main loop (`cargo xtask fleet-probe`, started by the harness in the node).
pub fn serve(interval: Duration) -> anyhow::Result<()> {
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    let mut looping = None;
    for line in stdin.lock().lines() {
        let line = line?;
        if line.starts_with("loop ") || line == "stop" {
            let answer = connect_loop::command(&line, &mut looping, try_once)?;
            writeln!(out, "{answer}")?;
            out.flush()?;
            continue;
        }
        let (addr, expect, timeout) = parse_wait(&line)?;
        if expect.holds(try_once(addr).as_deref()) {
            writeln!(out, "already")?;
            out.flush()?;
            continue;
        }
        writeln!(out, "armed")?;
        out.flush()?;
        let deadline = Instant::now() + timeout;
        let answer = loop {
            let t = sys::monotonic_ns();
            if expect.holds(try_once(addr).as_deref()) {
                break format!("seen {t}");
            }
            if Instant::now() > deadline {
                break "timeout".to_owned();
            }
            std::thread::sleep(interval);
        };
        writeln!(out, "{answer}")?;
        out.flush()?;
    }
    Ok(())
}

/// The backend servers, threads of the harness listening in the hub; stopped on drop.
pub struct Backends {
    hub: String,
    stop: Arc<AtomicBool>,
    threads: Vec<(SocketAddr, JoinHandle<()>)>,
}

impl Backends {
    pub fn start(net: &Net, count: u32) -> anyhow::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut backends = Self {
            hub: net.hub.clone(),
            stop: stop.clone(),
            threads: Vec::new(),
        };
        for b in 0..count {
            let addr = SocketAddr::from((net::backend(b), net::BACKEND_PORT));
            let listener = net::with_netns(&net.hub, || TcpListener::bind(addr))?
                .with_context(|| format!("binding backend {addr}"))?;
            let stop = stop.clone();
            let greeting = format!("{}\n", net::backend(b));
            let handle = std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    if let Ok(mut c) = conn {
                        let _ = c.write_all(greeting.as_bytes());
                    }
                }
            });
            backends.threads.push((addr, handle));
        }
        Ok(backends)
    }
}

impl Drop for Backends {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // One connect wakes each accept loop, which then sees the flag.
        let addrs: Vec<SocketAddr> = self.threads.iter().map(|(a, _)| *a).collect();
        let _ = net::with_netns(&self.hub, || {
            for a in &addrs {
                let _ = TcpStream::connect_timeout(a, Duration::from_secs(1));
            }
        });
        for (_, t) in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_line_names_an_address_an_expectation_and_a_bound() {
        let (addr, expect, bound) = parse_wait("wait 10.96.0.1:8080 up=10.220.0.3 30000").unwrap();
        assert_eq!(addr, "10.96.0.1:8080".parse().unwrap());
        assert_eq!(expect, Expect::Up(Ipv4Addr::new(10, 220, 0, 3)));
        assert_eq!(bound, Duration::from_secs(30));
        assert_eq!(
            parse_wait("wait 10.96.0.1:8080 down 5").unwrap().1,
            Expect::Down
        );
        assert_eq!(Expect::parse(&expect.word()).unwrap(), expect);
        for bad in [
            "",
            "wait",
            "wait x down 5",
            "wait 10.96.0.1:8080 sideways 5",
            "go 10.96.0.1:1 down 5",
            "wait 10.96.0.1:8080 up=nope 5",
        ] {
            assert!(parse_wait(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn up_needs_that_backend_and_down_needs_a_failed_connect() {
        let up = Expect::Up(Ipv4Addr::new(10, 220, 0, 3));
        assert!(up.holds(Some("10.220.0.3")));
        assert!(!up.holds(Some("10.220.0.4")));
        assert!(!up.holds(None));
        assert!(Expect::Down.holds(None));
        assert!(!Expect::Down.holds(Some("10.220.0.3")));
    }
}
