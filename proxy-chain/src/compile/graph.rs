//! Splitter nodes and whole-graph passes: cycle detection, flattening of nested splitters and
//! pruning of unreferenced nodes.

use std::collections::{BTreeSet, HashSet};

use super::{Compiler, DEFAULT_TENANCY, resolve::TargetOpts, tenancy_name};
use crate::{
    entries::{LoadBalancer, ServiceSplit, normalize_split_weight},
    error::ChainError,
    output::{DiscoveryGraphNode, DiscoverySplit, NodeType, node_key},
};

/// A step of the cycle search: visit a node, or leave the most recently entered one.
enum Step {
    Visit(String),
    Leave,
}

impl Compiler<'_> {
    /// The splitter node for `service`, built on first use; `None` when it has no splitter (or
    /// splitters are disabled by a protocol override).
    pub(super) fn splitter_node(&mut self, service: &str) -> Result<Option<String>, ChainError> {
        let name = tenancy_name(service);
        let key = node_key(NodeType::Splitter, &name);
        if self.splitters_built.contains(&name) {
            return Ok(Some(key));
        }
        let entries = self.entries;
        let Some(splitter) = entries.splitter(service) else {
            return Ok(None);
        };
        if self.disable_advanced {
            self.customized.protocol = true;
            return Ok(None);
        }
        if self.splitter_depth >= super::MAX_SPLITTER_DEPTH {
            return Err(ChainError::SplittersTooDeep {
                chain: self.req.service_name.clone(),
                max: super::MAX_SPLITTER_DEPTH,
            });
        }
        // Recorded before recursing so that a loop of splitters terminates.
        self.splitters_built.insert(name.clone());
        self.nodes
            .insert(key.clone(), empty_node(NodeType::Splitter, &name));
        let mut splits = Vec::with_capacity(splitter.splits.len());
        let mut load_balancer = None;
        for split in &splitter.splits {
            self.splitter_depth += 1;
            let next = self.split_next_node(service, split);
            self.splitter_depth -= 1;
            let (next_node, resolver_lb) = next?;
            // Only one hash policy can apply to a split route: the first one wins.
            if load_balancer.is_none() {
                load_balancer = resolver_lb.filter(LoadBalancer::is_hash_based);
            }
            splits.push(DiscoverySplit {
                definition: split.clone(),
                weight: split.weight,
                next_node,
            });
        }
        let node = self.nodes.get_mut(&key).expect("recorded above");
        node.splits = splits;
        node.load_balancer = load_balancer;
        self.uses_advanced = true;
        Ok(Some(key))
    }

    /// Next node of one split of `service`'s splitter: another service's splitter when the
    /// split names a different service without a subset, else a resolver (whose load balancer
    /// is returned as well).
    fn split_next_node(
        &mut self,
        service: &str,
        split: &ServiceSplit,
    ) -> Result<(String, Option<LoadBalancer>), ChainError> {
        let split_service = if split.service.is_empty() {
            service
        } else {
            split.service.as_str()
        };
        if split_service != service
            && split.service_subset.is_empty()
            && let Some(next) = self.splitter_node(split_service)?
        {
            return Ok((next, None));
        }
        let opts = TargetOpts {
            service_subset: split.service_subset.clone(),
            namespace: DEFAULT_TENANCY.to_owned(),
            partition: DEFAULT_TENANCY.to_owned(),
            ..TargetOpts::service(split_service)
        };
        let target = self.new_target(opts);
        let resolved = self.resolver_node(target, false)?;
        let key = node_key(NodeType::Resolver, &resolved);
        let load_balancer = self.nodes[&key].load_balancer.clone();
        Ok((key, load_balancer))
    }

    /// Depth-first search for a router/splitter cycle, reported as the path that closes it.
    pub(super) fn detect_circular_references(&self) -> Result<(), ChainError> {
        let mut todo = vec![Step::Visit(self.start_node.clone())];
        let mut visited = HashSet::new();
        let mut path: Vec<String> = Vec::new();
        while let Some(step) = todo.pop() {
            let current = match step {
                Step::Leave => {
                    if let Some(left) = path.pop() {
                        visited.remove(&left);
                    }
                    continue;
                }
                Step::Visit(current) => current,
            };
            path.push(current.clone());
            if !visited.insert(current.clone()) {
                return Err(ChainError::CircularReference(path));
            }
            todo.push(Step::Leave);
            let node = self.node(&current)?;
            let next = node
                .routes
                .iter()
                .map(|r| &r.next_node)
                .chain(node.splits.iter().map(|s| &s.next_node));
            todo.extend(next.map(|n| Step::Visit(n.clone())));
        }
        Ok(())
    }

    fn node(&self, key: &str) -> Result<&DiscoveryGraphNode, ChainError> {
        self.nodes.get(key).ok_or_else(|| ChainError::Dangling {
            chain: self.req.service_name.clone(),
            what: "node",
            key: key.to_owned(),
        })
    }

    /// Replaces every split that leads to another splitter by that splitter's legs, with
    /// multiplied weights, until no split leads to a splitter.
    pub(super) fn flatten_adjacent_splitters(&mut self) {
        loop {
            let mut changed = false;
            let keys: Vec<String> = self.nodes.keys().cloned().collect();
            for key in keys {
                if self.nodes[&key].node_type != NodeType::Splitter {
                    continue;
                }
                if let Some(flat) = self.flattened_splits(&key) {
                    self.nodes.get_mut(&key).expect("key from map").splits = flat;
                    changed = true;
                }
            }
            if !changed {
                return;
            }
        }
    }

    /// The node's splits with one level of nested splitters inlined, or `None` if none nest.
    fn flattened_splits(&self, key: &str) -> Option<Vec<DiscoverySplit>> {
        let node = &self.nodes[key];
        let nested = |s: &DiscoverySplit| {
            self.nodes
                .get(&s.next_node)
                .filter(|n| n.node_type == NodeType::Splitter)
        };
        if !node.splits.iter().any(|s| nested(s).is_some()) {
            return None;
        }
        let mut flat = Vec::with_capacity(node.splits.len());
        for split in &node.splits {
            let Some(inner) = nested(split) else {
                flat.push(split.clone());
                continue;
            };
            for inner_split in &inner.splits {
                flat.push(DiscoverySplit {
                    definition: inner_split.definition.merge_parent(&split.definition),
                    weight: normalize_split_weight(split.weight * inner_split.weight / 100.0),
                    next_node: inner_split.next_node.clone(),
                });
            }
        }
        Some(flat)
    }

    /// Drops nodes no longer reachable from the start node.
    pub(super) fn remove_unused_nodes(&mut self) {
        let mut reachable = BTreeSet::new();
        let mut todo = vec![self.start_node.clone()];
        while let Some(key) = todo.pop() {
            if !reachable.insert(key.clone()) {
                continue;
            }
            if let Some(node) = self.nodes.get(&key) {
                todo.extend(node.routes.iter().map(|r| r.next_node.clone()));
                todo.extend(node.splits.iter().map(|s| s.next_node.clone()));
            }
        }
        self.nodes.retain(|key, _| reachable.contains(key));
    }
}

fn empty_node(node_type: NodeType, name: &str) -> DiscoveryGraphNode {
    DiscoveryGraphNode {
        node_type,
        name: name.to_owned(),
        routes: Vec::new(),
        splits: Vec::new(),
        resolver: None,
        load_balancer: None,
    }
}
