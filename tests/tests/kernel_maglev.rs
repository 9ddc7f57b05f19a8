//! Consistent hashing on the kernel path (root): with `SERVICE_F_MAGLEV`, the slot is chosen by
//! the client's network-namespace cookie, so every connect from one namespace reaches the same
//! host, and removing one of N hosts moves (about) only the clients that were on it.

use std::{collections::BTreeMap, net::SocketAddr};

use integration_tests::kernel::{
    BannerServers, InProcess, Netns, Probe, TestCgroup, require_root, skip_without_dataplane, spec,
};
use proxy_common::service::SERVICE_F_MAGLEV;

const HOSTS: [&str; 5] = [
    "127.0.0.71:8080",
    "127.0.0.72:8080",
    "127.0.0.73:8080",
    "127.0.0.74:8080",
    "127.0.0.75:8080",
];
const CLIENT_NAMESPACES: usize = 12;

/// The one backend each namespace reaches; panics if a namespace reaches more than one.
fn placement(namespaces: &[Netns], cgroup: &TestCgroup, vip: SocketAddr) -> Vec<String> {
    namespaces
        .iter()
        .map(|ns| {
            let probe = Probe::run(ns, Some(cgroup.path()), vip, 10, false);
            assert!(probe.errors.is_empty(), "{probe:?}");
            assert_eq!(
                probe.backends.len(),
                1,
                "one namespace, one host: {probe:?}"
            );
            probe.backends.keys().next().unwrap().clone()
        })
        .collect()
}

#[test]
fn maglev_keeps_clients_and_moves_only_those_of_a_removed_host() {
    require_root();
    if skip_without_dataplane("maglev_keeps_clients_and_moves_only_those_of_a_removed_host") {
        return;
    }
    let cgroup = TestCgroup::new();
    let hosts: Vec<SocketAddr> = HOSTS.iter().map(|h| h.parse().unwrap()).collect();
    let namespaces: Vec<Netns> = (0..CLIENT_NAMESPACES).map(|_| Netns::new()).collect();
    let _servers: Vec<BannerServers> = namespaces
        .iter()
        .map(|ns| BannerServers::start(ns, &HOSTS.map(|h| (h.parse().unwrap(), h, false))))
        .collect();
    let vip: SocketAddr = "127.77.0.9:80".parse().unwrap();
    let mut dp = InProcess::open(&cgroup);
    dp.publisher()
        .publish(&spec("maglev", vip, false, SERVICE_F_MAGLEV, &hosts))
        .unwrap();
    let before = placement(&namespaces, &cgroup, vip);
    let spread: BTreeMap<&String, usize> = before.iter().fold(BTreeMap::new(), |mut m, h| {
        *m.entry(h).or_default() += 1;
        m
    });
    assert!(
        spread.len() > 1,
        "namespaces must spread over hosts: {spread:?}"
    );

    let removed = HOSTS[2];
    let fewer: Vec<SocketAddr> = hosts
        .iter()
        .copied()
        .filter(|h| h.to_string() != removed)
        .collect();
    dp.publisher()
        .publish(&spec("maglev", vip, false, SERVICE_F_MAGLEV, &fewer))
        .unwrap();
    let after = placement(&namespaces, &cgroup, vip);
    let mut collateral = 0;
    for (b, a) in before.iter().zip(&after) {
        assert_ne!(a, removed, "nobody may reach the removed host");
        if b != removed && a != b {
            collateral += 1;
        }
    }
    // Maglev is not perfectly minimal; with 1021 slots a few percent of slots move.
    assert!(
        collateral <= 2,
        "{collateral} clients of remaining hosts moved: {before:?} -> {after:?}"
    );
}
