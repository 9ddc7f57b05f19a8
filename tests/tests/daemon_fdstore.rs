//! A plain restart (root) of a daemon with an HTTP-routed `mode: proxy` service under a service
//! manager with a file-descriptor store, while an application in the cgroup sends requests
//! to the service in a loop: SIGTERM then a new daemon (what `systemctl restart` does), and
//! `kill -9` then a new daemon. The test is the manager: it owns the notify socket, keeps the
//! sockets the daemon stores (`FDSTORE=1`), and starts the next daemon with them as
//! `LISTEN_FDS` (from 3, `LISTEN_PID` the daemon's own, `LISTEN_FDNAMES`). The listener never
//! closes, so the kernel keeps redirecting to it and connects wait in its queue until the next
//! daemon accepts: not one is refused, which the kernel alone cannot give an HTTP-routed
//! service (it cannot route HTTP). Everything runs in a fresh network namespace and cgroup.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    os::{fd::OwnedFd, unix::net::UnixDatagram},
    time::{Duration, Instant},
};

use integration_tests::{
    http_servers::{Servers, http_server},
    kernel::{
        Daemon, InCgroup, LoopReport, Netns, TempDir, TestCgroup, errno_name, recv_with_fds,
        require_root, skip_without_dataplane, unique,
    },
};

/// The HTTP-routed proxy-mode service the loop sends requests to.
const VIP: &str = "127.77.0.1:80";
/// Its two clusters' hosts: `/api` goes to `api` (rewritten to `/v2`), the rest to `web`.
const WEB: &str = "127.0.0.21:8081";
const API: &str = "127.0.0.22:8082";
/// How long the request loop runs; the stop and the next start happen inside it.
const LOOP_FOR: Duration = Duration::from_secs(10);
/// How long one request may wait for its answer: across the gap between the daemons.
const ANSWER_WITHIN: Duration = Duration::from_secs(30);
/// What the test's manager says its store holds at most (`FDSTORE`).
const STORE_MAX: &str = "FDSTORE=64";
/// The name the daemon stores its listener under.
const FDNAME: &str = "proxy-listener";

fn config(instance: &str, cgroup: &TestCgroup) -> String {
    let endpoint = |addr: &str| {
        let a: SocketAddr = addr.parse().expect("literal");
        format!(
            "    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\n",
            a.ip(),
            a.port()
        )
    };
    format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nproxy:\n  listeners: [\"127.0.0.1:15001\"]\nclusters:\n  - name: web\n{}  - name: api\n{}config_entries:\n  - {{ Kind: service-defaults, Name: web, Protocol: http }}\n  - {{ Kind: service-defaults, Name: api, Protocol: http }}\n  - Kind: service-router\n    Name: web\n    Routes:\n      - Match: {{ HTTP: {{ PathPrefix: /api }} }}\n        Destination: {{ Service: api, PrefixRewrite: /v2 }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, chain: web, mode: proxy }}\n",
        instance,
        cgroup.path().display(),
        endpoint(WEB),
        endpoint(API),
    )
}

/// The manager's side: the notify socket, and the descriptors stored in it.
struct Manager {
    socket: UnixDatagram,
    path: std::path::PathBuf,
    /// The store: what `FDSTORE=1` brought under [`FDNAME`].
    store: Vec<OwnedFd>,
    _dir: TempDir,
}

impl Manager {
    fn bind() -> Self {
        let dir = TempDir::new();
        let path = dir.0.join("notify");
        let socket = UnixDatagram::bind(&path).expect("binds the notify socket");
        Self {
            socket,
            path,
            store: Vec::new(),
            _dir: dir,
        }
    }

    /// `NOTIFY_SOCKET=...`
    fn variable(&self) -> String {
        format!("NOTIFY_SOCKET={}", self.path.display())
    }

    /// Handles messages as systemd does for the store (`FDSTOREREMOVE=1`, `FDSTORE=1`) until
    /// `READY=1` (at most a minute); the store's size then.
    fn until_ready(&mut self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(60);
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            let (message, fds) = self.receive(left).expect("a message before READY=1");
            let lines: Vec<&str> = message.lines().collect();
            let ours = lines.contains(&format!("FDNAME={FDNAME}").as_str());
            if lines.contains(&"FDSTOREREMOVE=1") && ours {
                self.store.clear();
            }
            if lines.contains(&"FDSTORE=1") && ours {
                self.store.extend(fds);
            }
            if lines.contains(&"READY=1") {
                return self.store.len();
            }
        }
        panic!("no READY=1 within a minute");
    }

    /// One datagram and the descriptors it carries.
    fn receive(&self, within: Duration) -> Option<(String, Vec<OwnedFd>)> {
        recv_with_fds(&self.socket, within)
    }

    /// The next daemon, started with the store as `LISTEN_FDS`.
    fn start_next(&self, netns: &Netns, config: &str) -> Daemon {
        let wrapper = self.next_wrapper();
        let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
        Daemon::start_in_passing(netns, &wrapper, config, &self.store)
    }

    /// The command line prefix of a daemon started with the store as `LISTEN_FDS`.
    fn next_wrapper(&self) -> Vec<String> {
        let count = format!("LISTEN_FDS={}", self.store.len());
        let names = format!(
            "LISTEN_FDNAMES={}",
            vec![FDNAME; self.store.len()].join(":")
        );
        let notify = self.variable();
        // `LISTEN_PID` must be the daemon's pid: the shell's, which `exec` keeps.
        [
            "env",
            &notify,
            STORE_MAX,
            &count,
            &names,
            "sh",
            "-c",
            "export LISTEN_PID=$$; exec \"$@\"",
            "sh",
        ]
        .map(str::to_owned)
        .to_vec()
    }
}

/// GET `/api/<n>` through the service, `count` times or until `within` has passed; answers
/// counted by host, failures by phase (`connect: ...` before the connection was made, else
/// after). For a child in the cgroup.
fn http_loop(vip: SocketAddr, count: u32, within: Duration) -> LoopReport {
    let deadline = Instant::now() + within;
    let mut report = LoopReport::default();
    for n in 0..count {
        if Instant::now() >= deadline {
            break;
        }
        let answer = (|| {
            let mut s = TcpStream::connect_timeout(&vip, Duration::from_secs(2))
                .map_err(|e| format!("connect: {}", errno_name(&e)))?;
            let io = |e: std::io::Error| format!("after the connect: {}", errno_name(&e));
            s.set_read_timeout(Some(ANSWER_WITHIN)).map_err(io)?;
            write!(
                s,
                "GET /api/{n} HTTP/1.1\r\nhost: web\r\nconnection: close\r\n\r\n"
            )
            .map_err(io)?;
            let mut text = String::new();
            s.read_to_string(&mut text).map_err(io)?;
            Ok::<_, String>(text)
        })();
        let key = match answer {
            Ok(text) if text.ends_with(&format!("\r\n\r\napi /v2/{n}")) => Ok("api".to_owned()),
            Ok(text) => Ok(format!("unexpected: {text:?}")),
            Err(e) => Err(e),
        };
        match key {
            Ok(host) => *report.banners.entry(host).or_default() += 1,
            Err(e) => *report.errors.entry(e).or_default() += 1,
        }
    }
    report
}

/// How the first daemon goes.
#[derive(Clone, Copy, Debug)]
enum Stop {
    Sigterm,
    Kill9,
}

/// Answered, refused (failed before the connection was made) and lost (failed after it, or a
/// wrong answer) requests across `stop` of one daemon and the start of the next.
fn across(stop: Stop) -> (u32, u32, u32, LoopReport) {
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let hosts = [(WEB.parse().unwrap(), "web"), (API.parse().unwrap(), "api")];
    let _servers = Servers::start(&netns, &hosts, http_server);
    let config = config(&unique("fds"), &cgroup);
    let mut manager = Manager::bind();
    let first_env = ["env", &manager.variable(), STORE_MAX];
    let mut first = Daemon::start_in_wrapped(&netns, &first_env, &config, &[]);
    let stored = manager.until_ready();
    assert!(stored >= 1, "the first daemon stored its listener");
    let vip: SocketAddr = VIP.parse().expect("literal");
    let client = InCgroup::spawn(Some(cgroup.path()), &netns, move || {
        serde_json::to_string(&http_loop(vip, 10_000_000, LOOP_FOR)).expect("JSON")
    });
    std::thread::sleep(Duration::from_secs(1));
    let proxied_before = first.stat("proxy.downstream_rq_total");
    let started = Instant::now();
    match stop {
        Stop::Sigterm => assert!(first.terminate(), "clean exit:\n{}", first.log_text()),
        Stop::Kill9 => first.kill9(),
    }
    let stopped_after = started.elapsed();
    let mut second = manager.start_next(&netns, &config);
    let ready_after = started.elapsed();
    let restored = manager.until_ready();
    let report = LoopReport::parse(&client.wait(Duration::from_secs(90)));
    let answered = report.banners.get("api").copied().unwrap_or(0);
    let refused: u32 = (report.errors.iter())
        .filter(|(what, _)| what.starts_with("connect: "))
        .map(|(_, n)| n)
        .sum();
    let lost = report.ok() - answered + report.failed() - refused;
    println!(
        "{stop:?} + start (file-descriptor store of {stored} sockets): {answered} requests answered, {refused} refused, {lost} lost after the connect {:?}; the first daemon was gone after {stopped_after:?}, the next one ready after {ready_after:?}; {proxied_before} requests before the stop, {} served by the new proxy, which stored {restored} sockets again",
        report.errors,
        second.stat("proxy.downstream_rq_total"),
    );
    assert!(proxied_before > 0, "the first daemon served the service");
    assert!(
        second.wait_log("passed the proxy listener's sockets back", Duration::ZERO),
        "the next daemon took the stored sockets:\n{}",
        second.log_text()
    );
    assert_eq!(restored, stored, "the next daemon stored the same sockets");
    assert!(answered > 20, "{report:?}");
    assert!(
        second.stat("proxy.downstream_rq_total") > 0,
        "the next daemon serves"
    );
    // The kernel found the stored listener every time: it never refused a connect for want
    // of one.
    assert_eq!(second.counter("connect_proxy_no_listener"), 0);
    assert!(second.stop(), "clean stop:\n{}", second.log_text());
    (answered, refused, lost, report)
}

/// SIGTERM: the daemon stops accepting and drains, and leaves its listener published to the
/// kernel: the manager holds it open, connects wait in its queue, and the next daemon answers
/// them. Not one request fails.
#[test]
fn sigterm_and_a_new_daemon_lose_no_http_routed_request_with_a_descriptor_store() {
    require_root();
    if skip_without_dataplane(
        "sigterm_and_a_new_daemon_lose_no_http_routed_request_with_a_descriptor_store",
    ) {
        return;
    }
    let (_, refused, lost, report) = across(Stop::Sigterm);
    assert_eq!((refused, lost), (0, 0), "{report:?}");
}

/// `kill -9`: the killed daemon's descriptors go, but the manager's keep the listener open and
/// still listed in the kernel's settings: connects wait in its queue for the next daemon. No
/// connect is refused; the loop's one request in the killed daemon's hands is the only one
/// that can be lost.
#[test]
fn kill9_and_a_new_daemon_refuse_no_http_routed_connect_with_a_descriptor_store() {
    require_root();
    if skip_without_dataplane(
        "kill9_and_a_new_daemon_refuse_no_http_routed_connect_with_a_descriptor_store",
    ) {
        return;
    }
    let (_, refused, lost, report) = across(Stop::Kill9);
    assert_eq!(refused, 0, "{report:?}");
    assert!(
        lost <= 1,
        "only the request the killed daemon held: {report:?}"
    );
}

/// Whatever the store holds is checked before the daemon touches anything: a descriptor under
/// the listener's name that is not a listening TCP socket (here a UDP socket) stops the start
/// with an error naming it, before the data path is attached (no pin directory); a listening
/// socket of an address the configuration no longer has is closed and the configured one bound.
#[test]
fn a_stored_descriptor_is_checked_before_anything_is_attached() {
    require_root();
    if skip_without_dataplane("a_stored_descriptor_is_checked_before_anything_is_attached") {
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let instance = unique("fdbad");
    let config = config(&instance, &cgroup);
    let mut manager = Manager::bind();
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("a UDP socket");
    manager.store = vec![OwnedFd::from(udp)];
    let wrapper = manager.next_wrapper();
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let refused = Daemon::try_start_in_passing(&netns, &wrapper, &config, &manager.store)
        .err()
        .expect("the start is refused");
    println!("refused: {refused}");
    assert!(
        refused.contains("descriptor 3 passed by the service manager as \"proxy-listener\" is not a listening TCP socket (a socket of type SOCK_DGRAM"),
        "{refused}"
    );
    assert!(
        !std::path::Path::new("/sys/fs/bpf").join(&instance).exists(),
        "nothing attached"
    );

    // A listener of an address no longer configured: closed, and the configured one bound.
    let stale = std::net::TcpListener::bind("127.0.0.1:0").expect("a listener");
    let stale_addr = stale.local_addr().expect("its address");
    manager.store = vec![OwnedFd::from(stale)];
    let hosts = [(WEB.parse().unwrap(), "web"), (API.parse().unwrap(), "api")];
    let _servers = Servers::start(&netns, &hosts, http_server);
    let mut daemon = Daemon::start_in_passing(&netns, &wrapper, &config, &manager.store);
    assert!(
        manager.until_ready() >= 1,
        "the configured listener's sockets"
    );
    // The manager dropped the stale one with FDSTOREREMOVE=1: nothing listens there now.
    assert_eq!(
        std::net::TcpStream::connect(stale_addr)
            .map_err(|e| e.kind())
            .err(),
        Some(std::io::ErrorKind::ConnectionRefused)
    );
    assert!(
        daemon.wait_log(
            "closing stored listening sockets of addresses no longer configured",
            Duration::ZERO
        ),
        "{}",
        daemon.log_text()
    );
    assert!(daemon.stop(), "clean stop:\n{}", daemon.log_text());
}
