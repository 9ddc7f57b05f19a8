//! Reload (root): SIGHUP and `proxy reload` re-read the configuration file and apply what
//! changed, under connect loops from inside the cgroup. A service and a cluster are added, one
//! of each removed, and one cluster changed; the untouched cluster keeps its running health
//! checker (its check count goes on, it does not start again) and the services that stay lose
//! not one connect. A broken file, and a change that needs a restart, are refused with the
//! reason (the file's line and column for the broken one) in the log and as `proxy reload`'s
//! exit status, and change nothing.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use integration_tests::{
    kernel::{
        BannerServers, Daemon, InCgroup, LoopReport, Netns, PinDir, TestCgroup, proxy_bin,
        require_root, skip_without_dataplane, tcp_loop, unique,
    },
    slow_dns::{SLOW_ANSWER, SlowDns},
};

/// Service VIPs.
const STAY: &str = "127.77.9.1:80";
const CHANGE: &str = "127.77.9.2:80";
const GONE: &str = "127.77.9.3:80";
const NEW: &str = "127.77.9.4:80";
/// Hosts (their banner is their address).
const H_STAY: &str = "127.0.0.81:8081";
const H_CHANGE_OLD: &str = "127.0.0.82:8082";
const H_CHANGE_NEW: &str = "127.0.0.84:8084";
const H_GONE: &str = "127.0.0.83:8083";
const H_NEW: &str = "127.0.0.85:8085";

/// The client loops run across every reload of the test.
const LOOP_FOR: Duration = Duration::from_secs(14);

/// Checked every 0.5 s from the start (the test is about reload, not `no_traffic_interval`,
/// whose default daemon_health.rs shows).
const CHECK: &str = "    health_checks:\n      - { timeout: 0.5s, interval: 0.5s, no_traffic_interval: 0.5s, unhealthy_threshold: 2, healthy_threshold: 1, tcp_health_check: {} }\n";

fn cluster(name: &str, host: &str) -> String {
    let host: SocketAddr = host.parse().unwrap();
    format!(
        "  - name: {name}\n{CHECK}    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\n",
        host.ip(),
        host.port()
    )
}

fn service(name: &str, vip: &str, cluster: &str) -> String {
    let vip: SocketAddr = vip.parse().unwrap();
    format!(
        "  - {{ name: {name}, address: \"{}\", port: {}, cluster: {cluster} }}\n",
        vip.ip(),
        vip.port()
    )
}

fn head(instance: &str, cgroup: &Path, admin: &str) -> String {
    format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{admin}\"\n",
        cgroup.display()
    )
}

/// The first configuration: `stay`, `change` (on its old host) and `gone`.
fn first(head: &str) -> String {
    format!(
        "{head}clusters:\n{}{}{}services:\n{}{}{}",
        cluster("stay", H_STAY),
        cluster("change", H_CHANGE_OLD),
        cluster("gone", H_GONE),
        service("s-stay", STAY, "stay"),
        service("s-change", CHANGE, "change"),
        service("s-gone", GONE, "gone"),
    )
}

/// The second: `stay` as it was, `change` on a new host, `gone` removed, `new` added.
fn second(head: &str) -> String {
    format!(
        "{head}clusters:\n{}{}{}services:\n{}{}{}",
        cluster("stay", H_STAY),
        cluster("change", H_CHANGE_NEW),
        cluster("new", H_NEW),
        service("s-stay", STAY, "stay"),
        service("s-change", CHANGE, "change"),
        service("s-new", NEW, "new"),
    )
}

fn client(cgroup: &TestCgroup, netns: &Netns, vip: &str, within: Duration) -> InCgroup {
    let vip: SocketAddr = vip.parse().unwrap();
    InCgroup::spawn(Some(cgroup.path()), netns, move || {
        serde_json::to_string(&tcp_loop(vip, 10_000_000, within)).unwrap()
    })
}

/// A few connects to `vip` from the cgroup: what answered.
fn reach(cgroup: &TestCgroup, netns: &Netns, vip: &str) -> LoopReport {
    let vip: SocketAddr = vip.parse().unwrap();
    let c = InCgroup::spawn(Some(cgroup.path()), netns, move || {
        serde_json::to_string(&tcp_loop(vip, 5, Duration::from_secs(5))).unwrap()
    });
    LoopReport::parse(&c.wait(Duration::from_secs(30)))
}

/// `proxy reload` against the daemon's control socket, from inside its namespace: exit code,
/// stdout and stderr.
fn proxy_reload(netns: &Netns, daemon: &Daemon) -> (i32, String, String) {
    let out = Command::new("ip")
        .args(["netns", "exec", netns.name()])
        .arg(proxy_bin())
        .arg("reload")
        .arg(format!("--admin=unix:{}", daemon.control.display()))
        .output()
        .expect("running proxy reload");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Waits (bounded) until the log has `n` lines containing `what`.
fn wait_log(daemon: &Daemon, what: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while daemon.log_text().matches(what).count() < n {
        assert!(
            Instant::now() < deadline,
            "no {n}x {what:?} in the log:\n{}",
            daemon.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn reload_applies_the_difference_and_refuses_what_it_cannot() {
    require_root();
    if skip_without_dataplane("reload_applies_the_difference_and_refuses_what_it_cannot") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let servers: Vec<(SocketAddr, &str, bool)> =
        [H_STAY, H_CHANGE_OLD, H_CHANGE_NEW, H_GONE, H_NEW]
            .iter()
            .map(|h| (h.parse().unwrap(), *h, false))
            .collect();
    let _servers = BannerServers::start(&netns, &servers);
    let instance = unique("rl");
    let _pins = PinDir(PathBuf::from("/sys/fs/bpf").join(&instance));
    let mut daemon = Daemon::start_in(&netns, &first(&head(&instance, cgroup.path(), "{admin}")));
    let head = head(&instance, cgroup.path(), &daemon.admin.to_string());
    assert_eq!(reach(&cgroup, &netns, GONE).banners.get(H_GONE), Some(&5));
    let attempts = |d: &Daemon| d.stat("cluster.stay.health_check.attempt");

    let stay = client(&cgroup, &netns, STAY, LOOP_FOR);
    let change = client(&cgroup, &netns, CHANGE, LOOP_FOR);
    std::thread::sleep(Duration::from_secs(1));

    // SIGHUP with the second file: the difference is applied.
    let before = attempts(&daemon);
    std::fs::write(&daemon.config, second(&head)).unwrap();
    daemon.signal(libc::SIGHUP);
    wait_log(&daemon, "configuration reloaded", 1);
    let log = daemon.log_text();
    assert!(
        log.contains("clusters: 1 added, 1 removed, 1 changed, 1 unchanged; services: 2 published, 1 removed, 1 unchanged"),
        "{log}"
    );
    std::thread::sleep(Duration::from_secs(1));
    let after = attempts(&daemon);
    assert!(
        after > before,
        "the untouched cluster's checker went on counting ({before} -> {after}); a restarted one would count from 0"
    );
    assert_eq!(
        reach(&cgroup, &netns, NEW).banners.get(H_NEW),
        Some(&5),
        "the added service"
    );
    assert_eq!(
        reach(&cgroup, &netns, CHANGE).banners.get(H_CHANGE_NEW),
        Some(&5),
        "the changed cluster's new host"
    );
    let gone = reach(&cgroup, &netns, GONE);
    assert_eq!(
        gone.ok(),
        0,
        "the removed service is no longer served: {gone:?}"
    );
    let (_, clusters) = daemon.get("/clusters").expect("admin");
    assert!(!clusters.contains("gone::"), "{clusters}");
    assert!(clusters.contains(&format!("new::{H_NEW}::")), "{clusters}");

    refusals_change_nothing(&daemon, &netns, &cgroup, &second(&head), &instance);

    let stay = LoopReport::parse(&stay.wait(Duration::from_secs(60)));
    let change = LoopReport::parse(&change.wait(Duration::from_secs(60)));
    println!(
        "across 5 reloads: {} connects to the untouched service, {} failed; {} to the service whose cluster changed, {} failed ({:?})",
        stay.ok(),
        stay.failed(),
        change.ok(),
        change.failed(),
        change.banners
    );
    assert_eq!(stay.failed(), 0, "{stay:?}");
    assert!(stay.ok() > 100, "{stay:?}");
    assert_eq!(stay.banners.keys().collect::<Vec<_>>(), [H_STAY]);
    assert_eq!(change.failed(), 0, "{change:?}");
    assert!(
        change.banners.contains_key(H_CHANGE_OLD) && change.banners.contains_key(H_CHANGE_NEW),
        "{change:?}"
    );
    assert!(daemon.stop(), "clean stop:\n{}", daemon.log_text());
}

/// A broken file (by `proxy reload`, then by SIGHUP) and a change that needs a restart are
/// refused with the reason and change nothing; `good`, the file in force, again is "no change".
fn refusals_change_nothing(
    daemon: &Daemon,
    netns: &Netns,
    cgroup: &TestCgroup,
    good: &str,
    instance: &str,
) {
    // A broken file, by `proxy reload`: exit 64, the file's line and column, nothing changes.
    std::fs::write(&daemon.config, good.replace("port: 80", "port: eighty")).unwrap();
    let (code, _, stderr) = proxy_reload(netns, daemon);
    assert_eq!(code, 64, "{stderr}");
    let config_name = daemon.config.display().to_string();
    assert!(
        stderr.contains(&format!("{config_name}:")) && stderr.contains("port"),
        "the error names the file, line and column: {stderr}"
    );
    wait_log(daemon, "reload refused", 1);
    // A change that needs a restart: exit 1, nothing changes.
    std::fs::write(
        &daemon.config,
        good.replace(&format!("instance: {instance}"), "instance: another"),
    )
    .unwrap();
    let (code, _, stderr) = proxy_reload(netns, daemon);
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("instance") && stderr.contains("restart"),
        "{stderr}"
    );
    // SIGHUP with a broken file: refused in the log.
    std::fs::write(&daemon.config, "clusters: [").unwrap();
    daemon.signal(libc::SIGHUP);
    wait_log(daemon, "reload refused", 3);
    assert_eq!(
        reach(cgroup, netns, CHANGE).banners.get(H_CHANGE_NEW),
        Some(&5),
        "the refused reloads changed nothing"
    );
    // The same good file again: no change, and `proxy reload` says so.
    std::fs::write(&daemon.config, good).unwrap();
    let (code, stdout, stderr) = proxy_reload(netns, daemon);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.starts_with("no change"), "{stdout}");
}

/// A `mode: proxy` service and its hosts (banner servers).
const PROXIED: &str = "127.77.9.5:80";
const H_PROXIED_OLD: &str = "127.0.0.86:8086";
const H_PROXIED_NEW: &str = "127.0.0.87:8087";

/// The proxy-mode service `p` on cluster `pc` with `host`, and the untouched `stay`.
fn proxied(head: &str, host: &str) -> String {
    format!(
        "{head}proxy:\n  listeners: [\"127.0.0.1:15091\"]\nclusters:\n{}{}services:\n{}  - {{ name: p, address: \"127.77.9.5\", port: 80, cluster: pc, mode: proxy }}\n",
        cluster("stay", H_STAY),
        cluster("pc", host),
        service("s-stay", STAY, "stay"),
    )
}

/// What the proxy-mode reload tests start from: the hosts' servers and a daemon whose
/// proxy-mode service [`PROXIED`] reads cluster `pc` on [`H_PROXIED_OLD`], checked reachable.
struct ProxiedReload {
    daemon: Daemon,
    /// The configuration's head, with the daemon's admin address.
    head: String,
    _pins: PinDir,
    _servers: BannerServers,
    cgroup: TestCgroup,
    netns: Netns,
}

impl ProxiedReload {
    /// `prefix` names the daemon's instance.
    fn start(prefix: &str) -> Self {
        let netns = Netns::new();
        let cgroup = TestCgroup::new();
        let servers: Vec<(SocketAddr, &str, bool)> = [H_STAY, H_PROXIED_OLD, H_PROXIED_NEW]
            .iter()
            .map(|h| (h.parse().unwrap(), *h, false))
            .collect();
        let servers = BannerServers::start(&netns, &servers);
        let instance = unique(prefix);
        let pins = PinDir(PathBuf::from("/sys/fs/bpf").join(&instance));
        let daemon = Daemon::start_in(
            &netns,
            &proxied(&head(&instance, cgroup.path(), "{admin}"), H_PROXIED_OLD),
        );
        let head = head(&instance, cgroup.path(), &daemon.admin.to_string());
        assert_eq!(
            reach(&cgroup, &netns, PROXIED).banners.get(H_PROXIED_OLD),
            Some(&5)
        );
        Self {
            daemon,
            head,
            _pins: pins,
            _servers: servers,
            cgroup,
            netns,
        }
    }
}

/// A reload that moves a proxy-mode service's cluster to another host: a successor proxy takes
/// the listening sockets with the new table while a connect loop runs through it; not one
/// connect fails, new connections reach the new host, and the proxy's counters go on.
#[test]
fn reload_gives_the_proxy_path_its_new_services_without_a_failed_connect() {
    require_root();
    if skip_without_dataplane(
        "reload_gives_the_proxy_path_its_new_services_without_a_failed_connect",
    ) {
        return;
    }
    // Named (not `..`), so that nothing drops here; dropped in reverse: the daemon first.
    let ProxiedReload {
        netns,
        cgroup,
        _servers,
        _pins,
        head,
        mut daemon,
    } = ProxiedReload::start("rp");
    let looping = client(&cgroup, &netns, PROXIED, Duration::from_secs(6));
    std::thread::sleep(Duration::from_secs(2));
    let before = daemon.stat("proxy.downstream_cx_total");
    std::fs::write(&daemon.config, proxied(&head, H_PROXIED_NEW)).unwrap();
    let (code, stdout, stderr) = proxy_reload(&netns, &daemon);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("the proxy path took the new services"),
        "{stdout}"
    );
    assert_eq!(
        reach(&cgroup, &netns, PROXIED).banners.get(H_PROXIED_NEW),
        Some(&5),
        "new connections take the new table"
    );
    let report = LoopReport::parse(&looping.wait(Duration::from_secs(60)));
    let after = daemon.stat("proxy.downstream_cx_total");
    println!(
        "proxy-mode service across the reload: {} connects, {} failed ({:?}); proxy.downstream_cx_total {before} -> {after}",
        report.ok(),
        report.failed(),
        report.banners
    );
    assert_eq!(report.failed(), 0, "{report:?}");
    assert!(
        report.banners.contains_key(H_PROXIED_OLD) && report.banners.contains_key(H_PROXIED_NEW),
        "{report:?}"
    );
    assert!(
        after >= before + u64::from(report.ok()) / 2,
        "the successor counts on from the old proxy's total ({before} -> {after})"
    );
    assert!(daemon.stop(), "clean stop:\n{}", daemon.log_text());
}

/// The DNS name of the cluster `pc` moves to, answered by [`SlowDns`].
const SLOW_NAME: &str = "pc.slow.test";
/// Where [`SlowDns`] listens, in the test's namespace.
const SLOW_DNS: &str = "127.0.0.53:53";

/// `proxied` with `pc` as a STRICT_DNS cluster of [`SLOW_NAME`], resolved by [`SlowDns`].
fn proxied_by_slow_dns(head: &str, port: u16) -> String {
    format!(
        "{head}proxy:\n  listeners: [\"127.0.0.1:15091\"]\nclusters:\n{}  - name: pc\n    type: STRICT_DNS\n    dns_lookup_family: V4_ONLY\n    dns_resolvers: [\"{SLOW_DNS}\"]\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: \"{SLOW_NAME}\", port_value: {port} }} }} }}\nservices:\n{}  - {{ name: p, address: \"127.77.9.5\", port: 80, cluster: pc, mode: proxy }}\n",
        cluster("stay", H_STAY),
        service("s-stay", STAY, "stay"),
    )
}

/// A reload that moves a proxy-mode service to a cluster whose first discovery result comes
/// late (its DNS server answers after [`SLOW_ANSWER`]): the successor proxy takes the listeners
/// only once that cluster has its hosts, as Envoy warms a cluster before it replaces the old
/// one. Until then the old proxy serves; not one connect fails. Before the successor waited,
/// every connect of that window was reset (the new cluster had no host yet).
#[test]
fn a_proxy_mode_reload_waits_for_the_new_clusters_first_hosts() {
    require_root();
    if skip_without_dataplane("a_proxy_mode_reload_waits_for_the_new_clusters_first_hosts") {
        return;
    }
    // Named (not `..`), so that nothing drops here; dropped in reverse: the daemon first.
    let ProxiedReload {
        netns,
        cgroup,
        _servers,
        _pins,
        head,
        mut daemon,
    } = ProxiedReload::start("rw");
    let new_host: SocketAddr = H_PROXIED_NEW.parse().unwrap();
    let std::net::IpAddr::V4(new_ip) = new_host.ip() else {
        unreachable!("an IPv4 literal")
    };
    let _dns = SlowDns::start(&netns, SLOW_DNS.parse().unwrap(), new_ip);
    let looping = client(&cgroup, &netns, PROXIED, Duration::from_secs(6));
    std::thread::sleep(Duration::from_secs(1));
    std::fs::write(&daemon.config, proxied_by_slow_dns(&head, new_host.port())).unwrap();
    let asked = Instant::now();
    let (code, stdout, stderr) = proxy_reload(&netns, &daemon);
    let took = asked.elapsed();
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("the proxy path took the new services"),
        "{stdout}"
    );
    assert!(
        took >= SLOW_ANSWER,
        "the reload returned after {took:?}, before the new cluster's first answer"
    );
    assert_eq!(
        reach(&cgroup, &netns, PROXIED).banners.get(H_PROXIED_NEW),
        Some(&5),
        "new connections take the new cluster"
    );
    let report = LoopReport::parse(&looping.wait(Duration::from_secs(60)));
    println!(
        "proxy-mode reload onto a cluster that answers after {SLOW_ANSWER:?} (reload took {took:?}): {} connects, {} failed ({:?})",
        report.ok(),
        report.failed(),
        report.banners
    );
    assert_eq!(report.failed(), 0, "{report:?}");
    assert!(
        report.banners.contains_key(H_PROXIED_OLD) && report.banners.contains_key(H_PROXIED_NEW),
        "{report:?}"
    );
    assert!(daemon.stop(), "clean stop:\n{}", daemon.log_text());
}
