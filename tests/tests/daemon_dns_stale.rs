//! `dns_stale_bound` through the daemon and the kernel (root), against a real unbound in the
//! test's namespace: a name whose lookups fail keeps its hosts for at most the bound, then they
//! leave `/clusters` and the kernel's maps, and come back with the next successful lookup; unset,
//! the hosts stay (Envoy's behaviour). A name deleted at the server (NXDOMAIN) follows the
//! table in docs/configuration.md: STRICT_DNS drops its hosts at once, LOGICAL_DNS at the bound.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use integration_tests::{
    kernel::{BannerServers, Daemon, Netns, Probe, TestCgroup, require_root, unique},
    unbound::Unbound,
};

/// Bound of every wait for a change to reach the kernel.
const WITHIN: Duration = Duration::from_secs(15);

/// The bound the tests configure: long enough for several probes while the hosts are stale.
const BOUND: Duration = Duration::from_secs(3);

const VIP: &str = "127.77.0.1:80";

/// A cluster `web` of `kind` resolving `web.svc.test` (port 8080) every 0.2 s, behind the VIP;
/// `extra` is added to the cluster (e.g. `dns_stale_bound: 3s`).
fn config(cgroup: &TestCgroup, dns: &Unbound, kind: &str, extra: &str) -> String {
    format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - name: web\n    type: {kind}\n    dns_refresh_rate: 0.2s\n    dns_lookup_family: V4_ONLY\n    dns_resolvers: [\"{}\"]\n{extra}    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: web.svc.test, port_value: 8080 }} }} }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n",
        unique("stale"),
        cgroup.path().display(),
        dns.addr(),
    )
}

fn bounded() -> String {
    format!("    dns_stale_bound: {}s\n", BOUND.as_secs())
}

/// One test's namespace, cgroup, backend, name server (with `web.svc.test` -> `backend`) and
/// daemon. Fields drop in order: the daemon, the name server and the backend before the cgroup
/// and the namespace they run in.
struct Setup {
    daemon: Daemon,
    dns: Unbound,
    _servers: BannerServers,
    cgroup: TestCgroup,
    netns: Netns,
}

impl Setup {
    fn start(backend: &str, kind: &str, extra: &str) -> Self {
        require_root();
        let (netns, cgroup) = (Netns::new(), TestCgroup::new());
        let servers = BannerServers::start(&netns, &[(backend.parse().unwrap(), backend, false)]);
        let ip = backend.split(':').next().unwrap();
        let record = format!("web.svc.test. 5 IN A {ip}");
        let dns = Unbound::start_in(&netns.path(), &[record.as_str()]);
        let daemon = Daemon::start_in(&netns, &config(&cgroup, &dns, kind, extra));
        let setup = Self {
            daemon,
            dns,
            _servers: servers,
            cgroup,
            netns,
        };
        setup.wait_for(&[backend]);
        setup
    }

    /// Connects from the cgroup reach exactly `want` (none: no host) within [`WITHIN`].
    fn wait_for(&self, want: &[&str]) {
        let vip: SocketAddr = VIP.parse().unwrap();
        if !want.is_empty() {
            integration_tests::kernel::wait_for_backends(
                &self.netns,
                &self.cgroup,
                vip,
                want,
                WITHIN,
            );
            return;
        }
        let deadline = Instant::now() + WITHIN;
        while !self.probe().backends.is_empty() {
            assert!(Instant::now() < deadline, "the hosts never left the kernel");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn probe(&self) -> Probe {
        let vip: SocketAddr = VIP.parse().unwrap();
        Probe::run(&self.netns, Some(self.cgroup.path()), vip, 10, false)
    }

    /// Whether `/clusters` lists host `backend` in cluster `web`.
    fn listed(&self, backend: &str) -> bool {
        let (_, clusters) = self.daemon.get("/clusters").expect("admin /clusters");
        let prefix = format!("web::{backend}::");
        clusters.lines().any(|l| l.starts_with(&prefix))
    }

    fn stat(&self, name: &str) -> u64 {
        self.daemon.stat(&format!("cluster.web.{name}"))
    }

    /// While less than `until` has passed since `since`, every probe reaches only `backend`;
    /// returns how many probes finished in that time.
    fn kept_until(&self, since: Instant, until: Duration, backend: &str) -> u32 {
        let mut kept = 0;
        for _ in 0..100 {
            let probe = self.probe();
            if since.elapsed() >= until {
                break;
            }
            assert_eq!(
                probe.backends.keys().collect::<Vec<_>>(),
                [backend],
                "stale hosts kept before {until:?}: {probe:?}"
            );
            assert!(probe.errors.is_empty(), "{probe:?}");
            kept += 1;
            std::thread::sleep(Duration::from_millis(200));
        }
        kept
    }
}

/// (a) The name server stops: every lookup fails at once (its port is closed). The host is
/// served stale until the bound, then leaves `/clusters` and the kernel; after the server's
/// restart the next lookup brings it back.
#[test]
fn strict_dns_server_stopped_hosts_kept_until_the_bound_then_dropped_then_back() {
    let backend = "127.0.0.51:8080";
    let mut setup = Setup::start(backend, "STRICT_DNS", &bounded());
    setup.dns.stop();
    let stopped = Instant::now();
    assert!(setup.kept_until(stopped, BOUND, backend) > 0);
    setup.wait_for(&[]);
    assert!(stopped.elapsed() >= BOUND, "dropped before the bound");
    assert!(!setup.listed(backend));
    assert_eq!(setup.stat("dns_stale_expired"), 1);
    assert_eq!(setup.stat("dns_stale_names"), 0);
    assert_eq!(setup.stat("membership_total"), 0);
    let bound_ms = u64::try_from(BOUND.as_millis()).unwrap();
    assert!(
        setup.stat("dns_stale_served_ms") >= bound_ms,
        "one period of the bound"
    );

    setup.dns.restart();
    setup.wait_for(&[backend]);
    assert!(setup.listed(backend));
    assert_eq!(setup.stat("dns_stale_expired"), 1);
}

/// (b) STRICT_DNS: a name deleted at the server is an empty (NXDOMAIN) answer, a success: its
/// hosts are dropped at once, as Envoy drops them, long before the bound of 60 s.
#[test]
fn strict_dns_name_deleted_at_the_server_drains_at_once() {
    let backend = "127.0.0.52:8080";
    let setup = Setup::start(backend, "STRICT_DNS", "    dns_stale_bound: 60s\n");
    setup.dns.remove("web.svc.test");
    setup.wait_for(&[]);
    assert!(!setup.listed(backend));
    assert_eq!(
        setup.stat("dns_stale_expired"),
        0,
        "an empty answer is not stale"
    );
    assert_eq!(setup.stat("dns_stale_names"), 0);
}

/// (b) LOGICAL_DNS: an empty answer is a failure that keeps the logical host (Envoy), so a
/// deleted name is served stale until the bound, then dropped; re-added, it comes back.
#[test]
fn logical_dns_name_deleted_at_the_server_is_dropped_at_the_bound() {
    let backend = "127.0.0.53:8080";
    let setup = Setup::start(backend, "LOGICAL_DNS", &bounded());
    setup.dns.remove("web.svc.test");
    let removed = Instant::now();
    assert!(setup.kept_until(removed, BOUND, backend) > 0);
    setup.wait_for(&[]);
    assert!(removed.elapsed() >= BOUND, "dropped before the bound");
    assert!(!setup.listed(backend));
    assert_eq!(setup.stat("dns_stale_expired"), 1);

    setup.dns.add("web.svc.test. 5 IN A 127.0.0.53");
    setup.wait_for(&[backend]);
}

/// (c) The default (no `dns_stale_bound`): Envoy's behaviour, the hosts stay while the server
/// is down, for longer than the tests' bound, counted as served stale.
#[test]
fn by_default_a_stopped_server_leaves_the_hosts_in_place() {
    let backend = "127.0.0.54:8080";
    let mut setup = Setup::start(backend, "STRICT_DNS", "");
    setup.dns.stop();
    let stopped = Instant::now();
    let over = BOUND * 2;
    assert!(setup.kept_until(stopped, over, backend) > 0);
    assert!(setup.listed(backend));
    assert_eq!(setup.stat("dns_stale_names"), 1);
    assert_eq!(setup.stat("dns_stale_expired"), 0);
    assert!(setup.stat("update_failure") > 0);
    // The time served stale grows with the clock: at least the time between two reads.
    let first = setup.stat("dns_stale_served_ms");
    let after_first = Instant::now();
    std::thread::sleep(Duration::from_secs(1));
    let before_second = Instant::now();
    let second = setup.stat("dns_stale_served_ms");
    let between = u64::try_from((before_second - after_first).as_millis()).unwrap();
    assert!(
        second - first >= between,
        "served stale {first} ms, then {second} ms, {between} ms later"
    );
    assert!(setup.listed(backend), "still there");
}
