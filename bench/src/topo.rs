//! What the scenarios run on: the loopback or a veth pair between two namespaces of ours, the
//! backend servers, the daemon with N services, nft tables. Each piece removes itself on drop
//! (processes are stopped by PID, tables and namespaces deleted), so an error anywhere still
//! leaves the machine as it was.

use std::{
    fmt::Write as _,
    fs,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use serde_json::json;

use super::sys;
use crate::util::detail;

/// Backend ports: echo, connect, sink, iperf3. VIP ports are the same.
pub const ECHO: u16 = 17000;
pub const CONN: u16 = 17001;
pub const SINK: u16 = 17002;
pub const IPERF: u16 = 17003;
pub const PORTS: [u16; 4] = [ECHO, CONN, SINK, IPERF];
/// The VIP of the single-service rows on the host (loopback range: if a rewrite fails the
/// packet stays on the machine), and the first of the N connect-rate services.
pub const VIP: Ipv4Addr = Ipv4Addr::new(127, 77, 0, 1);
pub const VIP_N_BASE: Ipv4Addr = Ipv4Addr::new(127, 77, 1, 0);
/// Inside the veth client namespace the VIPs are 10.96.0.0/16, routed to the veth (whose peer
/// is our server namespace): a loopback VIP would be DNATed with a loopback source, which the
/// veth drops as martian.
pub const VETH_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 1);
pub const VETH_VIP_N_BASE: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 0);
/// The nft table the benchmark creates (and always deletes).
pub const NAT_TABLE: &str = "proxy_bench";

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Path2 {
    /// Client and server on the host's loopback.
    Lo,
    /// Client and server in two namespaces of ours joined by a veth pair.
    Veth,
}

impl Path2 {
    pub fn name(self) -> &'static str {
        match self {
            Path2::Lo => "lo",
            Path2::Veth => "veth",
        }
    }
}

/// A started process, stopped (SIGTERM, then SIGKILL) on drop.
pub struct Proc {
    pub child: Child,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        sys::stop(&mut self.child);
    }
}

/// Starts `cmd` and waits until it prints a line starting with `ready` (our workers) or until
/// `probe` accepts a connection.
pub fn start(
    mut cmd: Command,
    what: &str,
    probe: Option<SocketAddr>,
    netns: Option<&str>,
) -> anyhow::Result<Proc> {
    let piped = probe.is_none();
    cmd.stdin(Stdio::null())
        .stdout(if piped { Stdio::piped() } else { Stdio::null() });
    let child = cmd.spawn().with_context(|| format!("starting {what}"))?;
    let mut proc = Proc { child };
    let deadline = Instant::now() + Duration::from_secs(20);
    if piped {
        let out = proc.child.stdout.take().context("stdout")?;
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        if !line.starts_with("ready") {
            bail!("{what} did not start (said {line:?})");
        }
        return Ok(proc);
    }
    let addr = probe.expect("probe set");
    loop {
        if listens(netns, addr)? {
            return Ok(proc);
        }
        if let Ok(Some(st)) = proc.child.try_wait() {
            bail!("{what} exited at start ({st})");
        }
        if Instant::now() > deadline {
            bail!("{what} did not listen on {addr} within 20 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether something accepts TCP connections on `addr` in network namespace `netns`.
pub fn listens(netns: Option<&str>, addr: SocketAddr) -> anyhow::Result<bool> {
    in_netns(netns, || {
        TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
    })
}

/// Runs `f` in network namespace `netns` (one of ours, under /run/netns), on a thread of its
/// own: `setns` moves only the calling thread, and the thread ends with `f`.
pub fn in_netns<T: Send>(netns: Option<&str>, f: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
    let Some(ns) = netns else {
        return Ok(f());
    };
    let path = Path::new("/run/netns").join(ns);
    let file = fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                sys::enter_netns(&file)
                    .with_context(|| format!("entering network namespace {ns}"))?;
                Ok(f())
            })
            .join()
            .map_err(|_| anyhow::anyhow!("a thread in network namespace {ns} panicked"))?
    })
}

/// `cmd`'s program and arguments (nothing else of it: set stdio on the result) run in network
/// namespace `netns` through nsenter, which (unlike `ip netns exec`) keeps the host's /sys, so
/// the daemon still sees the cgroup and bpf file systems. nsenter execs the program without
/// forking: the PID is the program's.
pub fn in_netns_cmd(cmd: Command, netns: Option<&str>) -> Command {
    let Some(ns) = netns else {
        return cmd;
    };
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{ns}"))
        .arg("--")
        .arg(cmd.get_program())
        .args(cmd.get_args());
    c
}

/// Two namespaces of ours joined by a veth pair: client 10.77.0.1, server 10.77.0.2. No route
/// leaves them.
pub struct VethPair {
    pub client: String,
    pub server: String,
}

impl VethPair {
    pub fn create() -> anyhow::Result<Self> {
        let id = std::process::id();
        let pair = Self {
            client: format!("pbc-{id}"),
            server: format!("pbs-{id}"),
        };
        let (c_if, s_if) = (format!("pbc{id}"), format!("pbs{id}"));
        let ip = |args: &[&str]| {
            sys::sh(
                Command::new("ip").args(args),
                &format!("ip {}", args.join(" ")),
            )
        };
        ip(&["netns", "add", &pair.client])?;
        ip(&["netns", "add", &pair.server])?;
        ip(&["link", "add", &c_if, "type", "veth", "peer", "name", &s_if])?;
        ip(&["link", "set", &c_if, "netns", &pair.client])?;
        ip(&["link", "set", &s_if, "netns", &pair.server])?;
        for (ns, dev, addr) in [
            (&pair.client, &c_if, "10.77.0.1/24"),
            (&pair.server, &s_if, "10.77.0.2/24"),
        ] {
            ip(&["-n", ns, "addr", "add", addr, "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        ip(&[
            "-n",
            &pair.client,
            "route",
            "add",
            "10.96.0.0/16",
            "dev",
            &c_if,
        ])?;
        // Connect-rate runs leave the proxies' upstream sockets in TIME_WAIT (the peers close
        // upstream with a FIN; ours resets when the client does). Outside loopback the kernel
        // does not reuse them by default, and a second run within the minute finds the even
        // ports that connect() prefers taken: every proxy's connection rate then collapsed.
        // Reuse (with timestamps, after 1 s) is what loopback gets already.
        ip(&[
            "netns",
            "exec",
            &pair.client,
            "sysctl",
            "-qw",
            "net.ipv4.tcp_tw_reuse=1",
        ])?;
        Ok(pair)
    }
}

impl Drop for VethPair {
    fn drop(&mut self) {
        for ns in [&self.client, &self.server] {
            let _ = Command::new("ip").args(["netns", "delete", ns]).status();
        }
    }
}

/// Where the client runs and where the backends listen.
pub struct Net {
    pub path: Path2,
    pub client_ns: Option<String>,
    pub server_ns: Option<String>,
    pub backend: Ipv4Addr,
    pub vip: Ipv4Addr,
    vip_n_base: Ipv4Addr,
}

impl Net {
    /// The N-th connect-rate VIP.
    pub fn vip_n(&self, i: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.vip_n_base) + i)
    }

    pub fn lo() -> Self {
        Self {
            path: Path2::Lo,
            client_ns: None,
            server_ns: None,
            backend: Ipv4Addr::new(127, 0, 0, 91),
            vip: VIP,
            vip_n_base: VIP_N_BASE,
        }
    }

    pub fn veth(pair: &VethPair) -> Self {
        Self {
            path: Path2::Veth,
            client_ns: Some(pair.client.clone()),
            server_ns: Some(pair.server.clone()),
            backend: Ipv4Addr::new(10, 77, 0, 2),
            vip: VETH_VIP,
            vip_n_base: VETH_VIP_N_BASE,
        }
    }

    pub fn backend(&self, port: u16) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.backend, port))
    }

    /// `program args...` run in the given namespace (if any).
    pub fn in_ns(ns: Option<&str>, program: &Path, args: &[String]) -> Command {
        match ns {
            None => {
                let mut c = Command::new(program);
                c.args(args);
                c
            }
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(program).args(args);
                c
            }
        }
    }

    /// A client command: in `cgroup` from its first instruction (a shell in the host's mount
    /// namespace moves itself in, then execs; `ip netns exec` remounts /sys, so the cgroup must
    /// be joined before it), then in the client namespace.
    pub fn client(&self, program: &Path, args: &[String], cgroup: Option<&Path>) -> Command {
        let Some(cg) = cgroup else {
            return Self::in_ns(self.client_ns.as_deref(), program, args);
        };
        let mut full = vec![
            "-c".to_owned(),
            format!("echo $$ > '{}/cgroup.procs' && exec \"$@\"", cg.display()),
            "sh".to_owned(),
        ];
        if let Some(ns) = &self.client_ns {
            full.extend([
                "ip".to_owned(),
                "netns".to_owned(),
                "exec".to_owned(),
                ns.clone(),
            ]);
        }
        full.push(program.display().to_string());
        full.extend_from_slice(args);
        let mut c = Command::new("sh");
        c.args(full);
        c
    }

    /// The backend servers: our `serve` worker and an iperf3 server.
    pub fn start_backends(&self, worker: &Path) -> anyhow::Result<Vec<Proc>> {
        self.start_backends_at(worker, 0, None)
    }

    /// Backend servers on the ports + `offset`, inside `cgroup` when given (S6: a local server
    /// whose sockets sockops sees, so both ends of a connection can be spliced).
    pub fn start_backends_at(
        &self,
        worker: &Path,
        offset: u16,
        cgroup: Option<&Path>,
    ) -> anyhow::Result<Vec<Proc>> {
        let a = |p: u16| self.backend(p + offset).to_string();
        let serve_args = [
            "worker",
            "serve",
            "--echo",
            &a(ECHO),
            "--conn",
            &a(CONN),
            "--sink",
            &a(SINK),
        ]
        .map(str::to_owned);
        let command = |program: &Path, args: &[String]| match cgroup {
            Some(cg) => self.client(program, args, Some(cg)),
            None => Self::in_ns(self.server_ns.as_deref(), program, args),
        };
        let serve = start(command(worker, &serve_args), "backend servers", None, None)?;
        let iperf_args = [
            "-s",
            "-B",
            &self.backend.to_string(),
            "-p",
            &(IPERF + offset).to_string(),
        ]
        .map(str::to_owned);
        let mut iperf_cmd = command(Path::new("iperf3"), &iperf_args);
        // The readiness probe's bare connect makes iperf3 complain once; keep that quiet.
        iperf_cmd.stderr(Stdio::null());
        let iperf = start(
            iperf_cmd,
            "iperf3 server",
            Some(self.backend(IPERF + offset)),
            if cgroup.is_some() {
                self.client_ns.as_deref()
            } else {
                self.server_ns.as_deref()
            },
        )?;
        Ok(vec![serve, iperf])
    }
}

/// An nft table of ours (type nat: conntrack runs while it exists), deleted on drop and checked.
pub struct NatTable {
    netns: Option<String>,
}

impl NatTable {
    /// Loads `table ip proxy_bench { chain out { type nat hook output ...; <rules> } }`.
    pub fn load(netns: Option<&str>, rules: &str) -> anyhow::Result<Self> {
        let text = format!(
            "table ip {NAT_TABLE} {{\n chain out {{\n  type nat hook output priority -100; policy accept;\n{rules} }}\n}}\n"
        );
        let mut cmd = Net::in_ns(netns, Path::new("nft"), &["-f".to_owned(), "-".to_owned()]);
        let mut child = cmd
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting nft")?;
        let table = Self {
            netns: netns.map(str::to_owned),
        };
        child
            .stdin
            .take()
            .context("nft stdin")?
            .write_all(text.as_bytes())?;
        let mut err = String::new();
        child
            .stderr
            .take()
            .context("nft stderr")?
            .read_to_string(&mut err)?;
        if !child.wait()?.success() {
            bail!("nft could not load the benchmark table: {}", err.trim());
        }
        Ok(table)
    }
}

impl Drop for NatTable {
    fn drop(&mut self) {
        let del = ["delete", "table", "ip", NAT_TABLE].map(str::to_owned);
        let _ = Net::in_ns(self.netns.as_deref(), Path::new("nft"), &del)
            .stderr(Stdio::null())
            .status();
        let list = ["list", "tables"].map(str::to_owned);
        let left = Net::in_ns(self.netns.as_deref(), Path::new("nft"), &list).output();
        if left.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(NAT_TABLE)) {
            eprintln!(
                "WARNING: nft table {NAT_TABLE} is still there; delete it: nft delete table ip {NAT_TABLE}"
            );
        }
    }
}

/// DNAT rules: the three single-service VIPs, then `n` connect-rate services (linear, as
/// kube-proxy's iptables mode evaluates them).
pub fn dnat_rules(net: &Net, n: u32) -> String {
    let b = net.backend;
    let mut s = String::new();
    for i in 0..n {
        let _ = writeln!(
            s,
            "  ip daddr {} tcp dport {CONN} dnat to {b}:{CONN}",
            net.vip_n(i)
        );
    }
    for p in [ECHO, SINK, IPERF, CONN] {
        let _ = writeln!(s, "  ip daddr {} tcp dport {p} dnat to {b}:{p}", net.vip);
    }
    s
}

/// A running daemon with its config; on drop, stopped (SIGTERM, which leaves the data path
/// serving) and uninstalled (`proxy uninstall`: detached and unpinned), so that a baseline
/// measured afterwards in the same cgroup pays nothing for it.
pub struct Daemon {
    pub proc: Proc,
    pub cgroup: PathBuf,
    pub pins: PathBuf,
    pub publish_s: f64,
    pub proxy: PathBuf,
    pub config: PathBuf,
}

impl Daemon {
    /// Publishes the four single-service VIPs and `n` connect-rate VIPs, all to `net`'s backend.
    pub fn start(
        proxy: &Path,
        dir: &Path,
        net: &Net,
        n: u32,
        tweak: &dyn Fn(&mut serde_json::Value),
    ) -> anyhow::Result<Self> {
        let id = std::process::id();
        let cg = super::cgroup2_mount()?.join(format!("proxy-bench-{id}"));
        let instance = format!("proxy_bench_{id}");
        let admin = free_port()?;
        let cluster = |name: &str, port: u16| {
            json!({"name": name, "type": "STATIC", "load_assignment": {"endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": net.backend.to_string(), "port_value": port}}}}]}]}})
        };
        let mut services: Vec<_> = PORTS
            .iter()
            .map(|p| json!({"name": format!("vip-{p}"), "address": net.vip.to_string(), "port": p, "cluster": format!("c{p}")}))
            .collect();
        services.extend((0..n).map(|i| json!({"name": format!("svc-{i}"), "address": net.vip_n(i).to_string(), "port": CONN, "cluster": format!("c{CONN}")})));
        let mut config = json!({
            "instance": instance, "cgroup": cg.display().to_string(), "admin": {"address": admin.to_string()},
            "clusters": PORTS.iter().map(|p| cluster(&format!("c{p}"), *p)).collect::<Vec<_>>(),
            "services": services,
        });
        tweak(&mut config);
        let file = dir.join(format!("daemon-{n}.json"));
        fs::write(&file, serde_json::to_vec_pretty(&config)?)?;
        let log = fs::File::create(dir.join(format!("daemon-{n}.log")))?;
        let mut cmd = Command::new(proxy);
        cmd.arg("run").arg("--config").arg(&file);
        // On the veth path the daemon runs in the client's namespace (the sidecar's place):
        // its proxy listeners must be reachable from the client, its upstreams across the veth.
        let ns = net.client_ns.as_deref();
        let mut cmd = in_netns_cmd(cmd, ns);
        cmd.stderr(log);
        let t = Instant::now();
        let proc = start(cmd, "the daemon", Some(admin), ns)?;
        let pins = PathBuf::from("/sys/fs/bpf").join(&instance);
        let deadline = Instant::now() + Duration::from_secs(120);
        while in_netns(ns, || http_status(admin, "/ready"))? != Some(200) {
            if Instant::now() > deadline {
                bail!(
                    "the daemon was not ready within 120 s (log: {})",
                    dir.join(format!("daemon-{n}.log")).display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let publish_s = t.elapsed().as_secs_f64();
        detail(format!(
            "daemon ready with {} services in {publish_s:.2} s",
            n + 4
        ));
        Ok(Self {
            proc,
            cgroup: cg,
            pins,
            publish_s,
            proxy: proxy.to_owned(),
            config: file,
        })
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        sys::stop(&mut self.proc.child);
        let uninstalled = Command::new(&self.proxy)
            .arg("uninstall")
            .arg("--config")
            .arg(&self.config)
            .stdout(std::process::Stdio::null())
            .status();
        if !uninstalled
            .as_ref()
            .is_ok_and(std::process::ExitStatus::success)
        {
            eprintln!("WARNING: proxy uninstall failed: {uninstalled:?}");
        }
        if self.pins.exists() || self.cgroup.exists() {
            eprintln!(
                "WARNING: after the daemon stopped and was uninstalled, {} or {} is still there",
                self.pins.display(),
                self.cgroup.display()
            );
        }
    }
}

pub fn free_port() -> anyhow::Result<SocketAddr> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?)
}

/// The status code of a plain HTTP/1.0 GET, or None.
pub fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .ok()?;
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.split_whitespace().nth(1)?.parse().ok()
}

/// Runs `proxy check` on the benchmark's daemon config changed by `tweak`; the error is the
/// daemon's own message.
pub fn check_config(
    proxy: &Path,
    dir: &Path,
    net: &Net,
    tweak: fn(&mut serde_json::Value),
) -> anyhow::Result<()> {
    fs::create_dir_all(dir)?;
    let mut config = json!({
        "instance": "proxy_bench_check",
        "clusters": [{"name": "c", "load_assignment": {"endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": net.backend.to_string(), "port_value": ECHO}}}}]}]}}],
        "services": [{"name": "s", "address": VIP.to_string(), "port": ECHO, "cluster": "c"}],
    });
    tweak(&mut config);
    let file = dir.join("feature-check.json");
    fs::write(&file, serde_json::to_vec_pretty(&config)?)?;
    let out = Command::new(proxy)
        .arg("check")
        .arg("--config")
        .arg(&file)
        .output()?;
    if out.status.success() {
        return Ok(());
    }
    let msg = String::from_utf8_lossy(&out.stderr);
    let last = msg
        .lines()
        .rfind(|l| !l.trim().is_empty())
        .unwrap_or("rejected")
        .trim();
    // Drop "error: <file>:line:col: " and keep the daemon's own words.
    let words = last.rsplit_once(".json:").map_or(last, |(_, rest)| {
        rest.splitn(3, ':').nth(2).unwrap_or(rest).trim()
    });
    bail!("`proxy check` says: {words}")
}
