//! One cluster's health, wired: discovery updates and probe transitions in, routing out.
//!
//! [`ClusterHealth`] owns a [`ClusterMembership`], registers a probe with the node's
//! [`HealthCheckManager`] for every host it adds and unregisters it for every host it deletes,
//! and applies the probe transitions its owner hands it. It holds no subscription itself: the
//! cluster's event loop (`crate::upstream`) subscribes to the manager's events once and passes
//! them in; synchronous users (tests) do the same with [`ClusterHealth::pump_events`].

use std::{collections::HashMap, net::SocketAddr, sync::Arc};

use tokio::{sync::broadcast, time::Instant};
use tracing::warn;

use super::{
    cluster_config::{AssignmentPolicy, ClusterHealthConfig},
    config::HealthConfigError,
    manager::{HealthCheckManager, HealthEvent, ProbeId},
    matrix::{ClusterMembership, HostStatus, MembershipChange},
    outlier::{FailureVerdict, PassiveResult},
    priority::Routing,
    random::Random,
    spec::HealthCheckSpec,
    state::HostHealth,
    stats::{HealthCheckStats, render},
};
use crate::host::{HealthCheckTarget, HostSet};

/// A passive signal from the data path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PassiveSignal {
    /// A connect to the host failed.
    ConnectFailure(SocketAddr),
    /// A connect to the host succeeded.
    ConnectSuccess(SocketAddr),
    /// The cluster carried a connection (leaves `no_traffic_interval`).
    Traffic,
    /// The proxy path's HTTP exchange with the host ended with this status (a reset before the
    /// response counts as 503). The connect of such an exchange reports only its failure.
    Response(SocketAddr, u16),
}

/// Health state of one cluster.
pub struct ClusterHealth {
    name: String,
    membership: ClusterMembership,
    manager: HealthCheckManager,
    spec: Option<Arc<HealthCheckSpec>>,
    /// Host address -> its probe and what the probe checks (a host's `health_check_config`
    /// may move it); a host whose checks are disabled has none.
    probes: HashMap<SocketAddr, Checked>,
    /// Probe -> the hosts it checks (two hosts may name one check target).
    owners: HashMap<ProbeId, Vec<SocketAddr>>,
    stats: Arc<HealthCheckStats>,
    /// The cluster's own assignment policy, for host sets that bring none.
    policy: AssignmentPolicy,
}

/// One host's registration with the manager (`None`: its checks are disabled).
#[derive(Clone)]
struct Checked {
    probe: Option<ProbeId>,
    target: HealthCheckTarget,
}

impl ClusterHealth {
    /// Validates `config` and builds an empty cluster using `manager`'s probes. Subscribe to
    /// `manager`'s events ([`HealthCheckManager::subscribe`]) before adding hosts, so no
    /// transition of this cluster's probes is missed.
    pub fn new(
        name: &str,
        config: &ClusterHealthConfig,
        manager: &HealthCheckManager,
        random: Arc<dyn Random>,
    ) -> Result<Self, HealthConfigError> {
        let spec = config.validate(name)?.map(Arc::new);
        let panic = config.common_lb_config.healthy_panic_threshold.value;
        let od = config.outlier_detection.clone();
        Ok(Self {
            name: name.to_owned(),
            membership: ClusterMembership::new(spec.is_some(), panic, od, random)
                .balanced(config.balance())
                .ignoring_health_on_removal(config.ignore_health_on_host_removal),
            manager: manager.clone(),
            spec,
            probes: HashMap::new(),
            owners: HashMap::new(),
            stats: Arc::default(),
            policy: config.assignment_policy,
        })
    }

    /// Applies the assignment policy that came with a host set (`None`: the cluster's own);
    /// give it before the update's hosts ([`Self::update_hosts`]), which recompute routing.
    pub fn set_policy(&mut self, policy: Option<AssignmentPolicy>) {
        self.membership.set_policy(policy.unwrap_or(self.policy));
    }

    /// Applies a discovery update; must run inside a tokio runtime (it may start probes).
    pub fn update_hosts(&mut self, hosts: HostSet) {
        let change = self.membership.update_hosts(hosts);
        self.apply_change(change);
        // A host that stayed but whose health_check_config changed is checked anew.
        let moved: Vec<SocketAddr> = self
            .probes
            .iter()
            .filter(|(addr, c)| self.membership.health_check_of(**addr) != Some(&c.target))
            .map(|(addr, _)| *addr)
            .collect();
        for addr in moved {
            self.stop_probe(addr);
            self.start_probe(addr);
        }
    }

    /// Applies every transition pending in `events` (this cluster's subscription to the
    /// manager) without waiting. Returns how many were this cluster's.
    pub fn pump_events(&mut self, events: &mut broadcast::Receiver<HealthEvent>) -> usize {
        let mut applied = 0;
        loop {
            match events.try_recv() {
                Ok(event) => applied += usize::from(self.on_event(&event)),
                Err(broadcast::error::TryRecvError::Lagged(_)) => self.resync(),
                Err(_) => return applied,
            }
        }
    }

    /// Applies one transition if it is for one of this cluster's probes.
    pub fn on_event(&mut self, event: &HealthEvent) -> bool {
        let Some(hosts) = self.owners.get(&event.probe).cloned() else {
            return false;
        };
        for addr in hosts {
            let change = self.membership.set_active_health(addr, event.health);
            self.apply_change(change);
        }
        true
    }

    /// A passive connect failure.
    pub fn record_connect_failure(&mut self, addr: SocketAddr) -> FailureVerdict {
        self.membership.record_connect_failure(addr, Instant::now())
    }

    /// A passive connect success.
    pub fn record_connect_success(&mut self, addr: SocketAddr) {
        self.membership.record_connect_success(addr);
    }

    /// Marks the cluster as having carried traffic.
    pub fn note_traffic(&self) {
        self.manager.note_traffic(&self.name);
    }

    /// A passive result of a request (an HTTP status, or a connect result in that form).
    pub fn record_result(&mut self, addr: SocketAddr, result: PassiveResult) -> FailureVerdict {
        self.membership.record_result(addr, result, Instant::now())
    }

    /// The outlier sweep; returns whether a host was ejected or unejected.
    pub fn outlier_tick(&mut self) -> bool {
        self.membership.outlier_tick(Instant::now())
    }

    /// Current routing.
    pub fn routing(&self) -> Routing {
        self.membership.routing()
    }

    /// Every host with its `/clusters` flags.
    pub fn host_statuses(&self) -> Vec<HostStatus> {
        self.membership.host_statuses()
    }

    /// The membership (read-only).
    pub fn membership(&self) -> &ClusterMembership {
        &self.membership
    }

    /// All stats as `cluster.<name>.<stat>` pairs.
    pub fn stats(&self) -> Vec<(String, u64)> {
        self.stats.healthy.store(
            self.membership.active_healthy_count(),
            std::sync::atomic::Ordering::Relaxed,
        );
        let mut pairs = self.membership.membership_stats().pairs();
        if self.spec.is_some() {
            pairs.extend(self.stats.pairs());
        }
        if let Some(od) = self.membership.outlier_stats() {
            pairs.extend(od.pairs());
        }
        render(&self.name, pairs)
    }

    fn apply_change(&mut self, change: MembershipChange) {
        for addr in change.removed {
            self.stop_probe(addr);
        }
        if self.spec.is_none() {
            return;
        }
        for addr in change.added {
            self.start_probe(addr);
        }
    }

    /// Registers the probe of the host at `addr` (where its `health_check_config` says), or,
    /// when its checks are disabled, lets it route without one.
    fn start_probe(&mut self, addr: SocketAddr) {
        let (Some(spec), Some(target)) = (
            self.spec.clone(),
            self.membership.health_check_of(addr).cloned(),
        ) else {
            return;
        };
        if target.disabled {
            self.probes.insert(
                addr,
                Checked {
                    probe: None,
                    target,
                },
            );
            let change = self
                .membership
                .set_active_health(addr, HostHealth::default());
            self.apply_change(change);
            return;
        }
        let spec = match &target.hostname {
            Some(hostname) => Arc::new(spec.for_hostname(hostname)),
            None => spec,
        };
        let at = target.addr(addr);
        let (probe, health) = self.manager.register(&self.name, at, &spec, &self.stats);
        let checked = Checked {
            probe: Some(probe),
            target,
        };
        self.probes.insert(addr, checked);
        self.owners.entry(probe).or_default().push(addr);
        if !health.pending {
            // A probe shared with another cluster already knows the answer.
            let change = self.membership.set_active_health(addr, health);
            self.apply_change(change);
        }
    }

    fn stop_probe(&mut self, addr: SocketAddr) {
        let Some(probe) = self.probes.remove(&addr).and_then(|c| c.probe) else {
            return;
        };
        if let Some(hosts) = self.owners.get_mut(&probe) {
            hosts.retain(|h| *h != addr);
            if hosts.is_empty() {
                self.owners.remove(&probe);
            }
        }
        self.manager.unregister(&self.name, probe, &self.stats);
    }

    /// Re-reads every probe's health from the manager: what to do when this cluster's
    /// subscription lagged and transitions were lost.
    pub fn resync(&mut self) {
        warn!(cluster = %self.name, "health events lagged; resynchronising from the probes");
        let probes: Vec<(SocketAddr, ProbeId)> = self
            .probes
            .iter()
            .filter_map(|(a, c)| Some((*a, c.probe?)))
            .collect();
        for (addr, probe) in probes {
            if let Some(health) = self.manager.health(probe) {
                let change = self.membership.set_active_health(addr, health);
                self.apply_change(change);
            }
        }
    }
}

impl Drop for ClusterHealth {
    fn drop(&mut self) {
        for probe in self.probes.values().filter_map(|c| c.probe) {
            self.manager.unregister(&self.name, probe, &self.stats);
        }
    }
}
