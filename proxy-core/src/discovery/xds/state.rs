//! The transport-independent EDS state machine: decode, validate and apply responses, decide
//! ACK or NACK, publish host sets and count stats.
//!
//! What is checked follows Envoy's subscriptions (see [`cla`](super::cla) for the two stages):
//! * state of the world: every resource's type URL, decoding and proto rules; of several
//!   assignments with one name, gRPC uses the first and ignores the others (Envoy's mux keeps
//!   the first of a name, silently), REST rejects the answer; the host mapping runs for the
//!   assignments that subscribed clusters use;
//! * delta: duplicate names (among added, and added with removed) and type URLs for every
//!   resource; heartbeats skipped; decoding, proto rules, the name check and the host mapping
//!   for subscribed resources only.
//!
//! A response is applied atomically: every resource in it is decoded and validated first, and
//! if any fails the whole response is rejected and nothing changes (Envoy applies the watches it
//! reached before the failing one; we are stricter so a NACKed response never leaves a
//! half-applied state).

use std::{
    collections::{BTreeMap, HashSet},
    sync::Arc,
    time::Duration,
};

use envoy_types::pb::{
    envoy::{
        config::endpoint::v3::ClusterLoadAssignment,
        service::discovery::v3::{DeltaDiscoveryResponse, DiscoveryResponse},
    },
    google::protobuf::Any,
};
use prost::Message;
use thiserror::Error;
use tokio::{
    sync::{Notify, watch},
    time::Instant,
};

use crate::{
    config::MapSizes,
    discovery::{
        SourceStats, SourceUpdate, diff_hosts,
        xds::{
            cla::{ClaError, assignment_policy, check_constraints, map_hosts, stale_after},
            stats::{ClusterStats, version_gauge},
        },
    },
    health::AssignmentPolicy,
    host::HostSet,
};

/// The type URL of `envoy.config.endpoint.v3.ClusterLoadAssignment`.
pub const CLA_TYPE_URL: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// Why a response was NACKed. The message goes to the server in `error_detail.message`; where
/// Envoy NACKs the same input, the message starts with Envoy's words.
#[derive(Debug, Error)]
pub enum UpdateError {
    /// State of the world: a resource's `type_url` differs from the response's.
    #[error(
        "{found} does not match the message-wide type URL {CLA_TYPE_URL} in DiscoveryResponse (resource {index})"
    )]
    TypeUrlMismatch {
        /// Index of the resource in the response.
        index: usize,
        /// The resource's type URL.
        found: String,
    },
    /// Delta: a resource's `type_url` differs from the response's, or it has no body (and is
    /// not a heartbeat: the version we hold, without a body).
    #[error(
        "type URL {found} embedded in an individual Any does not match the message-wide type URL {CLA_TYPE_URL} in DeltaDiscoveryResponse (resource {name:?})"
    )]
    DeltaTypeUrlMismatch {
        /// The resource name.
        name: String,
        /// The resource's type URL (empty without a body).
        found: String,
    },
    /// A resource that does not decode as a `ClusterLoadAssignment`.
    #[error("Unable to unpack as envoy.config.endpoint.v3.ClusterLoadAssignment: resource {index}")]
    Decode {
        /// Index of the resource in the response.
        index: usize,
        /// The decoder's error.
        #[source]
        source: prost::DecodeError,
    },
    /// Delta: one name twice among the added resources.
    #[error("duplicate name {name} found among added/updated resources")]
    DuplicateAdded {
        /// The resource name.
        name: String,
    },
    /// Delta: one name both added and removed, or removed twice.
    #[error("duplicate name {name} found in the union of added+removed resources")]
    DuplicateRemoved {
        /// The resource name.
        name: String,
    },
    /// A delta resource whose name differs from its assignment's `cluster_name`.
    #[error("Unexpected EDS cluster (expecting {expected}): {found}")]
    UnexpectedCluster {
        /// The resource name.
        expected: String,
        /// The assignment's `cluster_name`.
        found: String,
    },
    /// REST: several assignments for one cluster in one answer (Envoy's HTTP subscription hands
    /// them all to the EDS cluster, which takes exactly one).
    #[error("Unexpected EDS resource length: {count} (cluster {name})")]
    Duplicate {
        /// The cluster name.
        name: String,
        /// How many assignments it had.
        count: usize,
    },
    /// An invalid assignment.
    #[error("cluster load assignment {name:?}: {source}")]
    Invalid {
        /// The assignment's `cluster_name`.
        name: String,
        /// What is wrong.
        #[source]
        source: ClaError,
    },
    /// An assignment with more hosts (`kernel_maps`) or priority levels than the kernel maps
    /// take.
    #[error("cluster load assignment {name:?}: {reason}")]
    TooManyHosts {
        /// The assignment's `cluster_name`.
        name: String,
        /// The numbers: hosts, the map, its size and the limit.
        reason: String,
    },
    /// A REST answer that is not a valid JSON `DiscoveryResponse`.
    #[error("invalid JSON discovery response: {reason}")]
    Json {
        /// What is wrong.
        reason: String,
    },
}

/// What a state-of-the-world response with several assignments of one name means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Duplicates {
    /// gRPC, as Envoy's mux: the first one is used and the others are ignored (still decoded
    /// and checked against the proto rules), without a NACK or a warning.
    FirstWins,
    /// REST, as Envoy's HTTP subscription: the response is rejected.
    Reject,
}

mod stale;

pub(crate) use self::stale::watch_leases;

/// One consumer of a resource: an EDS cluster (two clusters may share a `service_name`).
pub(crate) struct Sink {
    /// The cluster's name.
    pub(crate) cluster: String,
    pub(crate) tx: watch::Sender<SourceUpdate>,
    pub(crate) stats: Arc<ClusterStats>,
}

/// An accepted assignment: its hosts, the `policy` that travels with them, and its lease
/// (`policy.endpoint_stale_after`).
type Assigned = (HostSet, AssignmentPolicy, Option<Duration>);

struct Resource {
    sinks: Vec<Sink>,
    hosts: Option<HostSet>,
    /// The held assignment's policy.
    policy: AssignmentPolicy,
    /// Delta: the version of the resource we hold, sent in `initial_resource_versions`.
    delta_version: Option<String>,
    /// When the held assignment's lease (`endpoint_stale_after`) runs out.
    stale_at: Option<Instant>,
}

/// Subscribed resources and what we hold for them.
pub(crate) struct EdsState {
    resources: BTreeMap<String, Resource>,
    /// SotW: the `version_info` of the last accepted response (sent back in ACKs, NACKs and
    /// the first request of a new stream).
    version_info: String,
    /// Delta: resource names subscribed and unsubscribed since the stream's last request (a
    /// new stream's first request names every resource instead).
    pending_subscribe: Vec<String>,
    pending_unsubscribe: Vec<String>,
    /// The kernel maps' sizes an assignment's hosts must fit (`None`: no limit).
    maps: Option<MapSizes>,
    /// Woken when a lease is set, so that [`stale::watch_leases`] sleeps until the right one.
    leases: Arc<Notify>,
}

impl EdsState {
    /// State for `(resource name, sink)` pairs.
    pub(crate) fn new(sinks: Vec<(String, Sink)>) -> Self {
        let mut resources: BTreeMap<String, Resource> = BTreeMap::new();
        for (name, sink) in sinks {
            let resource = resources.entry(name).or_insert_with(|| Resource {
                sinks: Vec::new(),
                hosts: None,
                policy: AssignmentPolicy::default(),
                delta_version: None,
                stale_at: None,
            });
            resource.sinks.push(sink);
        }
        Self {
            resources,
            version_info: String::new(),
            pending_subscribe: Vec::new(),
            pending_unsubscribe: Vec::new(),
            maps: None,
            leases: Arc::new(Notify::new()),
        }
    }

    /// NACKs assignments with more hosts, or more priority levels, than `maps` take.
    pub(crate) fn within(mut self, maps: Option<MapSizes>) -> Self {
        self.maps = maps;
        self
    }

    /// The hosts of `cla`, or why it is NACKed: invalid, or too many for the kernel maps.
    fn hosts_of(&self, cla: &ClusterLoadAssignment) -> Result<Assigned, UpdateError> {
        let hosts = map_hosts(cla).map_err(|source| invalid(cla, source))?;
        let policy = assignment_policy(cla).map_err(|source| invalid(cla, source))?;
        let refusal = self.maps.and_then(|m| {
            m.hosts_refusal(hosts.len()).or_else(|| {
                let levels: std::collections::BTreeSet<u32> =
                    hosts.iter().map(|h| h.priority).collect();
                crate::config::kernel_maps::levels_refusal(levels.len())
            })
        });
        match refusal {
            Some(reason) => Err(UpdateError::TooManyHosts {
                name: cla.cluster_name.clone(),
                reason,
            }),
            None => Ok((hosts, policy, stale_after(cla))),
        }
    }

    /// Adds a cluster to resource `name` on the running stream (a reload). A resource already
    /// subscribed gives the new cluster the hosts it holds at once; a new one is asked for
    /// (delta: in the next request's `resource_names_subscribe`; state of the world: the next
    /// request names it).
    pub(crate) fn subscribe(&mut self, name: String, sink: Sink) {
        if let Some(resource) = self.resources.get_mut(&name) {
            if let Some(hosts) = &resource.hosts {
                sink.tx.send_modify(|update| {
                    update.version += 1;
                    update.version_info.clone_from(&self.version_info);
                    update.initialized = true;
                    update.hosts.clone_from(hosts);
                    update.added.clone_from(hosts);
                    update.policy = Some(resource.policy);
                });
                sink.stats.set_membership(hosts);
            }
            resource.sinks.push(sink);
            return;
        }
        self.pending_unsubscribe.retain(|n| *n != name);
        self.pending_subscribe.push(name.clone());
        self.resources.insert(
            name,
            Resource {
                sinks: vec![sink],
                hosts: None,
                policy: AssignmentPolicy::default(),
                delta_version: None,
                stale_at: None,
            },
        );
    }

    /// Removes `cluster` from the resource it reads; a resource no cluster reads any more is
    /// no longer asked for. Its watch closes.
    pub(crate) fn unsubscribe(&mut self, cluster: &str) {
        let Some(name) = self
            .resources
            .iter()
            .find(|(_, r)| r.sinks.iter().any(|s| s.cluster == cluster))
            .map(|(name, _)| name.clone())
        else {
            return;
        };
        let Some(resource) = self.resources.get_mut(&name) else {
            return;
        };
        resource.sinks.retain(|s| s.cluster != cluster);
        if resource.sinks.is_empty() {
            self.resources.remove(&name);
            self.pending_subscribe.retain(|n| *n != name);
            self.pending_unsubscribe.push(name);
        }
    }

    /// Delta: the names subscribed and unsubscribed since the last call (or the stream's
    /// start), for the next request.
    pub(crate) fn take_pending(&mut self) -> (Vec<String>, Vec<String>) {
        (
            std::mem::take(&mut self.pending_subscribe),
            std::mem::take(&mut self.pending_unsubscribe),
        )
    }

    /// Subscribed resource names, sorted. A new stream asks for these: nothing is pending.
    pub(crate) fn names(&self) -> Vec<String> {
        self.resources.keys().cloned().collect()
    }

    /// SotW: the last accepted `version_info`.
    pub(crate) fn version_info(&self) -> &str {
        &self.version_info
    }

    /// Delta: resource versions we hold, for `initial_resource_versions` on a new stream.
    pub(crate) fn delta_versions(&self) -> std::collections::HashMap<String, String> {
        let held = self.resources.iter();
        held.filter_map(|(n, r)| Some((n.clone(), r.delta_version.clone()?)))
            .collect()
    }

    /// gRPC state of the world: applies a response; `Err` means NACK (nothing changed). Of
    /// several assignments with one name the first is used.
    pub(crate) fn apply_sotw(&mut self, response: &DiscoveryResponse) -> Result<(), UpdateError> {
        self.apply_state_of_the_world(response, Duplicates::FirstWins)
    }

    /// REST: applies a polled answer; `Err` means NACK (nothing changed). Several assignments
    /// with one name are rejected.
    pub(crate) fn apply_rest(&mut self, response: &DiscoveryResponse) -> Result<(), UpdateError> {
        self.apply_state_of_the_world(response, Duplicates::Reject)
    }

    fn apply_state_of_the_world(
        &mut self,
        response: &DiscoveryResponse,
        duplicates: Duplicates,
    ) -> Result<(), UpdateError> {
        let result =
            decode_all(&response.resources).and_then(|clas| self.validate_sotw(&clas, duplicates));
        let assignments = self.reject_on_error(result)?;
        let single = self.resources.len() == 1;
        for (name, resource) in &mut self.resources {
            match assignments.get(name) {
                Some(assigned) => publish(resource, assigned.clone(), &response.version_info),
                None if single => count_empty(resource),
                None => {}
            }
        }
        self.version_info.clone_from(&response.version_info);
        self.leases.notify_one();
        Ok(())
    }

    /// Validates state-of-the-world assignments as Envoy does: the proto rules for every one,
    /// the host mapping only for the assignment a subscribed cluster uses.
    fn validate_sotw(
        &self,
        clas: &[ClusterLoadAssignment],
        duplicates: Duplicates,
    ) -> Result<BTreeMap<String, Assigned>, UpdateError> {
        for cla in clas {
            check_constraints(cla).map_err(|source| invalid(cla, source))?;
        }
        let mut seen = HashSet::new();
        let mut out = BTreeMap::new();
        for cla in clas {
            let name = &cla.cluster_name;
            if !seen.insert(name.as_str()) {
                let count = clas.iter().filter(|c| c.cluster_name == *name).count();
                if duplicates == Duplicates::Reject && self.resources.contains_key(name) {
                    return Err(UpdateError::Duplicate {
                        name: name.clone(),
                        count,
                    });
                }
                tracing::debug!(resource = %name, count, "assignments after the first of one name ignored");
                continue;
            }
            if self.resources.contains_key(name) {
                out.insert(name.clone(), self.hosts_of(cla)?);
            }
        }
        Ok(out)
    }

    /// Delta: applies a response; `Err` means NACK (nothing changed). Removed resources keep
    /// their hosts and count `update_empty`, as Envoy's EDS ignores removals.
    pub(crate) fn apply_delta(
        &mut self,
        response: &DeltaDiscoveryResponse,
    ) -> Result<(), UpdateError> {
        let added = self.reject_on_error(self.validate_delta(response))?;
        for (name, version, assigned) in added {
            if let Some(resource) = self.resources.get_mut(&name) {
                publish(resource, assigned, &version);
                resource.delta_version = Some(version);
            } else {
                tracing::debug!(resource = %name, "ignoring unsubscribed resource");
            }
        }
        for name in &response.removed_resources {
            if let Some(resource) = self.resources.get_mut(name) {
                resource.delta_version = None;
                count_empty(resource);
            }
        }
        self.leases.notify_one();
        Ok(())
    }

    /// Validates a delta response as Envoy does: duplicate names and type URLs for every
    /// resource; heartbeats (no body, the version we hold) skipped; then decoding, the proto
    /// rules, the name and the host mapping for subscribed resources only (others are not even
    /// decoded). Returns `(name, version, hosts)` of the subscribed ones.
    fn validate_delta(
        &self,
        response: &DeltaDiscoveryResponse,
    ) -> Result<Vec<(String, String, Assigned)>, UpdateError> {
        let mut names = HashSet::new();
        let mut wanted = Vec::new();
        for (index, resource) in response.resources.iter().enumerate() {
            let name = &resource.name;
            if !names.insert(name.as_str()) {
                return Err(UpdateError::DuplicateAdded { name: name.clone() });
            }
            let held = self.resources.get(name);
            let found = match &resource.resource {
                None if held.and_then(|r| r.delta_version.as_ref()) == Some(&resource.version) => {
                    continue;
                }
                None => String::new(),
                Some(any) if any.type_url == CLA_TYPE_URL => {
                    if held.is_some() {
                        wanted.push((index, resource, any));
                    } else {
                        tracing::debug!(resource = %name, "ignoring unsubscribed resource");
                    }
                    continue;
                }
                Some(any) => any.type_url.clone(),
            };
            let name = name.clone();
            return Err(UpdateError::DeltaTypeUrlMismatch { name, found });
        }
        for name in &response.removed_resources {
            if !names.insert(name.as_str()) {
                return Err(UpdateError::DuplicateRemoved { name: name.clone() });
            }
        }
        let mut decoded = Vec::with_capacity(wanted.len());
        for (index, resource, any) in wanted {
            let cla = decode_one(index, any)?;
            check_constraints(&cla).map_err(|source| invalid(&cla, source))?;
            decoded.push((resource, cla));
        }
        let mut out = Vec::with_capacity(decoded.len());
        for (resource, cla) in decoded {
            if cla.cluster_name != resource.name {
                return Err(UpdateError::UnexpectedCluster {
                    expected: resource.name.clone(),
                    found: cla.cluster_name,
                });
            }
            let assigned = self.hosts_of(&cla)?;
            out.push((resource.name.clone(), resource.version.clone(), assigned));
        }
        Ok(out)
    }

    /// A stream or poll failure: `update_attempt` and `update_failure` everywhere; hosts kept.
    pub(crate) fn on_failure(&self) {
        for sink in self.sinks() {
            SourceStats::inc(&sink.stats.source.update_attempt);
            SourceStats::inc(&sink.stats.source.update_failure);
            mark_initialized(sink);
        }
    }

    /// `initial_fetch_timeout` expired: clusters still waiting become initialized.
    pub(crate) fn on_init_timeout(&self) {
        for sink in self.sinks() {
            if !sink.tx.borrow().initialized {
                SourceStats::inc(&sink.stats.init_fetch_timeout);
                mark_initialized(sink);
            }
        }
    }

    /// Rejects an answer that could not even be parsed (REST); always `Err`.
    pub(crate) fn reject(&self, error: UpdateError) -> Result<(), UpdateError> {
        self.reject_on_error(Err(error))
    }

    fn sinks(&self) -> impl Iterator<Item = &Sink> {
        self.resources.values().flat_map(|r| r.sinks.iter())
    }

    fn reject_on_error<T>(&self, result: Result<T, UpdateError>) -> Result<T, UpdateError> {
        if result.is_err() {
            for sink in self.sinks() {
                SourceStats::inc(&sink.stats.source.update_attempt);
                SourceStats::inc(&sink.stats.source.update_rejected);
                mark_initialized(sink);
            }
        }
        result
    }
}

/// Decodes every `Any` as a `ClusterLoadAssignment`, checking its type URL.
pub(crate) fn decode_all(resources: &[Any]) -> Result<Vec<ClusterLoadAssignment>, UpdateError> {
    resources
        .iter()
        .enumerate()
        .map(|(index, any)| decode_one(index, any))
        .collect()
}

fn decode_one(index: usize, any: &Any) -> Result<ClusterLoadAssignment, UpdateError> {
    if any.type_url != CLA_TYPE_URL {
        let found = any.type_url.clone();
        return Err(UpdateError::TypeUrlMismatch { index, found });
    }
    ClusterLoadAssignment::decode(any.value.as_slice())
        .map_err(|source| UpdateError::Decode { index, source })
}

fn invalid(cla: &ClusterLoadAssignment, source: ClaError) -> UpdateError {
    let name = cla.cluster_name.clone();
    UpdateError::Invalid { name, source }
}

/// Publishes an accepted assignment to every sink of `resource`; a changed policy is a
/// change as a changed host is (Envoy rebuilds the host set for either). Every accepted
/// assignment restarts the lease: none without `endpoint_stale_after`, else that long from now
/// (counted in `assignment_timeout_received`, as Envoy counts it).
fn publish(resource: &mut Resource, (hosts, policy, stale): Assigned, version_info: &str) {
    resource.stale_at = stale.map(|lease| Instant::now() + lease);
    if stale.is_some() {
        for sink in &resource.sinks {
            SourceStats::inc(&sink.stats.assignment_timeout_received);
        }
    }
    let unchanged = resource.hosts.as_ref() == Some(&hosts) && resource.policy == policy;
    let (added, removed) = diff_hosts(resource.hosts.as_deref().unwrap_or_default(), &hosts);
    for sink in &resource.sinks {
        let stats = &sink.stats;
        SourceStats::inc(&stats.source.update_attempt);
        SourceStats::inc(&stats.source.update_success);
        stats.version.store(
            version_gauge(version_info),
            std::sync::atomic::Ordering::Relaxed,
        );
        if unchanged {
            SourceStats::inc(&stats.source.update_no_rebuild);
            sink.tx.send_if_modified(|update| {
                let was = (update.initialized, update.version_info.clone());
                update.initialized = true;
                update.version_info = version_info.to_owned();
                was != (true, version_info.to_owned())
            });
            continue;
        }
        SourceStats::inc(&stats.source.membership_change);
        stats.set_membership(&hosts);
        sink.tx.send_modify(|update| {
            update.version += 1;
            update.version_info = version_info.to_owned();
            update.initialized = true;
            update.hosts.clone_from(&hosts);
            update.added.clone_from(&added);
            update.removed.clone_from(&removed);
            update.policy = Some(policy);
        });
    }
    resource.hosts = Some(hosts);
    resource.policy = policy;
}

fn count_empty(resource: &Resource) {
    for sink in &resource.sinks {
        SourceStats::inc(&sink.stats.source.update_attempt);
        SourceStats::inc(&sink.stats.source.update_success);
        SourceStats::inc(&sink.stats.source.update_empty);
        mark_initialized(sink);
    }
}

fn mark_initialized(sink: &Sink) {
    sink.tx
        .send_if_modified(|update| !std::mem::replace(&mut update.initialized, true));
}
