//! Publishing under load (root), through the in-process `Dataplane` API: republishing
//! alternating host sets while a client connects in a tight loop is atomic, also when the set
//! switches between one host (carried in the service entry) and several (a slot table); removing
//! every host and adding them back works; a data path dropped without shutdown (as after
//! `kill -9`) keeps serving both layouts and the next one adopts and republishes them, and its
//! sweeps leave exactly the live tables and backends; 10,000 services publish and each selects
//! its own host.

use std::{
    collections::BTreeSet,
    net::SocketAddr,
    path::PathBuf,
    time::{Duration, Instant},
};

use integration_tests::kernel::{
    BannerServers, InCgroup, InProcess, LoopReport, Netns, PinDir, TestCgroup, require_root,
    skip_without_dataplane, spec, tcp_loop, udp_sendto_loop_within, unique,
};
use proxy::dataplane::{Dataplane, DataplaneOptions, publish_key};
use rstest::rstest;

/// How long the client loops while host sets flip.
const FLIP_FOR: Duration = Duration::from_secs(3);
/// How long the layout-switching test leaves each layout in place before switching again.
const LAYOUT_DWELL: Duration = Duration::from_micros(50);
/// Services in the scale test.
const SERVICES: u32 = 10_000;
/// Services of the scale test that a client actually dials.
const SAMPLE: u32 = 25;

struct Family {
    vip: &'static str,
    vip_cidr: Option<&'static str>,
    set_a: [&'static str; 2],
    set_b: [&'static str; 2],
}

const V4: Family = Family {
    vip: "127.77.4.1:80",
    vip_cidr: None,
    set_a: ["127.0.0.71:8081", "127.0.0.72:8082"],
    set_b: ["127.0.0.73:8083", "127.0.0.74:8084"],
};

const V6: Family = Family {
    vip: "[fd77::4:1]:80",
    vip_cidr: Some("fd77::4:1/128"),
    set_a: ["[::1]:8081", "[::1]:8082"],
    set_b: ["[::1]:8083", "[::1]:8084"],
};

fn addrs(list: &[&str]) -> Vec<SocketAddr> {
    list.iter().map(|a| a.parse().unwrap()).collect()
}

/// Namespace, cgroup, data path, and banner servers on every host of both sets and on the VIP
/// itself (so a connect that escaped translation would say so instead of failing).
fn setup(fam: &Family, udp: bool) -> (Netns, TestCgroup, InProcess, BannerServers) {
    require_root();
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    if let Some(cidr) = fam.vip_cidr {
        netns.add_lo_addr(cidr);
    }
    let mut servers: Vec<(SocketAddr, &str, bool)> = fam
        .set_a
        .iter()
        .chain(&fam.set_b)
        .map(|h| (h.parse().unwrap(), *h, udp))
        .collect();
    servers.push((fam.vip.parse().unwrap(), "vip-itself", udp));
    let servers = BannerServers::start(&netns, &servers);
    let dp = InProcess::open(&cgroup);
    (netns, cgroup, dp, servers)
}

fn client(
    cgroup: &TestCgroup,
    netns: &Netns,
    vip: SocketAddr,
    udp: bool,
    count: u32,
    within: Duration,
) -> InCgroup {
    InCgroup::spawn(Some(cgroup.path()), netns, move || {
        let report = if udp {
            udp_sendto_loop_within(vip, count, Some(within))
        } else {
            tcp_loop(vip, count, within)
        };
        serde_json::to_string(&report).unwrap()
    })
}

#[rstest]
#[case::ipv4_tcp(V4, false)]
#[case::ipv4_udp(V4, true)]
#[case::ipv6_tcp(V6, false)]
#[case::ipv6_udp(V6, true)]
fn alternating_host_sets_never_mix_or_fail(#[case] fam: Family, #[case] udp: bool) {
    require_root();
    if skip_without_dataplane("alternating_host_sets_never_mix_or_fail") {
        return;
    }
    let (netns, cgroup, mut dp, _servers) = setup(&fam, udp);
    let vip: SocketAddr = fam.vip.parse().unwrap();
    let (a, b) = (addrs(&fam.set_a), addrs(&fam.set_b));
    dp.publisher()
        .publish(&spec("flip", vip, udp, 0, &a))
        .expect("publishing A");
    // Both loops stop when the publishes stop (FLIP_FOR), or at `count` exchanges: each UDP
    // datagram waits for its answer, so a slow machine (QEMU under load) makes fewer.
    let count = if udp { 20_000 } else { 1_000_000 };
    let running = client(&cgroup, &netns, vip, udp, count, FLIP_FOR);
    let started = Instant::now();
    let mut flips = 0u32;
    while started.elapsed() < FLIP_FOR {
        let set = if flips.is_multiple_of(2) { &b } else { &a };
        dp.publisher()
            .publish(&spec("flip", vip, udp, 0, set))
            .expect("republishing");
        flips += 1;
    }
    let report = LoopReport::parse(&running.wait(Duration::from_secs(120)));
    println!(
        "{flips} publishes during {} exchanges: {:?}",
        report.ok(),
        report.banners
    );
    assert_eq!(report.failed(), 0, "{report:?}");
    let allowed: BTreeSet<&str> = fam.set_a.iter().chain(&fam.set_b).copied().collect();
    for banner in report.banners.keys() {
        assert!(
            allowed.contains(banner.as_str()),
            "reached {banner}, in neither set: {report:?}"
        );
    }
    assert!(
        report.ok() > 0 && flips > 10,
        "too little happened: {flips} flips, {report:?}"
    );
}

/// One host is published inside the service entry, two or more as a slot table: switching
/// between the layouts (both ways, and with Maglev) is as atomic as switching between tables.
#[rstest]
#[case::ipv4_tcp(V4, false, 0)]
#[case::ipv4_udp(V4, true, 0)]
#[case::ipv6_tcp(V6, false, 0)]
#[case::ipv4_tcp_maglev(V4, false, proxy_common::service::SERVICE_F_MAGLEV)]
fn switching_between_one_host_and_a_table_never_mixes_or_fails(
    #[case] fam: Family,
    #[case] udp: bool,
    #[case] flags: u32,
) {
    require_root();
    if skip_without_dataplane("switching_between_one_host_and_a_table_never_mixes_or_fails") {
        return;
    }
    let (netns, cgroup, mut dp, _servers) = setup(&fam, udp);
    let vip: SocketAddr = fam.vip.parse().unwrap();
    // set_a[1] is in neither set: reaching it would mean a stale or mixed host set.
    let (one, many) = (addrs(&fam.set_a[..1]), addrs(&fam.set_b));
    dp.publisher()
        .publish(&spec("switch", vip, udp, flags, &one))
        .expect("publishing one host");
    let count = if udp { 20_000 } else { 1_000_000 };
    let running = client(&cgroup, &netns, vip, udp, count, FLIP_FOR);
    let started = Instant::now();
    let mut flips = 0u32;
    while started.elapsed() < FLIP_FOR {
        let set = if flips.is_multiple_of(2) { &many } else { &one };
        dp.publisher()
            .publish(&spec("switch", vip, udp, flags, set))
            .expect("republishing");
        flips += 1;
        // Each layout holds for a while before the next switch. Without it the table layout
        // lasted only the short step to the next one-host publish, while the one-host layout
        // lasted through the whole table write; a slow client (76 connects in 3 s on a loaded
        // CI machine) then saw only the one-host layout.
        std::thread::sleep(LAYOUT_DWELL);
    }
    let report = LoopReport::parse(&running.wait(Duration::from_secs(120)));
    println!(
        "{flips} layout switches during {} exchanges: {:?}",
        report.ok(),
        report.banners
    );
    assert_eq!(report.failed(), 0, "{report:?}");
    let allowed: BTreeSet<&str> = fam.set_a[..1].iter().chain(&fam.set_b).copied().collect();
    for banner in report.banners.keys() {
        assert!(
            allowed.contains(banner.as_str()),
            "reached {banner}, in neither set: {report:?}"
        );
    }
    assert!(flips > 10, "too little happened: {flips} flips, {report:?}");
    // Both layouts served connects (the loop is long against the switch interval).
    assert!(
        report.banners.contains_key(fam.set_a[0]),
        "the one-host layout never served: {report:?}"
    );
    assert!(
        fam.set_b.iter().any(|b| report.banners.contains_key(*b)),
        "the table layout never served: {report:?}"
    );
}

#[rstest]
#[case::ipv4_tcp(V4, false)]
#[case::ipv4_udp(V4, true)]
#[case::ipv6_tcp(V6, false)]
#[case::ipv6_udp(V6, true)]
fn removing_all_hosts_then_adding_them_back_works(#[case] fam: Family, #[case] udp: bool) {
    require_root();
    if skip_without_dataplane("removing_all_hosts_then_adding_them_back_works") {
        return;
    }
    let (netns, cgroup, mut dp, _servers) = setup(&fam, udp);
    let vip: SocketAddr = fam.vip.parse().unwrap();
    let a = addrs(&fam.set_a);
    let run = |n| {
        LoopReport::parse(
            &client(&cgroup, &netns, vip, udp, n, Duration::from_secs(10))
                .wait(Duration::from_secs(60)),
        )
    };

    dp.publisher()
        .publish(&spec("svc", vip, udp, 0, &a))
        .expect("publishing");
    let before = run(20);
    assert_eq!(before.ok(), 20, "{before:?}");
    dp.publisher()
        .publish(&spec("svc", vip, udp, 0, &[]))
        .expect("removing every host");
    let none = run(5);
    // UDP datagrams are refused by sendmsg4/6, whose errno is the kernel's EPERM.
    let errno = if udp {
        "EPERM"
    } else {
        integration_tests::features::refused_errno()
    };
    assert_eq!(none.errors.get(errno), Some(&5), "{none:?}");
    dp.publisher()
        .publish(&spec("svc", vip, udp, 0, &a))
        .expect("adding them back");
    let after = run(20);
    assert_eq!(after.ok(), 20, "{after:?}");
    for banner in before.banners.keys().chain(after.banners.keys()) {
        assert!(fam.set_a.contains(&banner.as_str()), "reached {banner}");
    }
}

/// One exchange with each VIP from inside the cgroup: the banner that answered, or the errors.
fn banners_of(cgroup: &TestCgroup, netns: &Netns, vips: Vec<SocketAddr>) -> Vec<String> {
    let got = InCgroup::spawn(Some(cgroup.path()), netns, move || {
        let seen: Vec<String> = vips
            .iter()
            .map(|vip| {
                let r = tcp_loop(*vip, 1, Duration::from_secs(5));
                r.banners
                    .keys()
                    .next()
                    .cloned()
                    .unwrap_or_else(|| format!("{:?}", r.errors))
            })
            .collect();
        serde_json::to_string(&seen).unwrap()
    })
    .wait(Duration::from_secs(60));
    serde_json::from_str(&got).expect("JSON")
}

#[test]
fn a_dropped_data_path_keeps_both_layouts_and_the_next_adopts_them() {
    require_root();
    if skip_without_dataplane("a_dropped_data_path_keeps_both_layouts_and_the_next_adopts_them") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let opts = DataplaneOptions {
        cgroup: cgroup.path().to_owned(),
        bpffs: PathBuf::from("/sys/fs/bpf"),
        instance: unique("pta"),
        follow_sockets: true,
        kernel_log: proxy_core::config::KernelLogLevel::Off,
        kernel_maps: proxy_core::config::MapSizes::default(),
    };
    let _pins = PinDir(opts.bpffs.join(&opts.instance));
    let (single, table) = (V4.set_a[0], [V4.set_b[0], V4.set_b[1]]);
    let hosts: Vec<(SocketAddr, &str, bool)> = [single]
        .iter()
        .chain(&table)
        .map(|h| (h.parse().unwrap(), *h, false))
        .collect();
    let _servers = BannerServers::start(&netns, &hosts);
    let (vip1, vip2): (SocketAddr, SocketAddr) = (
        "127.77.6.1:80".parse().unwrap(),
        "127.77.6.2:80".parse().unwrap(),
    );
    let (one, many) = (addrs(&[single]), addrs(&table));

    let mut first = Dataplane::open(&opts).expect("opening the first data path");
    first
        .publisher()
        .publish(&spec("one", vip1, false, 0, &one))
        .expect("publishing one host");
    first
        .publisher()
        .publish(&spec("many", vip2, false, 0, &many))
        .expect("publishing a table");
    // Dropped without shutdown, as by `kill -9`: the pins keep programs and maps.
    drop(first);
    let seen = banners_of(&cgroup, &netns, vec![vip1, vip2]);
    assert_eq!(
        seen[0], single,
        "the one-host service after the drop: {seen:?}"
    );
    assert!(
        table.contains(&seen[1].as_str()),
        "the table service after the drop: {seen:?}"
    );

    // The instance lock (an flock on the pin directory) went with `first`, but a child another
    // test of this binary forked meanwhile inherits every descriptor, the lock's too, until it
    // exits (a real daemon does not fork): wait for that, bounded.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut second = loop {
        match Dataplane::open(&opts) {
            Err(proxy::dataplane::DataplaneError::InstanceBusy { .. })
                if std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            other => break other.expect("opening the second data path"),
        }
    };
    assert_eq!(second.publisher().adopted(), 2);
    // Swap the layouts of the adopted services, then sweep what the first run left.
    second
        .publisher()
        .publish(&spec("one", vip1, false, 0, &many))
        .expect("one -> table");
    second
        .publisher()
        .publish(&spec("many", vip2, false, 0, &one))
        .expect("table -> one");
    let tcp = proxy_common::service::PROTO_TCP;
    let keys: Vec<_> = [vip1, vip2]
        .iter()
        .map(|v| publish_key(v.ip(), v.port(), tcp))
        .collect();
    second.publisher().sweep(&keys).expect("sweeping");
    let seen = banners_of(&cgroup, &netns, vec![vip1, vip2, vip1, vip2]);
    // Swapped back, the generations of this run retire; a later sweep (which walks the maps only
    // while they may hold what this run has no record of) leaves exactly the live tables.
    second
        .publisher()
        .publish(&spec("one", vip1, false, 0, &one))
        .expect("one -> one host");
    second
        .publisher()
        .publish(&spec("many", vip2, false, 0, &many))
        .expect("many -> table");
    second.publisher().sweep(&keys).expect("sweeping again");
    let in_maps = map_entries(&opts.bpffs.join(&opts.instance));
    second.shutdown();
    assert_eq!(in_maps, (1, 2), "(slot tables, backends) after the churn");
    assert!(
        table.contains(&seen[0].as_str()),
        "the adopted service now a table: {seen:?}"
    );
    assert_eq!(
        seen[1], single,
        "the adopted table service now one host: {seen:?}"
    );
    assert!(
        table.contains(&seen[2].as_str()) && seen[3] == single,
        "{seen:?}"
    );
}

/// The entries of the pinned slot table and backend maps under `pins`.
fn map_entries(pins: &std::path::Path) -> (usize, usize) {
    use aya::maps::{HashMap, Map, MapData};
    use proxy_common::{
        abi::maps,
        service::{Backend, SlotTable, SlotTableKey},
    };
    let open = |name: &str| {
        Map::HashMap(MapData::from_pin(pins.join(name)).expect("opening a pinned map"))
    };
    let slots: HashMap<MapData, SlotTableKey, SlotTable> =
        HashMap::try_from(open(maps::SLOTS)).expect("the slot tables");
    let backends: HashMap<MapData, u32, Backend> =
        HashMap::try_from(open(maps::BACKENDS)).expect("the backends");
    (slots.keys().count(), backends.keys().count())
}

/// Service `i` of the scale test: its VIP and its one host.
fn scale_pair(i: u32) -> (SocketAddr, SocketAddr) {
    let (hi, lo) = ((i >> 8) as u8, (i & 0xff) as u8);
    (
        SocketAddr::from(([127, 100, hi, lo], 80)),
        SocketAddr::from(([127, 101, hi, lo], 9000)),
    )
}

#[test]
fn ten_thousand_services_publish_and_select_their_own_host() {
    require_root();
    if skip_without_dataplane("ten_thousand_services_publish_and_select_their_own_host") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let mut dp = InProcess::open(&cgroup);
    let specs: Vec<_> = (0..SERVICES)
        .map(|i| {
            let (vip, host) = scale_pair(i);
            spec(&format!("svc-{i}"), vip, false, 0, &[host])
        })
        .collect();
    let started = Instant::now();
    for s in &specs {
        dp.publisher().publish(s).expect("publishing");
    }
    let took = started.elapsed();
    println!(
        "published {SERVICES} services ({SERVICES} hosts) in {:.1} ms (target < 50 ms)",
        took.as_secs_f64() * 1e3
    );
    // Another 10,000 hosts, shaped as 100 services of 100 hosts each.
    let grouped: Vec<_> = (0..100u32)
        .map(|g| {
            let vip = SocketAddr::from(([127, 102, 0, g as u8], 80));
            let hosts: Vec<SocketAddr> = (0..100u32)
                .map(|h| {
                    let i = g * 100 + h;
                    SocketAddr::from(([127, 103, (i >> 8) as u8, (i & 0xff) as u8], 9000))
                })
                .collect();
            spec(&format!("group-{g}"), vip, false, 0, &hosts)
        })
        .collect();
    let started = Instant::now();
    for s in &grouped {
        dp.publisher().publish(s).expect("publishing");
    }
    println!(
        "published 100 services x 100 hosts in {:.1} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    let sample: Vec<u32> = (0..SAMPLE)
        .map(|k| k * (SERVICES / SAMPLE) + k % 7)
        .collect();
    let banners: Vec<String> = sample
        .iter()
        .map(|i| scale_pair(*i).1.to_string())
        .collect();
    let servers: Vec<(SocketAddr, &str, bool)> = sample
        .iter()
        .zip(&banners)
        .map(|(i, b)| (scale_pair(*i).1, b.as_str(), false))
        .collect();
    let _servers = BannerServers::start(&netns, &servers);
    let vips: Vec<SocketAddr> = sample.iter().map(|i| scale_pair(*i).0).collect();
    let got = InCgroup::spawn(Some(cgroup.path()), &netns, move || {
        let seen: Vec<String> = vips
            .iter()
            .map(|vip| {
                let r = tcp_loop(*vip, 1, Duration::from_secs(5));
                r.banners
                    .keys()
                    .next()
                    .cloned()
                    .unwrap_or_else(|| format!("{:?}", r.errors))
            })
            .collect();
        serde_json::to_string(&seen).unwrap()
    })
    .wait(Duration::from_secs(60));
    let seen: Vec<String> = serde_json::from_str(&got).expect("JSON");
    assert_eq!(
        seen, banners,
        "each sampled service must reach its own host"
    );
}
