//! A private unbound DNS server on 127.0.0.1 (or `[::1]` in a test namespace) for DNS discovery
//! tests, with live record changes.
//!
//! Each [`Unbound`] writes its own config into a fresh temp dir (its own UDP port, no daemon, no
//! chroot, a static `svc.test.` zone, remote control on a unix socket in that dir), starts the
//! binary as a child, waits until the control socket answers and kills the child (by its PID)
//! on drop. The packaged service is never used. unbound missing is a test failure, not a skip:
//! the project's setup installs it (`apt-get install -y unbound`).

use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    thread,
    time::{Duration, Instant},
};

/// How long unbound may take to start answering.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Directories searched for the binaries besides `PATH` (Debian installs them in /usr/sbin).
const SBIN_DIRS: [&str; 2] = ["/usr/sbin", "/usr/local/sbin"];

/// A running unbound serving the `svc.test.` zone on 127.0.0.1.
pub struct Unbound {
    dir: PathBuf,
    conf: PathBuf,
    addr: SocketAddr,
    control: PathBuf,
    child: Child,
    /// The namespace it serves in, for a restart.
    netns: Option<PathBuf>,
}

impl Unbound {
    /// Starts unbound with these `local-data` records, e.g. `"web.svc.test. 5 IN A 127.0.0.2"`.
    ///
    /// The port is one that was free a moment ago; another process (a parallel test's client, a
    /// benchmark) may take it before unbound binds it, so a start that fails with "Address
    /// already in use" is retried on a fresh port, a bounded number of times.
    pub fn start(records: &[&str]) -> Self {
        Self::start_with(records, None)
    }

    /// Like [`Unbound::start`], but serving on 127.0.0.1 inside the network namespace at
    /// `netns` (its control socket is a file, so records still change from here).
    pub fn start_in(netns: &Path, records: &[&str]) -> Self {
        Self::start_with(records, Some(netns))
    }

    /// Like [`Unbound::start_in`], but serving on `[::1]` (queries over IPv6) inside the
    /// network namespace at `netns`.
    pub fn start_v6_in(netns: &Path, records: &[&str]) -> Self {
        crate::start_retrying("unbound", 5, || {
            Self::try_start(records, Some(netns), Ipv6Addr::LOCALHOST.into())
        })
    }

    fn start_with(records: &[&str], netns: Option<&Path>) -> Self {
        crate::start_retrying("unbound", 5, || {
            Self::try_start(records, netns, Ipv4Addr::LOCALHOST.into())
        })
    }

    /// One start on `listen`; `Err` with unbound's log when it exited before serving.
    fn try_start(records: &[&str], netns: Option<&Path>, listen: IpAddr) -> Result<Self, String> {
        let server = find_binary("unbound");
        let control = find_binary("unbound-control");
        let dir = temp_dir();
        let port = free_udp_port();
        let conf = dir.join("unbound.conf");
        std::fs::write(&conf, config(&dir, SocketAddr::new(listen, port), records))
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", conf.display()));
        let log = dir.join("unbound.log");
        let log_file = std::fs::File::create(&log)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", log.display()));
        let mut cmd = Command::new(&server);
        cmd.args(["-d", "-p", "-c"])
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file);
        if let Some(ns) = netns {
            crate::kernel::exec_in_netns(&mut cmd, ns);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", server.display()));
        let mut unbound = Self {
            dir,
            conf,
            addr: SocketAddr::new(listen, port),
            control,
            child,
            netns: netns.map(Path::to_path_buf),
        };
        unbound.wait_until_serving()?;
        Ok(unbound)
    }

    /// Stops the server (SIGKILL to its PID): its port is closed, so queries are refused until
    /// [`Unbound::restart`].
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on the same port with the records of its config file (changes
    /// made live before the stop are gone).
    pub fn restart(&mut self) {
        self.stop();
        let log = std::fs::File::create(self.dir.join("unbound.log")).expect("unbound log");
        let mut cmd = Command::new(find_binary("unbound"));
        cmd.args(["-d", "-p", "-c"])
            .arg(&self.conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(ns) = &self.netns {
            crate::kernel::exec_in_netns(&mut cmd, ns);
        }
        self.child = cmd.spawn().expect("unbound restarts");
        self.wait_until_serving()
            .unwrap_or_else(|log| panic!("unbound did not restart on {}: {log}", self.addr));
    }

    /// The UDP address to send queries to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Adds a record live: `unbound-control local_data "<record>"`.
    pub fn add(&self, record: &str) {
        self.control(&["local_data", record])
            .expect("unbound-control local_data");
    }

    /// Removes every record of `name` live: `unbound-control local_data_remove <name>`.
    pub fn remove(&self, name: &str) {
        self.control(&["local_data_remove", name])
            .expect("unbound-control local_data_remove");
    }

    /// Replaces every record of `name` with `records`.
    pub fn replace(&self, name: &str, records: &[&str]) {
        self.remove(name);
        for record in records {
            self.add(record);
        }
    }

    fn control(&self, args: &[&str]) -> Result<String, String> {
        let output = Command::new(&self.control)
            .arg("-c")
            .arg(&self.conf)
            .args(args)
            .output()
            .map_err(|e| format!("cannot run {}: {e}", self.control.display()))?;
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        if output.status.success() && !stdout.starts_with("error") {
            Ok(stdout)
        } else {
            Err(format!(
                "{args:?}: {stdout}{}",
                String::from_utf8_lossy(&output.stderr)
            ))
        }
    }

    /// Waits until unbound answers `status`; `Err` with its log if it exited first.
    fn wait_until_serving(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(Some(_)) = self.child.try_wait() {
                return Err(
                    std::fs::read_to_string(self.dir.join("unbound.log")).unwrap_or_default()
                );
            }
            match self.control(&["status"]) {
                Ok(_) => return Ok(()),
                Err(err) if Instant::now() > deadline => {
                    let log = std::fs::read_to_string(self.dir.join("unbound.log"));
                    panic!(
                        "unbound on {} did not come up in {START_TIMEOUT:?}: {err}\nlog: {}",
                        self.addr,
                        log.unwrap_or_default()
                    )
                }
                Err(_) => thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

impl Drop for Unbound {
    fn drop(&mut self) {
        // Child::kill sends SIGKILL to this child's PID only.
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The config of a server on `listen` (127.0.0.1 or ::1, with its port).
fn config(dir: &Path, listen: SocketAddr, records: &[&str]) -> String {
    let dir = dir.display();
    let (ip, port) = (listen.ip(), listen.port());
    let (ip6, allow) = if ip.is_ipv6() {
        ("yes", "::1/128")
    } else {
        ("no", "127.0.0.0/8")
    };
    let mut conf = format!(
        "server:\n  interface: {ip}@{port}\n  port: {port}\n  do-daemonize: no\n  \
         username: \"\"\n  chroot: \"\"\n  directory: \"{dir}\"\n  pidfile: \"\"\n  \
         use-syslog: no\n  logfile: \"\"\n  verbosity: 0\n  num-threads: 1\n  do-ip6: {ip6}\n  \
         so-reuseport: no\n  access-control: {allow} allow\n  rrset-roundrobin: no\n  \
         module-config: \"iterator\"\n  local-zone: \"svc.test.\" static\n"
    );
    for record in records {
        let _ = writeln!(conf, "  local-data: \"{record}\"");
    }
    let _ = write!(
        conf,
        "remote-control:\n  control-enable: yes\n  control-interface: \"{dir}/control.sock\"\n  \
         control-use-cert: no\n"
    );
    conf
}

fn find_binary(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs = std::env::split_paths(&path).chain(SBIN_DIRS.iter().map(PathBuf::from));
    dirs.map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} is not installed; the DNS discovery tests need a real unbound: \
             run `apt-get install -y unbound` (the CI setup script does)"
            )
        })
}

fn temp_dir() -> PathBuf {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let unique = format!(
        "proxy-unbound-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    let dir = std::env::temp_dir().join(unique);
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    dir
}

/// A UDP port free right now on 127.0.0.1 (unbound binds it right after).
fn free_udp_port() -> u16 {
    let socket = UdpSocket::bind("127.0.0.1:0").expect("bind an ephemeral UDP port on 127.0.0.1");
    socket
        .local_addr()
        .expect("local address of an ephemeral socket")
        .port()
}
