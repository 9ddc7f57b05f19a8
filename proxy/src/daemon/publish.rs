//! Publishing: one task per service that turns the routing of the clusters it reads into its
//! kernel entry whenever one changes, the sweep of what a previous run left once every service
//! was published, and the reaper of retired generations.

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use proxy_common::service::{
    SERVICE_F_LEAST_REQUEST, SERVICE_F_MAGLEV, SERVICE_F_PANIC, SERVICE_F_PASSIVE, SERVICE_F_PROXY,
    SERVICE_F_ROUND_ROBIN, ServiceKey,
};
use proxy_core::{
    chain::{self, ChainPlan},
    config::{Config, LbPolicy, Service, ServiceMode},
    health::Routing,
    lb,
};
use tokio::sync::watch;
use tracing::warn;

use super::state::{PublishedTx, SharedDataplane, service_key};
use crate::dataplane::{self, ServiceSpec};

/// How long start-up waits for every service's first publish before it removes what a previous
/// run left behind; a service whose cluster is still resolving is published when it is ready.
pub(super) const FIRST_PUBLISH_WAIT: Duration = Duration::from_secs(10);

/// Waits until every service was published once (bounded), then removes services, tables and
/// backends a previous run left that this configuration does not have (its services are
/// `keys`), and the pins an earlier version of the daemon left (`proxy_common::abi::RETIRED`).
/// Until then, an adopted previous state keeps serving, and a rollback to the earlier version
/// would still find its maps.
pub(super) async fn sweep_after_first_publish(
    keys: &[ServiceKey],
    dp: &SharedDataplane,
    mut published: watch::Receiver<BTreeSet<ServiceKey>>,
) {
    // Checked after every first publish: keys found in are not looked up again. Looking every
    // key up each time is quadratic in services, and ran on the workers the publishers need.
    let mut found = 0;
    let all_in = |set: &BTreeSet<ServiceKey>| {
        while keys.get(found).is_some_and(|k| set.contains(k)) {
            found += 1;
        }
        found == keys.len()
    };
    let waited = tokio::time::timeout(FIRST_PUBLISH_WAIT, published.wait_for(all_in)).await;
    if waited.is_err() {
        warn!("not every service was published within {FIRST_PUBLISH_WAIT:?}; sweeping anyway");
    }
    let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(dp) = guard.as_mut() {
        if let Err(err) = dp.publisher().sweep(keys) {
            warn!(%err, "sweeping state of a previous run failed");
        }
        dp.remove_retired_pins();
    }
}

/// One cluster a service's kernel entry reads.
pub(super) struct ClusterInput {
    pub(super) name: String,
    pub(super) routing: watch::Receiver<Routing>,
}

/// Publishes one service whenever the routing of a cluster it reads changes (the publisher
/// itself skips writes when the kernel already has exactly this).
/// Until `warm` (the service's clusters' `initialized`) all hold, an adopted previous state (or
/// nothing) is better than an empty host set; after `FIRST_PUBLISH_WAIT`, it publishes what
/// there is.
pub(super) async fn publish_loop(
    template: SpecTemplate,
    mut inputs: Vec<ClusterInput>,
    mut warm: Vec<watch::Receiver<bool>>,
    dp: SharedDataplane,
    published: PublishedTx,
) {
    let all_initialized = async {
        for initialized in &mut warm {
            let _ = initialized.wait_for(|i| *i).await;
        }
    };
    if tokio::time::timeout(FIRST_PUBLISH_WAIT, all_initialized)
        .await
        .is_err()
    {
        warn!(service = %template.name, "clusters not initialized within {FIRST_PUBLISH_WAIT:?}; publishing what they have");
    }
    let mut first = true;
    loop {
        let spec = template.with(&inputs);
        let result = {
            let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match guard.as_mut() {
                Some(dp) => dp.publisher().publish(&spec).map(Some),
                None => return,
            }
        };
        match result {
            Ok(_) if first => {
                first = false;
                published.send_modify(|set| {
                    set.insert(spec.key);
                });
            }
            Ok(_) => {}
            Err(err) => {
                warn!(service = %spec.name, %err, "publish failed; the previous host set stays live");
            }
        }
        if !any_changed(&mut inputs).await {
            return;
        }
        // Coalesce a burst of changes into one publish: what changed meanwhile is read now.
        for input in &mut inputs {
            input.routing.borrow_and_update();
        }
    }
}

/// Waits on every input's own routing receiver until one changes; false once every input's
/// cluster is gone (at once when there is none).
async fn any_changed(inputs: &mut [ClusterInput]) -> bool {
    let mut waits: Vec<_> = inputs
        .iter_mut()
        .map(|input| Some(Box::pin(input.routing.changed())))
        .collect();
    std::future::poll_fn(|cx| {
        let mut open = false;
        for slot in &mut waits {
            let Some(wait) = slot else { continue };
            match wait.as_mut().poll(cx) {
                std::task::Poll::Ready(Ok(())) => return std::task::Poll::Ready(true),
                // That cluster stopped; a finished future must not be polled again.
                std::task::Poll::Ready(Err(_)) => *slot = None,
                std::task::Poll::Pending => open = true,
            }
        }
        if open {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(false)
        }
    })
    .await
}

/// The parts of a service's kernel entry that do not depend on its hosts.
pub(super) struct SpecTemplate {
    pub(super) name: String,
    pub(super) key: ServiceKey,
    pub(super) flags: u32,
    /// The chain's plan, for a chain service.
    pub(super) plan: Option<ChainPlan>,
    /// Where a refused share of connections is sent: the unspecified address of the service's
    /// family, port 0, which the kernel's connect refuses (ECONNREFUSED).
    pub(super) refuse: SocketAddr,
}

impl SpecTemplate {
    /// The templates of every service of `config`, in its order.
    pub(super) fn all(config: &Config) -> Vec<Self> {
        config
            .services
            .iter()
            .map(|svc| Self::new(svc, config))
            .collect()
    }

    fn new(svc: &Service, config: &Config) -> Self {
        let names = config.service_clusters(svc);
        let clusters: Vec<_> = names.iter().filter_map(|c| config.cluster(c)).collect();
        let maglev = clusters.iter().any(|c| c.lb_policy == LbPolicy::Maglev);
        // Consistent hashing wins over rotation when a chain mixes the two. A proxy-mode
        // service's kernel entry only redirects: the proxy rotates (`ClusterHandle`).
        let round_robin = !maglev
            && svc.mode == ServiceMode::Direct
            && clusters.iter().any(|c| c.lb_policy == LbPolicy::RoundRobin);
        // Least request needs sockops to count each backend's connections; the proxy counts its
        // own for proxy-mode services.
        let least = !maglev
            && !round_robin
            && svc.mode == ServiceMode::Direct
            && clusters
                .iter()
                .any(|c| c.lb_policy == LbPolicy::LeastRequest);
        // Only outlier detection reads the kernel's passive signal: without it sockops does not
        // follow the service's connections at all.
        let passive = clusters.iter().any(|c| c.outlier_detection.is_some());
        let unspecified = match svc.address {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        let mut flags = if maglev { SERVICE_F_MAGLEV } else { 0 };
        if round_robin {
            flags |= SERVICE_F_ROUND_ROBIN;
        }
        if least {
            flags |= SERVICE_F_LEAST_REQUEST;
        }
        if svc.mode == ServiceMode::Proxy {
            flags |= SERVICE_F_PROXY;
        }
        if passive {
            flags |= SERVICE_F_PASSIVE;
        }
        Self {
            name: svc.name.clone(),
            key: service_key(svc),
            flags,
            plan: config.chain_plan(svc),
            refuse: SocketAddr::new(unspecified, 0),
        }
    }

    fn with(&self, inputs: &[ClusterInput]) -> ServiceSpec {
        let routing_of = |name: &str| {
            inputs
                .iter()
                .find(|i| i.name == name)
                .map(|i| i.routing.borrow().clone())
        };
        let mut priorities = match &self.plan {
            Some(plan) => plan.levels(&routing_of),
            None => inputs
                .first()
                .map(|i| lb::kernel_levels(&i.routing.borrow()))
                .unwrap_or_default(),
        };
        for level in &mut priorities {
            for (addr, _) in level.iter_mut() {
                if *addr == chain::REFUSE {
                    *addr = self.refuse;
                }
            }
        }
        let panic = inputs.iter().any(|i| i.routing.borrow().in_panic());
        ServiceSpec {
            name: self.name.clone(),
            key: self.key,
            flags: if panic {
                self.flags | SERVICE_F_PANIC
            } else {
                self.flags
            },
            priorities,
        }
    }
}

/// Whether the data path needs sockops: a service whose connections it follows (proxy mode,
/// or a cluster with outlier detection), or splicing of local socket pairs. Without any, sockops
/// is not attached and the cgroup's connections pay connect4 alone.
pub(super) fn needs_sockops(config: &Config, templates: &[SpecTemplate]) -> bool {
    config.splice
        || templates
            .iter()
            .any(|t| t.flags & (SERVICE_F_PROXY | SERVICE_F_PASSIVE | SERVICE_F_LEAST_REQUEST) != 0)
}

/// Refuses to start when a direct-mode service asks for ROUND_ROBIN and the kernel refused the
/// programs that rotate (before 5.12): said at start, not at the service's first publish.
pub(super) fn check_round_robin(
    templates: &[SpecTemplate],
    dp: &SharedDataplane,
) -> anyhow::Result<()> {
    let guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(dp) = guard.as_ref() else {
        return Ok(());
    };
    if dp.round_robin() {
        return Ok(());
    }
    match templates
        .iter()
        .find(|t| t.flags & SERVICE_F_ROUND_ROBIN != 0)
    {
        Some(t) => Err(dataplane::DataplaneError::NoRoundRobin {
            service: t.name.clone(),
        }
        .into()),
        None => Ok(()),
    }
}

/// Frees retired generations whose grace period passed, once a second. Publishing frees them
/// too, but the generations the last publishes of a burst retired (a reload's, say) would
/// otherwise wait for the next publish.
pub(super) async fn reap(dp: SharedDataplane) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match guard.as_mut() {
            Some(dp) => dp.publisher().reap(false),
            None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn kernel_flags_follow_the_clusters() {
        let endpoint = "    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 1 } } } } ] } ] }\n";
        let yaml = format!(
            "clusters:\n  - name: plain\n{endpoint}  - name: watched\n    outlier_detection: {{ consecutive_5xx: 3 }}\n{endpoint}  - name: hashed\n    lb_policy: MAGLEV\n{endpoint}services:\n  - {{ name: a, address: 127.77.0.1, port: 80, cluster: plain }}\n  - {{ name: b, address: 127.77.0.2, port: 80, cluster: watched }}\n  - {{ name: c, address: 127.77.0.3, port: 80, cluster: hashed }}\n  - {{ name: d, address: 127.77.0.4, port: 80, cluster: watched, mode: proxy }}\n"
        );
        let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
        let flags: Vec<u32> = config
            .services
            .iter()
            .map(|s| SpecTemplate::new(s, &config).flags)
            .collect();
        assert_eq!(
            flags,
            [
                0,
                SERVICE_F_PASSIVE,
                SERVICE_F_MAGLEV,
                SERVICE_F_PASSIVE | SERVICE_F_PROXY
            ]
        );
    }

    #[test]
    fn sockops_is_attached_only_where_something_needs_it() {
        let endpoint = "    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 1 } } } } ] } ] }\n";
        let clusters = format!(
            "clusters:\n  - name: plain\n{endpoint}  - name: watched\n    outlier_detection: {{ consecutive_5xx: 3 }}\n{endpoint}"
        );
        let needs = |extra: &str, services: &str| {
            let yaml = format!("{extra}{clusters}services:\n{services}");
            let config = Config::parse(&yaml, Path::new("t.yaml")).expect("valid config");
            needs_sockops(&config, &SpecTemplate::all(&config))
        };
        let plain = "  - { name: a, address: 127.77.0.1, port: 80, cluster: plain }\n";
        assert!(!needs("", plain), "plain kernel-path services only");
        assert!(needs("splice: true\n", plain), "splicing");
        let watched = "  - { name: b, address: 127.77.0.2, port: 80, cluster: watched }\n";
        assert!(needs("", &format!("{plain}{watched}")), "outlier detection");
        let proxied =
            "  - { name: c, address: 127.77.0.3, port: 80, cluster: plain, mode: proxy }\n";
        let listener = "proxy: { listeners: [\"127.0.0.1:15001\"] }\n";
        assert!(needs(listener, &format!("{plain}{proxied}")), "proxy mode");
    }

    #[tokio::test]
    async fn any_changed_wakes_on_any_input_and_ends_with_them() {
        let input = |name: &str| {
            let (tx, routing) = watch::channel(Routing::default());
            let name = name.to_owned();
            (tx, ClusterInput { name, routing })
        };
        assert!(!any_changed(&mut []).await, "no input: nothing to wait for");
        let (a_tx, a) = input("a");
        let (b_tx, b) = input("b");
        let mut inputs = vec![a, b];
        b_tx.send_replace(Routing::default());
        assert!(any_changed(&mut inputs).await, "b changed");
        inputs[1].routing.borrow_and_update();
        drop(a_tx);
        b_tx.send_replace(Routing::default());
        assert!(
            any_changed(&mut inputs).await,
            "b still runs after a stopped"
        );
        inputs[1].routing.borrow_and_update();
        drop(b_tx);
        assert!(!any_changed(&mut inputs).await, "every cluster stopped");
    }
}
