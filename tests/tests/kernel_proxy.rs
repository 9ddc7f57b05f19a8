//! Proxy mode (root): connect4/6 send a proxy-mode service's connections to the daemon's
//! listener, sockops re-keys the original destination by 4-tuple, and the listener finds it from
//! `accept()` through `Dataplane::original_destination`. Entries go when connections close: the
//! map does not grow over 100,000 connections.

use std::{
    io::Write as _,
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use integration_tests::kernel::{
    InCgroup, InProcess, LoopReport, Netns, TestCgroup, in_netns, in_netns_at, require_root,
    skip_without_dataplane, spec, tcp_loop, widen_port_range,
};
use proxy::dataplane::OriginalDestinations;
use proxy_common::service::SERVICE_F_PROXY;
use rstest::rstest;

/// Connections in the growth test: 100,000 (about 12 s in a debug build), or
/// `$PROXY_TEST_CONNECTIONS` (the number is a million, about two minutes).
fn many() -> u32 {
    std::env::var("PROXY_TEST_CONNECTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000)
}

struct Family {
    vip: &'static str,
    listener: &'static str,
    host: &'static str,
}

const V4: Family = Family {
    vip: "127.77.1.1:80",
    listener: "127.0.0.1:15001",
    host: "127.0.0.41:8080",
};
const V6: Family = Family {
    vip: "[fd77::1:1]:80",
    listener: "[::1]:15001",
    host: "[::1]:8080",
};

/// A stand-in for the proxy listener: answers every connection with `orig=<address>` (what the
/// kernel recorded) and closes.
struct Listener {
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
    netns: std::path::PathBuf,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    fn start(netns: &Netns, addr: SocketAddr, orig: OriginalDestinations) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let flag = stop.clone();
        let thread = in_netns(netns, move || {
            let listener = TcpListener::bind(addr).expect("binding the proxy listener");
            tx.send(()).expect("test alive");
            for conn in listener.incoming() {
                if flag.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(mut conn) = conn else { continue };
                let (Ok(peer), Ok(local)) = (conn.peer_addr(), conn.local_addr()) else {
                    continue;
                };
                let found = orig
                    .lookup(peer, local)
                    .map_or("none".to_owned(), |a| a.to_string());
                let _ = writeln!(conn, "orig={found}");
            }
        });
        rx.recv_timeout(Duration::from_secs(5))
            .expect("listener started");
        Self {
            stop,
            addr,
            netns: netns.path(),
            thread: Some(thread),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let addr = self.addr;
        let _ = in_netns_at(self.netns.clone(), move || {
            let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(200));
        })
        .join();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn setup(fam: &Family) -> (Netns, TestCgroup, InProcess, SocketAddr, SocketAddr) {
    require_root();
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = fam.vip.parse().unwrap();
    let listener: SocketAddr = fam.listener.parse().unwrap();
    let mut dp = InProcess::open(&cgroup);
    let host: SocketAddr = fam.host.parse().unwrap();
    dp.publisher()
        .publish(&spec("proxied", vip, false, SERVICE_F_PROXY, &[host]))
        .expect("publishing");
    (netns, cgroup, dp, vip, listener)
}

fn wait_empty(orig: &OriginalDestinations) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = orig.len();
        if n == 0 || Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[rstest]
#[case::ipv4(V4)]
#[case::ipv6(V6)]
fn proxy_mode_redirects_to_the_listener_which_finds_the_original_destination(#[case] fam: Family) {
    require_root();
    if skip_without_dataplane(
        "proxy_mode_redirects_to_the_listener_which_finds_the_original_destination",
    ) {
        return;
    }
    let (netns, cgroup, mut dp, vip, listener) = setup(&fam);
    dp.set_proxy_listener(listener)
        .expect("setting the listener");
    let _listener = Listener::start(&netns, listener, dp.original_destinations());
    let report = LoopReport::parse(
        &InCgroup::spawn(Some(cgroup.path()), &netns, move || {
            serde_json::to_string(&tcp_loop(vip, 50, Duration::from_secs(20))).unwrap()
        })
        .wait(Duration::from_secs(60)),
    );
    assert_eq!(
        report.banners.get(&format!("orig={vip}")),
        Some(&50),
        "{report:?}"
    );
    assert_eq!(
        report.peers.iter().collect::<Vec<_>>(),
        [&vip.to_string()],
        "getpeername"
    );
    assert_eq!(dp.counter("connect_proxy_redirected"), 50);
    assert_eq!(dp.counter("orig_dst_rekeyed"), 50);
    assert_eq!(
        wait_empty(&dp.original_destinations()),
        0,
        "entries left after close"
    );
}

#[rstest]
#[case::ipv4(V4)]
#[case::ipv6(V6)]
fn proxy_mode_without_a_listener_refuses_connects(#[case] fam: Family) {
    require_root();
    if skip_without_dataplane("proxy_mode_without_a_listener_refuses_connects") {
        return;
    }
    let (netns, cgroup, dp, vip, _) = setup(&fam);
    let report = LoopReport::parse(
        &InCgroup::spawn(Some(cgroup.path()), &netns, move || {
            serde_json::to_string(&tcp_loop(vip, 5, Duration::from_secs(10))).unwrap()
        })
        .wait(Duration::from_secs(30)),
    );
    assert_eq!(
        report
            .errors
            .get(integration_tests::features::refused_errno()),
        Some(&5),
        "{report:?}"
    );
    assert_eq!(dp.counter("connect_proxy_no_listener"), 5);
}

#[test]
fn original_destinations_do_not_grow_over_many_connections() {
    require_root();
    if skip_without_dataplane("original_destinations_do_not_grow_over_many_connections") {
        return;
    }
    let (netns, cgroup, mut dp, vip, listener) = setup(&V4);
    widen_port_range(&netns);
    dp.set_proxy_listener(listener)
        .expect("setting the listener");
    let _listener = Listener::start(&netns, listener, dp.original_destinations());
    let many = many();
    let started = Instant::now();
    let report = LoopReport::parse(
        &InCgroup::spawn(Some(cgroup.path()), &netns, move || {
            let mut r = tcp_loop(vip, many, Duration::from_secs(900));
            // Only the distinct outcomes matter here; keep the report small.
            r.peers.clear();
            serde_json::to_string(&r).unwrap()
        })
        .wait(Duration::from_secs(1000)),
    );
    println!(
        "{many} proxied connections in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        report.banners.get(&format!("orig={vip}")),
        Some(&many),
        "{report:?}"
    );
    let left = wait_empty(&dp.original_destinations());
    assert_eq!(
        left,
        0,
        "{} kept {left} entries after {many} closed connections",
        proxy_common::abi::maps::ORIG_DST
    );
    assert_eq!(dp.counter("orig_dst_rekeyed"), u64::from(many));
    assert_eq!(dp.counter("orig_dst_removed"), u64::from(many));
    assert_eq!(
        dp.counter("orig_dst_rekey_failed") + dp.counter("orig_dst_record_failed"),
        0
    );
}
