//! The state machine without a network: atomic rejection, empty updates, no-rebuild, stats.

use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;
use tokio::sync::watch;

use super::fixtures::{cla, delta, ports, sotw};
use crate::discovery::{
    SourceUpdate as EdsUpdate,
    xds::{
        CLA_TYPE_URL, ClusterStatValues, ClusterStats, UpdateError,
        state::{EdsState, Sink},
    },
};

struct Cluster {
    rx: watch::Receiver<EdsUpdate>,
    stats: Arc<ClusterStats>,
}

fn state(resources: &[&str]) -> (EdsState, Vec<Cluster>) {
    let mut sinks = Vec::new();
    let mut clusters = Vec::new();
    for resource in resources {
        let (tx, rx) = watch::channel(EdsUpdate::default());
        let stats = Arc::new(ClusterStats::default());
        sinks.push((
            (*resource).to_owned(),
            Sink {
                tx,
                stats: Arc::clone(&stats),
            },
        ));
        clusters.push(Cluster { rx, stats });
    }
    (EdsState::new(sinks), clusters)
}

fn values(cluster: &Cluster) -> ClusterStatValues {
    cluster.stats.values()
}

#[test]
fn accepted_then_rejected_keeps_last_good() {
    let (mut state, clusters) = state(&["web"]);
    state
        .apply_sotw(&sotw("1", "a", &[cla("web", &[80, 81])]))
        .unwrap();
    let bad = sotw("2", "b", &[cla("web", &[0])]);
    let error = state.apply_sotw(&bad).unwrap_err();
    assert!(matches!(error, UpdateError::Invalid { .. }), "{error}");
    assert_eq!(state.version_info(), "1");
    let current = clusters[0].rx.borrow().clone();
    assert_eq!(
        (
            current.version,
            current.version_info.as_str(),
            ports(&current)
        ),
        (1, "1", vec![80, 81])
    );
    let v = values(&clusters[0]);
    assert_eq!(
        (v.update_attempt, v.update_success, v.update_rejected),
        (2, 1, 1)
    );
    assert_eq!(
        (v.version, v.membership_total, v.membership_healthy),
        (1, 2, 2)
    );
}

#[test]
fn wrong_type_and_undecodable_resources_are_rejected() {
    let (mut state, clusters) = state(&["web"]);
    let mut response = sotw("1", "a", &[cla("web", &[80])]);
    response.resources[0].type_url = "type.googleapis.com/envoy.config.cluster.v3.Cluster".into();
    let error = state.apply_sotw(&response).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("does not match the response type"),
        "{error}"
    );
    let mut response = sotw("1", "a", &[]);
    response.resources.push(Any {
        type_url: CLA_TYPE_URL.into(),
        value: vec![0xff, 0xff, 0xff],
    });
    assert!(matches!(
        state.apply_sotw(&response),
        Err(UpdateError::Decode { index: 0, .. })
    ));
    assert_eq!(values(&clusters[0]).update_rejected, 2);
    assert!(
        clusters[0].rx.borrow().initialized,
        "a rejection completes initialization"
    );
}

#[test]
fn one_bad_cluster_rejects_the_whole_response() {
    let (mut state, clusters) = state(&["api", "web"]);
    let response = sotw("1", "a", &[cla("api", &[90]), cla("web", &[70000])]);
    assert!(state.apply_sotw(&response).is_err());
    assert!(
        clusters[0].rx.borrow().hosts.is_empty(),
        "api must not be half-applied"
    );
    let duplicate = sotw("1", "a", &[cla("web", &[80]), cla("web", &[81])]);
    let error = state.apply_sotw(&duplicate).unwrap_err();
    assert!(
        error.to_string().contains("unexpected EDS resource length"),
        "{error}"
    );
}

#[test]
fn missing_assignment_is_update_empty_only_for_a_lone_subscription() {
    let (mut lone, lone_clusters) = state(&["web"]);
    lone.apply_sotw(&sotw("1", "a", &[cla("web", &[80])]))
        .unwrap();
    lone.apply_sotw(&sotw("2", "b", &[])).unwrap();
    assert_eq!(ports(&lone_clusters[0].rx.borrow()), [80]);
    assert_eq!(values(&lone_clusters[0]).update_empty, 1);

    let (mut pair, pair_clusters) = state(&["api", "web"]);
    pair.apply_sotw(&sotw("1", "a", &[cla("web", &[80])]))
        .unwrap();
    assert_eq!(values(&pair_clusters[0]), ClusterStatValues::default());
    assert_eq!(values(&pair_clusters[1]).update_success, 1);
}

#[test]
fn unchanged_assignment_counts_no_rebuild_and_publishes_no_new_hosts() {
    let (mut state, clusters) = state(&["web"]);
    state
        .apply_sotw(&sotw("1", "a", &[cla("web", &[80])]))
        .unwrap();
    state
        .apply_sotw(&sotw("2", "b", &[cla("web", &[80])]))
        .unwrap();
    let current = clusters[0].rx.borrow().clone();
    assert_eq!((current.version, current.version_info.as_str()), (1, "2"));
    let v = values(&clusters[0]);
    assert_eq!(
        (v.update_no_rebuild, v.membership_change, v.version),
        (1, 1, 2)
    );
    state
        .apply_sotw(&sotw("3", "c", &[cla("web", &[81])]))
        .unwrap();
    let current = clusters[0].rx.borrow().clone();
    assert_eq!(
        (
            ports(&current),
            current.added.len(),
            current.removed[0].addr.port()
        ),
        (vec![81], 1, 80)
    );
}

#[test]
fn empty_assignment_clears_hosts() {
    let (mut state, clusters) = state(&["web"]);
    state
        .apply_sotw(&sotw("1", "a", &[cla("web", &[80])]))
        .unwrap();
    state
        .apply_sotw(&sotw("2", "b", &[cla("web", &[])]))
        .unwrap();
    assert!(clusters[0].rx.borrow().hosts.is_empty());
    assert_eq!(
        (
            values(&clusters[0]).update_empty,
            values(&clusters[0]).membership_total
        ),
        (0, 0)
    );
}

#[test]
fn delta_versions_removal_and_name_checks() {
    let (mut state, clusters) = state(&["api", "web"]);
    state
        .apply_delta(&delta(
            "n1",
            &[("7", cla("web", &[80])), ("x", cla("other", &[1]))],
            &[],
        ))
        .unwrap();
    assert_eq!(
        state.delta_versions(),
        [("web".to_owned(), "7".to_owned())].into()
    );
    let mut mismatch = delta("n2", &[("8", cla("web", &[81]))], &[]);
    mismatch.resources[0].name = "api".into();
    let error = state.apply_delta(&mismatch).unwrap_err();
    assert_eq!(
        error.to_string(),
        "unexpected EDS cluster (expecting api): web"
    );
    let mut bodiless = delta("n3", &[("8", cla("web", &[81]))], &[]);
    bodiless.resources[0].resource = None;
    assert!(matches!(
        state.apply_delta(&bodiless),
        Err(UpdateError::MissingBody { .. })
    ));
    state.apply_delta(&delta("n4", &[], &["web"])).unwrap();
    assert!(state.delta_versions().is_empty());
    assert_eq!(
        ports(&clusters[1].rx.borrow()),
        [80],
        "removal keeps the hosts (Envoy's EDS)"
    );
    let v = values(&clusters[1]);
    assert_eq!((v.update_empty, v.update_rejected, v.version), (1, 2, 7));
}

#[test]
fn failure_and_init_timeout_mark_initialized() {
    let (state, clusters) = state(&["web", "api"]);
    state.on_init_timeout();
    assert!(clusters.iter().all(|c| c.rx.borrow().initialized));
    assert_eq!(values(&clusters[0]).init_fetch_timeout, 1);
    state.on_init_timeout();
    assert_eq!(
        values(&clusters[0]).init_fetch_timeout,
        1,
        "only clusters still waiting count"
    );
    state.on_failure();
    assert_eq!(
        (
            values(&clusters[1]).update_failure,
            values(&clusters[1]).update_attempt
        ),
        (1, 1)
    );
}
