//! Takeover (root): `proxy run --takeover` replaces a running daemon of the same instance while
//! applications in the cgroup connect to a `mode: proxy` service (and a `mode: direct` one) in
//! a loop. The running daemon hands its listening sockets over, keeps accepting until the new
//! one accepts, then drains and exits 0: not one connect is refused, and a connection opened
//! before the takeover runs on until it ends on its own. A takeover whose configuration has
//! other listeners is refused, and the running daemon serves on. Everything runs in a fresh
//! network namespace and cgroup.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use integration_tests::kernel::{
    BannerServers, Daemon, InCgroup, LoopReport, Netns, TestCgroup, require_root,
    skip_without_dataplane, tcp_loop, unique,
};

/// The service the connect loop dials: two banner servers behind it.
const WEB_VIP: &str = "127.77.0.1:80";
const WEB_HOSTS: [&str; 2] = ["127.0.0.11:8081", "127.0.0.12:8082"];
/// The same hosts as a kernel-path (`mode: direct`) service.
const DIRECT_VIP: &str = "127.77.0.3:80";
/// The service of the long-lived connection: an echo server.
const ECHO_VIP: &str = "127.77.0.2:80";
const ECHO_HOST: &str = "127.0.0.13:8083";
/// How long the connect loop runs; the takeover happens inside this window.
const LOOP_FOR: Duration = Duration::from_secs(8);
/// How long the long-lived connection lives (it starts before the takeover).
const LONG_FOR: Duration = Duration::from_secs(5);
/// The old daemon's drain deadline (`proxy.shutdown_timeout`).
const SHUTDOWN: Duration = Duration::from_secs(15);

fn endpoint(addr: &str) -> String {
    let a: SocketAddr = addr.parse().expect("literal");
    format!(
        "            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\n",
        a.ip(),
        a.port()
    )
}

/// The daemon's configuration: the web and echo services in proxy mode, behind `listeners`,
/// and the web hosts once more as a kernel-path service.
fn config(instance: &str, cgroup: &TestCgroup, listeners: &str) -> String {
    let web: String = WEB_HOSTS.iter().map(|h| endpoint(h)).collect();
    format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nproxy:\n  listeners: [{listeners}]\n  shutdown_timeout: {}s\nclusters:\n  - name: web\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{web}  - name: echo\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{}services:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web, mode: proxy }}\n  - {{ name: echo, address: 127.77.0.2, port: 80, cluster: echo, mode: proxy }}\n  - {{ name: direct, address: 127.77.0.3, port: 80, cluster: web }}\n",
        cgroup.path().display(),
        SHUTDOWN.as_secs(),
        endpoint(ECHO_HOST),
    )
}

/// An echo server in the namespace: `echo\n`, then every byte back until the client closes.
struct EchoServer {
    stop: Arc<AtomicBool>,
    netns: std::path::PathBuf,
    thread: Option<JoinHandle<()>>,
}

impl EchoServer {
    fn start(netns: &Netns) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, path) = (stop.clone(), netns.path());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            proxy::enter_netns(&path).expect("entering the test namespace");
            let listener = TcpListener::bind(ECHO_HOST).expect("binding the echo server");
            ready_tx.send(()).expect("test alive");
            for conn in listener.incoming() {
                if flag.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(mut conn) = conn else { continue };
                std::thread::spawn(move || {
                    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
                    if conn.write_all(b"echo\n").is_err() {
                        return;
                    }
                    let mut buf = [0u8; 256];
                    while let Ok(n @ 1..) = conn.read(&mut buf) {
                        if conn.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    // Ends the connection even while a child the test forked meanwhile (a
                    // client of a test running beside this one) holds a copy of the socket.
                    let _ = conn.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("echo server started");
        Self {
            stop,
            netns: netns.path(),
            thread: Some(thread),
        }
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let path = self.netns.clone();
        let waker = std::thread::spawn(move || {
            if proxy::enter_netns(&path).is_ok() {
                let addr: SocketAddr = ECHO_HOST.parse().expect("literal");
                let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(200));
            }
        });
        let _ = waker.join();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A client in the cgroup holding one connection to the echo service for [`LONG_FOR`]: a byte
/// and its echo every 50 ms, then an orderly close (it waits for the proxy's FIN). Reports
/// `ok <rounds>` or `error <what> after <rounds> rounds`.
fn long_lived(netns: &Netns, cgroup: &TestCgroup) -> InCgroup {
    InCgroup::spawn(Some(cgroup.path()), netns, || {
        let vip: SocketAddr = ECHO_VIP.parse().expect("literal");
        let mut rounds = 0u32;
        let mut run = || -> std::io::Result<()> {
            let mut s = TcpStream::connect_timeout(&vip, Duration::from_secs(2))?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            let mut banner = [0u8; 5];
            s.read_exact(&mut banner)?;
            let started = Instant::now();
            while started.elapsed() < LONG_FOR {
                let mut byte = [0u8; 1];
                s.write_all(b"x")?;
                s.read_exact(&mut byte)?;
                rounds += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            s.shutdown(std::net::Shutdown::Write)?;
            let mut rest = Vec::new();
            s.read_to_end(&mut rest)?;
            Ok(())
        };
        match run() {
            Ok(()) => format!("ok {rounds}"),
            Err(e) => format!("error {e} after {rounds} rounds"),
        }
    })
}

/// The connect loop: from inside the cgroup, to `vip`, for [`LOOP_FOR`].
fn connect_loop(netns: &Netns, cgroup: &TestCgroup, vip: &str) -> InCgroup {
    let vip: SocketAddr = vip.parse().expect("literal");
    InCgroup::spawn(Some(cgroup.path()), netns, move || {
        serde_json::to_string(&tcp_loop(vip, 10_000_000, LOOP_FOR)).expect("JSON")
    })
}

#[test]
fn a_takeover_refuses_no_connect_and_resets_no_connection() {
    require_root();
    if skip_without_dataplane("a_takeover_refuses_no_connect_and_resets_no_connection") {
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let banners: Vec<(SocketAddr, &str, bool)> = WEB_HOSTS
        .iter()
        .map(|h| (h.parse().unwrap(), *h, false))
        .collect();
    let _servers = BannerServers::start(&netns, &banners);
    let _echo = EchoServer::start(&netns);
    // Both families: every socket of both addresses moves (one per engine thread each).
    let config = config(
        &unique("to"),
        &cgroup,
        r#""127.0.0.1:15001", "[::1]:15001""#,
    );
    // `--takeover` with no daemon to take over from is a normal start.
    let mut old = Daemon::start_in_with(&netns, &config, &["--takeover"]);
    assert!(
        old.log_text().contains("starting normally"),
        "{}",
        old.log_text()
    );

    let long = long_lived(&netns, &cgroup);
    let client = connect_loop(&netns, &cgroup, WEB_VIP);
    let direct = connect_loop(&netns, &cgroup, DIRECT_VIP);
    std::thread::sleep(Duration::from_secs(1));
    let started = Instant::now();
    let new = Daemon::start_in_with(&netns, &config, &["--takeover"]);
    let ready_after = started.elapsed();
    let status = old.wait_exit(SHUTDOWN + Duration::from_secs(10));
    let exited_after = started.elapsed();
    let long = long.wait(Duration::from_secs(30));
    let report = LoopReport::parse(&client.wait(Duration::from_secs(60)));
    let direct = LoopReport::parse(&direct.wait(Duration::from_secs(60)));
    let old_log = old.log_text();
    println!(
        "across the takeover: {} connects, {} failed {:?}; the new daemon was ready after {ready_after:?} and accepted {}; the old one exited {status:?} after {exited_after:?}; long-lived connection: {long}",
        report.ok(),
        report.failed(),
        report.errors,
        new.stat("proxy.downstream_cx_total"),
    );
    println!(
        "the kernel path meanwhile: {} connects, {} failed {:?}",
        direct.ok(),
        direct.failed(),
        direct.errors
    );
    for report in [&report, &direct] {
        assert_eq!(report.failed(), 0, "{report:?}");
        assert!(report.ok() > 100, "{report:?}");
        for banner in report.banners.keys() {
            assert!(WEB_HOSTS.contains(&banner.as_str()), "reached {banner}");
        }
    }
    assert!(
        status.is_some_and(|s| s.success()),
        "the old daemon exits 0 after draining: {status:?}\n{old_log}"
    );
    let rounds: u32 = long
        .strip_prefix("ok ")
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("the long-lived connection failed: {long}\n{old_log}"));
    assert!(rounds > 40, "bytes kept flowing: {long}");
    assert!(
        old_log.contains("Graceful"),
        "the old daemon's connections ended on their own before its deadline:\n{old_log}"
    );
    assert!(
        new.stat("proxy.downstream_cx_total") > 0,
        "the new daemon accepts on the handed-over listener"
    );
    // The new daemon serves on alone.
    let after = LoopReport::parse(
        &InCgroup::spawn(Some(cgroup.path()), &netns, || {
            let vip: SocketAddr = WEB_VIP.parse().expect("literal");
            serde_json::to_string(&tcp_loop(vip, 50, Duration::from_secs(10))).expect("JSON")
        })
        .wait(Duration::from_secs(30)),
    );
    assert_eq!((after.ok(), after.failed()), (50, 0), "{after:?}");
}

#[test]
fn a_takeover_with_other_listeners_is_refused_and_the_old_daemon_serves_on() {
    require_root();
    if skip_without_dataplane(
        "a_takeover_with_other_listeners_is_refused_and_the_old_daemon_serves_on",
    ) {
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let banners: Vec<(SocketAddr, &str, bool)> = WEB_HOSTS
        .iter()
        .map(|h| (h.parse().unwrap(), *h, false))
        .collect();
    let _servers = BannerServers::start(&netns, &banners);
    let _echo = EchoServer::start(&netns);
    let instance = unique("tx");
    let listeners = r#""127.0.0.1:15001""#;
    let mut old = Daemon::start_in(&netns, &config(&instance, &cgroup, listeners));
    let client = connect_loop(&netns, &cgroup, WEB_VIP);
    std::thread::sleep(Duration::from_secs(1));
    let other = config(&instance, &cgroup, r#""127.0.0.1:15002""#);
    let Err(refused) = Daemon::try_start_in(&netns, &other, &["--takeover"]) else {
        panic!("a takeover onto other listeners started");
    };
    let report = LoopReport::parse(&client.wait(Duration::from_secs(60)));
    println!(
        "a refused takeover: {} connects, {} failed {:?}",
        report.ok(),
        report.failed(),
        report.errors
    );
    assert!(
        refused.contains("a takeover keeps the listening sockets"),
        "the refusal says why:\n{refused}"
    );
    assert!(
        refused.starts_with("exit status: 64"),
        "a configuration that cannot take over exits 64 (not retried by proxy@.service):\n{refused}"
    );
    assert_eq!(report.failed(), 0, "{report:?}");
    assert!(report.ok() > 100, "{report:?}");
    assert!(
        old.wait_exit(Duration::ZERO).is_none(),
        "the old daemon runs on"
    );
    let log = old.log_text();
    assert!(
        log.contains("without a takeover"),
        "the old daemon logs the refused attempt:\n{log}"
    );
    assert_eq!(
        old.get("/ready").map(|(code, _)| code),
        Some(200),
        "the old daemon is still ready"
    );
    assert!(old.stop(), "clean stop:\n{}", old.log_text());
}

/// Every daemon serves its takeover socket and its admin control socket; one killed with
/// `kill -9` leaves the files behind, and `proxy uninstall` removes them with the rest of the
/// instance.
#[test]
fn uninstall_removes_the_takeover_socket_a_killed_daemon_left() {
    require_root();
    if skip_without_dataplane("uninstall_removes_the_takeover_socket_a_killed_daemon_left") {
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let instance = unique("tk");
    let socket =
        proxy::daemon::takeover_socket_path(std::path::Path::new("/sys/fs/bpf"), &instance);
    let mut daemon = Daemon::start_in(&netns, &config(&instance, &cgroup, r#""127.0.0.1:15001""#));
    let sockets = [socket, daemon.control.clone()];
    for socket in &sockets {
        assert!(socket.exists(), "{} while it runs", socket.display());
    }
    daemon.kill9();
    for socket in &sockets {
        assert!(socket.exists(), "kill -9 leaves {}", socket.display());
    }
    assert!(daemon.uninstall(), "proxy uninstall");
    for socket in &sockets {
        assert!(!socket.exists(), "{} after uninstall", socket.display());
    }
}

/// A bpffs the test mounts at a directory of its own; unmounted and removed on drop.
struct OwnBpffs(std::path::PathBuf);

impl OwnBpffs {
    fn mount() -> Self {
        let dir = std::env::temp_dir().join(unique("bpffs"));
        std::fs::create_dir_all(&dir).expect("a directory for the bpffs");
        let status = std::process::Command::new("mount")
            .args(["-t", "bpf", "bpf"])
            .arg(&dir)
            .status()
            .expect("mount");
        assert!(status.success(), "mounting a bpffs at {}", dir.display());
        Self(dir)
    }
}

impl Drop for OwnBpffs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Two daemons of one instance name on two bpffs mounts are two instances: each has its own
/// takeover socket (named after its pin directory), and each can be taken over. Before, the
/// socket was named after the instance alone: the second daemon found it taken, ran without
/// one, and a takeover of it reached the first daemon, whose pin directory it refused.
#[test]
fn one_instance_name_on_two_bpffs_mounts_can_each_be_taken_over() {
    require_root();
    if skip_without_dataplane("one_instance_name_on_two_bpffs_mounts_can_each_be_taken_over") {
        return;
    }
    let own = OwnBpffs::mount();
    let instance = unique("tb");
    let listeners = r#""127.0.0.1:15001""#;
    let (netns_a, cgroup_a) = (Netns::new(), TestCgroup::new());
    let (netns_b, cgroup_b) = (Netns::new(), TestCgroup::new());
    let config_a = config(&instance, &cgroup_a, listeners);
    // The admin control socket is named after the instance alone: the second daemon names
    // its own (a start that finds it taken is refused, saying so).
    let control = std::path::Path::new("/run/proxy").join(format!("{instance}-b.admin"));
    let config_b = format!(
        "bpffs: {}\n{}",
        own.0.display(),
        config(&instance, &cgroup_b, listeners).replace(
            "admin:\n",
            &format!("admin:\n  control_socket: \"{}\"\n", control.display())
        )
    );
    let mut a = Daemon::start_in(&netns_a, &config_a);
    let mut b = Daemon::start_in(&netns_b, &config_b);
    for (bpffs, daemon) in [(std::path::Path::new("/sys/fs/bpf"), &a), (&*own.0, &b)] {
        let socket = proxy::daemon::takeover_socket_path(bpffs, &instance);
        assert!(
            socket.exists(),
            "{} while it runs:\n{}",
            socket.display(),
            daemon.log_text()
        );
    }
    for (name, netns, config, old) in [
        ("b", &netns_b, &config_b, &mut b),
        ("a", &netns_a, &config_a, &mut a),
    ] {
        let mut new = Daemon::try_start_in(netns, config, &["--takeover"])
            .unwrap_or_else(|log| panic!("the takeover of {name} failed:\n{log}"));
        let status = old.wait_exit(SHUTDOWN + Duration::from_secs(10));
        assert!(
            status.is_some_and(|s| s.success()),
            "{name}: the old daemon hands over and exits 0 ({status:?}):\n{}",
            old.log_text()
        );
        assert!(new.stop(), "{name}: clean stop:\n{}", new.log_text());
    }
}
