//! Zone-aware clusters follow the local cluster (`cluster_manager.local_cluster_name`): what a
//! starting one is given to follow, and which a reload restarts so each follows the running
//! local cluster.

use std::{collections::BTreeMap, sync::Arc};

use proxy_core::{
    config::{Cluster, Config},
    upstream::Upstream,
};

use super::reload::Plan;

/// A zone-aware cluster's local cluster routing and settings: the local cluster just started,
/// or the running one.
pub(super) fn zone_input(
    config: &Config,
    cluster: &proxy_core::config::Cluster,
    started: &BTreeMap<String, Arc<Upstream>>,
    running: &BTreeMap<String, Arc<Upstream>>,
) -> anyhow::Result<Option<proxy_core::upstream::ZoneInput>> {
    let (Some(zone), Some(cm)) = (
        &cluster.common_lb_config.zone_aware_lb_config,
        &config.cluster_manager,
    ) else {
        return Ok(None);
    };
    let name = &cm.local_cluster_name;
    let local = started
        .get(name)
        .or_else(|| running.get(name))
        .ok_or_else(|| {
            anyhow::anyhow!(
                "cluster {:?}: its local cluster {name:?} is not running",
                cluster.name
            )
        })?;
    let node = config
        .node
        .as_ref()
        .map(|n| n.locality.clone())
        .unwrap_or_default();
    Ok(Some(proxy_core::upstream::ZoneInput {
        local: local.routing(),
        settings: zone.settings(node),
    }))
}

/// A restarted local cluster restarts every running zone-aware cluster (for any reason, an
/// xDS restart included): each follows the routing of the local cluster it started with.
pub(super) fn restart_followers(new: &Config, olds: &BTreeMap<&str, &Cluster>, plan: &mut Plan) {
    let Some(cm) = &new.cluster_manager else {
        return;
    };
    if !plan.start.contains(&cm.local_cluster_name) {
        return;
    }
    for c in &new.clusters {
        if c.common_lb_config.zone_aware_lb_config.is_some()
            && olds.contains_key(c.name.as_str())
            && plan.start.insert(c.name.clone())
        {
            plan.stop.insert(c.name.clone());
            plan.kept_clusters = plan.kept_clusters.saturating_sub(1);
        }
    }
}

/// Whether a cluster runs as before: its definition is equal, and for a zone-aware cluster
/// also the node's locality and the local cluster's definition, whose routing its loop follows
/// (a changed local cluster restarts it, so it follows the new one).
pub(super) fn same_cluster(old: &Config, was: &Cluster, new: &Config, now: &Cluster) -> bool {
    if was != now {
        return false;
    }
    if now.common_lb_config.zone_aware_lb_config.is_none() {
        return true;
    }
    old.node == new.node && local_cluster(old) == local_cluster(new)
}

/// The definition of the local cluster `config` names, if it has one.
fn local_cluster(config: &Config) -> Option<&Cluster> {
    config
        .cluster_manager
        .as_ref()
        .and_then(|cm| config.cluster(&cm.local_cluster_name))
}
