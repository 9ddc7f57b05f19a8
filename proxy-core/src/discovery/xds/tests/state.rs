//! The state machine without a network: atomic rejection, empty updates, no-rebuild, stats.

use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;
use tokio::sync::watch;

use super::fixtures::{cla, delta, endpoint, locality, ports, sotw};
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
                cluster: (*resource).to_owned(),
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
    let bad = sotw("2", "b", &[cla("web", &[70000])]);
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
        (
            v.source.update_attempt,
            v.source.update_success,
            v.source.update_rejected
        ),
        (2, 1, 1)
    );
    assert_eq!(
        (v.version, v.source.membership_total, v.membership_healthy),
        (1, 2, 2)
    );
}

#[test]
fn wrong_type_and_undecodable_resources_are_rejected() {
    let (mut state, clusters) = state(&["web"]);
    let mut response = sotw("1", "a", &[cla("web", &[80])]);
    response.resources[0].type_url = "type.googleapis.com/envoy.config.cluster.v3.Cluster".into();
    let error = state.apply_sotw(&response).unwrap_err();
    assert_eq!(
        error.to_string(),
        "type.googleapis.com/envoy.config.cluster.v3.Cluster does not match the message-wide type URL type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment in DiscoveryResponse (resource 0)"
    );
    let mut response = sotw("1", "a", &[]);
    response.resources.push(Any {
        type_url: CLA_TYPE_URL.into(),
        value: vec![0xff, 0xff, 0xff],
    });
    let error = state.apply_sotw(&response).unwrap_err();
    assert!(matches!(error, UpdateError::Decode { index: 0, .. }));
    assert!(
        crate::discovery::xds::grpc::nack_status(&error)
            .message
            .starts_with(
                "Unable to unpack as envoy.config.endpoint.v3.ClusterLoadAssignment: resource 0: "
            ),
        "{error}"
    );
    assert_eq!(values(&clusters[0]).source.update_rejected, 2);
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
}

#[test]
fn sotw_duplicates_first_wins_without_a_nack() {
    let (mut state, clusters) = state(&["web"]);
    let duplicate = sotw("1", "a", &[cla("web", &[80]), cla("web", &[81])]);
    state.apply_sotw(&duplicate).unwrap();
    assert_eq!(ports(&clusters[0].rx.borrow()), [80]);
    let v = values(&clusters[0]);
    assert_eq!((v.source.update_success, v.source.update_rejected), (1, 0));
    // The ignored one is still held to the proto rules, not to the host mapping.
    let mut unusable = cla("web", &[83]);
    unusable.endpoints[0].lb_endpoints[0] = endpoint("web.local", 83);
    state
        .apply_sotw(&sotw("2", "b", &[cla("web", &[82]), unusable]))
        .unwrap();
    assert_eq!(ports(&clusters[0].rx.borrow()), [82]);
    let error = state
        .apply_sotw(&sotw("3", "c", &[cla("web", &[84]), cla("web", &[70000])]))
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("Proto constraint validation failed"),
        "{error}"
    );
    assert_eq!(ports(&clusters[0].rx.borrow()), [82]);
    // An empty first one wins too.
    state
        .apply_sotw(&sotw("4", "d", &[cla("web", &[]), cla("web", &[85])]))
        .unwrap();
    assert!(clusters[0].rx.borrow().hosts.is_empty());
}

#[test]
fn rest_duplicates_are_rejected() {
    let (mut state, clusters) = state(&["web"]);
    let duplicate = sotw("1", "a", &[cla("web", &[80]), cla("web", &[81])]);
    let error = state.apply_rest(&duplicate).unwrap_err();
    assert_eq!(
        error.to_string(),
        "Unexpected EDS resource length: 2 (cluster web)"
    );
    assert_eq!(values(&clusters[0]).source.update_rejected, 1);
    state
        .apply_rest(&sotw("2", "b", &[cla("web", &[80])]))
        .unwrap();
}

#[test]
fn port_zero_is_accepted_and_published() {
    let (mut state, clusters) = state(&["web"]);
    state
        .apply_sotw(&sotw("1", "a", &[cla("web", &[0, 80])]))
        .unwrap();
    assert_eq!(ports(&clusters[0].rx.borrow()), [0, 80]);
    assert_eq!(values(&clusters[0]).source.membership_total, 2);
}

#[test]
fn unsubscribed_resources_are_not_mapped() {
    let mut other = cla("other", &[1]);
    other.endpoints[0].lb_endpoints[0] = endpoint("not-an-ip", 1);
    let (mut state, clusters) = state(&["web"]);
    state
        .apply_sotw(&sotw("1", "a", &[cla("web", &[80]), other.clone()]))
        .unwrap();
    assert_eq!(ports(&clusters[0].rx.borrow()), [80]);
    // State of the world: every resource is held to the proto rules.
    let error = state
        .apply_sotw(&sotw(
            "2",
            "b",
            &[cla("web", &[81]), cla("other", &[70000])],
        ))
        .unwrap_err();
    assert!(matches!(error, UpdateError::Invalid { .. }), "{error}");
    // Delta: unsubscribed resources are not even decoded.
    let mut garbage = delta("n1", &[("1", cla("web", &[82]))], &[]);
    let mut extra = garbage.resources[0].clone();
    extra.name = "other".into();
    extra.resource.as_mut().unwrap().value = vec![0xff, 0xff];
    garbage.resources.push(extra);
    state.apply_delta(&garbage).unwrap();
    assert_eq!(ports(&clusters[0].rx.borrow()), [82]);
}

#[test]
fn missing_assignment_is_update_empty_only_for_a_lone_subscription() {
    let (mut lone, lone_clusters) = state(&["web"]);
    lone.apply_sotw(&sotw("1", "a", &[cla("web", &[80])]))
        .unwrap();
    lone.apply_sotw(&sotw("2", "b", &[])).unwrap();
    assert_eq!(ports(&lone_clusters[0].rx.borrow()), [80]);
    assert_eq!(values(&lone_clusters[0]).source.update_empty, 1);

    let (mut pair, pair_clusters) = state(&["api", "web"]);
    pair.apply_sotw(&sotw("1", "a", &[cla("web", &[80])]))
        .unwrap();
    assert_eq!(values(&pair_clusters[0]), ClusterStatValues::default());
    assert_eq!(values(&pair_clusters[1]).source.update_success, 1);
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
        (
            v.source.update_no_rebuild,
            v.source.membership_change,
            v.version
        ),
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
            values(&clusters[0]).source.update_empty,
            values(&clusters[0]).source.membership_total
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
        "Unexpected EDS cluster (expecting api): web"
    );
    let mut bodiless = delta("n3", &[("8", cla("web", &[81]))], &[]);
    bodiless.resources[0].resource = None;
    assert_eq!(
        state.apply_delta(&bodiless).unwrap_err().to_string(),
        "type URL  embedded in an individual Any does not match the message-wide type URL type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment in DeltaDiscoveryResponse (resource \"web\")"
    );
    // A heartbeat (no body, the version held) changes nothing and is no NACK.
    let mut heartbeat = delta("n3b", &[("7", cla("web", &[81]))], &[]);
    heartbeat.resources[0].resource = None;
    state.apply_delta(&heartbeat).unwrap();
    assert_eq!(ports(&clusters[1].rx.borrow()), [80]);
    state.apply_delta(&delta("n4", &[], &["web"])).unwrap();
    assert!(state.delta_versions().is_empty());
    assert_eq!(
        ports(&clusters[1].rx.borrow()),
        [80],
        "removal keeps the hosts (Envoy's EDS)"
    );
    let v = values(&clusters[1]);
    assert_eq!(
        (v.source.update_empty, v.source.update_rejected, v.version),
        (1, 2, 7)
    );
}

#[test]
fn delta_rejections_use_envoys_words() {
    let (mut state, clusters) = state(&["web"]);
    let twice = delta(
        "n1",
        &[("1", cla("web", &[80])), ("2", cla("web", &[81]))],
        &[],
    );
    assert_eq!(
        state.apply_delta(&twice).unwrap_err().to_string(),
        "duplicate name web found among added/updated resources"
    );
    let both = delta("n2", &[("1", cla("web", &[80]))], &["web"]);
    assert_eq!(
        state.apply_delta(&both).unwrap_err().to_string(),
        "duplicate name web found in the union of added+removed resources"
    );
    let mut wrong = delta("n3", &[("1", cla("web", &[80]))], &[]);
    wrong.resources[0].resource.as_mut().unwrap().type_url =
        "type.googleapis.com/envoy.config.cluster.v3.Cluster".into();
    assert!(
        state
            .apply_delta(&wrong)
            .unwrap_err()
            .to_string()
            .starts_with("type URL type.googleapis.com/envoy.config.cluster.v3.Cluster embedded in an individual Any does not match the message-wide type URL")
    );
    // The proto rules come before the name check.
    let mut unnamed = delta("n4", &[("1", cla("", &[80]))], &[]);
    unnamed.resources[0].name = "web".into();
    assert!(
        state
            .apply_delta(&unnamed)
            .unwrap_err()
            .to_string()
            .contains("Proto constraint validation failed (ClusterLoadAssignmentValidationError.ClusterName: value length must be at least 1 characters)")
    );
    assert_eq!(values(&clusters[0]).source.update_rejected, 4);
    assert!(clusters[0].rx.borrow().hosts.is_empty());
    // A resource without a name matches no subscription: ignored, as by Envoy.
    let mut nameless = delta("n5", &[("1", cla("web", &[80]))], &[]);
    nameless.resources[0].name.clear();
    state.apply_delta(&nameless).unwrap();
    assert!(clusters[0].rx.borrow().hosts.is_empty());
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
            values(&clusters[1]).source.update_failure,
            values(&clusters[1]).source.update_attempt
        ),
        (1, 1)
    );
}

#[test]
fn long_nack_messages_are_cut_as_envoy_cuts_them() {
    let name = "é".repeat(3000);
    let (mut state, _clusters) = state(&["web"]);
    let mut twice = delta("n1", &[("1", cla("web", &[80]))], &[]);
    twice.resources[0].name.clone_from(&name);
    twice.resources.push(twice.resources[0].clone());
    let error = state.apply_delta(&twice).unwrap_err();
    let message = crate::discovery::xds::grpc::nack_status(&error).message;
    assert!(message.ends_with("...(truncated)"), "{message}");
    assert!(message.len() <= 4096 + "...(truncated)".len());
    let short = crate::discovery::xds::grpc::nack_status(&UpdateError::DuplicateAdded {
        name: "web".into(),
    });
    assert_eq!(
        short.message,
        "duplicate name web found among added/updated resources"
    );
}

/// A reload's subscription changes: a cluster added on a resource already held gets its hosts
/// at once and asks for nothing; a new resource is asked for; a resource is let go only when
/// its last cluster goes; the untouched cluster keeps its state.
#[test]
fn subscriptions_change_without_touching_the_others() {
    let (mut state, clusters) = state(&["web"]);
    state
        .apply_sotw(&sotw("1", "a", &[cla("web", &[80])]))
        .unwrap();
    let sink = |cluster: &str| {
        let (tx, rx) = watch::channel(EdsUpdate::default());
        let stats = Arc::new(ClusterStats::default());
        let cluster = cluster.to_owned();
        (
            Sink {
                cluster,
                tx,
                stats: Arc::clone(&stats),
            },
            Cluster { rx, stats },
        )
    };
    // A second cluster on the resource `web`: its hosts at once, nothing to ask for.
    let (web2, web2_out) = sink("web2");
    state.subscribe("web".to_owned(), web2);
    assert_eq!(ports(&web2_out.rx.borrow()), [80]);
    assert!(web2_out.rx.borrow().initialized);
    assert_eq!(state.take_pending(), (vec![], vec![]));
    // A new resource: asked for.
    let (api, api_out) = sink("api");
    state.subscribe("api".to_owned(), api);
    assert_eq!(state.names(), ["api", "web"]);
    assert_eq!(state.take_pending(), (vec!["api".to_owned()], vec![]));
    state
        .apply_sotw(&sotw("2", "b", &[cla("web", &[80]), cla("api", &[90])]))
        .unwrap();
    assert_eq!(ports(&api_out.rx.borrow()), [90]);
    // `web2` goes: `web` stays subscribed for `web`; `api` goes: let go.
    state.unsubscribe("web2");
    assert_eq!(state.take_pending(), (vec![], vec![]));
    assert!(
        web2_out.rx.has_changed().is_err(),
        "the removed cluster's watch closed"
    );
    state.unsubscribe("api");
    assert_eq!(state.take_pending(), (vec![], vec!["api".to_owned()]));
    assert_eq!(state.names(), ["web"]);
    // The untouched cluster: one membership change (version 1 only), hosts kept.
    let web = clusters[0].rx.borrow().clone();
    assert_eq!((web.version, ports(&web)), (1, vec![80]));
    assert_eq!(values(&clusters[0]).source.update_success, 2);
}

/// An assignment with more hosts than the kernel maps take is NACKed with the numbers (state
/// of the world and delta alike); the hosts held stay, and a set that fits is taken.
#[test]
fn a_host_set_larger_than_the_kernel_maps_is_nacked_with_the_limit() {
    let small = crate::config::MapSizes {
        backends: 16,
        ..crate::config::MapSizes::default()
    };
    let (state, clusters) = state(&["web"]);
    let mut state = state.within(Some(small));
    let eight: Vec<u32> = (80..88).collect();
    let nine: Vec<u32> = (80..89).collect();
    state
        .apply_sotw(&sotw("1", "a", &[cla("web", &eight)]))
        .unwrap();
    let error = state
        .apply_sotw(&sotw("2", "b", &[cla("web", &nine)]))
        .unwrap_err();
    let message = crate::discovery::xds::grpc::nack_status(&error).message;
    assert_eq!(
        message,
        "cluster load assignment \"web\": 9 hosts do not fit the kernel maps: BACKENDS_V2 holds 16 entries (kernel_maps.backends) and a publish writes the new hosts beside the live ones, so one cluster may have at most 8"
    );
    assert_eq!(state.version_info(), "1", "NACKed: the last good version");
    assert_eq!(ports(&clusters[0].rx.borrow()).len(), 8, "hosts kept");
    let error = state
        .apply_delta(&delta("n3", &[("3", cla("web", &nine))], &[]))
        .unwrap_err();
    assert!(matches!(error, UpdateError::TooManyHosts { .. }), "{error}");
    let v = values(&clusters[0]);
    assert_eq!((v.source.update_success, v.source.update_rejected), (1, 2));
    state
        .apply_delta(&delta("n4", &[("4", cla("web", &[90]))], &[]))
        .unwrap();
    assert_eq!(ports(&clusters[0].rx.borrow()), [90], "a set that fits");
}

#[test]
fn more_priority_levels_than_the_kernel_holds_are_nacked_with_the_limit() {
    let (state, clusters) = state(&["web"]);
    let mut state = state.within(Some(crate::config::MapSizes::default()));
    let levels = |n: u32| {
        let mut assignment = cla("web", &[]);
        assignment.endpoints = (0..n)
            .map(|p| locality(p * 10, vec![endpoint("127.0.0.1", 8000 + p)]))
            .collect();
        assignment
    };
    state.apply_sotw(&sotw("1", "a", &[levels(4)])).unwrap();
    let error = state.apply_sotw(&sotw("2", "b", &[levels(5)])).unwrap_err();
    let message = crate::discovery::xds::grpc::nack_status(&error).message;
    assert_eq!(
        message,
        "cluster load assignment \"web\": 5 priority levels do not fit the kernel maps: a service holds a slot table for each of at most 4 levels, so a cluster may use at most 4 distinct priorities"
    );
    assert_eq!(state.version_info(), "1", "NACKed: the last good version");
    assert_eq!(ports(&clusters[0].rx.borrow()).len(), 4, "hosts kept");
}
