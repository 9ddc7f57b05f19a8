//! systemd's notification protocol against a notify socket the test owns, as a `Type=notify`
//! unit with `WatchdogSec=` runs the daemon: `STATUS=` lines through the start, `READY=1` only
//! once `/ready` answers 200, `WATCHDOG=1` at half the interval the manager asked for,
//! `RELOADING=1` then `READY=1` around a reload, and `STOPPING=1` on SIGTERM.

use std::{
    os::unix::net::UnixDatagram,
    time::{Duration, Instant},
};

use integration_tests::kernel::{
    Daemon, TempDir, TestCgroup, http_get, require_root, skip_without_dataplane, unique,
};

/// The watchdog interval the test's "manager" asks for (`WATCHDOG_USEC`): pings every 250 ms.
const WATCHDOG_USEC: u64 = 500_000;

/// The manager's side: a datagram socket bound where `NOTIFY_SOCKET` points.
struct Manager {
    socket: UnixDatagram,
    path: std::path::PathBuf,
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
            _dir: dir,
        }
    }

    /// The next message, or `None` after `within`.
    fn next(&self, within: Duration) -> Option<String> {
        self.socket
            .set_read_timeout(Some(within))
            .expect("read timeout");
        let mut buf = [0u8; 4096];
        let n = self.socket.recv(&mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    }

    /// Messages until one satisfies `done` (which is returned last), at most `within` in all.
    fn until(&self, within: Duration, done: impl Fn(&str) -> bool) -> Vec<String> {
        let deadline = Instant::now() + within;
        let mut seen = Vec::new();
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            let Some(message) = self.next(left) else {
                break;
            };
            let last = done(&message);
            seen.push(message);
            if last {
                return seen;
            }
        }
        panic!("no such message within {within:?}; seen: {seen:?}");
    }
}

fn config(instance: &str, cgroup: &TestCgroup) -> String {
    format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - name: web\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 8081 }} }} }}\nservices:\n  - {{ name: web, address: 127.77.31.1, port: 80, cluster: web }}\n",
        cgroup.path().display()
    )
}

#[test]
fn the_service_manager_hears_status_readiness_watchdog_reload_and_stop() {
    require_root();
    if skip_without_dataplane("the_service_manager_hears_status_readiness_watchdog_reload_and_stop")
    {
        return;
    }
    let cgroup = TestCgroup::new();
    let manager = Manager::bind();
    let socket = format!("NOTIFY_SOCKET={}", manager.path.display());
    let watchdog = format!("WATCHDOG_USEC={WATCHDOG_USEC}");
    let daemon = Daemon::spawn_wrapped(
        &["env", &socket, &watchdog],
        &config(&unique("notify"), &cgroup),
    );

    // The start: status lines, then READY=1 when /ready is 200 already.
    let start = manager.until(Duration::from_secs(60), |m| m.starts_with("READY=1"));
    println!("start: {start:?}");
    let ready = start.last().expect("a message");
    assert_eq!(ready, "READY=1\nSTATUS=serving 1 services");
    assert_eq!(
        http_get(daemon.admin, "/ready").map(|(status, _)| status),
        Some(200),
        "READY=1 came before /ready answered 200"
    );
    for status in [
        "STATUS=attaching the data path",
        "STATUS=publishing 1 services",
    ] {
        assert!(
            start.iter().any(|m| m == status),
            "{status} not in {start:?}"
        );
    }

    // The watchdog: a ping every half interval (250 ms): at least 4 in 1.5 s, and nothing
    // else while nothing changes.
    let begin = Instant::now();
    let mut pings = 0;
    while begin.elapsed() < Duration::from_millis(1500) {
        if let Some(message) = manager.next(Duration::from_millis(100)) {
            assert_eq!(message, "WATCHDOG=1");
            pings += 1;
        }
    }
    println!("{pings} pings in 1.5 s (WATCHDOG_USEC {WATCHDOG_USEC})");
    assert!(pings >= 4, "{pings} pings in 1.5 s");

    // A reload (SIGHUP): RELOADING=1 with the monotonic clock, then READY=1 again.
    daemon.signal(libc::SIGHUP);
    let reload = manager.until(Duration::from_secs(30), |m| m.starts_with("READY=1"));
    let reloading = reload
        .iter()
        .find(|m| m.starts_with("RELOADING=1"))
        .unwrap_or_else(|| panic!("no RELOADING=1 in {reload:?}"));
    assert!(
        reloading.contains("\nMONOTONIC_USEC=")
            && reloading.ends_with("STATUS=reloading the configuration"),
        "{reloading}"
    );

    // The stop.
    daemon.signal(libc::SIGTERM);
    let stop = manager.until(Duration::from_secs(30), |m| m.starts_with("STOPPING=1"));
    assert_eq!(
        stop.last().map(String::as_str),
        Some("STOPPING=1\nSTATUS=stopping: draining the proxy path")
    );
}
