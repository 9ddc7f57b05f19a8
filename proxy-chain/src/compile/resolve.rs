//! Targets and resolver nodes: redirects, default subsets, timeouts, SNI, mesh gateway modes and
//! failover (Consul's `newTarget`, `rewriteTarget` and `getResolverNode`).

use std::{borrow::Cow, collections::HashSet};

use super::{Compiler, DEFAULT_CONNECT_TIMEOUT, DEFAULT_TENANCY};
use crate::{
    entries::{MeshGatewayMode, ResolverFailover, ServiceResolver},
    error::ChainError,
    output::{DiscoveryFailover, DiscoveryGraphNode, DiscoveryResolver, DiscoveryTarget, NodeType},
};

/// The identifying fields of a target (Consul's `DiscoveryTargetOpts`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct TargetOpts {
    pub service: String,
    pub service_subset: String,
    pub namespace: String,
    pub partition: String,
    pub datacenter: String,
    pub peer: String,
}

impl TargetOpts {
    pub fn service(name: &str) -> Self {
        TargetOpts {
            service: name.to_owned(),
            ..Default::default()
        }
    }

    fn of(target: &DiscoveryTarget) -> Self {
        TargetOpts {
            service: target.service.clone(),
            service_subset: target.service_subset.clone(),
            namespace: target.namespace.clone(),
            partition: target.partition.clone(),
            datacenter: target.datacenter.clone(),
            peer: target.peer.clone(),
        }
    }

    fn of_failover(f: &ResolverFailover) -> Self {
        TargetOpts {
            service: f.service.clone(),
            service_subset: f.service_subset.clone(),
            namespace: f.namespace.clone(),
            ..Default::default()
        }
    }

    /// `[<subset>.]<service>.<ns>.<partition>.<dc>`, or `<service>.<ns>.default.external.<peer>`.
    fn id(&self) -> String {
        let TargetOpts {
            service,
            service_subset,
            namespace,
            partition,
            datacenter,
            peer,
        } = self;
        if !peer.is_empty() {
            format!("{service}.{namespace}.default.external.{peer}")
        } else if service_subset.is_empty() {
            format!("{service}.{namespace}.{partition}.{datacenter}")
        } else {
            format!("{service_subset}.{service}.{namespace}.{partition}.{datacenter}")
        }
    }
}

/// Consul's `connect.ServiceSNI`: `[<subset>.]<service>.<ns>.<dc>.internal.<trust domain>` in
/// the default partition, `...<ns>.<partition>.<dc>.internal-v1.<trust domain>` elsewhere.
pub fn service_sni(
    subset: &str,
    service: &str,
    ns: &str,
    partition: &str,
    dc: &str,
    trust: &str,
) -> String {
    let ns = if ns.is_empty() { DEFAULT_TENANCY } else { ns };
    let partition = if partition.is_empty() {
        DEFAULT_TENANCY
    } else {
        partition
    };
    let mut parts = Vec::with_capacity(7);
    if !subset.is_empty() {
        parts.push(subset);
    }
    parts.extend([service, ns]);
    if partition == DEFAULT_TENANCY {
        parts.extend([dc, "internal", trust]);
    } else {
        parts.extend([partition, dc, "internal-v1", trust]);
    }
    parts.join(".")
}

impl Compiler<'_> {
    /// Fills defaults, interns the target and returns its ID.
    pub(super) fn new_target(&mut self, mut opts: TargetOpts) -> String {
        let or = |value: String, default: &str| {
            if value.is_empty() {
                default.to_owned()
            } else {
                value
            }
        };
        if opts.peer.is_empty() {
            opts.datacenter = or(opts.datacenter, &self.req.evaluate_in_datacenter);
            opts.namespace = or(opts.namespace, &self.req.evaluate_in_namespace);
            opts.partition = or(opts.partition, &self.req.evaluate_in_partition);
        } else {
            opts.datacenter.clear();
            opts.partition = DEFAULT_TENANCY.to_owned();
            opts.namespace = or(opts.namespace, DEFAULT_TENANCY);
        }
        let id = opts.id();
        if self.targets.contains_key(&id) {
            return id;
        }
        let mut target = DiscoveryTarget {
            id: id.clone(),
            service: opts.service,
            service_subset: opts.service_subset,
            namespace: opts.namespace,
            partition: opts.partition,
            datacenter: opts.datacenter,
            peer: opts.peer,
            ..Default::default()
        };
        if target.peer.is_empty() {
            target.sni = service_sni(
                &target.service_subset,
                &target.service,
                &target.namespace,
                &target.partition,
                &target.datacenter,
                &self.req.evaluate_in_trust_domain,
            );
            target.name = target.sni.clone();
        }
        self.targets.insert(id.clone(), target);
        id
    }

    /// Applies a redirect or failover rewrite to a target (Consul's `rewriteTarget`).
    pub(super) fn rewrite_target(&mut self, id: &str, opts: &TargetOpts) -> String {
        let mut merged = TargetOpts::of(&self.targets[id]);
        if !opts.service.is_empty() && opts.service != merged.service {
            merged.service = opts.service.clone();
            merged.service_subset.clear();
        }
        if !opts.service_subset.is_empty() {
            merged.service_subset = opts.service_subset.clone();
        }
        if !opts.partition.is_empty() {
            merged.partition = opts.partition.clone();
        }
        if !opts.namespace.is_empty() || !opts.peer.is_empty() {
            merged.namespace = opts.namespace.clone();
        }
        if !opts.datacenter.is_empty() {
            merged.datacenter = opts.datacenter.clone();
        }
        merged.peer = opts.peer.clone();
        self.new_target(merged)
    }

    fn resolver_entry(&self, service: &str) -> Cow<'_, ServiceResolver> {
        match self.entries.resolver(service) {
            Some(resolver) => Cow::Borrowed(resolver),
            None => Cow::Owned(ServiceResolver::default_for(service)),
        }
    }

    /// Follows redirects and default subsets from `id`; returns the final target ID and its
    /// resolver entry.
    fn follow_redirects(
        &mut self,
        mut id: String,
    ) -> Result<(String, Option<ServiceResolver>), ChainError> {
        let mut history = HashSet::new();
        let mut order = Vec::new();
        loop {
            if self.resolved.contains(&id) {
                return Ok((id, None));
            }
            let target = &self.targets[&id];
            let (service, subset) = (target.service.clone(), target.service_subset.clone());
            if target.peer.is_empty() {
                self.record_service_protocol(&service)?;
            }
            let resolver = self.resolver_entry(&service).into_owned();
            order.push(id.clone());
            if !history.insert(id.clone()) {
                return Err(ChainError::CircularRedirect(order));
            }
            if let Some(redirect) = &resolver.redirect {
                let opts = TargetOpts {
                    service: redirect.service.clone(),
                    service_subset: redirect.service_subset.clone(),
                    namespace: redirect.namespace.clone(),
                    partition: redirect.partition.clone(),
                    datacenter: redirect.datacenter.clone(),
                    peer: redirect.peer.clone(),
                };
                let redirected = self.rewrite_target(&id, &opts);
                if redirected != id {
                    id = redirected;
                    continue;
                }
            }
            if subset.is_empty() && !resolver.default_subset.is_empty() {
                let opts = TargetOpts {
                    service_subset: resolver.default_subset.clone(),
                    ..Default::default()
                };
                id = self.rewrite_target(&id, &opts);
                continue;
            }
            if !resolver.subset_exists(&subset) {
                return Err(ChainError::MissingSubset { service, subset });
            }
            return Ok((id, Some(resolver)));
        }
    }

    /// Builds (or finds) the resolver node for a target and returns its final target ID. With
    /// `for_failover` the node is neither recorded nor given failover of its own.
    pub(super) fn resolver_node(
        &mut self,
        id: String,
        for_failover: bool,
    ) -> Result<String, ChainError> {
        let (id, resolver) = self.follow_redirects(id)?;
        let Some(resolver) = resolver else {
            return Ok(id);
        };
        let mut connect_timeout = resolver.connect_timeout;
        if connect_timeout.as_nanos() < 1 {
            connect_timeout = DEFAULT_CONNECT_TIMEOUT;
        }
        let override_timeout = self.req.override_connect_timeout;
        if override_timeout.as_nanos() > 0 && connect_timeout != override_timeout {
            connect_timeout = override_timeout;
            self.customized.connect_timeout = true;
        }
        self.configure_target(&id, &resolver, connect_timeout)?;
        self.retained_targets.insert(id.clone());
        if for_failover {
            return Ok(id);
        }
        let node = DiscoveryGraphNode {
            node_type: NodeType::Resolver,
            name: id.clone(),
            routes: Vec::new(),
            splits: Vec::new(),
            resolver: Some(DiscoveryResolver {
                connect_timeout,
                default: resolver.is_default(),
                request_timeout: resolver.request_timeout,
                target: id.clone(),
                failover: None,
            }),
            load_balancer: resolver.load_balancer.clone(),
        };
        let key = node.map_key();
        self.nodes.insert(key.clone(), node);
        self.resolved.insert(id.clone());
        let failover = self.failover(&id, &resolver)?;
        if let Some(resolver_node) = self.nodes.get_mut(&key).and_then(|n| n.resolver.as_mut()) {
            resolver_node.failover = failover;
        }
        Ok(id)
    }

    /// Per-target settings: timeout, subset, external SNI and mesh gateway mode.
    ///
    /// Mesh gateway modes follow Consul 1.8.7: a target in the datacenter the chain is used
    /// from (`use_in_datacenter`) and an external target get none; a target in another
    /// datacenter takes its service-defaults mode, else proxy-defaults', and then the
    /// request's override, which marks the chain customized only where it changed a mode.
    /// (Consul 1.11 and later give local targets modes too, for partitions; 1.8.7 does not.)
    fn configure_target(
        &mut self,
        id: &str,
        resolver: &ServiceResolver,
        connect_timeout: crate::duration::GoDuration,
    ) -> Result<(), ChainError> {
        let entries = self.entries;
        let override_mode = self.req.override_mesh_gateway;
        let target = self.targets.get_mut(id).expect("interned target");
        target.connect_timeout = connect_timeout;
        target.subset = resolver
            .subsets
            .get(&target.service_subset)
            .cloned()
            .unwrap_or_default();
        let service_defaults = entries.service_defaults(&target.service);
        if let Some(sni) = service_defaults
            .map(|s| &s.external_sni)
            .filter(|s| !s.is_empty())
        {
            target.sni = sni.clone();
            target.external = true;
        }
        if target.external {
            let service = target.service.clone();
            if resolver.redirect.is_some() {
                return Err(ChainError::ExternalSniRedirect(service));
            }
            if !resolver.subsets.is_empty() {
                return Err(ChainError::ExternalSniSubsets(service));
            }
            if !resolver.failover.is_empty() {
                return Err(ChainError::ExternalSniFailover(service));
            }
            target.mesh_gateway.mode = MeshGatewayMode::Default;
            return Ok(());
        }
        // Not in Consul 1.8.7 (1.10+): every non-external target takes `DialedDirectly`.
        if let Some(defaults) = service_defaults {
            target.transparent_proxy.dialed_directly = defaults.transparent_proxy.dialed_directly;
        }
        if let Some(proxy) = entries.proxy_defaults() {
            target.transparent_proxy.dialed_directly |= proxy.transparent_proxy.dialed_directly;
        }
        if target.datacenter == self.req.use_in_datacenter {
            target.mesh_gateway.mode = MeshGatewayMode::Default;
            return Ok(());
        }
        if let Some(defaults) = service_defaults {
            target.mesh_gateway = defaults.mesh_gateway;
        }
        if let Some(proxy) = entries.proxy_defaults()
            && target.mesh_gateway.mode.is_default()
        {
            target.mesh_gateway.mode = proxy.mesh_gateway.mode;
        }
        if !override_mode.is_default() && target.mesh_gateway.mode != override_mode {
            target.mesh_gateway.mode = override_mode;
            self.customized.mesh_gateway = true;
        }
        Ok(())
    }

    /// Failover targets of a resolved target, redirected but without failover of their own.
    fn failover(
        &mut self,
        id: &str,
        resolver: &ServiceResolver,
    ) -> Result<Option<DiscoveryFailover>, ChainError> {
        let subset = self.targets[id].service_subset.clone();
        let Some(section) = resolver
            .failover
            .get(&subset)
            .or_else(|| resolver.failover.get("*"))
        else {
            return Ok(None);
        };
        let mut candidates = Vec::new();
        if !section.datacenters.is_empty() {
            for dc in &section.datacenters {
                let opts = TargetOpts {
                    datacenter: dc.clone(),
                    ..TargetOpts::of_failover(section)
                };
                candidates.push(self.rewrite_target(id, &opts));
            }
        } else if !section.targets.is_empty() {
            for t in &section.targets {
                let opts = TargetOpts {
                    service: t.service.clone(),
                    service_subset: t.service_subset.clone(),
                    namespace: t.namespace.clone(),
                    partition: t.partition.clone(),
                    datacenter: t.datacenter.clone(),
                    peer: t.peer.clone(),
                };
                candidates.push(self.rewrite_target(id, &opts));
            }
        } else {
            candidates.push(self.rewrite_target(id, &TargetOpts::of_failover(section)));
        }
        candidates.retain(|candidate| candidate != id);
        if candidates.is_empty() {
            return Ok(None);
        }
        let policy = match &section.policy {
            Some(policy) if !policy.mode.is_empty() => Some(policy.clone()),
            _ => self
                .entries
                .proxy_defaults()
                .and_then(|p| p.failover_policy.clone()),
        };
        let mut targets = Vec::with_capacity(candidates.len());
        for candidate in candidates {
            targets.push(self.resolver_node(candidate, true)?);
        }
        Ok(Some(DiscoveryFailover { targets, policy }))
    }
}
