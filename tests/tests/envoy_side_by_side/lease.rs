//! `policy.endpoint_stale_after` side by side with Envoy 1.40: one xDS server, one EDS cluster
//! on both. An assignment with a 3 s lease shows its hosts on both; the same hosts again at a
//! new version restart both leases at one moment (the server pushes to both streams at once);
//! with nothing more, both remove every host about 3 s later, within a poll of each other, and
//! count it in `assignment_stale`; `assignment_timeout_received` agrees; an assignment without
//! the field brings the hosts back for good.

use std::time::{Duration, Instant};

use integration_tests::{
    kernel::{Daemon, TestCgroup, require_root, skip_without_dataplane, unique},
    xds_server::{Envoy, XdsServer},
};
use serde_json::{Value, json};

use super::{Sides, eds_daemon_config, endpoint, until_both};

/// The lease of the pushed assignments.
const LEASE: Duration = Duration::from_secs(3);

fn hosts() -> Value {
    json!([
        endpoint("127.0.0.61:8061", "HEALTHY", 1, 0),
        endpoint("127.0.0.62:8062", "HEALTHY", 1, 0),
    ])
}

#[test]
fn a_stale_assignment_loses_its_hosts_as_in_envoy() {
    require_root();
    if skip_without_dataplane("a_stale_assignment_loses_its_hosts_as_in_envoy") {
        return;
    }
    let cgroup = TestCgroup::new();
    let server = XdsServer::start();
    let lease = json!({"endpoint_stale_after": format!("{}s", LEASE.as_secs())});
    server.push_with_policy("c", "1", hosts(), lease.clone());
    let envoy = Envoy::start(&server, &unique("envoy"), &["c"]);
    let daemon = Daemon::start(&eds_daemon_config("sbslease", &cgroup, &server));
    let sides = Sides {
        netns: None,
        envoy: envoy.admin(),
        daemon: &daemon,
    };
    // Each received version 1 when it connected; version 2 restarts both leases together.
    until_both(&sides, Duration::from_secs(10), "version 1", |v| {
        v.len() == 2
    });
    server.push_with_policy("c", "2", hosts(), lease);
    let pushed = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(10);
    while sides.stat("cluster.c.assignment_timeout_received") != (2, 2) {
        assert!(
            Instant::now() < deadline,
            "version 2 not received by both: {:?}",
            sides.stat("cluster.c.assignment_timeout_received")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (envoy_at, daemon_at) = until_both(
        &sides,
        Duration::from_secs(15),
        "the lease ran out",
        <[_]>::is_empty,
    );
    let since_push = pushed.elapsed();
    println!(
        "hosts gone: envoy after {envoy_at:?}, daemon after {daemon_at:?} (lease {LEASE:?}, {since_push:?} since the push)"
    );
    assert!(
        envoy_at.abs_diff(daemon_at) <= Duration::from_secs(1),
        "envoy {envoy_at:?}, daemon {daemon_at:?}"
    );
    for stat in [
        "cluster.c.assignment_stale",
        "cluster.c.assignment_timeout_received",
        "cluster.c.membership_total",
    ] {
        let (envoy, daemon) = sides.stat(stat);
        assert_eq!(envoy, daemon, "{stat}");
    }
    assert_eq!(sides.stat("cluster.c.assignment_stale"), (1, 1));

    // Without the field: the hosts come back and stay past the old lease.
    server.push("c", "3", hosts());
    until_both(&sides, Duration::from_secs(10), "version 3", |v| {
        v.len() == 2
    });
    std::thread::sleep(LEASE + Duration::from_secs(1));
    let (envoy_json, daemon_json) = sides.clusters();
    assert_eq!(
        super::hosts_of(&envoy_json).len(),
        2,
        "envoy kept its hosts"
    );
    assert_eq!(
        super::hosts_of(&daemon_json).len(),
        2,
        "the daemon kept its hosts"
    );
    assert_eq!(sides.stat("cluster.c.assignment_stale"), (1, 1));
}
