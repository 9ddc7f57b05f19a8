//! The layout rules and the key encoding.

use proxy_common::service::{FAMILY_V4, FAMILY_V6, SERVICE_F_MAGLEV};

use super::*;

#[test]
fn keys_are_in_network_order() {
    let key = service_key("127.77.0.1".parse().unwrap(), 80, 6);
    assert_eq!(key.addr[0].to_ne_bytes(), [127, 77, 0, 1]);
    assert_eq!(key.port.to_ne_bytes(), [0, 80]);
    assert_eq!(key.family, FAMILY_V4);
    let b = backend_of("[::1]:8080".parse().unwrap());
    assert_eq!(b.addr[3].to_ne_bytes(), [0, 0, 0, 1]);
    assert_eq!(b.family, FAMILY_V6);
}

fn spec_of(priorities: Vec<Vec<(SocketAddr, u32)>>) -> ServiceSpec {
    ServiceSpec {
        name: "svc".into(),
        key: service_key("127.77.0.1".parse().unwrap(), 80, 6),
        flags: SERVICE_F_MAGLEV,
        priorities,
        max_connections: None,
        drop_overload: 0,
    }
}

fn host(i: u8, weight: u32) -> (SocketAddr, u32) {
    (SocketAddr::from(([127, 0, 0, i], 8000)), weight)
}

#[test]
fn no_routable_host_is_the_empty_layout() {
    assert_eq!(layout(&spec_of(vec![])), Layout::Empty);
    assert_eq!(layout(&spec_of(vec![vec![], vec![]])), Layout::Empty);
}

#[test]
fn one_host_in_the_first_level_with_hosts_is_single_whatever_its_weight_or_lower_levels() {
    assert_eq!(
        layout(&spec_of(vec![vec![host(1, 7)]])),
        Layout::Single(host(1, 7).0)
    );
    let failover = spec_of(vec![vec![], vec![host(2, 1)], vec![host(3, 1), host(4, 1)]]);
    assert_eq!(layout(&failover), Layout::Single(host(2, 1).0));
    let standby = spec_of(vec![vec![host(5, 100)], vec![host(6, 1), host(7, 1)]]);
    assert_eq!(layout(&standby), Layout::Single(host(5, 1).0));
}

#[test]
fn two_or_more_hosts_get_a_table_at_their_own_priority() {
    let hosts = vec![host(1, 1), host(2, 3)];
    let top = spec_of(vec![hosts.clone(), vec![host(9, 1)]]);
    assert_eq!(
        layout(&top),
        Layout::Table {
            priority: 0,
            hosts: &hosts
        }
    );
    let lower = spec_of(vec![vec![], vec![], hosts.clone()]);
    assert_eq!(
        layout(&lower),
        Layout::Table {
            priority: 2,
            hosts: &hosts
        }
    );
    // The same address twice is still a table (the weights add up in its slots).
    let twice = vec![host(1, 1), host(1, 1)];
    let dup = spec_of(vec![twice.clone()]);
    assert_eq!(
        layout(&dup),
        Layout::Table {
            priority: 0,
            hosts: &twice
        }
    );
}

#[test]
fn every_priority_fits_the_table_bitmask() {
    assert_eq!(ALL_TABLES.count_ones(), MAX_PRIORITIES);
}
