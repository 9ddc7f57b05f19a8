//! The kernel path end to end (root): the real daemon binary attaches the real eBPF object to a
//! fresh cgroup; clients in a fresh network namespace connect to a VIP.
//!
//! Asserts the rewrite, the weight distribution over a fixed number of connects, that
//! getpeername shows the VIP, that processes outside the cgroup and destinations that are not
//! services are untouched, that a service without hosts refuses connects, and that a bad config
//! changes nothing. With the data path opened in-process: which record getpeername reads.
#![allow(
    unsafe_code,
    reason = "raw socket calls the standard library has no binding for"
)]

use std::{
    net::SocketAddr,
    os::fd::{AsRawFd as _, FromRawFd as _},
    path::Path,
    process::Command,
    time::Duration,
};

use integration_tests::{
    features::{Feature, missing, refused_errno},
    kernel::{
        BannerServers, Daemon, InCgroup, InProcess, Netns, Probe, TestCgroup, assert_share,
        proxy_bin, require_root, skip_without_dataplane, spec, unique,
    },
};
use proxy::dataplane::{DataplaneError, publish_key};
use proxy_common::{
    abi::{maps, pins},
    service::{PROTO_TCP, SERVICE_F_PASSIVE, SERVICE_F_PROXY},
};
use rstest::rstest;

/// Connects per distribution test: enough that a 4.5-sigma bound is a few percent.
const CONNECTS: u32 = 2000;

struct Family {
    vip: &'static str,
    hosts: [&'static str; 3],
    not_a_service: &'static str,
}

const V4: Family = Family {
    vip: "127.77.0.1:80",
    hosts: ["127.0.0.11:8081", "127.0.0.12:8082", "127.0.0.13:8083"],
    not_a_service: "127.0.0.50:9000",
};

// IPv6 VIPs other than loopback exist only inside the test's own namespace.
const V6: Family = Family {
    vip: "[fd77::1]:80",
    hosts: ["[::1]:8081", "[::1]:8082", "[::1]:8083"],
    not_a_service: "[::1]:9000",
};

#[expect(
    clippy::format_collect,
    reason = "builds a small YAML fixture; clarity over one allocation"
)]
fn config(instance: &str, cgroup: &Path, vip: SocketAddr, hosts: &[(&str, u32)]) -> String {
    let endpoints: String = hosts
        .iter()
        .map(|(addr, w)| {
            let a: SocketAddr = addr.parse().expect("host address");
            format!(
                "            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\n              load_balancing_weight: {w}\n",
                a.ip(),
                a.port()
            )
        })
        .collect();
    format!(
        "instance: {instance}\ncgroup: {cgroup}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - name: web\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{endpoints}services:\n  - name: web\n    address: \"{ip}\"\n    port: {port}\n    cluster: web\n",
        cgroup = cgroup.display(),
        ip = vip.ip(),
        port = vip.port(),
    )
}

#[rstest]
#[case::ipv4(V4)]
#[case::ipv6(V6)]
fn connect_rewrites_by_weight_and_getpeername_shows_the_vip(#[case] fam: Family) {
    require_root();
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = fam.vip.parse().unwrap();
    let weights = [5, 3, 2];
    let mut servers: Vec<(SocketAddr, &str, bool)> = fam
        .hosts
        .iter()
        .map(|h| (h.parse().unwrap(), *h, false))
        .collect();
    // Something on the VIP itself and on a plain address, so an untouched connect succeeds and
    // says where it went.
    if vip.is_ipv6() {
        netns.add_lo_addr("fd77::1/128");
    }
    servers.push((vip, "vip-itself", false));
    servers.push((fam.not_a_service.parse().unwrap(), "not-a-service", false));
    let _servers = BannerServers::start(&netns, &servers);
    let hosts: Vec<(&str, u32)> = fam.hosts.iter().copied().zip(weights).collect();
    let daemon = Daemon::start(&config(&unique("t"), cgroup.path(), vip, &hosts));

    let inside = Probe::run(&netns, Some(cgroup.path()), vip, CONNECTS, false);
    assert!(
        inside.errors.is_empty(),
        "connect errors: {:?}",
        inside.errors
    );
    assert_eq!(
        inside.count("vip-itself"),
        0,
        "a connect in the cgroup was not rewritten"
    );
    for (host, weight) in &hosts {
        assert_share(
            host,
            inside.count(host),
            CONNECTS,
            f64::from(*weight) / 10.0,
        );
    }
    assert_eq!(
        inside.peers,
        [vip.to_string()],
        "getpeername must show the VIP"
    );
    assert_eq!(daemon.counter("connect_rewritten"), u64::from(CONNECTS));
    // Envoy's per-cluster names count the kernel path's connections too.
    assert_eq!(
        daemon.stat("cluster.web.upstream_cx_total"),
        u64::from(CONNECTS)
    );
    assert_eq!(daemon.stat("cluster.web.lb_healthy_panic"), 0);
    assert_eq!(daemon.stat("cluster.web.upstream_cx_none_healthy"), 0);

    let outside = Probe::run(&netns, None, vip, 20, false);
    assert_eq!(
        outside.count("vip-itself"),
        20,
        "outside the cgroup: {outside:?}"
    );

    let plain = Probe::run(
        &netns,
        Some(cgroup.path()),
        fam.not_a_service.parse().unwrap(),
        20,
        false,
    );
    assert_eq!(
        plain.count("not-a-service"),
        20,
        "a non-service destination: {plain:?}"
    );
    assert!(daemon.counter("connect_not_service") >= 20);
}

#[test]
fn service_without_hosts_refuses_connects() {
    require_root();
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = V4.vip.parse().unwrap();
    let _servers = BannerServers::start(&netns, &[(vip, "vip-itself", false)]);
    let daemon = Daemon::start(&config(&unique("t"), cgroup.path(), vip, &[]));
    let probe = Probe::run(&netns, Some(cgroup.path()), vip, 10, false);
    // A program chooses the errno where the kernel lets it (bpf_set_retval, 5.18): the one a
    // connect to a closed port gives. Before, the kernel's EPERM for a rejected connect.
    assert_eq!(probe.errors.get(refused_errno()), Some(&10), "{probe:?}");
    assert_eq!(daemon.counter("connect_no_host"), 10);
    // The same, counted for the service itself.
    assert_eq!(daemon.stat("service.web.cx_no_host"), 10);
    assert_eq!(daemon.stat("service.web.cx_to_host"), 0);
    // And under Envoy's name for the cluster.
    assert_eq!(daemon.stat("cluster.web.upstream_cx_none_healthy"), 10);
}

#[test]
fn udp_connect_is_rewritten_for_udp_services() {
    require_root();
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = "127.77.0.53:53".parse().unwrap();
    let host = "127.0.0.31:5353";
    let _servers = BannerServers::start(&netns, &[(host.parse().unwrap(), host, true)]);
    let cfg = config(&unique("t"), cgroup.path(), vip, &[(host, 1)]).replace(
        "    cluster: web\n",
        "    cluster: web\n    protocol: UDP\n",
    );
    let _daemon = Daemon::start(&cfg);
    let probe = Probe::run(&netns, Some(cgroup.path()), vip, 20, true);
    assert_eq!(probe.count(host), 20, "{probe:?}");
    assert_eq!(probe.peers, [vip.to_string()]);
}

#[test]
fn stop_removes_pins_and_the_created_cgroup() {
    require_root();
    let parent = TestCgroup::new();
    let cgroup = parent.path().join("child-created-by-daemon");
    let instance = unique("t");
    let vip: SocketAddr = V4.vip.parse().unwrap();
    let mut daemon = Daemon::start(&config(&instance, &cgroup, vip, &[(V4.hosts[0], 1)]));
    let pin_dir = Path::new("/sys/fs/bpf").join(&instance);
    assert!(pin_dir.join(maps::SERVICES).exists() && pin_dir.join(pins::LINK_CONNECT4).exists());
    // Plain kernel-path services only: nothing for sockops to follow.
    assert!(
        !pin_dir.join(pins::LINK_SOCKOPS).exists(),
        "sockops attached without a need"
    );
    assert!(cgroup.exists(), "the daemon creates a missing cgroup");
    assert!(
        daemon.stop(),
        "clean exit on SIGTERM:\n{}",
        daemon.log_text()
    );
    assert!(!pin_dir.exists(), "pins left behind");
    assert!(
        !cgroup.exists(),
        "the cgroup the daemon created is left behind"
    );
}

#[test]
fn bad_config_exits_64_and_attaches_nothing() {
    require_root();
    let dir = integration_tests::kernel::TempDir::new();
    let instance = unique("t");
    let path = dir.0.join("bad.yaml");
    std::fs::write(
        &path,
        format!(
            "instance: {instance}\nclusters:\n  - name: web\n    lb_policy: CLUSTER_PROVIDED\n"
        ),
    )
    .unwrap();
    for sub in ["check", "run"] {
        let out = Command::new(proxy_bin())
            .args([sub, "--config"])
            .arg(&path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{sub}: {stderr}");
        let want = format!("{}:4:5: clusters[0].lb_policy:", path.display());
        assert!(stderr.contains(&want), "{sub}: {stderr}");
    }
    assert!(
        !Path::new("/sys/fs/bpf").join(&instance).exists(),
        "nothing may be pinned"
    );
}

/// A connected socket's cookie (`SO_COOKIE`).
fn socket_cookie(fd: std::os::fd::RawFd) -> u64 {
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: a valid socket fd, and an out-buffer of `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            (&raw mut cookie).cast(),
            &raw mut len,
        )
    };
    assert_eq!(rc, 0, "SO_COOKIE: {}", std::io::Error::last_os_error());
    cookie
}

/// A kernel-path socket's service is in the `maps::SOCK_PEER` slot of its cookie, and getpeername
/// takes it only while the slot is the socket's own and whole: a slot that a socket
/// `PEER_SLOTS` cookies newer took over, or a torn one (its check does not match), shows the
/// backend (fail-open), never another socket's service.
#[test]
fn getpeername_takes_only_the_sockets_own_slot() {
    use aya::maps::{Array, Map, MapData};
    use proxy_common::socket::{PEER_SLOTS, PeerSlot};
    require_root();
    if skip_without_dataplane("getpeername_takes_only_the_sockets_own_slot") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = "127.77.4.1:80".parse().unwrap();
    let other: SocketAddr = "127.77.4.2:81".parse().unwrap();
    let host: SocketAddr = V4.hosts[0].parse().unwrap();
    let _servers = BannerServers::start_holding(&netns, &[(host, "h", false)]);
    let mut dp = InProcess::open(&cgroup);
    dp.publisher()
        .publish(&spec("one", vip, false, 0, &[host]))
        .expect("publishing");
    let slots = dp.pin_dir().join(maps::SOCK_PEER);
    let child = InCgroup::spawn(Some(cgroup.path()), &netns, move || {
        let stream = std::net::TcpStream::connect(vip).expect("connecting to the VIP");
        let cookie = socket_cookie(stream.as_raw_fd());
        let map = MapData::from_pin(&slots)
            .and_then(Map::from_map_data)
            .expect("the pinned slots");
        let mut map = Array::<MapData, PeerSlot>::try_from(map).expect("an array of slots");
        let index = (cookie & u64::from(PEER_SLOTS - 1)) as u32;
        let key = publish_key(other.ip(), other.port(), PROTO_TCP);
        let mut seen = vec![stream.peer_addr().expect("getpeername").to_string()];
        // A socket PEER_SLOTS cookies newer took the slot over.
        let newer = PeerSlot::new(cookie + u64::from(PEER_SLOTS), key);
        map.set(index, newer, 0).expect("writing the slot");
        seen.push(stream.peer_addr().expect("getpeername").to_string());
        // The socket's cookie next to the newer socket's check: torn.
        map.set(index, PeerSlot { cookie, ..newer }, 0)
            .expect("writing the slot");
        seen.push(stream.peer_addr().expect("getpeername").to_string());
        // The socket's own slot, with another service in it: that is what getpeername shows.
        map.set(index, PeerSlot::new(cookie, key), 0)
            .expect("writing the slot");
        seen.push(stream.peer_addr().expect("getpeername").to_string());
        seen.join(" ")
    });
    assert_eq!(
        child.wait(Duration::from_secs(10)),
        format!("{vip} {host} {host} {other}")
    );
}

/// A TCP socket may connect again after a failed connect. One that first dialled a followed
/// service (passive health: its VIP is in the socket's storage) and then a plain kernel-path
/// service shows the second VIP: connect4 clears the stale storage entry.
#[test]
fn a_socket_that_connects_again_shows_the_service_it_reached() {
    require_root();
    if skip_without_dataplane("a_socket_that_connects_again_shows_the_service_it_reached") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let followed: SocketAddr = "127.77.4.3:80".parse().unwrap();
    let plain: SocketAddr = "127.77.4.4:80".parse().unwrap();
    let closed: SocketAddr = "127.0.0.61:9".parse().unwrap();
    let host: SocketAddr = V4.hosts[1].parse().unwrap();
    let _servers = BannerServers::start_holding(&netns, &[(host, "h", false)]);
    let mut dp = InProcess::open(&cgroup);
    dp.publisher()
        .publish(&spec(
            "followed",
            followed,
            false,
            SERVICE_F_PASSIVE,
            &[closed],
        ))
        .expect("publishing");
    dp.publisher()
        .publish(&spec("plain", plain, false, 0, &[host]))
        .expect("publishing");
    let child = InCgroup::spawn(Some(cgroup.path()), &netns, move || {
        // SAFETY: plain socket calls on a descriptor this closure owns and closes.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
            assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
            let first = connect_v4(fd, followed).map_err(|e| e.raw_os_error());
            connect_v4(fd, plain).expect("the second connect");
            let stream = std::net::TcpStream::from_raw_fd(fd);
            format!("{first:?} {}", stream.peer_addr().expect("getpeername"))
        }
    });
    let want = format!("Err(Some({})) {plain}", libc::ECONNREFUSED);
    assert_eq!(child.wait(Duration::from_secs(10)), want);
    assert_eq!(dp.counter("passive_connect_failed"), 1);
}

/// connect(2) of an IPv4 stream socket.
fn connect_v4(fd: std::os::fd::RawFd, to: SocketAddr) -> std::io::Result<()> {
    let SocketAddr::V4(to) = to else {
        panic!("an IPv4 address")
    };
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: to.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(to.ip().octets()),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: `sa` is a valid sockaddr_in of the length given.
    let rc = unsafe {
        libc::connect(
            fd,
            (&raw const sa).cast(),
            size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A data path opened without sockops (no service it follows, no splicing) serves the kernel
/// path, getpeername included, and refuses what sockops is needed for, changing nothing.
#[test]
fn without_sockops_the_kernel_path_works_and_followed_services_are_refused() {
    require_root();
    if skip_without_dataplane(
        "without_sockops_the_kernel_path_works_and_followed_services_are_refused",
    ) {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = "127.77.4.5:80".parse().unwrap();
    let followed: SocketAddr = "127.77.4.6:80".parse().unwrap();
    let host: SocketAddr = V4.hosts[2].parse().unwrap();
    let _servers = BannerServers::start(
        &netns,
        &[(host, "host", false), (followed, "followed-itself", false)],
    );
    let mut dp = InProcess::open_with(&cgroup, false);
    assert!(!dp.follows_sockets());
    assert!(
        !dp.pin_dir().join(pins::LINK_SOCKOPS).exists(),
        "sockops is attached"
    );
    assert!(dp.pin_dir().join(pins::LINK_CONNECT4).exists());
    dp.publisher()
        .publish(&spec("plain", vip, false, 0, &[host]))
        .expect("publishing");
    for flags in [SERVICE_F_PASSIVE, SERVICE_F_PROXY] {
        let refused = dp
            .publisher()
            .publish(&spec("followed", followed, false, flags, &[host]));
        assert!(
            matches!(refused, Err(DataplaneError::NoSockops { .. })),
            "{refused:?}"
        );
    }
    let refused = dp.set_splice(true);
    assert!(
        matches!(refused, Err(DataplaneError::NoSockops { .. })),
        "{refused:?}"
    );
    dp.set_splice(false).expect("splicing off needs nothing");

    let probe = Probe::run(&netns, Some(cgroup.path()), vip, 20, false);
    assert_eq!(
        (probe.count("host"), &probe.peers),
        (20, &vec![vip.to_string()]),
        "{probe:?}"
    );
    // The refused service was not published: its address is not rewritten.
    let probe = Probe::run(&netns, Some(cgroup.path()), followed, 5, false);
    assert_eq!(probe.count("followed-itself"), 5, "{probe:?}");
}

/// ROUND_ROBIN on the kernel path is an exact rotation, whichever CPU a connect runs on: two
/// clients connect at the same time, and the hosts' counts are exactly their weights' shares.
/// On a kernel without atomic fetch-and-add (before 5.12) the daemon refuses the service at
/// start, says why, and leaves nothing behind.
#[test]
fn round_robin_rotates_exactly_across_cpus() {
    require_root();
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = "127.77.4.9:80".parse().unwrap();
    let hosts = [(V4.hosts[0], 2), (V4.hosts[1], 1), (V4.hosts[2], 1)];
    let instance = unique("t");
    let cfg = config(&instance, cgroup.path(), vip, &hosts).replace(
        "  - name: web\n    load_assignment:",
        "  - name: web\n    lb_policy: ROUND_ROBIN\n    load_assignment:",
    );
    if let Some(why) = missing(&[Feature::AtomicFetch]) {
        let dir = integration_tests::kernel::TempDir::new();
        let path = dir.0.join("rr.yaml");
        let admin = integration_tests::kernel::free_port().to_string();
        std::fs::write(&path, cfg.replace("{admin}", &admin)).unwrap();
        let out = Command::new(proxy_bin())
            .args(["run", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        assert!(
            stderr.contains("ROUND_ROBIN needs BPF atomic fetch-and-add"),
            "{why}: {stderr}"
        );
        assert!(
            !Path::new("/sys/fs/bpf").join(&instance).exists(),
            "a refused start leaves no pins"
        );
        return;
    }
    let servers: Vec<(SocketAddr, &str, bool)> = hosts
        .iter()
        .map(|(h, _)| (h.parse().unwrap(), *h, false))
        .collect();
    let _servers = BannerServers::start(&netns, &servers);
    let _daemon = Daemon::start(&cfg);
    // Two clients at once, 600 connects each: 1,200 turns of a 4-slot rotation.
    let probes: Vec<Probe> = std::thread::scope(|scope| {
        let runs: Vec<_> = (0..2)
            .map(|_| scope.spawn(|| Probe::run(&netns, Some(cgroup.path()), vip, 600, false)))
            .collect();
        runs.into_iter().map(|r| r.join().expect("probe")).collect()
    });
    for (host, weight) in hosts {
        let got: u32 = probes.iter().map(|p| p.count(host)).sum();
        assert_eq!(got, 300 * weight, "{host}: {probes:?}");
    }
}

/// With too few healthy hosts the cluster is in panic mode (Envoy's 50 % threshold): every host
/// routes, and each connect counts in Envoy's `lb_healthy_panic` for the cluster (and the
/// service's `cx_panic`), as the kernel chose it from a table published in panic mode.
#[test]
fn panic_mode_connects_count_as_lb_healthy_panic() {
    require_root();
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = "127.77.4.10:80".parse().unwrap();
    // One of three hosts answers: 33 % healthy, below the 50 % panic threshold.
    let up = V4.hosts[0];
    let _servers = BannerServers::start(&netns, &[(up.parse().unwrap(), up, false)]);
    let hosts = [(V4.hosts[0], 1), (V4.hosts[1], 1), (V4.hosts[2], 1)];
    let cfg = config(&unique("t"), cgroup.path(), vip, &hosts).replace(
        "  - name: web\n    load_assignment:",
        "  - name: web\n    health_checks:\n      - { timeout: 0.5s, interval: 1s, unhealthy_threshold: 1, healthy_threshold: 1, tcp_health_check: {} }\n    load_assignment:",
    );
    let daemon = Daemon::start_in(&netns, &cfg);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while daemon.stat("cluster.web.membership_healthy") != 1
        || daemon.stat("cluster.web.membership_excluded") != 0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the first checks did not finish"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let probe = Probe::run(&netns, Some(cgroup.path()), vip, 30, false);
    // Panic mode sends connects to the failed hosts as well.
    assert!(probe.count(up) > 0, "{probe:?}");
    assert!(probe.errors.values().sum::<u32>() > 0, "{probe:?}");
    assert_eq!(daemon.stat("cluster.web.lb_healthy_panic"), 30);
    assert_eq!(daemon.stat("service.web.cx_panic"), 30);
    assert_eq!(daemon.stat("cluster.web.upstream_cx_total"), 30);
}

/// LEAST_REQUEST in the kernel: sockops counts every connection of the service in its backend's
/// entry of `ACTIVE_V1` from its connect until it closes, and connect4 takes the backend with
/// fewer of two random draws. A host loaded with a million connections gets only the connects
/// whose two draws both fell on it (a quarter); ten held connections count ten and are taken
/// back when they close.
#[test]
fn least_request_prefers_the_backend_with_fewer_open_connections() {
    use aya::maps::{HashMap as BpfHashMap, Map, MapData};
    use proxy_common::service::{Backend, FAMILY_V4, SERVICE_F_LEAST_REQUEST};
    require_root();
    if skip_without_dataplane("least_request_prefers_the_backend_with_fewer_open_connections") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = "127.77.4.11:80".parse().unwrap();
    let (a, b): (SocketAddr, SocketAddr) =
        (V4.hosts[0].parse().unwrap(), V4.hosts[1].parse().unwrap());
    let _servers = BannerServers::start_holding(&netns, &[(a, "a", false), (b, "b", false)]);
    let mut dp = InProcess::open(&cgroup);
    dp.publisher()
        .publish(&spec("least", vip, false, SERVICE_F_LEAST_REQUEST, &[a, b]))
        .expect("publishing");
    let active = || {
        let map = MapData::from_pin(dp.pin_dir().join(maps::ACTIVE)).expect("ACTIVE_V1 pinned");
        BpfHashMap::<MapData, Backend, u64>::try_from(Map::HashMap(map)).expect("a hash map")
    };
    let backend = |addr: SocketAddr| {
        let std::net::IpAddr::V4(ip) = addr.ip() else {
            unreachable!("IPv4 hosts")
        };
        Backend {
            addr: [u32::from_ne_bytes(ip.octets()), 0, 0, 0],
            port: addr.port().to_be(),
            family: FAMILY_V4,
            _pad: 0,
        }
    };
    let load = 1_000_000;
    active()
        .insert(backend(a), load, 0)
        .expect("loading host a");

    let probe = Probe::run(&netns, Some(cgroup.path()), vip, 400, false);
    // Expect 100 on a (both draws on a: 1/4); 4.5 sigma of binomial(400, 1/4) is about 39.
    assert!((61..=139).contains(&probe.count("a")), "{probe:?}");
    assert_eq!(probe.count("a") + probe.count("b"), 400, "{probe:?}");
    // Every probe connection has closed: the counts are back where they were.
    let settled = |want_b: u64| {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let m = active();
            let got = (
                m.get(&backend(a), 0).unwrap_or(0),
                m.get(&backend(b), 0).unwrap_or(0),
            );
            if got == (load, want_b) || std::time::Instant::now() > deadline {
                return got;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    assert_eq!(settled(0), (load, 0), "connections not taken back");

    // Ten connections held open: ten counted (on b, the unloaded host), then taken back.
    let dir = integration_tests::kernel::TempDir::new();
    let (ready, release) = (dir.0.join("ready"), dir.0.join("release"));
    let child = {
        let (ready, release) = (ready.clone(), release.clone());
        InCgroup::spawn(Some(cgroup.path()), &netns, move || {
            let held: Vec<_> = (0..10)
                .map(|_| std::net::TcpStream::connect(vip).expect("connect"))
                .collect();
            std::fs::write(&ready, b"").expect("ready");
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while !release.exists() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            drop(held);
            String::new()
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !ready.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the client did not connect"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let m = active();
    let held = m.get(&backend(a), 0).unwrap_or(0) - load + m.get(&backend(b), 0).unwrap_or(0);
    assert_eq!(held, 10, "ten open connections");
    std::fs::write(&release, b"").unwrap();
    child.wait(Duration::from_secs(30));
    assert_eq!(settled(0), (load, 0), "held connections not taken back");
}
