//! Outlier detection fed by the kernel's passive signal (root): connects from a fresh cgroup to
//! a host with nothing listening fail; sockops counts them; the daemon ejects the host and new
//! connects go to the healthy one.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use integration_tests::kernel::{
    BannerServers, Daemon, Netns, Probe, TestCgroup, require_root, unique,
};

#[test]
fn connect_failures_eject_the_host() {
    require_root();
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let (good, bad) = ("127.0.0.61:8080", "127.0.0.62:8080");
    // Only the good host listens; connects rewritten to the bad one are refused.
    let _servers = BannerServers::start(&netns, &[(good.parse().unwrap(), good, false)]);
    let endpoint = |a: &str| {
        let a: SocketAddr = a.parse().unwrap();
        format!(
            "            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\n",
            a.ip(),
            a.port()
        )
    };
    let config = format!(
        "instance: {}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - name: web\n    outlier_detection: {{ consecutive_5xx: 2, interval: 0.2s, max_ejection_percent: 50 }}\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{}{}services:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n",
        unique("t"),
        cgroup.path().display(),
        endpoint(good),
        endpoint(bad),
    );
    let daemon = Daemon::start(&config);
    let vip: SocketAddr = "127.77.0.1:80".parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let probe = Probe::run(&netns, Some(cgroup.path()), vip, 20, false);
        if probe.errors.is_empty() && probe.count(good) == 20 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the refusing host was never ejected: {probe:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The refused connects before the ejection, in the service's kernel counter.
    let failed = daemon.stat("service.web.cx_passive_failure");
    println!("service.web.cx_passive_failure: {failed}");
    assert!(failed >= 2, "at least consecutive_5xx failures: {failed}");
}
