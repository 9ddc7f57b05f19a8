//! The 2x2 matrix, EDS health without active checks, degraded hosts, panic and priorities.

use std::sync::Arc;

use super::support::addr;
use crate::{
    health::{
        matrix::{ClusterMembership, MembershipChange},
        random::SeededRandom,
        state::HostHealth,
    },
    host::{EdsHealth, Host},
};

const HEALTHY: HostHealth = HostHealth {
    failed: false,
    pending: false,
    degraded: false,
    timeout: false,
};
const FAILED: HostHealth = HostHealth {
    failed: true,
    pending: false,
    degraded: false,
    timeout: false,
};

fn membership(active_hc: bool, panic: f64) -> ClusterMembership {
    ClusterMembership::new(active_hc, panic, None, Arc::new(SeededRandom::with_seed(1)))
}

fn hosts(last: &[u8]) -> Vec<Host> {
    last.iter().map(|l| Host::new(addr(*l))).collect()
}

fn routable(m: &ClusterMembership) -> Vec<u8> {
    m.routing()
        .routable()
        .iter()
        .map(|h| {
            h.addr
                .ip()
                .to_string()
                .rsplit('.')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect()
}

fn flags(m: &ClusterMembership) -> Vec<String> {
    m.host_statuses().iter().map(|s| s.flags.render()).collect()
}

/// Active HC on; hosts 1 and 2 discovered and checked healthy.
fn checked_pair() -> ClusterMembership {
    let mut m = membership(true, 0.0);
    let change = m.update_hosts(hosts(&[1, 2]));
    assert_eq!(change.added, vec![addr(1), addr(2)]);
    m.set_active_health(addr(1), HEALTHY);
    m.set_active_health(addr(2), HEALTHY);
    m
}

#[test]
fn discovered_and_ok_routes() {
    let m = checked_pair();
    assert_eq!(routable(&m), vec![1, 2]);
    assert_eq!(flags(&m), vec!["healthy", "healthy"]);
}

/// `ignore_health_on_host_removal`: an absent host goes with the update that left it out,
/// healthy or not, and its probe is released.
#[test]
fn ignoring_health_on_removal_deletes_absent_hosts_at_once() {
    let mut m = membership(true, 0.0).ignoring_health_on_removal(true);
    m.update_hosts(hosts(&[1, 2]));
    m.set_active_health(addr(1), HEALTHY);
    m.set_active_health(addr(2), HEALTHY);
    let change = m.update_hosts(hosts(&[1]));
    assert_eq!(change.removed, vec![addr(2)], "its probe is released");
    assert_eq!(routable(&m), vec![1]);
    assert_eq!(flags(&m), vec!["healthy"]);
}

#[test]
fn absent_and_ok_keeps_routing_pending_removal() {
    let mut m = checked_pair();
    let change = m.update_hosts(hosts(&[1]));
    assert_eq!(change, MembershipChange::default(), "nothing deleted");
    assert_eq!(routable(&m), vec![1, 2]);
    assert_eq!(flags(&m), vec!["healthy", "/pending_dynamic_removal"]);
    // Rediscovered: the flag clears.
    m.update_hosts(hosts(&[1, 2]));
    assert_eq!(flags(&m), vec!["healthy", "healthy"]);
}

#[test]
fn discovered_and_failed_does_not_route_and_is_kept() {
    let mut m = checked_pair();
    let change = m.set_active_health(addr(2), FAILED);
    assert!(change.removed.is_empty());
    assert_eq!(routable(&m), vec![1]);
    assert_eq!(flags(&m), vec!["healthy", "/failed_active_hc"]);
}

#[test]
fn absent_and_failed_is_deleted() {
    // Fails after it went absent.
    let mut m = checked_pair();
    m.update_hosts(hosts(&[1]));
    let change = m.set_active_health(addr(2), FAILED);
    assert_eq!(change.removed, vec![addr(2)]);
    assert_eq!(m.host_statuses().len(), 1);
    // Goes absent after it failed.
    let mut m = checked_pair();
    m.set_active_health(addr(2), FAILED);
    let change = m.update_hosts(hosts(&[1]));
    assert_eq!(change.removed, vec![addr(2)]);
    assert_eq!(routable(&m), vec![1]);
}

/// One address twice (two STRICT_DNS names resolving to it) is two hosts that share the
/// address's check: one probe registration, one health, each counted and routed.
#[test]
fn one_address_twice_is_two_hosts_sharing_its_check() {
    let mut m = membership(true, 0.0);
    let change = m.update_hosts(hosts(&[1, 1, 2]));
    assert_eq!(
        change.added,
        vec![addr(1), addr(2)],
        "one probe per address"
    );
    assert_eq!(m.membership_stats().total, 3);
    assert_eq!(
        m.membership_stats().excluded,
        3,
        "all wait for their first check"
    );
    m.set_active_health(addr(1), HEALTHY);
    m.set_active_health(addr(2), HEALTHY);
    assert_eq!(routable(&m), vec![1, 1, 2]);
    assert_eq!(m.active_healthy_count(), 3);

    // A second host at an address already checked knows its health at once.
    let change = m.update_hosts(hosts(&[1, 1, 2, 2]));
    assert_eq!(change, MembershipChange::default());
    assert_eq!(routable(&m), vec![1, 1, 2, 2]);

    // One of the two goes: the address keeps its probe; the other host stays until it fails.
    let change = m.update_hosts(hosts(&[1, 2, 2]));
    assert_eq!(change, MembershipChange::default());
    assert_eq!(
        flags(&m),
        vec!["healthy", "/pending_dynamic_removal", "healthy", "healthy"]
    );
    let change = m.set_active_health(addr(1), FAILED);
    assert!(
        change.removed.is_empty(),
        "address 1 is still discovered once"
    );
    assert_eq!(flags(&m), vec!["/failed_active_hc", "healthy", "healthy"]);
    let change = m.update_hosts(hosts(&[2, 2]));
    assert_eq!(change.removed, vec![addr(1)]);
    assert_eq!(routable(&m), vec![2, 2]);
}

#[test]
fn without_active_hc_one_address_twice_is_two_hosts() {
    let mut m = membership(false, 0.0);
    let change = m.update_hosts(hosts(&[1, 1]));
    assert_eq!(change.added, vec![addr(1)]);
    assert_eq!(routable(&m), vec![1, 1]);
    let change = m.update_hosts(hosts(&[1]));
    assert_eq!(
        change,
        MembershipChange::default(),
        "the address is still there"
    );
    assert_eq!(routable(&m), vec![1]);
    assert_eq!(m.membership_stats().total, 1);
}

#[test]
fn unchecked_hosts_are_excluded_and_deleted_when_absent() {
    let mut m = membership(true, 50.0);
    m.update_hosts(hosts(&[1, 2]));
    assert!(
        routable(&m).is_empty(),
        "excluded until the first check, no panic either"
    );
    assert_eq!(flags(&m), vec!["/failed_active_hc/pending_active_hc"; 2]);
    assert_eq!(m.membership_stats().excluded, 2);
    assert_eq!(m.update_hosts(hosts(&[1])).removed, vec![addr(2)]);
}

#[test]
fn without_active_hc_eds_health_decides_and_absent_hosts_go_at_once() {
    let mut m = membership(false, 0.0);
    let mut set = hosts(&[1, 2, 3, 4, 5]);
    set[1].eds_health = EdsHealth::Healthy;
    set[2].eds_health = EdsHealth::Unhealthy;
    set[3].eds_health = EdsHealth::Draining;
    set[4].eds_health = EdsHealth::Timeout;
    m.update_hosts(set);
    assert_eq!(routable(&m), vec![1, 2]);
    assert_eq!(
        flags(&m),
        vec![
            "healthy",
            "healthy",
            "/failed_eds_health",
            "/eds_status_draining",
            "/failed_eds_health"
        ]
    );
    assert_eq!(
        m.update_hosts(hosts(&[1])).removed,
        vec![addr(2), addr(3), addr(4), addr(5)]
    );
}

#[test]
fn eds_unhealthy_overrides_a_passing_active_check() {
    let mut m = checked_pair();
    let mut set = hosts(&[1, 2]);
    set[1].eds_health = EdsHealth::Unhealthy;
    m.update_hosts(set);
    assert_eq!(routable(&m), vec![1]);
}

/// Envoy 1.40 keeps an absent host only while nothing marks it failed: a host its source last
/// said was UNHEALTHY or TIMEOUT (FAILED_EDS_HEALTH), or one whose checks are disabled, goes
/// with the update that leaves it out, passing checks or not (`envoy_side_by_side` compares).
#[test]
fn absent_hosts_failed_by_their_source_or_unchecked_go_at_once() {
    for unhealthy in [EdsHealth::Unhealthy, EdsHealth::Timeout] {
        let mut m = checked_pair();
        let mut set = hosts(&[1, 2]);
        set[1].eds_health = unhealthy;
        m.update_hosts(set);
        let change = m.update_hosts(hosts(&[1]));
        assert_eq!(change.removed, vec![addr(2)], "{unhealthy:?}");
    }
    let mut m = checked_pair();
    let mut set = hosts(&[1, 2]);
    set[1].detail_mut().health_check.disabled = true;
    m.update_hosts(set);
    let change = m.update_hosts(hosts(&[1]));
    assert_eq!(change.removed, vec![addr(2)], "an unchecked host");
    // DRAINING is not FAILED_EDS_HEALTH: such a host stays pending while its checks pass.
    let mut m = checked_pair();
    let mut set = hosts(&[1, 2]);
    set[1].eds_health = EdsHealth::Draining;
    m.update_hosts(set);
    let change = m.update_hosts(hosts(&[1]));
    assert_eq!(change, MembershipChange::default());
}

#[test]
fn degraded_routes_only_when_healthy_hosts_do_not_suffice() {
    let mut m = membership(false, 0.0);
    // 8 healthy + 2 degraded: 8 * 1.4 = 112 % >= 100 -> degraded unused.
    let mut set = hosts(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
    set[8].eds_health = EdsHealth::Degraded;
    set[9].eds_health = EdsHealth::Degraded;
    m.update_hosts(set.clone());
    assert_eq!(routable(&m), vec![1, 2, 3, 4, 5, 6, 7, 8]);
    // 6 healthy + 4 degraded: 84 % healthy -> degraded take the remaining 16 %.
    for h in &mut set[6..8] {
        h.eds_health = EdsHealth::Degraded;
    }
    m.update_hosts(set);
    let r = m.routing();
    assert_eq!(
        (r.priorities[0].healthy_load, r.priorities[0].degraded_load),
        (84, 16)
    );
    assert_eq!(routable(&m), vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
}

#[test]
fn panic_threshold_routes_to_all_below_it_and_zero_disables() {
    let mut set = hosts(&[1, 2, 3, 4]);
    for h in &mut set[1..] {
        h.eds_health = EdsHealth::Unhealthy;
    }
    // 25 % healthy < 50 %: panic, route to all four.
    let mut m = membership(false, 50.0);
    m.update_hosts(set.clone());
    assert!(m.routing().priorities[0].panic);
    assert_eq!(routable(&m), vec![1, 2, 3, 4]);
    // Threshold 0: no panic, only the healthy one.
    let mut m = membership(false, 0.0);
    m.update_hosts(set.clone());
    assert!(!m.routing().priorities[0].panic);
    assert_eq!(routable(&m), vec![1]);
    // All down and panic disabled: nothing routes ("no healthy upstream").
    set[0].eds_health = EdsHealth::Unhealthy;
    m.update_hosts(set);
    assert!(routable(&m).is_empty());
    // 50 % healthy is not below a 50 % threshold (and 1.4 * 50 = 70 % < 100 %).
    let mut set = hosts(&[1, 2]);
    set[1].eds_health = EdsHealth::Unhealthy;
    let mut m = membership(false, 50.0);
    m.update_hosts(set);
    assert!(!m.routing().priorities[0].panic);
    assert_eq!(routable(&m), vec![1]);
}

#[test]
fn priorities_spill_over_with_overprovisioning() {
    let mut m = membership(false, 50.0);
    let mut set = hosts(&[1, 2, 3, 4, 5, 6]);
    for h in &mut set[3..] {
        h.priority = 1;
    }
    m.update_hosts(set.clone());
    assert_eq!(routable(&m), vec![1, 2, 3], "P0 fully healthy takes 100 %");
    // P0 at 2/3 healthy: 1.4 * 66 = 93 %; P1 takes the 7 % left.
    set[2].eds_health = EdsHealth::Unhealthy;
    m.update_hosts(set.clone());
    let r = m.routing();
    assert_eq!(
        (r.priorities[0].healthy_load, r.priorities[1].healthy_load),
        (93, 7)
    );
    assert!(!r.priorities[0].panic && !r.priorities[1].panic);
    assert_eq!(routable(&m), vec![1, 2, 4, 5, 6]);
    // P0 fully down: P1 takes everything; P0 is "in panic" but gets no load.
    for h in &mut set[..3] {
        h.eds_health = EdsHealth::Unhealthy;
    }
    m.update_hosts(set);
    let r = m.routing();
    assert_eq!(
        (r.priorities[0].healthy_load, r.priorities[1].healthy_load),
        (0, 100)
    );
    assert_eq!(routable(&m), vec![4, 5, 6]);
}
