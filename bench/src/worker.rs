//! The benchmark's own clients and servers, run as `proxy-bench worker ...` in their own
//! processes (so their CPU is theirs, and the client alone joins the benchmark cgroup).
//!
//! Clients print one JSON object on stdout. Every loop is bounded by a duration or a count.

use std::{
    io::{BufRead as _, Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use clap::Subcommand;
use serde_json::json;

/// Worker processes of the benchmark (internal).
#[derive(Debug, Subcommand)]
pub enum Worker {
    /// Servers: echo (RR, open loop, idle), connect (1-byte hello per connection), sink
    /// (hashes everything it reads, answers the hash).
    Serve {
        #[arg(long)]
        echo: SocketAddr,
        #[arg(long)]
        conn: SocketAddr,
        #[arg(long)]
        sink: SocketAddr,
    },
    /// UDP echo on `count` addresses from `base` up, each at `port` (one socket per address,
    /// so a reply leaves from the address the datagram was sent to, as a checker connected to
    /// that address requires).
    UdpEcho {
        #[arg(long)]
        base: Ipv4Addr,
        #[arg(long)]
        count: u32,
        #[arg(long)]
        port: u16,
    },
    /// Closed-loop request/response: `conns` connections, each writes `size` bytes and reads
    /// them back, for `secs`.
    Rr {
        #[arg(long)]
        target: SocketAddr,
        #[arg(long)]
        size: usize,
        #[arg(long)]
        conns: usize,
        #[arg(long)]
        secs: f64,
        #[arg(long)]
        cgroup: Option<String>,
    },
    /// Open loop: one connection, 16-byte messages sent on a fixed schedule at `rate`/s; latency
    /// is measured from the scheduled send time (no coordinated omission).
    OpenLoop {
        #[arg(long)]
        target: SocketAddr,
        #[arg(long)]
        rate: u32,
        #[arg(long)]
        secs: f64,
        #[arg(long)]
        cgroup: Option<String>,
    },
    /// Connect/hello/close loop against `count` consecutive IPv4 addresses from `target`
    /// (one service each), a random one per connection; RST on close (no TIME_WAIT pile-up).
    Cps {
        #[arg(long)]
        target: SocketAddr,
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[arg(long)]
        secs: f64,
        #[arg(long)]
        cgroup: Option<String>,
    },
    /// Sends `bytes` of pseudo-random data to a sink and compares its hash with ours.
    Integrity {
        #[arg(long)]
        target: SocketAddr,
        #[arg(long)]
        bytes: u64,
        #[arg(long)]
        cgroup: Option<String>,
    },
    /// Opens `conns` connections to an echo server (one round trip each), prints `ready`, holds
    /// them until stdin closes or `secs` pass.
    Idle {
        #[arg(long)]
        target: SocketAddr,
        #[arg(long)]
        conns: usize,
        #[arg(long)]
        secs: f64,
        #[arg(long)]
        cgroup: Option<String>,
    },
    /// proxy_core::health TCP checks (UDP payload checks with `--udp`) against `endpoints`
    /// addresses 127.88.x.y:`port` (run in a network namespace with a listener and a UDP echo on
    /// 0.0.0.0:`port`); reports our CPU over `secs`.
    Health {
        #[arg(long)]
        udp: bool,
        #[arg(long)]
        endpoints: u32,
        #[arg(long)]
        port: u16,
        #[arg(long)]
        interval_ms: u64,
        #[arg(long)]
        secs: f64,
    },
}

pub fn run(w: Worker) -> anyhow::Result<()> {
    match w {
        Worker::Serve { echo, conn, sink } => serve(echo, conn, sink),
        Worker::UdpEcho { base, count, port } => udp_echo(base, count, port),
        Worker::Rr {
            target,
            size,
            conns,
            secs,
            cgroup,
        } => {
            join_cgroup(cgroup.as_deref())?;
            rr(target, size, conns, secs)
        }
        Worker::OpenLoop {
            target,
            rate,
            secs,
            cgroup,
        } => {
            join_cgroup(cgroup.as_deref())?;
            open_loop(target, rate, secs)
        }
        Worker::Cps {
            target,
            count,
            secs,
            cgroup,
        } => {
            join_cgroup(cgroup.as_deref())?;
            cps(target, count, secs)
        }
        Worker::Integrity {
            target,
            bytes,
            cgroup,
        } => {
            join_cgroup(cgroup.as_deref())?;
            integrity(target, bytes)
        }
        Worker::Idle {
            target,
            conns,
            secs,
            cgroup,
        } => {
            join_cgroup(cgroup.as_deref())?;
            idle(target, conns, secs)
        }
        Worker::Health {
            udp,
            endpoints,
            port,
            interval_ms,
            secs,
        } => super::health::run(udp, endpoints, port, interval_ms, secs),
    }
}

/// Moves this process into the benchmark cgroup before it opens any socket.
fn join_cgroup(cgroup: Option<&str>) -> anyhow::Result<()> {
    if let Some(cg) = cgroup {
        std::fs::write(format!("{cg}/cgroup.procs"), std::process::id().to_string())
            .with_context(|| format!("joining cgroup {cg}"))?;
    }
    Ok(())
}

/// p50 and p99 in microseconds of nanosecond samples.
fn percentiles(mut ns: Vec<u64>) -> (f64, f64, f64) {
    if ns.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q).round() as usize] as f64 / 1e3;
    (at(0.5), at(0.99), at(0.999))
}

fn rr(target: SocketAddr, size: usize, conns: usize, secs: f64) -> anyhow::Result<()> {
    let stop = Instant::now() + Duration::from_secs_f64(secs);
    let handles: Vec<_> = (0..conns)
        .map(|_| {
            thread::spawn(move || -> anyhow::Result<Vec<u64>> {
                let mut s = TcpStream::connect(target)
                    .with_context(|| format!("connecting to {target}"))?;
                s.set_nodelay(true)?;
                let out = vec![0x5a_u8; size];
                let mut back = vec![0_u8; size];
                let mut lat = Vec::with_capacity(1 << 16);
                while Instant::now() < stop {
                    let t = Instant::now();
                    s.write_all(&out)?;
                    s.read_exact(&mut back)?;
                    lat.push(t.elapsed().as_nanos() as u64);
                }
                Ok(lat)
            })
        })
        .collect();
    let mut all = Vec::new();
    for h in handles {
        all.extend(
            h.join()
                .map_err(|_| anyhow::anyhow!("rr thread panicked"))??,
        );
    }
    let n = all.len();
    let (p50, p99, _) = percentiles(all);
    println!(
        "{}",
        json!({"transactions": n, "tps": n as f64 / secs, "p50_us": p50, "p99_us": p99})
    );
    Ok(())
}

fn open_loop(target: SocketAddr, rate: u32, secs: f64) -> anyhow::Result<()> {
    let s = TcpStream::connect(target).with_context(|| format!("connecting to {target}"))?;
    s.set_nodelay(true)?;
    let total = (f64::from(rate) * secs) as u64;
    let period = Duration::from_secs_f64(1.0 / f64::from(rate));
    let start = Instant::now() + Duration::from_millis(20);
    let mut reader = s.try_clone()?;
    reader.set_read_timeout(Some(Duration::from_secs(2)))?;
    let recv = thread::spawn(move || {
        let mut lat = Vec::with_capacity(total as usize);
        let mut buf = [0_u8; 16];
        for _ in 0..total {
            if reader.read_exact(&mut buf).is_err() {
                break;
            }
            let seq = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
            let due = start + period * seq as u32;
            lat.push(Instant::now().saturating_duration_since(due).as_nanos() as u64);
        }
        lat
    });
    let mut w = s;
    for seq in 0..total {
        let due = start + period * seq as u32;
        let now = Instant::now();
        if due > now {
            let wait = due - now;
            if wait > Duration::from_micros(80) {
                thread::sleep(wait.saturating_sub(Duration::from_micros(60)));
            }
            while Instant::now() < due {
                std::hint::spin_loop();
            }
        }
        let mut msg = [0_u8; 16];
        msg[..8].copy_from_slice(&seq.to_le_bytes());
        w.write_all(&msg)?;
    }
    let lat = recv
        .join()
        .map_err(|_| anyhow::anyhow!("receiver panicked"))?;
    let received = lat.len();
    let (p50, p99, p999) = percentiles(lat);
    println!(
        "{}",
        json!({"sent": total, "received": received, "lost": total - received as u64,
               "p50_us": p50, "p99_us": p99, "p999_us": p999})
    );
    Ok(())
}

/// xorshift64*, for picking services and filling buffers.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Fisher-Yates: a uniformly random order of `items`.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
    }
}

fn nth_addr(base: SocketAddr, i: u32) -> anyhow::Result<SocketAddr> {
    let SocketAddr::V4(v4) = base else {
        bail!("cps targets are IPv4")
    };
    let ip = Ipv4Addr::from(u32::from(*v4.ip()) + i);
    Ok(SocketAddr::V4(SocketAddrV4::new(ip, v4.port())))
}

fn cps(target: SocketAddr, count: u32, secs: f64) -> anyhow::Result<()> {
    let targets: Vec<SocketAddr> = (0..count.max(1))
        .map(|i| nth_addr(target, i))
        .collect::<Result<_, _>>()?;
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15 ^ u64::from(std::process::id()));
    let stop = Instant::now() + Duration::from_secs_f64(secs);
    let (mut lat, mut failures, mut first_error) = (Vec::new(), 0_u64, None::<String>);
    while Instant::now() < stop {
        let addr = targets[(rng.next() % targets.len() as u64) as usize];
        let t = Instant::now();
        match TcpStream::connect(addr) {
            Ok(mut s) => {
                lat.push(t.elapsed().as_nanos() as u64);
                let mut b = [0_u8; 1];
                let ok = s.set_nodelay(true).is_ok()
                    && s.set_read_timeout(Some(Duration::from_secs(2))).is_ok()
                    && s.write_all(b"h").is_ok()
                    && s.read_exact(&mut b).is_ok();
                if !ok {
                    failures += 1;
                }
                super::sys::linger_zero(&s);
            }
            Err(e) => {
                failures += 1;
                first_error.get_or_insert_with(|| format!("{addr}: {e}"));
                if failures > 1000 {
                    break;
                }
            }
        }
    }
    let n = lat.len();
    let (p50, p99, _) = percentiles(lat);
    println!(
        "{}",
        json!({"connections": n, "cps": n as f64 / secs, "failures": failures,
               "connect_p50_us": p50, "connect_p99_us": p99, "first_error": first_error})
    );
    Ok(())
}

/// FNV-1a over 8-byte words (fast enough not to dominate; both ends use it).
#[derive(Clone, Copy)]
pub struct Hash(u64);

impl Hash {
    pub fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
    pub fn update(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    pub fn value(self) -> u64 {
        self.0
    }
}

fn integrity(target: SocketAddr, bytes: u64) -> anyhow::Result<()> {
    let mut s = TcpStream::connect(target).with_context(|| format!("connecting to {target}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut rng = Rng::new(0x1234_5678);
    let mut buf = vec![0_u8; 64 * 1024];
    let (mut sent, mut hash) = (0_u64, Hash::new());
    while sent < bytes {
        let n = ((bytes - sent) as usize).min(buf.len());
        for chunk in buf[..n].chunks_mut(8) {
            let r = rng.next().to_le_bytes();
            chunk.copy_from_slice(&r[..chunk.len()]);
        }
        hash.update(&buf[..n]);
        s.write_all(&buf[..n])?;
        sent += n as u64;
    }
    s.shutdown(std::net::Shutdown::Write)?;
    let mut answer = [0_u8; 16];
    let eagain = read_exact_counting_eagain(&mut s, &mut answer, Duration::from_secs(30))
        .context("reading the sink's hash")?;
    let got_len = u64::from_le_bytes(answer[..8].try_into().expect("8"));
    let got_hash = u64::from_le_bytes(answer[8..].try_into().expect("8"));
    let ok = got_len == sent && got_hash == hash.value();
    println!(
        "{}",
        json!({"bytes": sent, "received": got_len, "ok": ok, "eagain": eagain})
    );
    Ok(())
}

/// `read_exact` on a blocking socket that tolerates, and counts, EAGAIN before `limit`.
///
/// A blocking `recv` on a socket in a sockmap can return EAGAIN long before its receive timeout:
/// the kernel's sockmap receive path (`tcp_bpf_recvmsg_parser`, 6.18 included) sleeps once and
/// answers EAGAIN when it wakes without data, and the send side's write-space wake-up (the peer
/// consumed what this socket sent) is such a wake-up. That is a change of socket semantics a
/// blocking application sees, not lost data: the count is reported (the S5 verdict refuses
/// splicing by default while it is not zero) and the read goes on, so the bytes can still be
/// checked.
fn read_exact_counting_eagain(
    s: &mut TcpStream,
    mut buf: &mut [u8],
    limit: Duration,
) -> anyhow::Result<u64> {
    let deadline = Instant::now() + limit;
    let mut eagain = 0_u64;
    while !buf.is_empty() {
        match s.read(buf) {
            Ok(0) => bail!("the sink closed before its answer was complete"),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                eagain += 1;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(eagain)
}

fn idle(target: SocketAddr, conns: usize, secs: f64) -> anyhow::Result<()> {
    let mut held = Vec::with_capacity(conns);
    for i in 0..conns {
        let mut s =
            TcpStream::connect(target).with_context(|| format!("connection {i} to {target}"))?;
        s.write_all(b"i")?;
        let mut b = [0_u8; 1];
        s.read_exact(&mut b)?;
        held.push(s);
    }
    println!("ready {}", held.len());
    std::io::stdout().flush()?;
    let done = Arc::new(AtomicBool::new(false));
    let d = Arc::clone(&done);
    thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::stdin().lock().read_line(&mut line);
        d.store(true, Ordering::Relaxed);
    });
    let stop = Instant::now() + Duration::from_secs_f64(secs);
    while !done.load(Ordering::Relaxed) && Instant::now() < stop {
        thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn udp_echo(base: Ipv4Addr, count: u32, port: u16) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut tasks = Vec::with_capacity(count as usize);
        for i in 0..count {
            let addr = SocketAddrV4::new(Ipv4Addr::from(u32::from(base) + i), port);
            let socket = tokio::net::UdpSocket::bind(addr)
                .await
                .with_context(|| format!("binding UDP {addr}"))?;
            tasks.push(tokio::spawn(async move {
                let mut buf = [0_u8; 2048];
                while let Ok((n, from)) = socket.recv_from(&mut buf).await {
                    let _ = socket.send_to(&buf[..n], from).await;
                }
            }));
        }
        println!("ready");
        std::io::stdout().flush()?;
        for task in tasks {
            let _ = task.await;
        }
        anyhow::Ok(())
    })
}

fn serve(echo: SocketAddr, conn: SocketAddr, sink: SocketAddr) -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let echo_l = tokio::net::TcpListener::bind(echo)
            .await
            .with_context(|| format!("binding {echo}"))?;
        let conn_l = tokio::net::TcpListener::bind(conn)
            .await
            .with_context(|| format!("binding {conn}"))?;
        let sink_l = tokio::net::TcpListener::bind(sink)
            .await
            .with_context(|| format!("binding {sink}"))?;
        println!("ready");
        std::io::stdout().flush()?;
        let echo_task = tokio::spawn(async move {
            while let Ok((mut s, _)) = echo_l.accept().await {
                tokio::spawn(async move {
                    let _ = s.set_nodelay(true);
                    let mut buf = vec![0_u8; 16 * 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let conn_task = tokio::spawn(async move {
            while let Ok((mut s, _)) = conn_l.accept().await {
                tokio::spawn(async move {
                    let _ = s.set_nodelay(true);
                    let mut b = [0_u8; 64];
                    if matches!(s.read(&mut b).await, Ok(n) if n > 0) {
                        let _ = s.write_all(&b[..1]).await;
                        let _ = s.read(&mut b).await;
                    }
                });
            }
        });
        let sink_task = tokio::spawn(async move {
            while let Ok((mut s, _)) = sink_l.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0_u8; 64 * 1024];
                    let (mut len, mut hash) = (0_u64, Hash::new());
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        hash.update(&buf[..n]);
                        len += n as u64;
                    }
                    let mut answer = [0_u8; 16];
                    answer[..8].copy_from_slice(&len.to_le_bytes());
                    answer[8..].copy_from_slice(&hash.value().to_le_bytes());
                    let _ = s.write_all(&answer).await;
                    let _ = s.shutdown().await;
                });
            }
        });
        let _ = tokio::join!(echo_task, conn_task, sink_task);
        anyhow::Ok(())
    })
}
