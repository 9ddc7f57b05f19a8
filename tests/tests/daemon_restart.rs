//! A plain restart (root) of a daemon with a `mode: proxy` service, while an application in
//! the cgroup connects to it in a loop: SIGTERM then a new daemon (what `systemctl restart` and
//! a package upgrade do), and `kill -9` then a new daemon. Between the two daemons no proxy
//! listens; the kernel then sends the service's connects straight to its hosts
//! (`connect_proxy_absent_direct`) instead of refusing them, and once the new daemon listens,
//! to its proxy again. Everything runs in a fresh network namespace and cgroup.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use integration_tests::kernel::{
    BannerServers, Daemon, InCgroup, LoopReport, Netns, TestCgroup, in_netns, require_root,
    skip_without_dataplane, tcp_loop, unique,
};

/// The proxy-mode service the loop dials, and its two banner servers.
const VIP: &str = "127.77.0.1:80";
const HOSTS: [&str; 2] = ["127.0.0.11:8081", "127.0.0.12:8082"];
/// How long the connect loop runs; the stop and the next start happen inside it.
const LOOP_FOR: Duration = Duration::from_secs(8);
/// The proxy listener the kernel redirects the loop's (IPv4) connects to.
const LISTENER: &str = "127.0.0.1:15001";

/// One STATIC endpoint of the cluster, as YAML.
fn endpoint(host: &str) -> String {
    let a: SocketAddr = host.parse().expect("literal");
    format!(
        "            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\n",
        a.ip(),
        a.port()
    )
}

fn config(instance: &str, cgroup: &TestCgroup) -> String {
    let endpoints: String = HOSTS.iter().map(|h| endpoint(h)).collect();
    format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nproxy:\n  listeners: [\"{LISTENER}\", \"[::1]:15001\"]\nclusters:\n  - name: web\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{endpoints}services:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web, mode: proxy }}\n",
        cgroup.path().display(),
    )
}

/// How a restart went for the connect loop.
struct Outcome {
    report: LoopReport,
    /// Connects that failed (refused, or any error before the connection was made).
    refused: u32,
    /// Connections made that then lost their answer (reset, or closed without a banner).
    lost: u32,
    /// The first daemon's listening sockets at [`LISTENER`] (one per engine thread).
    listeners: u32,
}

impl Outcome {
    fn of(report: LoopReport, listeners: u32) -> Self {
        // `tcp_loop` names a failure after the connect by its phase; anything else failed
        // to connect.
        let lost_after = |what: &str| what.starts_with("reading the banner");
        let refused = (report.errors.iter())
            .filter(|(what, _)| !lost_after(what))
            .map(|(_, n)| n)
            .sum();
        let no_answer: u32 = (report.banners.iter())
            .filter(|(banner, _)| !HOSTS.contains(&banner.as_str()))
            .map(|(_, n)| n)
            .sum();
        let errors_after: u32 = (report.errors.iter())
            .filter(|(what, _)| lost_after(what))
            .map(|(_, n)| n)
            .sum();
        Self {
            refused,
            lost: no_answer + errors_after,
            listeners,
            report,
        }
    }

    fn answered(&self) -> u32 {
        (self.report.banners.iter())
            .filter(|(banner, _)| HOSTS.contains(&banner.as_str()))
            .map(|(_, n)| n)
            .sum()
    }
}

/// How the first daemon goes.
#[derive(Clone, Copy, Debug)]
enum Stop {
    Sigterm,
    Kill9,
}

/// Runs the connect loop across `stop` of one daemon and the start of the next (same
/// configuration, same instance); checks that the proxy path serves again afterwards.
fn across(stop: Stop) -> Outcome {
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let banners: Vec<(SocketAddr, &str, bool)> = HOSTS
        .iter()
        .map(|h| (h.parse().unwrap(), *h, false))
        .collect();
    let _servers = BannerServers::start(&netns, &banners);
    let config = config(&unique("rp"), &cgroup);
    let mut first = Daemon::start_in(&netns, &config);
    let vip: SocketAddr = VIP.parse().expect("literal");
    let client = InCgroup::spawn(Some(cgroup.path()), &netns, move || {
        serde_json::to_string(&tcp_loop(vip, 10_000_000, LOOP_FOR)).expect("JSON")
    });
    std::thread::sleep(Duration::from_secs(1));
    let proxied_before = first.counter("connect_proxy_redirected");
    let listeners = listening_sockets(&netns);
    let started = Instant::now();
    match stop {
        Stop::Sigterm => assert!(first.terminate(), "clean exit:\n{}", first.log_text()),
        Stop::Kill9 => first.kill9(),
    }
    let stopped_after = started.elapsed();
    let mut second = Daemon::start_in(&netns, &config);
    let ready_after = started.elapsed();
    let report = LoopReport::parse(&client.wait(Duration::from_secs(60)));
    let outcome = Outcome::of(report, listeners);
    let direct = second.counter("connect_proxy_absent_direct");
    println!(
        "{stop:?} + start: {} connects answered, {} refused, {} lost after the connect {:?} (the first daemon had {listeners} sockets listening at {LISTENER}); the first daemon was gone after {stopped_after:?}, the next one ready after {ready_after:?}; {proxied_before} proxied before, {direct} served by the kernel while no proxy listened, {} accepted by the new proxy",
        outcome.answered(),
        outcome.refused,
        outcome.lost,
        outcome.report.errors,
        second.stat("proxy.downstream_cx_total"),
    );
    assert!(proxied_before > 0, "the first daemon proxied the service");
    assert!(
        direct > 0,
        "the kernel served the gap itself:\n{}",
        second.log_text()
    );
    assert!(outcome.answered() > 100, "{:?}", outcome.report);

    // The new daemon's proxy serves the service again, and the kernel no longer by itself.
    let redirected = second.counter("connect_proxy_redirected");
    let after = LoopReport::parse(
        &InCgroup::spawn(Some(cgroup.path()), &netns, move || {
            serde_json::to_string(&tcp_loop(vip, 50, Duration::from_secs(10))).expect("JSON")
        })
        .wait(Duration::from_secs(30)),
    );
    assert_eq!((after.ok(), after.failed()), (50, 0), "{after:?}");
    assert_eq!(second.counter("connect_proxy_redirected"), redirected + 50);
    assert_eq!(second.counter("connect_proxy_absent_direct"), direct);
    assert!(second.stat("proxy.downstream_cx_total") >= 50);
    assert!(second.stop(), "clean stop:\n{}", second.log_text());
    outcome
}

/// The TCP sockets listening at [`LISTENER`] in `netns` (`ss`).
fn listening_sockets(netns: &Netns) -> u32 {
    let out = in_netns(netns, || {
        std::process::Command::new("ss")
            .args(["-Htln", "sport = :15001"])
            .output()
            .expect("running ss")
    })
    .join()
    .expect("ss in the namespace");
    assert!(out.status.success(), "ss: {out:?}");
    let listening = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|line| line.split_whitespace().nth(3) == Some(LISTENER))
        .count();
    u32::try_from(listening).expect("a few sockets")
}

/// SIGTERM: the daemon withdraws its listener from the kernel, accepts what was already on its
/// way, drains and exits; the kernel serves the service's hosts until the next daemon listens.
/// Not one connect fails.
#[test]
fn sigterm_and_a_new_daemon_lose_no_proxy_mode_connect() {
    require_root();
    if skip_without_dataplane("sigterm_and_a_new_daemon_lose_no_proxy_mode_connect") {
        return;
    }
    let outcome = across(Stop::Sigterm);
    assert_eq!(
        (outcome.refused, outcome.lost),
        (0, 0),
        "{:?}",
        outcome.report
    );
}

/// `kill -9`: the listener's address stays in the kernel's settings, but its sockets go with
/// the process; the kernel then finds no socket listening there and serves the service's
/// hosts until the next daemon listens. No connect is refused. Connections the killed daemon
/// held die with it, and nothing can save them: the one its proxy was relaying, and the ones
/// the kernel had already queued on its listening sockets while the process was being torn
/// down (each is reset when its socket closes). The loop has one connection at a time, and
/// after a reset its next connect can land only on a listening socket not closed yet: at most
/// one per listening socket, plus the relayed one.
#[test]
fn kill9_and_a_new_daemon_refuse_no_proxy_mode_connect() {
    require_root();
    if skip_without_dataplane("kill9_and_a_new_daemon_refuse_no_proxy_mode_connect") {
        return;
    }
    let outcome = across(Stop::Kill9);
    assert_eq!(outcome.refused, 0, "{:?}", outcome.report);
    assert!(outcome.listeners >= 1, "the first daemon listened");
    assert!(
        outcome.lost <= 1 + outcome.listeners,
        "only connections the killed daemon held: {:?}",
        outcome.report
    );
}
