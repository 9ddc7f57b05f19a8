//! Unconnected UDP on the kernel path (root): `sendto(VIP)` from a process in the cgroup goes to
//! a chosen host per datagram (sendmsg4/6), and `recvfrom` reports the VIP as the source of the
//! reply (recvmsg4/6). The same `sendto` from outside the cgroup is untouched.

use std::{net::SocketAddr, time::Duration};

use integration_tests::kernel::{
    BannerServers, InCgroup, InProcess, LoopReport, Netns, TestCgroup, require_root,
    skip_without_dataplane, spec, udp_sendto_loop,
};
use rstest::rstest;

/// Datagrams per run: enough that both hosts are reached with overwhelming probability.
const DATAGRAMS: u32 = 200;

struct Family {
    vip: &'static str,
    /// Address added to `lo` inside the namespace so the VIP itself can answer (IPv6 only).
    vip_cidr: Option<&'static str>,
    hosts: [&'static str; 2],
}

const V4: Family = Family {
    vip: "127.77.0.53:53",
    vip_cidr: None,
    hosts: ["127.0.0.21:5301", "127.0.0.22:5302"],
};

const V6: Family = Family {
    vip: "[fd77::53]:53",
    vip_cidr: Some("fd77::53/128"),
    hosts: ["[::1]:5301", "[::1]:5302"],
};

#[rstest]
#[case::ipv4(V4)]
#[case::ipv6(V6)]
fn unconnected_udp_is_translated_per_datagram_and_replies_come_from_the_vip(#[case] fam: Family) {
    require_root();
    if skip_without_dataplane(
        "unconnected_udp_is_translated_per_datagram_and_replies_come_from_the_vip",
    ) {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    if let Some(cidr) = fam.vip_cidr {
        netns.add_lo_addr(cidr);
    }
    let vip: SocketAddr = fam.vip.parse().unwrap();
    let hosts: Vec<SocketAddr> = fam.hosts.iter().map(|h| h.parse().unwrap()).collect();
    let mut servers: Vec<(SocketAddr, &str, bool)> = hosts
        .iter()
        .zip(fam.hosts)
        .map(|(a, b)| (*a, b, true))
        .collect();
    servers.push((vip, "vip-itself", true));
    let _servers = BannerServers::start(&netns, &servers);
    let mut dp = InProcess::open(&cgroup);
    dp.publisher()
        .publish(&spec("dns", vip, true, 0, &hosts))
        .expect("publishing");

    let inside = LoopReport::parse(
        &InCgroup::spawn(Some(cgroup.path()), &netns, move || {
            serde_json::to_string(&udp_sendto_loop(vip, DATAGRAMS)).unwrap()
        })
        .wait(Duration::from_secs(60)),
    );
    assert_eq!(inside.failed(), 0, "{inside:?}");
    for host in fam.hosts {
        assert!(
            inside.banners.get(host).is_some_and(|n| *n > 0),
            "{host} never answered: {inside:?}"
        );
    }
    assert_eq!(inside.ok(), DATAGRAMS, "{inside:?}");
    assert_eq!(
        inside.peers.iter().collect::<Vec<_>>(),
        [&vip.to_string()],
        "recvfrom showed a backend"
    );
    assert!(dp.counter("sendmsg_rewritten") >= u64::from(DATAGRAMS));
    assert!(dp.counter("recvmsg_rewritten") >= u64::from(DATAGRAMS));

    // The same sendto from a process outside the cgroup reaches the VIP itself.
    let outside = LoopReport::parse(
        &InCgroup::spawn(None, &netns, move || {
            serde_json::to_string(&udp_sendto_loop(vip, 20)).unwrap()
        })
        .wait(Duration::from_secs(30)),
    );
    assert_eq!(outside.banners.get("vip-itself"), Some(&20), "{outside:?}");
}
