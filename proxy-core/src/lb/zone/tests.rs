//! Zone-aware routing's rules, each against the shares Envoy's rules give.

use std::net::SocketAddr;

use super::{DEFAULT_MIN_CLUSTER_SIZE, ZoneSettings, ZoneState, zone_shares};
use crate::{
    health::{HostClass, Routing},
    host::{Host, Locality},
    lb::kernel_levels,
};

fn zone(name: &str) -> Locality {
    Locality {
        zone: name.into(),
        ..Locality::default()
    }
}

/// `n` hosts in `zone` from `127.0.<net>.<first>` on, of class `class`.
fn hosts(net: u8, first: u8, n: u8, name: &str, class: HostClass) -> Vec<(Host, HostClass)> {
    (first..first + n)
        .map(|i| {
            let host =
                Host::new(SocketAddr::from(([127, 0, net, i], 80))).with_locality(zone(name));
            (host, class)
        })
        .collect()
}

fn routing(groups: &[Vec<(Host, HostClass)>]) -> Routing {
    Routing::compute(&groups.concat(), 50.0)
}

fn settings(node: &str) -> ZoneSettings {
    ZoneSettings {
        node: zone(node),
        routing_enabled: 100.0,
        min_cluster_size: DEFAULT_MIN_CLUSTER_SIZE,
        fail_traffic_on_panic: false,
    }
}

/// Level 0's weight per zone, in millionths of the traffic.
fn per_zone(mut upstream: Routing, local: &Routing, s: &ZoneSettings) -> Vec<(String, u32)> {
    upstream.zone = Some(zone_shares(&upstream, local, s));
    let level = kernel_levels(&upstream)
        .into_iter()
        .next()
        .unwrap_or_default();
    let mut out: Vec<(String, u32)> = Vec::new();
    for (addr, w) in level {
        let SocketAddr::V4(v4) = addr else { continue };
        let name = if v4.ip().octets()[3] < 100 { "a" } else { "b" };
        match out.iter_mut().find(|(n, _)| n == name) {
            Some((_, total)) => *total += w,
            None => out.push((name.to_owned(), w)),
        }
    }
    out.sort();
    out
}

#[test]
fn a_locality_with_its_share_of_hosts_or_more_takes_everything() {
    let upstream = routing(&[
        hosts(0, 1, 4, "a", HostClass::Healthy),
        hosts(0, 101, 4, "b", HostClass::Healthy),
    ]);
    let local = routing(&[
        hosts(1, 1, 2, "a", HostClass::Healthy),
        hosts(1, 101, 2, "b", HostClass::Healthy),
    ]);
    let shares = zone_shares(&upstream, &local, &settings("a"));
    assert_eq!(shares.state, ZoneState::Direct);
    assert_eq!(
        per_zone(upstream, &local, &settings("a")),
        [("a".into(), 1_000_000)]
    );
}

#[test]
fn a_smaller_local_share_keeps_its_ratio_and_spills_by_residual_capacity() {
    // Upstream: a 2 of 8 (25 %), b 6 of 8 (75 %). Local: a 1 of 2 (50 %), b 50 %.
    // Stays in a: 2500 / 5000 = 50 %; b's residual 7500 - 5000 takes the rest.
    let upstream = routing(&[
        hosts(0, 1, 2, "a", HostClass::Healthy),
        hosts(0, 101, 6, "b", HostClass::Healthy),
    ]);
    let local = routing(&[
        hosts(1, 1, 1, "a", HostClass::Healthy),
        hosts(1, 101, 1, "b", HostClass::Healthy),
    ]);
    let shares = zone_shares(&upstream, &local, &settings("a"));
    assert_eq!(shares.state, ZoneState::Residual);
    let got = per_zone(upstream, &local, &settings("a"));
    near(&got, &[("a", 500_000), ("b", 500_000)]);
}

/// Each zone's weight is `want`'s within the rounding of its hosts' weights (half a millionth
/// each, eight hosts at most here).
fn near(got: &[(String, u32)], want: &[(&str, u32)]) {
    let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
    let wanted: Vec<&str> = want.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, wanted, "{got:?}");
    for ((_, g), (_, w)) in got.iter().zip(want) {
        assert!(g.abs_diff(*w) <= 4, "{got:?} against {want:?}");
    }
}

#[test]
fn envoy_leaves_zone_routing_off_for_small_or_unknown_clusters() {
    let five = routing(&[
        hosts(0, 1, 2, "a", HostClass::Healthy),
        hosts(0, 101, 3, "b", HostClass::Healthy),
    ]);
    let local = routing(&[
        hosts(1, 1, 1, "a", HostClass::Healthy),
        hosts(1, 101, 3, "b", HostClass::Healthy),
    ]);
    let too_small = zone_shares(&five, &local, &settings("a"));
    assert_eq!(too_small.state, ZoneState::TooSmall);
    // Host by host: 2 of 5 in a.
    assert_eq!(
        per_zone(five.clone(), &local, &settings("a")),
        [("a".into(), 400_000), ("b".into(), 600_000)]
    );
    let mut bigger = settings("a");
    bigger.min_cluster_size = 5;
    // a has 40 % of the upstream's healthy hosts and 25 % of the local cluster's: direct.
    assert_eq!(zone_shares(&five, &local, &bigger).state, ZoneState::Direct);
    // This node's zone is not among the local cluster's.
    let elsewhere = zone_shares(&five, &local, &settings("c"));
    assert_eq!(elsewhere.state, ZoneState::LocalClusterNotOk);
    // One upstream locality only.
    let one = routing(&[hosts(0, 1, 8, "a", HostClass::Healthy)]);
    let single = zone_shares(&one, &local, &settings("a"));
    assert_eq!(single.state, ZoneState::NoLocalities);
}

#[test]
fn a_local_cluster_in_panic_turns_zone_routing_off() {
    let upstream = routing(&[
        hosts(0, 1, 2, "a", HostClass::Healthy),
        hosts(0, 101, 6, "b", HostClass::Healthy),
    ]);
    let local = routing(&[
        hosts(1, 1, 1, "a", HostClass::Healthy),
        hosts(1, 2, 3, "a", HostClass::Unhealthy),
        hosts(1, 101, 4, "b", HostClass::Unhealthy),
    ]);
    assert!(local.priorities[0].panic);
    let shares = zone_shares(&upstream, &local, &settings("a"));
    assert_eq!(shares.state, ZoneState::LocalClusterNotOk);
}

#[test]
fn routing_enabled_mixes_zone_shares_with_host_by_host() {
    let upstream = routing(&[
        hosts(0, 1, 4, "a", HostClass::Healthy),
        hosts(0, 101, 4, "b", HostClass::Healthy),
    ]);
    let local = routing(&[
        hosts(1, 1, 2, "a", HostClass::Healthy),
        hosts(1, 101, 2, "b", HostClass::Healthy),
    ]);
    let mut half = settings("a");
    half.routing_enabled = 50.0;
    // Half direct to a, half host by host (a half of that).
    let got = per_zone(upstream, &local, &half);
    assert_eq!(got, [("a".into(), 750_000), ("b".into(), 250_000)]);
}

#[test]
fn fail_traffic_on_panic_leaves_a_priority_in_panic_without_hosts() {
    let upstream = routing(&[
        hosts(0, 1, 1, "a", HostClass::Healthy),
        hosts(0, 2, 4, "a", HostClass::Unhealthy),
        hosts(0, 101, 5, "b", HostClass::Unhealthy),
    ]);
    assert!(upstream.priorities[0].panic);
    let local = routing(&[
        hosts(1, 1, 1, "a", HostClass::Healthy),
        hosts(1, 101, 1, "b", HostClass::Healthy),
    ]);
    let mut failing = settings("a");
    failing.fail_traffic_on_panic = true;
    assert!(per_zone(upstream.clone(), &local, &failing).is_empty());
    // Without it, panic routes to every host as always.
    let all = per_zone(upstream, &local, &settings("a"));
    assert_eq!(all, [("a".into(), 500_000), ("b".into(), 500_000)]);
}
