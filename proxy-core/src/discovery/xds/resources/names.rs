//! RDS by name on the ADS stream: the route configurations the listeners name, asked for
//! whenever that set changes (state of the world: every name, with the last RDS version and
//! nonce; delta: the names added and dropped), right after the listener response that changed
//! it, as Envoy does.

use std::collections::BTreeSet;

use envoy_types::pb::envoy::{
    config::{core::v3::Node, route::v3::RouteConfiguration},
    service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest},
};
use prost::Message;

use super::{ResourceState, decode::Named};
use crate::discovery::xds::hcm::ROUTE_TYPE_URL;

impl ResourceState {
    /// The route configurations the held listeners name.
    pub fn route_names(&self) -> BTreeSet<String> {
        let forms = self.held.listeners.values();
        forms.filter_map(|h| h.form.rds.clone()).collect()
    }

    /// State of the world: the names an ACK or NACK of `type_url` carries (every request
    /// restates the subscription: the RDS names asked; none for a wildcard type).
    pub fn asked_names(&self, type_url: &str) -> Vec<String> {
        if type_url == ROUTE_TYPE_URL {
            self.routes_asked.iter().cloned().collect()
        } else {
            Vec::new()
        }
    }

    /// The resources of a response of `type_url` to consider: of RDS, only those a listener
    /// names (Envoy ignores the others); one that does not decode is kept, to be refused.
    pub(super) fn asked<'a>(&self, type_url: &str, named: Named<'a>) -> Named<'a> {
        if type_url != ROUTE_TYPE_URL {
            return named;
        }
        let names = self.route_names();
        let name_of = |any: &envoy_types::pb::google::protobuf::Any| {
            RouteConfiguration::decode(any.value.as_slice())
                .ok()
                .map(|c| c.name)
        };
        named
            .into_iter()
            .filter(|(_, name, _, any)| {
                let name = name.clone().or_else(|| name_of(any));
                name.is_none_or(|n| names.contains(&n))
            })
            .collect()
    }

    /// A new stream: nothing is asked on it yet.
    pub fn stream_started(&mut self) {
        self.routes_asked.clear();
        self.route_nonce.clear();
    }

    /// The names to ask for when they differ from those asked on this stream: (every name,
    /// the names added, the names dropped); marks them asked.
    fn route_names_due(&mut self) -> Option<(Vec<String>, Vec<String>, Vec<String>)> {
        let now = self.route_names();
        if now == self.routes_asked {
            return None;
        }
        let added = now.difference(&self.routes_asked).cloned().collect();
        let dropped = self.routes_asked.difference(&now).cloned().collect();
        self.routes_asked.clone_from(&now);
        Some((now.into_iter().collect(), added, dropped))
    }

    /// State of the world: the RDS request when the names changed (every name; none left is
    /// an empty list).
    pub fn route_request_sotw(&mut self, node: &Node) -> Option<DiscoveryRequest> {
        let (names, _, _) = self.route_names_due()?;
        tracing::info!(resources = ?names, "RDS subscription changed on the running stream");
        Some(DiscoveryRequest {
            version_info: self.version_info(ROUTE_TYPE_URL).to_owned(),
            node: Some(node.clone()),
            resource_names: names,
            type_url: ROUTE_TYPE_URL.to_owned(),
            response_nonce: self.route_nonce.clone(),
            ..Default::default()
        })
    }

    /// Delta: the RDS request when the names changed; on a new stream (`first`) it lists the
    /// versions held in `initial_resource_versions`.
    pub fn route_request_delta(
        &mut self,
        node: &Node,
        first: bool,
    ) -> Option<DeltaDiscoveryRequest> {
        let (_, subscribe, unsubscribe) = self.route_names_due()?;
        tracing::info!(
            ?subscribe,
            ?unsubscribe,
            "RDS subscription changed on the running stream"
        );
        let initial_resource_versions = if first {
            self.delta_versions(ROUTE_TYPE_URL)
        } else {
            std::collections::HashMap::new()
        };
        Some(DeltaDiscoveryRequest {
            node: Some(node.clone()),
            type_url: ROUTE_TYPE_URL.to_owned(),
            resource_names_subscribe: subscribe,
            resource_names_unsubscribe: unsubscribe,
            initial_resource_versions,
            ..Default::default()
        })
    }
}
