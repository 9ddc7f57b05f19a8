//! Cluster membership: discovery x health decides which hosts exist and which route.
//!
//! The 2x2 matrix (active health checking configured):
//!
//! | | discovered | absent from discovery |
//! |---|---|---|
//! | HC ok | route | route (`/pending_dynamic_removal`) |
//! | HC failed | don't route | don't route **and delete** (the only purge) |
//!
//! Without active health checking an absent host is removed at once and a host is healthy unless
//! its [`EdsHealth`] says otherwise (UNKNOWN, HEALTHY route; UNHEALTHY, DRAINING, TIMEOUT don't;
//! DEGRADED routes when the healthy hosts do not suffice). EDS health and outlier ejection apply
//! on top of active health. New hosts wait for their first active check (`/pending_active_hc`)
//! and are excluded from routing and from the panic computation meanwhile.
//!
//! One address may be several hosts: a STRICT_DNS address returned by two names is two hosts in
//! Envoy (each name keeps its own), so it counts twice in membership, routing and weight. Such
//! hosts share what is known per address: the node-wide probe of that address and the outlier
//! state (the data path reports connect results per address).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::SocketAddr,
    ops::RangeInclusive,
    sync::Arc,
};

use serde::Serialize;
use tokio::time::Instant;

use super::{
    cluster_config::{AssignmentPolicy, OutlierDetection},
    outlier::{FailureVerdict, OutlierDetector, PassiveResult},
    priority::{Balance, HostClass, Routing},
    random::Random,
    state::HostHealth,
    stats::{MembershipStats, OutlierStats},
};
use crate::host::{EdsHealth, Host, HostSet};

/// Envoy's host health flags, as `/clusters` prints them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HostFlags {
    /// Failed active health checking (or not yet checked).
    pub failed_active_hc: bool,
    /// Ejected by outlier detection.
    pub failed_outlier_check: bool,
    /// EDS says UNHEALTHY or TIMEOUT.
    pub failed_eds_health: bool,
    /// Active health checking reported degraded.
    pub degraded_active_hc: bool,
    /// EDS says DEGRADED.
    pub degraded_eds_health: bool,
    /// Gone from discovery but still passing health checks.
    pub pending_dynamic_removal: bool,
    /// No active check has completed yet.
    pub pending_active_hc: bool,
    /// The last active failure was a timeout.
    pub active_hc_timeout: bool,
    /// EDS says DRAINING.
    pub eds_status_draining: bool,
}

impl HostFlags {
    /// `healthy`, or the set flags as `/failed_active_hc/pending_dynamic_removal`.
    pub fn render(&self) -> String {
        let names = [
            (self.failed_active_hc, "/failed_active_hc"),
            (self.failed_outlier_check, "/failed_outlier_check"),
            (self.failed_eds_health, "/failed_eds_health"),
            (self.degraded_active_hc, "/degraded_active_hc"),
            (self.degraded_eds_health, "/degraded_eds_health"),
            (self.pending_dynamic_removal, "/pending_dynamic_removal"),
            (self.pending_active_hc, "/pending_active_hc"),
            (self.active_hc_timeout, "/active_hc_timeout"),
            (self.eds_status_draining, "/eds_status_draining"),
        ];
        let out: String = names
            .iter()
            .filter(|(on, _)| *on)
            .map(|(_, n)| *n)
            .collect();
        if out.is_empty() {
            "healthy".to_owned()
        } else {
            out
        }
    }

    /// How the flags count for load balancing.
    pub fn class(&self) -> HostClass {
        if self.pending_active_hc {
            HostClass::Excluded
        } else if self.failed_active_hc
            || self.failed_outlier_check
            || self.failed_eds_health
            || self.eds_status_draining
        {
            HostClass::Unhealthy
        } else if self.degraded_active_hc || self.degraded_eds_health {
            HostClass::Degraded
        } else {
            HostClass::Healthy
        }
    }
}

/// One host with its flags, for `/clusters`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HostStatus {
    /// The host as last discovered.
    pub host: Host,
    /// Its flags.
    pub flags: HostFlags,
}

/// Addresses that gained their first host or lost their last one, so the caller can
/// (un)register their probes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MembershipChange {
    /// Addresses with hosts now and none before.
    pub added: Vec<SocketAddr>,
    /// Addresses with no host left.
    pub removed: Vec<SocketAddr>,
}

/// A member: its address and which occurrence of that address in the discovered hosts it is
/// (0 for the first).
type MemberKey = (SocketAddr, u32);

/// Every member key of `addr`.
fn keys_of(addr: SocketAddr) -> RangeInclusive<MemberKey> {
    (addr, 0)..=(addr, u32::MAX)
}

#[derive(Clone, Debug)]
struct Member {
    host: Host,
    discovered: bool,
    active: HostHealth,
}

/// The membership of one cluster.
#[derive(Debug)]
pub struct ClusterMembership {
    active_hc: bool,
    /// `ignore_health_on_host_removal`: an absent host goes at once, healthy or not.
    ignore_health_on_removal: bool,
    balance: Balance,
    members: BTreeMap<MemberKey, Member>,
    outlier: Option<OutlierDetector>,
}

impl ClusterMembership {
    /// An empty membership. `active_hc`: whether the cluster has an active health checker.
    /// `panic_threshold`: `healthy_panic_threshold` in percent (0 disables).
    pub fn new(
        active_hc: bool,
        panic_threshold: f64,
        outlier: Option<OutlierDetection>,
        random: Arc<dyn Random>,
    ) -> Self {
        Self {
            active_hc,
            ignore_health_on_removal: false,
            balance: Balance::new(panic_threshold),
            members: BTreeMap::new(),
            outlier: outlier.map(|c| OutlierDetector::new(c, random)),
        }
    }

    /// With `balance` (its panic threshold replaces the one given to [`Self::new`]):
    /// locality weighting and the assignment policy.
    #[must_use]
    pub fn balanced(mut self, balance: Balance) -> Self {
        self.balance = balance;
        self
    }

    /// Replaces the assignment policy (overprovisioning factor, weighted priority health, drop
    /// overload); routing follows from the next [`Self::routing`].
    pub fn set_policy(&mut self, policy: AssignmentPolicy) {
        self.balance.overprovisioning_factor = policy.overprovisioning_factor;
        self.balance.weighted_priority_health = policy.weighted_priority_health;
        self.balance.drop_overload = policy.drop_overload;
    }

    /// With `ignore`, a host discovery no longer returns is deleted at once, even while active
    /// health checking finds it healthy (Envoy's `ignore_health_on_host_removal`).
    #[must_use]
    pub fn ignoring_health_on_removal(mut self, ignore: bool) -> Self {
        self.ignore_health_on_removal = ignore;
        self
    }

    /// Applies a discovery update (the full host set). A host whose address appears again is
    /// another host at that address.
    pub fn update_hosts(&mut self, hosts: HostSet) -> MembershipChange {
        let before = self.addresses();
        let mut seen = BTreeMap::new();
        let mut occurrences: HashMap<SocketAddr, u32> = HashMap::new();
        for host in hosts {
            let nth = occurrences.entry(host.addr).or_default();
            seen.insert((host.addr, *nth), host);
            *nth += 1;
        }
        for (key, member) in &mut self.members {
            member.discovered = seen.contains_key(key);
        }
        for (key, host) in seen {
            if let Some(member) = self.members.get_mut(&key) {
                member.host = host;
                continue;
            }
            // Another host at a known address shares its probe, so it knows its health already.
            let sibling = self.members.range(keys_of(key.0)).next();
            let active = match sibling {
                Some((_, sibling)) => sibling.active,
                None if self.active_hc => HostHealth::new_host(),
                None => HostHealth::default(),
            };
            let member = Member {
                host,
                discovered: true,
                active,
            };
            self.members.insert(key, member);
        }
        // Envoy keeps an absent host that active health checking has not failed (it goes at
        // its first failure), unless told to ignore health on removal. A host its source last
        // marked UNHEALTHY or TIMEOUT (Envoy's FAILED_EDS_HEALTH), or one that is not checked
        // (`disable_active_health_check`), goes at once, as in Envoy 1.40.
        let keep_absent = self.active_hc && !self.ignore_health_on_removal;
        self.members.retain(|_, m| {
            m.discovered
                || (keep_absent
                    && !m.active.failed
                    && !matches!(m.host.eds_health, EdsHealth::Unhealthy | EdsHealth::Timeout)
                    && !m.host.health_check().disabled)
        });
        self.sync_outlier();
        let after = self.addresses();
        MembershipChange {
            added: after.difference(&before).copied().collect(),
            removed: before.difference(&after).copied().collect(),
        }
    }

    /// Applies an active health result for `addr` (every host there). An absent host that
    /// failed is deleted.
    pub fn set_active_health(&mut self, addr: SocketAddr, health: HostHealth) -> MembershipChange {
        let mut change = MembershipChange::default();
        let mut deleted = false;
        for member in self.members.range_mut(keys_of(addr)).map(|(_, m)| m) {
            member.active = health;
            deleted |= !member.discovered && health.failed;
        }
        if deleted {
            self.members.retain(|key, m| key.0 != addr || m.discovered);
            if self.members.range(keys_of(addr)).next().is_none() {
                change.removed.push(addr);
            }
            self.sync_outlier();
        } else if let (false, Some(od)) = (health.failed, &mut self.outlier)
            && od.unejects_on_health_check()
        {
            od.uneject(addr, Instant::now());
        }
        change
    }

    /// A connect to `addr` failed (passive signal).
    pub fn record_connect_failure(&mut self, addr: SocketAddr, now: Instant) -> FailureVerdict {
        match &mut self.outlier {
            Some(od) => od.record_connect_failure(addr, now),
            None => FailureVerdict::Counted,
        }
    }

    /// A connect to `addr` succeeded (passive signal).
    pub fn record_connect_success(&mut self, addr: SocketAddr) {
        if let Some(od) = &mut self.outlier {
            od.record_connect_success(addr);
        }
    }

    /// One result of a request to `addr` (passive signal): an HTTP status, or a connect
    /// result in that form; may eject the host.
    pub fn record_result(
        &mut self,
        addr: SocketAddr,
        result: PassiveResult,
        now: Instant,
    ) -> FailureVerdict {
        match &mut self.outlier {
            Some(od) => od.record(addr, result, now),
            None => FailureVerdict::Counted,
        }
    }

    /// The outlier sweep; call every `outlier_detection.interval`. Returns whether a host was
    /// ejected or unejected.
    pub fn outlier_tick(&mut self, now: Instant) -> bool {
        self.outlier.as_mut().is_some_and(|od| od.tick(now))
    }

    /// Every host with its flags, in address order.
    pub fn host_statuses(&self) -> Vec<HostStatus> {
        self.members
            .iter()
            .map(|(key, m)| HostStatus {
                host: m.host.clone(),
                flags: self.flags(key.0, m),
            })
            .collect()
    }

    /// The current routing.
    pub fn routing(&self) -> Routing {
        let classified: Vec<(Host, HostClass)> = self
            .members
            .iter()
            .map(|(key, m)| (m.host.clone(), self.flags(key.0, m).class()))
            .collect();
        Routing::compute_with(&classified, &self.balance)
    }

    /// Membership gauges.
    pub fn membership_stats(&self) -> MembershipStats {
        let mut stats = MembershipStats {
            total: self.members.len() as u64,
            ..Default::default()
        };
        for status in self.host_statuses() {
            match status.flags.class() {
                HostClass::Healthy => stats.healthy += 1,
                HostClass::Degraded => stats.degraded += 1,
                HostClass::Excluded => stats.excluded += 1,
                HostClass::Unhealthy => {}
            }
        }
        stats
    }

    /// Hosts passing active health checks (the `health_check.healthy` gauge).
    pub fn active_healthy_count(&self) -> u64 {
        self.members
            .values()
            .filter(|m| self.active_hc && !m.active.failed)
            .count() as u64
    }

    /// Outlier counters, if outlier detection is configured.
    pub fn outlier_stats(&self) -> Option<&OutlierStats> {
        self.outlier.as_ref().map(OutlierDetector::stats)
    }

    fn flags(&self, addr: SocketAddr, m: &Member) -> HostFlags {
        let eds = m.host.eds_health;
        HostFlags {
            failed_active_hc: self.active_hc && m.active.failed,
            failed_outlier_check: self.outlier.as_ref().is_some_and(|od| od.is_ejected(addr)),
            failed_eds_health: matches!(eds, EdsHealth::Unhealthy | EdsHealth::Timeout),
            degraded_active_hc: self.active_hc && m.active.degraded,
            degraded_eds_health: eds == EdsHealth::Degraded,
            pending_dynamic_removal: !m.discovered,
            pending_active_hc: self.active_hc && m.active.pending,
            active_hc_timeout: self.active_hc && m.active.timeout,
            eds_status_draining: eds == EdsHealth::Draining,
        }
    }

    /// How active checks reach the host at `addr` (its first member's
    /// `health_check_config`); `None` when no host is there.
    pub fn health_check_of(&self, addr: SocketAddr) -> Option<&crate::host::HealthCheckTarget> {
        self.members
            .range(keys_of(addr))
            .next()
            .map(|(_, m)| m.host.health_check())
    }

    /// Every address with at least one host.
    fn addresses(&self) -> BTreeSet<SocketAddr> {
        self.members.keys().map(|key| key.0).collect()
    }

    fn sync_outlier(&mut self) {
        let addresses = self.addresses();
        if let Some(od) = &mut self.outlier {
            od.sync_hosts(addresses);
        }
    }
}
