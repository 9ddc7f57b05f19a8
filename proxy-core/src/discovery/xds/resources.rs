//! The CDS, LDS and RDS state of one ADS stream: apply state-of-the-world and delta responses
//! through one path, decide ACK or NACK, and publish what is accepted as an [`Overlay`].
//!
//! Both protocols reduce a response to the whole next set of its type (state of the world:
//! the response's resources; delta: the held set with the response's additions and removals),
//! and that set is checked as one, together with the other type and with the names the file
//! defines: every cluster by the file's rules ([`cds`]), every listener against the clusters it
//! may name ([`lds`]), and no name that the file also defines (a clash is refused naming both
//! sources; the file's resource is never overridden). Any failure NACKs the whole response and
//! keeps the last good state.
//!
//! Warming, as Envoy's: a listener naming a cluster that neither the file nor CDS defines is
//! held (accepted, not published) until the cluster arrives; an HTTP listener's inline route
//! table is refused instead, unless its `validate_clusters` is false (Envoy checks inline
//! tables). A CDS cluster is published at once; an EDS one then waits for its first endpoints (or its `initial_fetch_timeout`) in the
//! daemon's cluster loop, which publishes no service before its cluster's first hosts.
//!
//! RDS: the route configurations the listeners name are asked for by name
//! (`resources/names.rs`). An RDS listener is held until its route configuration is (and every
//! cluster it names is known, refused instead when its `validate_clusters` is true); a changed
//! route configuration changes the listener's chain; a removed one (state of the world: absent
//! from the answer; delta: removed) withdraws the listener's service, since a chain needs routes.

use std::collections::{BTreeMap, BTreeSet};

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryResponse, DiscoveryResponse, Resource,
};

use crate::{
    config::{ClusterType, Config, sources::xds::XdsConfig},
    desired::{Feed, Overlay},
    discovery::xds::{
        cds::{self, CLUSTER_TYPE_URL, ResourceError},
        hcm::{self, ROUTE_TYPE_URL},
        lds::{self, LISTENER_TYPE_URL},
        listener::ListenerForm,
    },
};

mod decode;
mod error;
mod names;

use self::decode::{Sets, versions};
pub use self::error::ResponseError;

/// The names the configuration file defines, which xDS may not define again.
#[derive(Clone, Debug, Default)]
pub struct FileNames {
    /// Clusters and their types (listeners may name them).
    pub clusters: BTreeMap<String, ClusterType>,
    /// Services.
    pub services: BTreeSet<String>,
    /// Config entries, by kind and name (a listener's generated entries may not take them).
    pub entries: BTreeSet<(&'static str, String)>,
}

impl FileNames {
    /// The names `config` defines.
    pub fn of(config: &Config) -> Self {
        Self {
            clusters: config
                .clusters
                .iter()
                .map(|c| (c.name.clone(), c.cluster_type))
                .collect(),
            services: config.services.iter().map(|s| s.name.clone()).collect(),
            entries: config
                .config_entries
                .iter()
                .map(|e| (e.kind().as_str(), e.name().to_owned()))
                .collect(),
        }
    }
}

/// The CDS, LDS and RDS resources of one stream.
pub struct ResourceState {
    xds: XdsConfig,
    file: FileNames,
    held: Sets,
    /// State of the world: the last accepted `version_info` by type URL.
    versions: BTreeMap<String, String>,
    /// The wildcard types subscribed, in the order Envoy asks for them.
    types: Vec<&'static str>,
    /// Subscribed types without a first answer (accepted or not): nothing is published before
    /// every type has answered once, so the first overlay is never a partial state.
    waiting: BTreeSet<&'static str>,
    /// The RDS names asked for on this stream.
    routes_asked: BTreeSet<String>,
    /// State of the world: the nonce of the last RDS response on this stream.
    route_nonce: String,
    /// What the last accepted state publishes.
    current: Overlay,
    /// The cluster forms (in name order) whose checked clusters are `current.clusters`: a
    /// response that leaves them as they are (a listener or route change) is not checked
    /// through the file's rules again, since the same forms check to the same clusters.
    checked_forms: Vec<std::sync::Arc<str>>,
    feed: Feed,
}

impl ResourceState {
    /// An empty state publishing on `feed`, checking EDS clusters against `xds` and names
    /// against `file`.
    /// Subscribes the types `xds` enables (`cds_config`, `lds_config`; both when neither is
    /// set); RDS comes with LDS, by the names the listeners give.
    pub fn new(xds: XdsConfig, file: FileNames, feed: Feed) -> Self {
        let mut types = Vec::new();
        if xds.cds_config.is_some() || xds.lds_config.is_none() {
            types.push(CLUSTER_TYPE_URL);
        }
        if xds.lds_config.is_some() || xds.cds_config.is_none() {
            types.push(LISTENER_TYPE_URL);
        }
        Self {
            xds,
            file,
            held: Sets::default(),
            versions: BTreeMap::new(),
            waiting: types.iter().copied().collect(),
            types,
            routes_asked: BTreeSet::new(),
            route_nonce: String::new(),
            current: Overlay::default(),
            checked_forms: Vec::new(),
            feed,
        }
    }

    /// The wildcard types subscribed, in the order Envoy asks for them (clusters, then
    /// listeners).
    pub fn types(&self) -> &[&'static str] {
        &self.types
    }

    /// Whether a response of `type_url` is ours (RDS is, with LDS).
    pub fn handles(&self, type_url: &str) -> bool {
        self.types.contains(&type_url)
            || (type_url == ROUTE_TYPE_URL && self.types.contains(&LISTENER_TYPE_URL))
    }

    /// `type_url` answered (accepted or not): the first overlay goes out once every
    /// subscribed type has.
    fn answered(&mut self, type_url: &str) {
        let was_waiting = !self.waiting.is_empty();
        self.waiting.retain(|t| *t != type_url);
        if was_waiting && self.waiting.is_empty() {
            self.feed.send_replace(self.current.clone());
        }
    }

    /// State of the world: the last accepted `version_info` of `type_url`.
    pub fn version_info(&self, type_url: &str) -> &str {
        self.versions.get(type_url).map_or("", String::as_str)
    }

    /// Delta: the versions held of `type_url`, for `initial_resource_versions` (RDS: of the
    /// names the listeners ask for).
    pub fn delta_versions(&self, type_url: &str) -> std::collections::HashMap<String, String> {
        match type_url {
            CLUSTER_TYPE_URL => versions(&self.held.clusters),
            ROUTE_TYPE_URL => {
                let mut held = versions(&self.held.routes);
                let names = self.route_names();
                held.retain(|n, _| names.contains(n));
                held
            }
            _ => versions(&self.held.listeners),
        }
    }

    /// The file was reloaded: its names change what clashes and what a listener waits for.
    /// `Err` (nothing changed) when an accepted xDS resource now clashes with the file.
    pub fn set_file(&mut self, file: FileNames) -> Result<(), ResponseError> {
        let old = std::mem::replace(&mut self.file, file);
        if let Err(error) = self.commit(self.held.clone()) {
            self.file = old;
            return Err(error);
        }
        Ok(())
    }

    /// State of the world: the response's resources are the whole set of its type.
    pub fn apply_sotw(&mut self, response: &DiscoveryResponse) -> Result<(), ResponseError> {
        let version = &response.version_info;
        let mut named = Vec::with_capacity(response.resources.len());
        for (index, any) in response.resources.iter().enumerate() {
            named.push((index, None, version.clone(), any));
        }
        if response.type_url == ROUTE_TYPE_URL {
            self.route_nonce.clone_from(&response.nonce);
        }
        let named = self.asked(&response.type_url, named);
        let result = self
            .held
            .next(&response.type_url, named, &[], true)
            .and_then(|sets| self.commit(sets));
        if result.is_ok() {
            self.versions
                .insert(response.type_url.clone(), version.clone());
        }
        self.answered(&response.type_url);
        result
    }

    /// Delta: the held set with the response's additions and removals.
    pub fn apply_delta(&mut self, response: &DeltaDiscoveryResponse) -> Result<(), ResponseError> {
        let mut named = Vec::with_capacity(response.resources.len());
        for (index, resource) in response.resources.iter().enumerate() {
            let Resource {
                name,
                version,
                resource,
                ..
            } = resource;
            let Some(any) = resource else {
                continue; // A heartbeat: the version we hold, without a body.
            };
            named.push((index, Some(name.clone()), version.clone(), any));
        }
        let named = self.asked(&response.type_url, named);
        let removed = &response.removed_resources;
        let result = self
            .held
            .next(&response.type_url, named, removed, false)
            .and_then(|sets| self.commit(sets));
        self.answered(&response.type_url);
        result
    }

    /// Checks the next sets as one and, when they pass, keeps and publishes them.
    fn commit(&mut self, sets: Sets) -> Result<(), ResponseError> {
        let overlay = self.check(&sets)?;
        self.checked_forms = sets.clusters.values().map(|h| h.form.clone()).collect();
        self.held = sets;
        self.current = overlay;
        if self.waiting.is_empty() {
            self.feed.send_replace(self.current.clone());
        }
        Ok(())
    }

    /// The overlay of the sets, or why they are refused.
    fn check(&self, sets: &Sets) -> Result<Overlay, ResponseError> {
        let clash = |kind, name: &String, field| ResponseError::Clash {
            kind,
            name: name.clone(),
            field,
        };
        if let Some(name) = sets
            .clusters
            .keys()
            .find(|n| self.file.clusters.contains_key(*n))
        {
            return Err(clash("cluster", name, "clusters"));
        }
        if let Some(name) = sets
            .listeners
            .keys()
            .find(|n| self.file.services.contains(*n))
        {
            return Err(clash("listener", name, "services"));
        }
        let listeners = routed(sets);
        if let Some((kind, name)) = self.entry_clash(&listeners) {
            return Err(ResponseError::Clash {
                kind,
                name,
                field: "config_entries",
            });
        }
        let forms: Vec<(String, std::sync::Arc<str>)> = sets
            .clusters
            .iter()
            .map(|(n, h)| (n.clone(), h.form.clone()))
            .collect();
        let unchanged = forms.len() == self.checked_forms.len()
            && forms
                .iter()
                .zip(&self.checked_forms)
                .all(|((_, now), was)| std::sync::Arc::ptr_eq(now, was) || now == was);
        let typed = if forms.is_empty() {
            std::sync::Arc::default()
        } else if unchanged {
            self.current.clusters.clone()
        } else {
            cds::validate(&forms, &self.xds)?.into()
        };
        let mut known = self.file.clusters.clone();
        known.extend(typed.iter().map(|c| (c.name.clone(), c.cluster_type)));
        Self::listener_overlay(typed, listeners, &known)
    }

    /// The first generated config entry (kind, name) that the file defines too.
    fn entry_clash(&self, listeners: &[(String, ListenerForm)]) -> Option<(&'static str, String)> {
        let generated = listeners.iter().flat_map(|(_, l)| &l.entries);
        generated
            .filter_map(|e| Some((e.get("Kind")?.as_str()?, e.get("Name")?.as_str()?)))
            .find_map(|(kind, name)| {
                self.file
                    .entries
                    .iter()
                    .find(|(k, n)| *k == kind && n == name)
                    .map(|(k, n)| (*k, n.clone()))
            })
    }

    /// Checks every listener (one naming a cluster not known yet against a stand-in) and
    /// publishes the ready ones: those whose clusters are all known.
    fn listener_overlay(
        clusters: std::sync::Arc<Vec<crate::config::Cluster>>,
        all: Vec<(String, ListenerForm)>,
        known: &BTreeMap<String, ClusterType>,
    ) -> Result<Overlay, ResponseError> {
        let mut stand_ins = known.clone();
        for (_, form) in &all {
            for c in &form.clusters {
                stand_ins.entry(c.clone()).or_insert(ClusterType::Static);
            }
        }
        if !all.is_empty() {
            let stand_ins: Vec<(String, ClusterType)> = stand_ins.into_iter().collect();
            lds::validate(&all, &stand_ins)?;
        }
        let mut ready = Vec::with_capacity(all.len());
        for (name, form) in all {
            let Some(cluster) = form.clusters.iter().find(|c| !known.contains_key(*c)) else {
                ready.push((name, form));
                continue;
            };
            if form.validate_clusters {
                return Err(unknown_route_cluster(&name, &form, cluster).into());
            }
            tracing::info!(listener = %name, %cluster, "listener held until its cluster arrives (warming)");
        }
        let known: Vec<(String, ClusterType)> =
            known.iter().map(|(n, t)| (n.clone(), *t)).collect();
        let (services, config_entries) = if ready.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            lds::validate(&ready, &known)?
        };
        Ok(Overlay {
            clusters,
            services: services.into(),
            config_entries,
        })
    }

    /// The names of the accepted clusters.
    pub fn cluster_names(&self) -> Vec<String> {
        self.held.clusters.keys().cloned().collect()
    }

    /// The names of the accepted listeners (published or held).
    pub fn listener_names(&self) -> Vec<String> {
        self.held.listeners.keys().cloned().collect()
    }
}

/// The listeners with their chains: an RDS listener with its route configuration's, one
/// whose route configuration is not held is left out (held, warming).
fn routed(sets: &Sets) -> Vec<(String, ListenerForm)> {
    let mut all = Vec::with_capacity(sets.listeners.len());
    for (name, held) in &sets.listeners {
        let Some(route) = &held.form.rds else {
            all.push((name.clone(), held.form.clone()));
            continue;
        };
        if let Some(table) = sets.routes.get(route) {
            let service = held.form.service.clone();
            all.push((
                name.clone(),
                hcm::with_routes(name, service, Some(route.clone()), &table.form),
            ));
        } else {
            tracing::info!(listener = %name, route, "listener held until its route configuration arrives (warming)");
        }
    }
    all
}

/// Envoy's refusal of a route table (inline or RDS) naming a cluster not known.
fn unknown_route_cluster(listener: &str, form: &ListenerForm, cluster: &str) -> ResourceError {
    let weighted = form.entries.iter().any(|e| {
        e["Kind"] == "service-splitter"
            && e["Splits"]
                .as_array()
                .is_some_and(|s| s.iter().any(|x| x["Service"] == cluster))
    });
    let what = if weighted {
        "weighted cluster"
    } else {
        "cluster"
    };
    let (kind, name, field) = match &form.rds {
        Some(route) => ("route configuration", route.as_str(), "virtual_hosts[0]"),
        None => ("listener", listener, "route_config"),
    };
    ResourceError::Invalid {
        kind,
        name: name.to_owned(),
        field: field.to_owned(),
        reason: format!("route: unknown {what} '{cluster}'"),
    }
}
