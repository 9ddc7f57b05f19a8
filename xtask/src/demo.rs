//! `cargo xtask demo`: the main job on the embedded default configuration, end to end.
//!
//! Starts one banner server per host of the default STATIC cluster (on 127.0.0.x), runs the
//! daemon without `--config`, lets `proxy probe` make a bounded number of connections to the VIP
//! from inside the attached cgroup, prints connections per backend against their weights and
//! what `getpeername` showed, then stops everything it started (the daemon's stop leaves the
//! kernel serving), removes the data path with `proxy uninstall` and checks that its cgroup and
//! pins are gone.
//!
//! The demo links no crate of the product. What it needs before the daemon runs (the admin
//! address, the VIP, the hosts and their weights) it reads from the file the daemon embeds as
//! its default, `examples/demo.yaml`; where the daemon attaches and pins (its effective config,
//! defaults included) it asks the running daemon (`/config_dump?format=proxy`).

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
use serde::Deserialize;

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
    let demo = Demo::embedded()?;

    step(format!("starting {} backends", demo.hosts.len()));
    let backends = Backends::start(demo.hosts.iter().map(|h| h.addr))?;
    let log_path = util::target_dir()?.join("demo-daemon.log");
    step(format!(
        "starting the daemon (embedded default config; log: {})",
        log_path.display()
    ));
    let mut daemon = Daemon::start(&proxy, &log_path, demo.admin)?;
    let placement = Placement::of(demo.admin);
    let result = match &placement {
        Ok(placement) => exercise(&proxy, &demo, &placement.cgroup, count),
        Err(_) => Ok(()),
    };
    step("stopping the daemon (SIGTERM; the kernel keeps serving what it published)");
    daemon.stop()?;
    backends.stop();
    let placement = placement?;
    step("removing the data path (proxy uninstall)");
    let cleanup = uninstall(&proxy, &placement).and_then(|()| check_cleanup(&placement));
    result?;
    cleanup
}

/// The embedded default as the demo reads it: only the fields it uses, unknown ones ignored
/// (`proxy check` validates the file; the daemon's unit tests parse it).
#[derive(Debug, Deserialize)]
struct DemoFile {
    admin: DemoAdmin,
    clusters: Vec<DemoCluster>,
    services: Vec<DemoService>,
}

#[derive(Debug, Deserialize)]
struct DemoAdmin {
    address: SocketAddr,
}

/// A STATIC cluster in Envoy's `load_assignment` shape.
#[derive(Debug, Deserialize)]
struct DemoCluster {
    name: String,
    load_assignment: LoadAssignment,
}

#[derive(Debug, Deserialize)]
struct LoadAssignment {
    endpoints: Vec<LocalityEndpoints>,
}

#[derive(Debug, Deserialize)]
struct LocalityEndpoints {
    lb_endpoints: Vec<LbEndpoint>,
}

/// The demo file states every weight (the demo compares the traffic with them).
#[derive(Debug, Deserialize)]
struct LbEndpoint {
    endpoint: Endpoint,
    load_balancing_weight: u32,
}

#[derive(Debug, Deserialize)]
struct Endpoint {
    address: EndpointAddress,
}

#[derive(Debug, Deserialize)]
struct EndpointAddress {
    socket_address: SocketAddress,
}

#[derive(Debug, Deserialize)]
struct SocketAddress {
    address: std::net::IpAddr,
    port_value: u16,
}

#[derive(Debug, Deserialize)]
struct DemoService {
    address: std::net::IpAddr,
    port: u16,
    cluster: String,
}

/// One backend of the demo's cluster.
#[derive(Debug, PartialEq)]
struct DemoHost {
    addr: SocketAddr,
    weight: u32,
}

/// What the demo needs before the daemon runs: its first service and that service's hosts.
#[derive(Debug)]
struct Demo {
    admin: SocketAddr,
    vip: SocketAddr,
    hosts: Vec<DemoHost>,
}

impl Demo {
    /// The file `proxy run` uses without `--config`.
    const FILE: &str = include_str!("../../examples/demo.yaml");

    fn embedded() -> anyhow::Result<Self> {
        Self::parse(Self::FILE).context("reading examples/demo.yaml (the embedded default)")
    }

    fn parse(text: &str) -> anyhow::Result<Self> {
        let file: DemoFile = serde_norway::from_str(text)?;
        let service = file.services.first().context("the file has no service")?;
        let cluster = file
            .clusters
            .iter()
            .find(|c| c.name == service.cluster)
            .with_context(|| format!("no cluster {:?} for the first service", service.cluster))?;
        let hosts: Vec<DemoHost> = cluster
            .load_assignment
            .endpoints
            .iter()
            .flat_map(|e| &e.lb_endpoints)
            .map(|lb| {
                let a = &lb.endpoint.address.socket_address;
                DemoHost {
                    addr: SocketAddr::new(a.address, a.port_value),
                    weight: lb.load_balancing_weight,
                }
            })
            .collect();
        if hosts.is_empty() || hosts.iter().any(|h| h.weight == 0) {
            bail!(
                "cluster {:?} needs hosts with weights of at least 1",
                cluster.name
            );
        }
        Ok(Self {
            admin: file.admin.address,
            vip: SocketAddr::new(service.address, service.port),
            hosts,
        })
    }
}

/// Where the running daemon attaches and pins, from its effective config
/// (`/config_dump?format=proxy`).
struct Placement {
    /// The cgroup as configured: absolute, or relative to the cgroup v2 mount.
    cgroup: String,
    /// `<bpffs>/<instance>`.
    pins: PathBuf,
}

impl Placement {
    fn of(admin: SocketAddr) -> anyhow::Result<Self> {
        let dump: serde_json::Value =
            serde_json::from_str(&http_get(admin, "/config_dump?format=proxy")?)
                .context("parsing the daemon's /config_dump?format=proxy")?;
        let field = |key: &str| {
            dump[key]
                .as_str()
                .with_context(|| format!("/config_dump?format=proxy has no string {key:?}"))
        };
        Ok(Self {
            cgroup: field("cgroup")?.to_owned(),
            pins: Path::new(field("bpffs")?).join(field("instance")?),
        })
    }
}

fn exercise(proxy: &Path, demo: &Demo, cgroup: &str, count: u32) -> anyhow::Result<()> {
    let (vip, hosts, admin) = (demo.vip, &demo.hosts, demo.admin);
    step(format!(
        "client in cgroup {cgroup:?}: {count} connections to {vip}"
    ));
    let report = probe(proxy, vip, count, Some(cgroup))?;
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
    // Exit status 1 means some connections failed, which the report lists (the connect from
    // outside the cgroup is expected to); anything else is a probe that could not run.
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("starting proxy probe")?;
    if !matches!(out.status.code(), Some(0 | 1)) {
        bail!("proxy probe failed ({})", out.status);
    }
    serde_json::from_slice(&out.stdout).context("parsing the probe report")
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
        "GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    if !head.starts_with("HTTP/1.1 200") {
        bail!("GET {path}: {}", head.lines().next().unwrap_or_default());
    }
    Ok(body.to_owned())
}

/// `proxy uninstall` of the demo's instance.
fn uninstall(proxy: &Path, placement: &Placement) -> anyhow::Result<()> {
    let (Some(bpffs), Some(instance)) = (placement.pins.parent(), placement.pins.file_name())
    else {
        bail!("no instance in {}", placement.pins.display());
    };
    let out = util::output(
        Command::new(proxy)
            .arg("uninstall")
            .arg("--bpffs")
            .arg(bpffs)
            .arg("--instance")
            .arg(instance),
        "proxy uninstall",
    )?;
    print!("  {out}");
    Ok(())
}

fn check_cleanup(placement: &Placement) -> anyhow::Result<()> {
    let cgroup = proxy_cgroup(&placement.cgroup);
    let mut left = Vec::new();
    if placement.pins.exists() {
        left.push(placement.pins.display().to_string());
    }
    if let Some(cg) = cgroup.filter(|c| c.exists()) {
        left.push(cg.display().to_string());
    }
    if !left.is_empty() {
        bail!("proxy uninstall left {left:?} behind");
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
            .args(["run", "--demo"])
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demo_reads_its_service_and_weighted_hosts_from_the_embedded_default() {
        let demo = Demo::embedded().unwrap();
        let file: serde_norway::Value = serde_norway::from_str(Demo::FILE).unwrap();
        let service = &file["services"][0];
        assert_eq!(
            demo.vip.to_string(),
            format!(
                "{}:{}",
                service["address"].as_str().unwrap(),
                service["port"].as_u64().unwrap()
            )
        );
        assert!(demo.hosts.len() > 1, "{demo:?}");
        assert!(demo.hosts.iter().all(|h| h.weight >= 1), "{demo:?}");
    }

    #[test]
    fn a_host_without_a_weight_is_refused() {
        let text = Demo::FILE.replace("load_balancing_weight", "weight_typo");
        let err = Demo::parse(&text).unwrap_err();
        assert!(
            format!("{err:#}").contains("load_balancing_weight"),
            "{err:#}"
        );
    }
}
