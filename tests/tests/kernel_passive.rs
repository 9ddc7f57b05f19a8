//! The kernel's passive health signal (root): for services published with `SERVICE_F_PASSIVE`
//! (a cluster with outlier detection), sockops counts, per backend, connects that never got
//! established and established connections that were reset, and the daemon reads them with
//! `Dataplane::passive_counters`, and per service in its `passive_failures` (the daemon's
//! `service.<name>.cx_passive_failure`). Other services' connections are not followed at all.

use std::{
    net::{SocketAddr, TcpListener},
    time::Duration,
};

use integration_tests::kernel::{
    InCgroup, InProcess, LoopReport, Netns, TestCgroup, in_netns, require_root, reset_on_accept,
    skip_without_dataplane, spec, tcp_loop,
};
use proxy::dataplane::PassiveReport;
use proxy_common::service::SERVICE_F_PASSIVE;
use rstest::rstest;

/// Connects per test.
const CONNECTS: u32 = 20;

struct Family {
    vip: &'static str,
    closed: &'static str,
    resetting: &'static str,
}

const V4: Family = Family {
    vip: "127.77.3.1:80",
    closed: "127.0.0.61:9",
    resetting: "127.0.0.62:8080",
};
const V6: Family = Family {
    vip: "[fd77::3:1]:80",
    closed: "[::1]:9",
    resetting: "[::1]:8080",
};

fn report_for(dp: &InProcess, backend: SocketAddr) -> PassiveReport {
    dp.passive_counters()
        .expect("reading passive counters")
        .into_iter()
        .find(|r| r.backend == backend)
        .unwrap_or_else(|| panic!("no passive counters for {backend}"))
}

/// The service at `vip`'s count of passive failures.
fn service_failures(dp: &InProcess, vip: SocketAddr) -> u64 {
    let key = proxy::dataplane::publish_key(vip.ip(), vip.port(), proxy_common::service::PROTO_TCP);
    dp.service_counts(&key)
        .expect("the service is published")
        .passive_failures
}

fn run_client(cgroup: &TestCgroup, netns: &Netns, vip: SocketAddr) -> LoopReport {
    LoopReport::parse(
        &InCgroup::spawn(Some(cgroup.path()), netns, move || {
            serde_json::to_string(&tcp_loop(vip, CONNECTS, Duration::from_secs(20))).unwrap()
        })
        .wait(Duration::from_secs(60)),
    )
}

#[rstest]
#[case::ipv4(V4)]
#[case::ipv6(V6)]
fn connects_to_a_closed_port_count_as_failures_of_that_backend(#[case] fam: Family) {
    require_root();
    if skip_without_dataplane("connects_to_a_closed_port_count_as_failures_of_that_backend") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = fam.vip.parse().unwrap();
    let closed: SocketAddr = fam.closed.parse().unwrap();
    let mut dp = InProcess::open(&cgroup);
    dp.publisher()
        .publish(&spec("closed", vip, false, SERVICE_F_PASSIVE, &[closed]))
        .expect("publishing");
    let report = run_client(&cgroup, &netns, vip);
    assert_eq!(
        report.errors.get("ECONNREFUSED"),
        Some(&CONNECTS),
        "{report:?}"
    );
    let passive = report_for(&dp, closed);
    assert_eq!(
        (passive.connect_failures, passive.resets),
        (u64::from(CONNECTS), 0),
        "{passive:?}"
    );
    assert_eq!(dp.counter("passive_connect_failed"), u64::from(CONNECTS));
    assert_eq!(service_failures(&dp, vip), u64::from(CONNECTS));
}

#[rstest]
#[case::ipv4(V4)]
#[case::ipv6(V6)]
fn connections_reset_by_the_server_count_as_resets_of_that_backend(#[case] fam: Family) {
    require_root();
    if skip_without_dataplane("connections_reset_by_the_server_count_as_resets_of_that_backend") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = fam.vip.parse().unwrap();
    let resetting: SocketAddr = fam.resetting.parse().unwrap();
    let mut dp = InProcess::open(&cgroup);
    dp.publisher()
        .publish(&spec(
            "resetting",
            vip,
            false,
            SERVICE_F_PASSIVE,
            &[resetting],
        ))
        .expect("publishing");
    let (tx, rx) = std::sync::mpsc::channel();
    let server = in_netns(&netns, move || {
        let listener = TcpListener::bind(resetting).expect("binding the resetting server");
        tx.send(()).expect("test alive");
        reset_on_accept(&listener, CONNECTS, Duration::from_secs(30));
    });
    rx.recv_timeout(Duration::from_secs(5))
        .expect("server started");
    let report = run_client(&cgroup, &netns, vip);
    server.join().expect("server thread");
    assert_eq!(report.ok() + report.failed(), CONNECTS, "{report:?}");
    let passive = report_for(&dp, resetting);
    assert_eq!(
        (passive.connect_failures, passive.resets),
        (0, u64::from(CONNECTS)),
        "{passive:?}"
    );
    assert_eq!(dp.counter("passive_reset"), u64::from(CONNECTS));
    assert_eq!(service_failures(&dp, vip), u64::from(CONNECTS));
}

#[test]
fn an_established_connect_ends_the_run_of_failures() {
    require_root();
    if skip_without_dataplane("an_established_connect_ends_the_run_of_failures") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = "127.77.3.9:80".parse().unwrap();
    let backend: SocketAddr = "127.0.0.63:8080".parse().unwrap();
    let mut dp = InProcess::open(&cgroup);
    dp.publisher()
        .publish(&spec("flapping", vip, false, SERVICE_F_PASSIVE, &[backend]))
        .expect("publishing");
    // Nothing listens yet: every connect fails and the run grows with them.
    let report = run_client(&cgroup, &netns, vip);
    assert_eq!(
        report.errors.get("ECONNREFUSED"),
        Some(&CONNECTS),
        "{report:?}"
    );
    let passive = report_for(&dp, backend);
    assert_eq!(
        (passive.connect_failures, passive.run),
        (u64::from(CONNECTS), u64::from(CONNECTS))
    );
    // The backend comes up: one established connect ends the run; the totals stay.
    let (tx, rx) = std::sync::mpsc::channel();
    let server = in_netns(&netns, move || {
        let listener = TcpListener::bind(backend).expect("binding the backend");
        tx.send(()).expect("test alive");
        let _ = listener.accept();
    });
    rx.recv_timeout(Duration::from_secs(5))
        .expect("server started");
    let one = LoopReport::parse(
        &InCgroup::spawn(Some(cgroup.path()), &netns, move || {
            serde_json::to_string(&tcp_loop(vip, 1, Duration::from_secs(10))).unwrap()
        })
        .wait(Duration::from_secs(30)),
    );
    server.join().expect("server thread");
    assert_eq!(one.ok(), 1, "{one:?}");
    let passive = report_for(&dp, backend);
    assert_eq!(
        (passive.connect_failures, passive.run),
        (u64::from(CONNECTS), 0),
        "{passive:?}"
    );
}

#[test]
fn services_without_the_passive_flag_are_not_followed() {
    require_root();
    if skip_without_dataplane("services_without_the_passive_flag_are_not_followed") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = "127.77.3.11:80".parse().unwrap();
    let closed: SocketAddr = "127.0.0.64:9".parse().unwrap();
    let mut dp = InProcess::open(&cgroup);
    dp.publisher()
        .publish(&spec("unfollowed", vip, false, 0, &[closed]))
        .expect("publishing");
    let report = run_client(&cgroup, &netns, vip);
    // The connects were rewritten (refused by the backend address, not by the VIP) ...
    assert_eq!(
        report.errors.get("ECONNREFUSED"),
        Some(&CONNECTS),
        "{report:?}"
    );
    assert_eq!(dp.counter("connect_rewritten"), u64::from(CONNECTS));
    // ... and nothing counted them: no state callbacks were asked for.
    let counted = dp.passive_counters().expect("reading passive counters");
    assert!(counted.iter().all(|r| r.backend != closed), "{counted:?}");
    assert_eq!(dp.counter("passive_connect_failed"), 0);
    assert_eq!(service_failures(&dp, vip), 0);
}
