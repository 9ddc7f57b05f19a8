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
    BannerServers, InCgroup, InProcess, LoopReport, Netns, TestCgroup, in_netns, in_netns_at,
    require_root, skip_without_dataplane, spec, tcp_loop, widen_port_range,
};
use proxy::dataplane::OriginalDestinations;
use proxy_common::service::{
    SERVICE_F_NO_PROXY_DIALLED, SERVICE_F_NO_PROXY_HOSTS, SERVICE_F_PROXY,
};
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
    setup_with(fam, SERVICE_F_PROXY)
}

/// [`setup`] with the proxy-mode service published with `flags`.
fn setup_with(fam: &Family, flags: u32) -> (Netns, TestCgroup, InProcess, SocketAddr, SocketAddr) {
    require_root();
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = fam.vip.parse().unwrap();
    let listener: SocketAddr = fam.listener.parse().unwrap();
    let mut dp = InProcess::open(&cgroup);
    let host: SocketAddr = fam.host.parse().unwrap();
    dp.publisher()
        .publish(&spec("proxied", vip, false, flags, &[host]))
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

/// A proxy-mode service the kernel cannot serve itself (no `SERVICE_F_NO_PROXY_*` flag: an
/// HTTP-routed one) while no proxy listens, whether a listener is set or not, is refused.
#[rstest]
#[case::ipv4(V4)]
#[case::ipv6(V6)]
fn proxy_mode_without_a_listener_refuses_connects(#[case] fam: Family) {
    require_root();
    if skip_without_dataplane("proxy_mode_without_a_listener_refuses_connects") {
        return;
    }
    let (netns, cgroup, mut dp, vip, listener) = setup(&fam);
    for (set, refused) in [(false, 5), (true, 10)] {
        if set {
            dp.set_proxy_listener(listener)
                .expect("setting the listener");
        }
        let report = connects(&netns, &cgroup, vip, 5);
        assert_eq!(
            report
                .errors
                .get(integration_tests::features::refused_errno()),
            Some(&5),
            "listener set: {set}: {report:?}"
        );
        assert_eq!(dp.counter("connect_proxy_no_listener"), refused);
    }
    assert_eq!(dp.counter("connect_proxy_absent_direct"), 0);
}

/// `count` connects from the cgroup to `vip`.
fn connects(netns: &Netns, cgroup: &TestCgroup, vip: SocketAddr, count: u32) -> LoopReport {
    LoopReport::parse(
        &InCgroup::spawn(Some(cgroup.path()), netns, move || {
            serde_json::to_string(&tcp_loop(vip, count, Duration::from_secs(20))).unwrap()
        })
        .wait(Duration::from_secs(60)),
    )
}

/// A proxy-mode TCP service published with its hosts (`SERVICE_F_NO_PROXY_HOSTS`) while no
/// proxy listens: with the listener withdrawn (a daemon's stop) and with it still set but its
/// socket gone (`kill -9`), connects go straight to the host, shown as the service, and are
/// counted `connect_proxy_absent_direct`; once the listener is there, to it again.
#[rstest]
#[case::ipv4(V4)]
#[case::ipv6(V6)]
fn without_a_listening_proxy_a_proxy_mode_service_goes_to_its_hosts(#[case] fam: Family) {
    require_root();
    if skip_without_dataplane("without_a_listening_proxy_a_proxy_mode_service_goes_to_its_hosts") {
        return;
    }
    let flags = SERVICE_F_PROXY | SERVICE_F_NO_PROXY_HOSTS;
    let (netns, cgroup, mut dp, vip, listener) = setup_with(&fam, flags);
    let host: SocketAddr = fam.host.parse().unwrap();
    let _host = BannerServers::start(&netns, &[(host, "host", false)]);
    let direct = |dp: &InProcess, what: &str| {
        let report = connects(&netns, &cgroup, vip, 20);
        assert_eq!(report.banners.get("host"), Some(&20), "{what}: {report:?}");
        assert_eq!(report.peers.iter().collect::<Vec<_>>(), [&vip.to_string()]);
        println!("{what}: 20 of 20 connects reached the host");
        dp.counter("connect_proxy_absent_direct")
    };
    assert_eq!(direct(&dp, "no listener set"), 20);
    dp.set_proxy_listener(listener)
        .expect("setting the listener");
    assert_eq!(direct(&dp, "a listener set, nothing listening"), 40);
    assert_eq!(dp.counter("connect_proxy_redirected"), 0);
    assert_eq!(dp.counter("connect_proxy_no_listener"), 0);

    let _listener = Listener::start(&netns, listener, dp.original_destinations());
    let report = connects(&netns, &cgroup, vip, 20);
    assert_eq!(
        report.banners.get(&format!("orig={vip}")),
        Some(&20),
        "{report:?}"
    );
    assert_eq!(dp.counter("connect_proxy_redirected"), 20);
    assert_eq!(dp.counter("connect_proxy_absent_direct"), 40);
}

/// An ORIGINAL_DST proxy-mode service (`SERVICE_F_NO_PROXY_DIALLED`, no hosts) while no proxy
/// listens: connects go to the address dialled, counted `connect_proxy_absent_direct`.
#[test]
fn without_a_listening_proxy_an_original_dst_service_goes_where_dialled() {
    require_root();
    if skip_without_dataplane(
        "without_a_listening_proxy_an_original_dst_service_goes_where_dialled",
    ) {
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let vip: SocketAddr = "127.77.1.2:80".parse().unwrap();
    let mut dp = InProcess::open(&cgroup);
    let flags = SERVICE_F_PROXY | SERVICE_F_NO_PROXY_DIALLED;
    dp.publisher()
        .publish(&spec("dialled", vip, false, flags, &[]))
        .expect("publishing");
    dp.set_proxy_listener(V4.listener.parse().unwrap())
        .expect("setting the listener");
    let _dialled = BannerServers::start(&netns, &[(vip, "dialled", false)]);
    let report = connects(&netns, &cgroup, vip, 20);
    assert_eq!(report.banners.get("dialled"), Some(&20), "{report:?}");
    assert_eq!(dp.counter("connect_proxy_absent_direct"), 20);
    assert_eq!(dp.counter("connect_proxy_redirected"), 0);
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
