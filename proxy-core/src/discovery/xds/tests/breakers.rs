//! CDS `circuit_breakers`: decoded into the file's form, Envoy's defaults for what a threshold
//! leaves out, and the fields not honoured refused by name.

use envoy_types::pb::{
    envoy::config::{
        cluster::v3::{
            CircuitBreakers,
            circuit_breakers::{Thresholds, thresholds::RetryBudget},
        },
        core::v3::RoutingPriority,
    },
    google::protobuf::UInt32Value,
};

use super::resources::{clusters, state, static_cluster};
use crate::{
    config::circuit_breakers::{CircuitBreakers as FileBreakers, Limits},
    discovery::xds::resources::FileNames,
};

fn value(v: u32) -> UInt32Value {
    UInt32Value { value: v }
}

#[test]
fn thresholds_decode_with_envoys_defaults_for_what_they_leave_out() {
    let (mut state, rx) = state(FileNames::default());
    let mut a = static_cluster("a", 9001);
    a.circuit_breakers = Some(CircuitBreakers {
        thresholds: vec![
            Thresholds {
                priority: RoutingPriority::High as i32,
                max_connections: Some(value(9)),
                ..Default::default()
            },
            Thresholds {
                max_connections: Some(value(2)),
                max_pending_requests: Some(value(1)),
                max_retries: Some(value(0)),
                track_remaining: true,
                ..Default::default()
            },
        ],
        per_host_thresholds: Vec::new(),
    });
    state.apply_sotw(&clusters("1", &[a])).expect("ACK");
    let overlay = rx.borrow().clone();
    let limits = FileBreakers::default_limits(overlay.clusters[0].circuit_breakers.as_ref());
    assert_eq!(
        limits,
        Limits {
            max_connections: 2,
            max_pending_requests: 1,
            max_requests: 1024,
            max_retries: 0,
            track_remaining: true,
        }
    );
}

#[test]
fn fields_not_honoured_are_nacked_by_name() {
    let cases = [
        (
            Thresholds {
                retry_budget: Some(RetryBudget::default()),
                ..Default::default()
            },
            false,
            "circuit_breakers.thresholds[0].retry_budget: retry budgets are not supported",
        ),
        (
            Thresholds {
                max_connection_pools: Some(value(4)),
                ..Default::default()
            },
            false,
            "circuit_breakers.thresholds[0].max_connection_pools: is not supported",
        ),
        (
            Thresholds::default(),
            true,
            "circuit_breakers.per_host_thresholds: per-host circuit breakers are not supported",
        ),
        (
            Thresholds {
                priority: 7,
                ..Default::default()
            },
            false,
            "circuit_breakers.thresholds[0].priority: unknown priority 7",
        ),
    ];
    for (thresholds, per_host, says) in cases {
        let (mut state, _rx) = state(FileNames::default());
        let mut a = static_cluster("a", 9001);
        a.circuit_breakers = Some(CircuitBreakers {
            thresholds: vec![thresholds],
            per_host_thresholds: if per_host {
                vec![thresholds]
            } else {
                Vec::new()
            },
        });
        let text = state
            .apply_sotw(&clusters("1", &[a]))
            .expect_err("NACK")
            .to_string();
        assert!(
            text.starts_with(&format!("cluster \"a\": {says}")),
            "{text}"
        );
    }
}
