//! `cargo xtask demo`: the main job on the embedded default configuration, end to end.
//!
//! Starts one banner server per host of the default STATIC cluster (on 127.0.0.x), runs the
//! daemon without `--config`, lets `proxy probe` make a bounded number of connections to the VIP
//! from inside the attached cgroup, prints connections per backend against their weights and
//! what `getpeername` showed, then stops everything it started and checks that the daemon
//! removed its cgroup and pins.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use proxy_core::config::Config;

use crate::{
    setup,
    util::{self, detail, step},
};

/// How long the daemon may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

pub fn run(count: u32) -> anyhow::Result<()> {
    setup::run()?;
    util::require_root("the demo")?;
    let proxy = util::build_proxy()?;
    let config = Config::embedded_default();
    let service = config
        .services
        .first()
        .context("the default config has a service")?;
    let vip = SocketAddr::new(service.address, service.port);
    let hosts = config
        .cluster(&service.cluster)
        .context("the default service has a cluster")?
        .static_hosts();

    step(format!("starting {} backends", hosts.len()));
    let backends = Backends::start(hosts.iter().map(|h| h.addr))?;
    let log_path = util::target_dir()?.join("demo-daemon.log");
    step(format!(
        "starting the daemon (embedded default config; log: {})",
        log_path.display()
    ));
    let mut daemon = Daemon::start(&proxy, &log_path, config.admin.address)?;
    let result = exercise(&proxy, &config, vip, &hosts, count, config.admin.address);
    step("stopping the daemon (SIGTERM)");
    daemon.stop()?;
    backends.stop();
    let cleanup = check_cleanup(&config);
    result?;
    cleanup
}

fn exercise(
    proxy: &Path,
    config: &Config,
    vip: SocketAddr,
    hosts: &[proxy_core::discovery::Host],
    count: u32,
    admin: SocketAddr,
) -> anyhow::Result<()> {
    step(format!(
        "client in cgroup {:?}: {count} connections to {vip}",
        config.cgroup
    ));
    let report = probe(proxy, vip, count, Some(&config.cgroup))?;
    let total_weight: u32 = hosts.iter().map(|h| h.weight).sum();
    println!();
    println!(
        "  {:<22} {:>6} {:>9} {:>8} {:>9}",
        "backend", "weight", "expected", "conns", "observed"
    );
    let mut off = Vec::new();
    for host in hosts {
        let got = report["backends"][host.addr.to_string()]
            .as_u64()
            .unwrap_or(0);
        let p = f64::from(host.weight) / f64::from(total_weight);
        let (expected, observed) = (100.0 * p, 100.0 * got as f64 / f64::from(count));
        // Random selection: the share is binomial; 4.5 standard deviations is a bound that a
        // correct data path exceeds about once in 150,000 runs.
        let tolerance = 100.0 * 4.5 * (p * (1.0 - p) / f64::from(count)).sqrt();
        if (expected - observed).abs() > tolerance {
            off.push(format!(
                "{}: {observed:.1}% vs {expected:.1}% +- {tolerance:.1}",
                host.addr
            ));
        }
        println!(
            "  {:<22} {:>6} {:>8.1}% {:>8} {:>8.1}%",
            host.addr, host.weight, expected, got, observed
        );
    }
    let peers: Vec<&str> = report["peers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p.as_str())
        .collect();
    println!("  getpeername() in the client showed: {}", peers.join(", "));
    let errors = &report["errors"];
    let outside = probe(proxy, vip, 1, None)?;
    let outside_result = outside["errors"]
        .as_object()
        .and_then(|e| e.keys().next().cloned())
        .or_else(|| {
            outside["backends"]
                .as_object()
                .and_then(|b| b.keys().next().cloned())
        })
        .unwrap_or_default();
    println!("  the same connect from outside the cgroup: {outside_result} (not rewritten)");
    println!("  kernel counters: {}", kernel_counters(admin)?);
    println!();
    if errors.as_object().is_some_and(|e| !e.is_empty()) {
        bail!("some connections failed: {errors}");
    }
    if peers != [vip.to_string()] {
        bail!("getpeername showed {peers:?}, not the VIP {vip}");
    }
    if !off.is_empty() {
        bail!(
            "the distribution does not follow the weights: {}",
            off.join("; ")
        );
    }
    if outside["backends"]
        .as_object()
        .is_some_and(|b| !b.is_empty())
    {
        bail!("a process outside the cgroup reached a backend through the VIP");
    }
    Ok(())
}

fn probe(
    proxy: &Path,
    vip: SocketAddr,
    count: u32,
    cgroup: Option<&str>,
) -> anyhow::Result<serde_json::Value> {
    let mut cmd = Command::new(proxy);
    cmd.args([
        "probe",
        &vip.to_string(),
        "--count",
        &count.to_string(),
        "--json",
    ]);
    cmd.args(["--timeout-ms", "500"]);
    if let Some(cgroup) = cgroup {
        cmd.args(["--cgroup", cgroup]);
    }
    let out = util::output(&mut cmd, "proxy probe")?;
    serde_json::from_str(&out).context("parsing the probe report")
}

/// `bpf.*` lines of the admin `/stats`, on one line.
fn kernel_counters(admin: SocketAddr) -> anyhow::Result<String> {
    let body = http_get(admin, "/stats")?;
    Ok(body
        .lines()
        .filter(|l| l.starts_with("bpf.") && !l.ends_with(": 0"))
        .collect::<Vec<_>>()
        .join(", "))
}

/// A GET against the admin interface; returns the body of a 200.
fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: admin\r\nconnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    if !head.starts_with("HTTP/1.1 200") {
        bail!("GET {path}: {}", head.lines().next().unwrap_or_default());
    }
    Ok(body.to_owned())
}

fn check_cleanup(config: &Config) -> anyhow::Result<()> {
    let pins = PathBuf::from(&config.bpffs).join(&config.instance);
    let cgroup = proxy_cgroup(&config.cgroup);
    let mut left = Vec::new();
    if pins.exists() {
        left.push(pins.display().to_string());
    }
    if let Some(cg) = cgroup.filter(|c| c.exists()) {
        left.push(cg.display().to_string());
    }
    if !left.is_empty() {
        bail!("the daemon left {left:?} behind");
    }
    step("stopped everything; the cgroup and the pins are gone");
    Ok(())
}

fn proxy_cgroup(configured: &str) -> Option<PathBuf> {
    if configured.starts_with('/') {
        return Some(PathBuf::from(configured));
    }
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    let mount = mounts.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(2) == Some(&"cgroup2")).then(|| f[1].to_owned())
    })?;
    Some(Path::new(&mount).join(configured))
}

/// The daemon process, stopped by PID.
struct Daemon {
    child: Child,
}

impl Daemon {
    fn start(proxy: &Path, log: &Path, admin: SocketAddr) -> anyhow::Result<Self> {
        let log_file = std::fs::File::create(log).context("creating the daemon log")?;
        let child = Command::new(proxy)
            .arg("run")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .context("starting the daemon")?;
        let mut daemon = Self { child };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = daemon.child.try_wait()? {
                let log = std::fs::read_to_string(log).unwrap_or_default();
                bail!("the daemon exited ({status}) before it was ready:\n{log}");
            }
            if http_get(admin, "/ready").is_ok() {
                detail(format!("daemon ready (pid {})", daemon.child.id()));
                return Ok(daemon);
            }
            if Instant::now() > deadline {
                daemon.stop()?;
                bail!(
                    "the daemon was not ready within {READY_TIMEOUT:?}; see {}",
                    log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGTERM, then SIGKILL after 10 s.
    fn stop(&mut self) -> anyhow::Result<()> {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: kill has no memory-safety preconditions; pid is our own child.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                if !status.success() {
                    bail!("the daemon exited with {status}");
                }
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.child.kill()?;
        self.child.wait()?;
        bail!("the daemon did not stop within 10 s of SIGTERM and was killed");
    }
}

/// Banner servers: each accepts connections and writes its own address as the first line.
struct Backends {
    stop: Arc<AtomicBool>,
    threads: Vec<(SocketAddr, JoinHandle<()>)>,
}

impl Backends {
    fn start(addrs: impl Iterator<Item = SocketAddr>) -> anyhow::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for addr in addrs {
            let listener =
                TcpListener::bind(addr).with_context(|| format!("binding backend {addr}"))?;
            let stop = stop.clone();
            threads.push((
                addr,
                std::thread::spawn(move || serve(&listener, addr, &stop)),
            ));
            detail(format!("backend listening on {addr}"));
        }
        Ok(Self { stop, threads })
    }

    fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        for (addr, thread) in self.threads {
            // Wake the blocking accept so the thread sees the flag.
            let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(200));
            let _ = thread.join();
        }
    }
}

fn serve(listener: &TcpListener, addr: SocketAddr, stop: &AtomicBool) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        if let Ok(mut conn) = conn {
            let _ = writeln!(conn, "{addr}");
        }
    }
}
