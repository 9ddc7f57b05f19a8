//! Localities, locality weights, `common_lb_config` and the assignment `policy` over CDS and
//! EDS: decoded into the file's form or carried with the hosts, and what is not honoured
//! refused by name.

use envoy_types::pb::{
    envoy::{
        config::{
            cluster::v3::cluster::{
                CommonLbConfig,
                common_lb_config::{
                    LocalityConfigSpecifier, LocalityWeightedLbConfig, ZoneAwareLbConfig,
                },
            },
            endpoint::v3::{ClusterLoadAssignment, cluster_load_assignment::Policy},
        },
        r#type::v3::Percent,
    },
    google::protobuf::{Duration, UInt32Value},
};

use super::{
    fixtures::{endpoint, locality, sotw},
    resources::{clusters, state, static_cluster},
};
use crate::{
    discovery::{
        SourceUpdate,
        xds::{
            ClusterStats,
            resources::FileNames,
            state::{EdsState, Sink},
        },
    },
    health::AssignmentPolicy,
    host::Locality,
};

/// An assignment of `name`: zone `eu-1a` (weight 1) with port 80 and zone `eu-1b` (weight 2)
/// with ports 81 and 82, and `policy`.
fn zoned(name: &str, policy: Option<Policy>) -> ClusterLoadAssignment {
    let mut a = locality(0, vec![endpoint("127.0.0.1", 80)]);
    a.load_balancing_weight = Some(UInt32Value { value: 1 });
    let mut b = locality(
        0,
        vec![endpoint("127.0.0.1", 81), endpoint("127.0.0.1", 82)],
    );
    b.locality.as_mut().expect("fixture locality").zone = "eu-1b".into();
    b.load_balancing_weight = Some(UInt32Value { value: 2 });
    ClusterLoadAssignment {
        cluster_name: name.into(),
        endpoints: vec![a, b],
        policy,
        ..Default::default()
    }
}

fn factor(value: u32) -> Policy {
    Policy {
        overprovisioning_factor: Some(UInt32Value { value }),
        ..Default::default()
    }
}

/// A policy with `drop_overloads` of `(category, numerator, denominator)`.
fn drops(entries: &[(&str, u32, i32)]) -> Policy {
    use envoy_types::pb::envoy::{
        config::endpoint::v3::cluster_load_assignment::policy::DropOverload,
        r#type::v3::FractionalPercent,
    };
    let drop_overloads = entries
        .iter()
        .map(|&(category, numerator, denominator)| DropOverload {
            category: category.into(),
            drop_percentage: Some(FractionalPercent {
                numerator,
                denominator,
            }),
        })
        .collect();
    Policy {
        drop_overloads,
        ..Default::default()
    }
}

/// An inline assignment's `drop_overloads` reaches the cluster's balance, in the file's form.
#[test]
fn cds_drop_overloads_are_honoured() {
    let (mut state, rx) = state(FileNames::default());
    let mut web = static_cluster("web", 80);
    // MILLION is 2.
    web.load_assignment = Some(zoned("web", Some(drops(&[("lb", 125_000, 2)]))));
    state.apply_sotw(&clusters("1", &[web])).expect("ACK");
    let balance = rx.borrow().clusters[0].health_config().balance();
    assert_eq!(balance.drop_overload.per_million(), 125_000);
}

#[test]
fn cds_localities_weights_policy_and_locality_weighting_are_honoured() {
    let (mut state, rx) = state(FileNames::default());
    let mut web = static_cluster("web", 80);
    web.load_assignment = Some(zoned(
        "web",
        Some(Policy {
            weighted_priority_health: true,
            ..factor(200)
        }),
    ));
    web.common_lb_config = Some(CommonLbConfig {
        healthy_panic_threshold: Some(Percent { value: 20.0 }),
        locality_config_specifier: Some(LocalityConfigSpecifier::LocalityWeightedLbConfig(
            LocalityWeightedLbConfig {},
        )),
        ..Default::default()
    });
    state.apply_sotw(&clusters("1", &[web])).expect("ACK");
    let overlay = rx.borrow().clone();
    let cluster = &overlay.clusters[0];
    let hosts = cluster.static_hosts();
    let zones: Vec<(u16, &str, Option<u32>)> = hosts
        .iter()
        .map(|h| (h.addr.port(), h.locality().zone.as_str(), h.locality_weight))
        .collect();
    assert_eq!(
        zones,
        [
            (80, "eu-1a", Some(1)),
            (81, "eu-1b", Some(2)),
            (82, "eu-1b", Some(2))
        ]
    );
    assert_eq!(hosts[0].locality().region, "eu");
    let balance = cluster.health_config().balance();
    assert_eq!(
        (
            balance.panic_threshold,
            balance.overprovisioning_factor,
            balance.weighted_priority_health,
            balance.locality_weighted
        ),
        (20.0, 200, true, true)
    );
}

#[test]
fn cds_fields_not_honoured_are_refused_by_name() {
    let merge = CommonLbConfig {
        update_merge_window: Some(Duration::default()),
        ..Default::default()
    };
    let stale = Policy {
        endpoint_stale_after: Some(Duration::default()),
        ..Default::default()
    };
    let cases = [
        (
            Some(merge),
            None,
            "common_lb_config.update_merge_window: is not supported",
        ),
        (
            None,
            Some(stale),
            "load_assignment.policy.endpoint_stale_after: is not supported",
        ),
        (
            None,
            Some(factor(0)),
            "load_assignment.policy.overprovisioning_factor: invalid value: integer `0`, expected a nonzero u32",
        ),
        (
            None,
            Some(drops(&[("a", 1, 0), ("b", 1, 0)])),
            "has 2 categories. Envoy only support one.",
        ),
        (
            None,
            Some(drops(&[("a", 1, 5)])),
            "load_assignment.policy.drop_overloads[0].drop_percentage.denominator: value must be one of the defined enum values, not 5",
        ),
    ];
    for (common, policy, says) in cases {
        let (mut state, _rx) = state(FileNames::default());
        let mut web = static_cluster("web", 80);
        web.common_lb_config = common;
        web.load_assignment = Some(zoned("web", policy));
        let text = state
            .apply_sotw(&clusters("1", &[web]))
            .expect_err("NACK")
            .to_string();
        assert!(text.contains(says), "{text}");
    }
}

#[test]
fn eds_policy_travels_with_the_hosts_and_a_change_of_it_is_published() {
    let (tx, rx) = tokio::sync::watch::channel(SourceUpdate::default());
    let sink = Sink {
        cluster: "web".into(),
        tx,
        stats: std::sync::Arc::new(ClusterStats::default()),
    };
    let mut state = EdsState::new(vec![("web".to_owned(), sink)]);
    state
        .apply_sotw(&sotw("1", "a", &[zoned("web", None)]))
        .expect("ACK");
    let first = rx.borrow().clone();
    assert_eq!(first.policy, Some(AssignmentPolicy::default()));
    let b = Locality {
        region: "eu".into(),
        zone: "eu-1b".into(),
        sub_zone: String::new(),
    };
    assert_eq!(
        (first.hosts[1].locality(), first.hosts[1].locality_weight),
        (&b, Some(2))
    );
    // The same hosts under another policy: a new version with that policy.
    state
        .apply_sotw(&sotw("2", "b", &[zoned("web", Some(factor(100)))]))
        .expect("ACK");
    let second = rx.borrow().clone();
    assert_eq!(second.version, first.version + 1);
    assert_eq!(second.policy.map(|p| p.overprovisioning_factor), Some(100));
    // Envoy's proto rule: a factor of 0 is NACKed and the last policy kept.
    let zero = state
        .apply_sotw(&sotw("3", "c", &[zoned("web", Some(factor(0)))]))
        .expect_err("NACK");
    assert!(
        zero.to_string().contains("OverprovisioningFactor"),
        "{zero}"
    );
    assert_eq!(rx.borrow().policy, second.policy);
}

/// A CDS cluster with `zone_aware_lb_config` is decoded into the file's form and validated
/// as a file cluster is: without the file's local cluster and node locality it is NACKed
/// naming what it needs (never accepted and routed without zones).
#[test]
fn cds_zone_aware_without_a_local_cluster_is_nacked_naming_what_it_needs() {
    let (mut state, _rx) = state(FileNames::default());
    let mut web = static_cluster("web", 80);
    web.common_lb_config = Some(CommonLbConfig {
        locality_config_specifier: Some(LocalityConfigSpecifier::ZoneAwareLbConfig(
            ZoneAwareLbConfig {
                routing_enabled: Some(Percent { value: 30.0 }),
                min_cluster_size: Some(envoy_types::pb::google::protobuf::UInt64Value { value: 2 }),
                fail_traffic_on_panic: true,
            },
        )),
        ..Default::default()
    });
    let err = state
        .apply_sotw(&clusters("1", &[web]))
        .expect_err("NACK")
        .to_string();
    assert!(
        err.contains("common_lb_config.zone_aware_lb_config"),
        "{err}"
    );
    assert!(err.contains("cluster_manager.local_cluster_name"), "{err}");
}
