//! Kernel-test fixtures: a fresh network namespace and cgroup per test, banner servers inside
//! the namespace, the real daemon binary, and `proxy probe` as the client.
//!
//! Everything is removed on drop (namespace, cgroup, daemon by PID, servers), also when the test
//! fails. Traffic stays inside the test's own namespace.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A name unique to this test process and call, e.g. `pt-4242-3`.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

/// The `proxy` binary under test: `$PROXY_BIN` (set by `cargo xtask test`), else
/// `target/debug/proxy` of this workspace.
pub fn proxy_bin() -> PathBuf {
    let path = std::env::var_os("PROXY_BIN").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/proxy"),
        PathBuf::from,
    );
    assert!(
        path.exists(),
        "the proxy binary is not at {} (run `cargo xtask test`, which builds it and sets PROXY_BIN)",
        path.display()
    );
    path
}

/// Panics unless running as root: these tests need the kernel.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "kernel tests need root; run them through `cargo xtask test` as root"
    );
}

pub(crate) fn sh(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A network namespace with only `lo`, up.
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates a fresh namespace.
    pub fn new() -> Self {
        let name = unique("pt");
        sh(Command::new("ip").args(["netns", "add", &name]));
        let ns = Self { name };
        sh(Command::new("ip").args(["-n", &ns.name, "link", "set", "lo", "up"]));
        ns
    }

    /// Its name (for `ip -n` and `proxy probe --netns`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Path of its namespace file.
    pub fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    /// Adds an address to `lo` (e.g. a second IPv6 address); IPv4 127.0.0.0/8 needs none.
    /// IPv6 addresses are added with `nodad`: otherwise they stay tentative for a moment and a
    /// bind to them fails with EADDRNOTAVAIL.
    pub fn add_lo_addr(&self, cidr: &str) {
        let mut cmd = Command::new("ip");
        cmd.args(["-n", &self.name, "addr", "add", cidr, "dev", "lo"]);
        if cidr.contains(':') {
            cmd.arg("nodad");
        }
        sh(&mut cmd);
    }
}

impl Netns {
    /// The namespace's TCP counters (`/proc/net/netstat` and `/proc/net/snmp`, the `TcpExt` and
    /// `Tcp` rows) that are not zero, by name: a connection the host dropped shows here
    /// (`ListenOverflows`, `ListenDrops`, `TCPTimeWaitOverflow`, `PAWSEstab`, ...).
    pub fn tcp_counters(&self) -> std::collections::BTreeMap<String, u64> {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.name,
                "cat",
                "/proc/net/netstat",
                "/proc/net/snmp",
            ])
            .output()
            .expect("reading the namespace's TCP counters");
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        let mut counters = std::collections::BTreeMap::new();
        for pair in lines.chunks(2) {
            let [names, values] = pair else { continue };
            let (Some((table, names)), Some((_, values))) =
                (names.split_once(": "), values.split_once(": "))
            else {
                continue;
            };
            if table != "TcpExt" && table != "Tcp" {
                continue;
            }
            for (name, value) in names.split_whitespace().zip(values.split_whitespace()) {
                if let Ok(v) = value.parse::<u64>()
                    && v != 0
                {
                    counters.insert(format!("{table}.{name}"), v);
                }
            }
        }
        counters
    }
}

impl Default for Netns {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// A child cgroup of the cgroup v2 mount, removed on drop.
pub struct TestCgroup {
    path: PathBuf,
}

impl TestCgroup {
    /// Creates a fresh cgroup.
    pub fn new() -> Self {
        let path = cgroup2_mount().join(unique("proxy-test"));
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
        Self { path }
    }

    /// Its directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Default for TestCgroup {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Processes that were in it may take a moment to be reaped.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.path).is_ok() || !self.path.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The cgroup v2 mount point.
pub fn cgroup2_mount() -> PathBuf {
    let mounts = std::fs::read_to_string("/proc/mounts").expect("reading /proc/mounts");
    mounts
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
        })
        .expect("no cgroup v2 mount")
}

/// Servers inside a namespace that answer every TCP connection (or UDP datagram) with a banner
/// line, so a client knows which one it reached.
pub struct BannerServers {
    stop: Arc<AtomicBool>,
    wakers: Vec<(SocketAddr, bool)>,
    netns: PathBuf,
    threads: Vec<JoinHandle<()>>,
}

impl BannerServers {
    /// Starts one server per (address, banner, udp) inside `netns`.
    pub fn start(netns: &Netns, servers: &[(SocketAddr, &str, bool)]) -> Self {
        Self::start_styled(netns, servers, Style::CloseAtOnce)
    }

    /// Like [`BannerServers::start`], but a TCP server writes its banner [`HOLD_DELAY`] after
    /// the accept and keeps the connection until the client closes it (at most 5 s), each on
    /// a thread of its own: a proxy in between has its upstream connected, and can splice it,
    /// before the banner comes, and no socket closes under it meanwhile.
    pub fn start_holding(netns: &Netns, servers: &[(SocketAddr, &str, bool)]) -> Self {
        Self::start_styled(netns, servers, Style::Hold)
    }

    fn start_styled(netns: &Netns, servers: &[(SocketAddr, &str, bool)], style: Style) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for &(addr, banner, udp) in servers {
            let (stop, banner, path) = (stop.clone(), banner.to_owned(), netns.path());
            let (ready_tx, ready_rx) = std::sync::mpsc::channel();
            threads.push(std::thread::spawn(move || {
                proxy::enter_netns(&path).expect("entering the test namespace");
                if udp {
                    let socket = UdpSocket::bind(addr).expect("binding a UDP banner server");
                    ready_tx.send(()).expect("test alive");
                    serve_udp(&socket, &banner, &stop);
                } else {
                    let listener = TcpListener::bind(addr).expect("binding a banner server");
                    ready_tx.send(()).expect("test alive");
                    serve_tcp(&listener, &banner, &stop, style);
                }
            }));
            ready_rx
                .recv_timeout(Duration::from_secs(5))
                .expect("banner server started");
        }
        let wakers = servers.iter().map(|&(a, _, udp)| (a, udp)).collect();
        Self {
            stop,
            wakers,
            netns: netns.path(),
            threads,
        }
    }
}

/// How a TCP banner server treats a connection.
#[derive(Clone, Copy)]
enum Style {
    /// Banner, then close, on the accepting thread.
    CloseAtOnce,
    /// A thread per connection: [`HOLD_DELAY`], banner, then wait for the client's close.
    Hold,
}

/// How long a holding banner server waits before its banner.
pub const HOLD_DELAY: Duration = Duration::from_millis(20);

fn serve_tcp(listener: &TcpListener, banner: &str, stop: &AtomicBool, style: Style) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut conn) = conn else { continue };
        match style {
            Style::CloseAtOnce => {
                let _ = writeln!(conn, "{banner}");
            }
            Style::Hold => {
                let banner = banner.to_owned();
                std::thread::spawn(move || {
                    std::thread::sleep(HOLD_DELAY);
                    let _ = writeln!(conn, "{banner}");
                    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
                    let mut rest = Vec::new();
                    let _ = std::io::Read::read_to_end(&mut conn, &mut rest);
                });
            }
        }
    }
}

fn serve_udp(socket: &UdpSocket, banner: &str, stop: &AtomicBool) {
    let mut buf = [0u8; 512];
    while !stop.load(Ordering::SeqCst) {
        if let Ok((_, from)) = socket.recv_from(&mut buf) {
            let _ = socket.send_to(format!("{banner}\n").as_bytes(), from);
        }
    }
}

impl Drop for BannerServers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let (wakers, path) = (self.wakers.clone(), self.netns.clone());
        // Wake blocking accept/recv calls from inside the namespace.
        let waker = std::thread::spawn(move || {
            if proxy::enter_netns(&path).is_err() {
                return;
            }
            for (addr, udp) in wakers {
                if udp {
                    let any: SocketAddr = if addr.is_ipv4() {
                        "0.0.0.0:0"
                    } else {
                        "[::]:0"
                    }
                    .parse()
                    .expect("literal");
                    if let Ok(s) = UdpSocket::bind(any) {
                        let _ = s.send_to(b"stop", addr);
                    }
                } else {
                    let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(200));
                }
            }
        });
        let _ = waker.join();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// The daemon's log without terminal colour codes.
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// How long a started daemon may take to answer `/ready` with 200.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// The real daemon, run from its binary with a config file; on drop, SIGTERM, wait, and
/// `proxy uninstall` (the stop keeps the data path serving; the test's must go).
pub struct Daemon {
    child: Option<Child>,
    /// Its configuration file.
    pub config: PathBuf,
    /// Admin address (inside `netns` when the daemon runs in one: use [`Daemon::get`]).
    pub admin: SocketAddr,
    /// Its admin control socket (`admin.control_socket`, or `/run/proxy/<instance>.admin`),
    /// where state changes such as `POST /reload` go.
    pub control: PathBuf,
    /// The network namespace the daemon runs in; `None`: the test's own.
    netns: Option<PathBuf>,
    /// Where its log goes.
    pub log: PathBuf,
    _dir: TempDir,
}

impl Daemon {
    /// Writes `config` (YAML, with `{admin}` replaced by a free loopback address) and starts
    /// `proxy run` on it; returns once `/ready` answers.
    ///
    /// The admin port was free a moment ago; if another process takes it first, the daemon exits
    /// with "Address already in use" and the start is retried on a fresh port (bounded).
    pub fn start(config: &str) -> Self {
        Self::start_with(config, None, &[])
    }

    /// Like [`Daemon::start`], with the daemon's command line prefixed by `wrapper` (e.g.
    /// `setpriv` with a capability bounding set).
    pub fn start_wrapped(wrapper: &[&str], config: &str) -> Self {
        Self::start_with(config, None, wrapper)
    }

    /// Like [`Daemon::start`], but the daemon runs inside `netns` (network namespace only: it
    /// still sees the host's bpffs and cgroup mounts): its proxy listener, admin interface and
    /// upstream connections live there, next to the test's clients and backends.
    pub fn start_in(netns: &Netns, config: &str) -> Self {
        Self::start_with(config, Some(netns.path()), &[])
    }

    /// Like [`Daemon::start_in`], with `args` after `proxy run --config FILE` (e.g.
    /// `--takeover`).
    pub fn start_in_with(netns: &Netns, config: &str, args: &[&str]) -> Self {
        let netns = Some(netns.path());
        crate::start_retrying("the daemon", 4, || {
            Self::try_start(config, netns.clone(), &[], args)
        })
    }

    /// Like [`Daemon::start_in_with`], with the daemon's command line prefixed by `wrapper`
    /// (e.g. `unshare` for a mount namespace of its own).
    pub fn start_in_wrapped(netns: &Netns, wrapper: &[&str], config: &str, args: &[&str]) -> Self {
        let netns = Some(netns.path());
        crate::start_retrying("the daemon", 4, || {
            Self::try_start(config, netns.clone(), wrapper, args)
        })
    }

    /// Like [`Daemon::start_in_wrapped`], with `passed` open in the daemon as descriptors 3,
    /// 4, ... (a service manager's `LISTEN_FDS`; the variables are the wrapper's to set).
    pub fn start_in_passing(
        netns: &Netns,
        wrapper: &[&str],
        config: &str,
        passed: &[std::os::fd::OwnedFd],
    ) -> Self {
        crate::start_retrying("the daemon", 4, || {
            Self::try_start_in_passing(netns, wrapper, config, passed)
        })
    }

    /// One start of [`Daemon::start_in_passing`], not retried: `Err` with the exit status and
    /// the log if the daemon exited before it was ready.
    pub fn try_start_in_passing(
        netns: &Netns,
        wrapper: &[&str],
        config: &str,
        passed: &[std::os::fd::OwnedFd],
    ) -> Result<Self, String> {
        use std::os::fd::AsRawFd;
        let raw: Vec<i32> = passed.iter().map(AsRawFd::as_raw_fd).collect();
        let mut daemon = Self::launch_passing(config, Some(netns.path()), wrapper, &[], &raw);
        daemon.wait_ready().map(|()| daemon)
    }

    /// One start of [`Daemon::start_in_with`], not retried: `Err` with the exit status and the
    /// log if the daemon exited before it was ready (a start expected to fail).
    pub fn try_start_in(netns: &Netns, config: &str, args: &[&str]) -> Result<Self, String> {
        Self::try_start(config, Some(netns.path()), &[], args)
    }

    #[expect(
        clippy::needless_pass_by_value,
        reason = "each retry takes a clone of the namespace path"
    )]
    fn start_with(config: &str, netns: Option<PathBuf>, wrapper: &[&str]) -> Self {
        crate::start_retrying("the daemon", 4, || {
            Self::try_start(config, netns.clone(), wrapper, &[])
        })
    }

    /// Starts `proxy run` on `config` (in the test's own namespace) and returns at once,
    /// without waiting for `/ready`: for what happens during the start.
    pub fn spawn(config: &str) -> Self {
        Self::launch(config, None, &[], &[])
    }

    /// Like [`Daemon::spawn`], with the daemon's command line prefixed by `wrapper` (e.g. `env`
    /// with variables of a service manager).
    pub fn spawn_wrapped(wrapper: &[&str], config: &str) -> Self {
        Self::launch(config, None, wrapper, &[])
    }

    /// Waits (at most `within`) until the daemon's log, without colour codes, contains `what`;
    /// whether it did.
    pub fn wait_log(&self, what: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            if strip_ansi(&self.log_text()).contains(what) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits for `/ready` (at most a minute); `Err` with the exit status and log if the daemon
    /// exited first.
    pub fn ready(&mut self) -> Result<(), String> {
        self.wait_ready()
    }

    /// One start; `Err` with the daemon's log if it exited before it was ready.
    fn try_start(
        config: &str,
        netns: Option<PathBuf>,
        wrapper: &[&str],
        args: &[&str],
    ) -> Result<Self, String> {
        let mut daemon = Self::launch(config, netns, wrapper, args);
        daemon.wait_ready()?;
        Ok(daemon)
    }

    /// Writes the configuration and spawns the daemon.
    fn launch(config: &str, netns: Option<PathBuf>, wrapper: &[&str], args: &[&str]) -> Self {
        Self::launch_passing(config, netns, wrapper, args, &[])
    }

    /// [`Daemon::launch`], with the open descriptors `passed` as 3, 4, ... in the child.
    fn launch_passing(
        config: &str,
        netns: Option<PathBuf>,
        wrapper: &[&str],
        args: &[&str],
        passed: &[i32],
    ) -> Self {
        let dir = TempDir::new();
        let admin = match &netns {
            Some(ns) => in_netns_path(ns, free_port),
            None => free_port(),
        };
        let path = dir.0.join("config.yaml");
        let config = config.replace("{admin}", &admin.to_string());
        std::fs::write(&path, &config).expect("writing config");
        let control = proxy_core::config::Config::parse(&config, &path).map_or_else(
            // A configuration meant to be refused: no daemon serves it.
            |_| PathBuf::new(),
            |c| c.admin.control_path(&c.instance),
        );
        let log = dir.0.join("daemon.log");
        let file = std::fs::File::create(&log).expect("creating the daemon log");
        let mut cmd = match wrapper.split_first() {
            None => Command::new(proxy_bin()),
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(proxy_bin());
                cmd
            }
        };
        cmd.args(["run", "--config"])
            .arg(&path)
            .args(args)
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("dup"))
            .stderr(file);
        if let Some(ns) = &netns {
            exec_in_netns(&mut cmd, ns);
        }
        if !passed.is_empty() {
            pass_descriptors(&mut cmd, passed.to_vec());
        }
        let child = cmd.spawn().expect("starting the daemon");
        Self {
            child: Some(child),
            config: path,
            admin,
            control,
            netns,
            log,
            _dir: dir,
        }
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        // Generous: a debug build publishing 10,000 services (load.rs) takes tens of seconds.
        let deadline = Instant::now() + READY_WITHIN;
        while Instant::now() < deadline {
            let child = self.child.as_mut().expect("running");
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(format!("{status}\n{}", self.log_text()));
            }
            if self.get("/ready").is_some_and(|(code, _)| code == 200) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("daemon not ready in {READY_WITHIN:?}:\n{}", self.log_text());
    }

    /// The daemon's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A GET on the admin interface (from inside the daemon's namespace).
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        self.get_within(path, Duration::from_secs(2))
    }

    /// [`Daemon::get`] allowing `idle` between reads (a large answer's rendering).
    pub fn get_within(&self, path: &str, idle: Duration) -> Option<(u16, String)> {
        let (admin, path) = (self.admin, path.to_owned());
        match &self.netns {
            Some(ns) => in_netns_path(ns, move || http_get_within(admin, &path, idle)),
            None => http_get_within(admin, &path, idle),
        }
    }

    /// A `bpf.<name>` counter from `/stats`.
    pub fn counter(&self, name: &str) -> u64 {
        self.stat(&format!("bpf.{name}"))
    }

    /// Any stat from `/stats` by its full name (e.g. `proxy.downstream_cx_total`).
    pub fn stat(&self, name: &str) -> u64 {
        let (_, body) = self.get("/stats").expect("admin /stats");
        body.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no stat {name} in /stats:\n{body}"))
    }

    /// SIGTERM and wait (at most 10 s, then SIGKILL), then `proxy uninstall` of its instance;
    /// returns whether it exited cleanly and the uninstall succeeded.
    pub fn stop(&mut self) -> bool {
        let exited = self.terminate();
        exited & self.uninstall()
    }

    /// `proxy uninstall --config` of the daemon's instance (bounded); whether it succeeded.
    pub fn uninstall(&self) -> bool {
        let Ok(mut child) = Command::new(proxy_bin())
            .args(["uninstall", "--config"])
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
        else {
            return false;
        };
        exits_cleanly(&mut child, Duration::from_secs(20))
    }

    /// SIGTERM and wait (at most 10 s, then SIGKILL), leaving the data path as the daemon's stop
    /// leaves it; returns whether it exited cleanly.
    pub fn terminate(&mut self) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        exits_cleanly(&mut child, Duration::from_secs(10))
    }
}

/// Waits up to `within` for `child` to exit (then kills and reaps it); whether it exited with
/// status 0.
fn exits_cleanly(child: &mut Child, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return status.success();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    false
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Removes a pin directory (maps and links: unpinning the links detaches the programs) on drop,
/// for a test that leaves a data path pinned on purpose and might fail before it shuts it down.
pub struct PinDir(pub PathBuf);

impl Drop for PinDir {
    fn drop(&mut self) {
        if let Ok(entries) = std::fs::read_dir(&self.0) {
            for entry in entries.flatten() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A temporary directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// Creates one under the system temp directory.
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(unique("proxy-test"));
        std::fs::create_dir_all(&dir).expect("creating a temp dir");
        Self(dir)
    }
}

impl Default for TempDir {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `f` inside the network namespace at `path` and waits for its result.
fn in_netns_path<T: Send + 'static>(path: &Path, f: impl FnOnce() -> T + Send + 'static) -> T {
    in_netns_at(path.to_owned(), f)
        .join()
        .expect("namespace thread panicked")
}

/// Makes `cmd` enter the network namespace at `ns` (only that: it keeps the host's mounts)
/// between fork and exec.
pub fn exec_in_netns(cmd: &mut Command, ns: &Path) {
    use std::os::{fd::AsRawFd as _, unix::process::CommandExt as _};
    let ns_file =
        std::fs::File::open(ns).unwrap_or_else(|e| panic!("cannot open {}: {e}", ns.display()));
    // SAFETY: between fork and exec the child only calls setns (async-signal-safe) on a
    // descriptor the closure keeps open until then.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(ns_file.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Makes `cmd`'s child have the test's open descriptors `fds` as 3, 4, ... (not close-on-exec).
fn pass_descriptors(cmd: &mut Command, fds: Vec<i32>) {
    use std::os::unix::process::CommandExt as _;
    /// Out of the way of both the sources and 3, 4, ... while they are moved.
    const PARK: i32 = 1000;
    // SAFETY: between fork and exec the child only calls dup2 and close (async-signal-safe) on
    // descriptors the test keeps open until the spawn returns; nothing allocates.
    unsafe {
        cmd.pre_exec(move || {
            for (i, &fd) in (0..).zip(&fds) {
                if libc::dup2(fd, PARK + i) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            for i in (0..).take(fds.len()) {
                // dup2 leaves the copy without close-on-exec.
                if libc::dup2(PARK + i, 3 + i) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(PARK + i);
            }
            Ok(())
        });
    }
}

/// One datagram from `socket` within `within`, with the descriptors it carries (close-on-exec,
/// at most 120): what a service manager reads from its notify socket.
pub fn recv_with_fds(
    socket: &std::os::unix::net::UnixDatagram,
    within: Duration,
) -> Option<(String, Vec<std::os::fd::OwnedFd>)> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    socket.set_read_timeout(Some(within)).expect("timeout");
    let mut buf = [0u8; 4096];
    let mut control = [0u64; 64];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty one; it then points at `iov` and `control`,
    // both alive for the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(&control);
    // SAFETY: `msg` describes buffers valid for the lengths it gives.
    let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &raw mut msg, libc::MSG_CMSG_CLOEXEC) };
    let n = usize::try_from(n).ok()?;
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `control` with `msg_controllen` bytes of headers; each
    // SCM_RIGHTS one holds whole descriptors, now this process's.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg);
                for i in 0..bytes / size_of::<i32>() {
                    let mut raw = [0u8; size_of::<i32>()];
                    std::ptr::copy_nonoverlapping(data.add(i * raw.len()), raw.as_mut_ptr(), 4);
                    fds.push(OwnedFd::from_raw_fd(i32::from_ne_bytes(raw)));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&raw const msg, cmsg);
        }
    }
    Some((String::from_utf8_lossy(&buf[..n]).into_owned(), fds))
}

/// A loopback address with a port that was free a moment ago.
pub fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding port 0")
}

/// A GET on the host's loopback; returns (status, body).
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    http_get_within(addr, path, Duration::from_secs(2))
}

/// [`http_get`] allowing `idle` between reads.
pub fn http_get_within(addr: SocketAddr, path: &str, idle: Duration) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(idle)).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((code, body))
}

/// What `proxy probe --json` reported.
#[derive(Debug, serde::Deserialize)]
pub struct Probe {
    /// Connections per banner.
    pub backends: std::collections::BTreeMap<String, u32>,
    /// Addresses getpeername showed.
    pub peers: Vec<String>,
    /// Failures by errno name.
    pub errors: std::collections::BTreeMap<String, u32>,
}

impl Probe {
    /// Runs `proxy probe` in `netns`, inside `cgroup` when given.
    pub fn run(
        netns: &Netns,
        cgroup: Option<&Path>,
        target: SocketAddr,
        count: u32,
        udp: bool,
    ) -> Self {
        let mut cmd = Command::new(proxy_bin());
        cmd.args([
            "probe",
            &target.to_string(),
            "--json",
            "--timeout-ms",
            "1000",
        ]);
        cmd.args(["--count", &count.to_string(), "--netns", netns.name()]);
        if let Some(cg) = cgroup {
            cmd.arg("--cgroup").arg(cg);
        }
        if udp {
            cmd.arg("--udp");
        }
        let out = cmd.output().expect("running proxy probe");
        let report: Self = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "probe JSON ({e}; {}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
        });
        // The exit status says whether any connection failed.
        let failed = report.errors.values().sum::<u32>() > 0;
        assert_eq!(
            out.status.code(),
            Some(i32::from(failed)),
            "probe exit status with errors {:?}",
            report.errors
        );
        report
    }

    /// Connections that reached `banner`.
    pub fn count(&self, banner: &str) -> u32 {
        self.backends.get(banner).copied().unwrap_or(0)
    }
}

/// Probes `vip` from `cgroup` in `netns` (40 connects at a time) until every connect succeeds
/// and exactly the banners `want` answer; panics after `within`.
pub fn wait_for_backends(
    netns: &Netns,
    cgroup: &TestCgroup,
    vip: SocketAddr,
    want: &[&str],
    within: Duration,
) {
    let deadline = Instant::now() + within;
    loop {
        let probe = Probe::run(netns, Some(cgroup.path()), vip, 40, false);
        let seen: Vec<&str> = probe.backends.keys().map(String::as_str).collect();
        if probe.errors.is_empty() && seen == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "connects never reached only {want:?}: {probe:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Asserts that `observed` of `n` is within 4.5 standard deviations of share `p` (binomial):
/// a correct random choice fails this about once in 150,000 runs.
pub fn assert_share(what: &str, observed: u32, n: u32, p: f64) {
    let expected = p * f64::from(n);
    let sigma = (f64::from(n) * p * (1.0 - p)).sqrt();
    let off = (f64::from(observed) - expected).abs();
    assert!(
        off <= 4.5 * sigma.max(1.0),
        "{what}: {observed} of {n}, expected {expected:.0} +- {:.0}",
        4.5 * sigma
    );
}

impl Daemon {
    /// `kill -9`: the daemon gets no chance to clean up (its pins stay). Waits for the exit.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The daemon's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `sig` to the daemon (a no-op once it exited).
    pub fn signal(&self, sig: libc::c_int) {
        if let Some(child) = &self.child {
            // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
            unsafe { libc::kill(child.id() as libc::pid_t, sig) };
        }
    }

    /// Waits up to `within` for the daemon to exit on its own (it is reaped then); its exit
    /// status, or `None` if it still runs.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            let status = self.child.as_mut()?.try_wait().ok().flatten();
            if let Some(status) = status {
                self.child = None;
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the daemon has exited (it is reaped then).
    pub fn exited(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => false,
            Some(_) => {
                self.child = None;
                true
            }
            None => true,
        }
    }
}

mod clients;
mod fork;
mod in_process;
pub mod xlated;

pub use self::{
    clients::{
        LoopReport, digest, errno_name, framed_exchange, in_netns, in_netns_at, pattern,
        recv_framed, reset_on_accept, send_framed, tcp_loop, tcp_loop_to_first_failure,
        udp_sendto_loop, udp_sendto_loop_within, widen_port_range,
    },
    fork::InCgroup,
    in_process::{DATAPLANE_FEATURES, InProcess, skip_without_dataplane, spec},
};
