//! Per-priority load, degraded spill-over and panic mode (Envoy's priority and panic rules).
//!
//! For each priority `P`, `health(P) = min(100, factor * healthy / total)` (the assignment's
//! overprovisioning factor in percent, default 140; host counts, or host weights under
//! `weighted_priority_health`; excluded hosts not counted) and likewise for degraded hosts. Load is
//! handed out in priority order: healthy first, then degraded, normalised by the total
//! availability. A priority is in panic when the total availability is below 100 and its
//! healthy + degraded share is below `healthy_panic_threshold` (0 disables panic); then it
//! routes to all its hosts regardless of health.

use serde::Serialize;

use super::DropOverload;
use crate::host::Host;

/// Overprovisioning factor, in percent (Envoy's default 140).
pub const OVERPROVISIONING_PERCENT: u32 = 140;

/// How a cluster spreads load beyond its hosts' health: the panic threshold and the locality
/// choice of `common_lb_config`, and the host set's `ClusterLoadAssignment.policy`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Balance {
    /// `healthy_panic_threshold` in percent (0 disables panic).
    pub panic_threshold: f64,
    /// `policy.overprovisioning_factor` in percent (default 140).
    pub overprovisioning_factor: u32,
    /// `policy.weighted_priority_health`: a priority's health counts host weights, not hosts.
    pub weighted_priority_health: bool,
    /// `locality_weighted_lb_config`: inside a priority, localities share by effective weight.
    pub locality_weighted: bool,
    /// `policy.drop_overloads`: the share of traffic refused before a host is chosen.
    pub drop_overload: DropOverload,
}

impl Balance {
    /// Envoy's defaults with this panic threshold.
    pub fn new(panic_threshold: f64) -> Self {
        Self {
            panic_threshold,
            overprovisioning_factor: OVERPROVISIONING_PERCENT,
            weighted_priority_health: false,
            locality_weighted: false,
            drop_overload: DropOverload::NONE,
        }
    }
}

/// How a host counts for load balancing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HostClass {
    /// Routable.
    Healthy,
    /// Routable only when healthy hosts do not suffice.
    Degraded,
    /// Not routable (except in panic).
    Unhealthy,
    /// Not routable and not counted (pending its first active check).
    Excluded,
}

/// One priority level's routing.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PriorityRouting {
    /// Priority, 0 = highest.
    pub priority: u32,
    /// Healthy hosts.
    pub healthy: Vec<Host>,
    /// Degraded hosts.
    pub degraded: Vec<Host>,
    /// Every non-excluded host (the panic set).
    pub all: Vec<Host>,
    /// Percent of traffic sent to this priority's healthy hosts.
    pub healthy_load: u32,
    /// Percent of traffic sent to this priority's degraded hosts.
    pub degraded_load: u32,
    /// In panic: traffic for this priority goes to `all`.
    pub panic: bool,
}

impl PriorityRouting {
    /// The hosts this priority sends traffic to now.
    pub fn routable(&self) -> Vec<Host> {
        if self.healthy_load + self.degraded_load == 0 {
            return Vec::new();
        }
        if self.panic {
            return self.all.clone();
        }
        let mut out = Vec::new();
        if self.healthy_load > 0 {
            out.extend(self.healthy.iter().cloned());
        }
        if self.degraded_load > 0 {
            out.extend(self.degraded.iter().cloned());
        }
        out
    }
}

/// A cluster's routing: one entry per priority present, ascending.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Routing {
    /// Per-priority state.
    pub priorities: Vec<PriorityRouting>,
    /// The overprovisioning factor (percent) the loads were computed with; locality effective
    /// weights use it too.
    pub overprovisioning_factor: u32,
    /// Whether localities share each priority's load by effective weight
    /// ([`crate::lb::kernel_levels`]).
    pub locality_weighted: bool,
    /// Zone-aware routing's shares of priority 0, when the cluster routes by zone (set by the
    /// cluster's loop from the local cluster's routing).
    pub zone: Option<crate::lb::zone::ZoneShares>,
    /// The host set's `policy.drop_overloads`: the share of requests (proxy path) or connects
    /// (kernel path) refused before a host is chosen.
    pub drop_overload: DropOverload,
}

impl Default for Routing {
    fn default() -> Self {
        Self {
            priorities: Vec::new(),
            overprovisioning_factor: OVERPROVISIONING_PERCENT,
            locality_weighted: false,
            zone: None,
            drop_overload: DropOverload::NONE,
        }
    }
}

impl Routing {
    /// This routing with only the hosts `keep` admits, at every priority (loads and panic as
    /// they are: a priority left without hosts routes nothing).
    #[must_use]
    pub fn filtered(&self, keep: impl Fn(&Host) -> bool) -> Self {
        let admit = |hosts: &[Host]| -> Vec<Host> {
            let mut out: Vec<Host> = hosts.iter().filter(|h| keep(h)).cloned().collect();
            out.shrink_to_fit();
            out
        };
        Self {
            priorities: self
                .priorities
                .iter()
                .map(|p| PriorityRouting {
                    healthy: admit(&p.healthy),
                    degraded: admit(&p.degraded),
                    all: admit(&p.all),
                    ..p.clone()
                })
                .collect(),
            zone: self.zone.clone(),
            ..*self
        }
    }

    /// Whether a priority that receives traffic is in panic mode: a host chosen now may be
    /// one that failed its checks (Envoy counts such choices in `lb_healthy_panic`).
    pub fn in_panic(&self) -> bool {
        self.priorities
            .iter()
            .any(|p| p.panic && p.healthy_load + p.degraded_load > 0)
    }

    /// Every host that receives traffic, highest priority first; empty means "no healthy
    /// upstream".
    pub fn routable(&self) -> Vec<Host> {
        self.priorities
            .iter()
            .flat_map(PriorityRouting::routable)
            .collect()
    }

    /// Computes routing from classified hosts with Envoy's defaults and this panic threshold.
    pub fn compute(hosts: &[(Host, HostClass)], panic_threshold: f64) -> Self {
        Self::compute_with(hosts, &Balance::new(panic_threshold))
    }

    /// Computes routing from classified hosts under `balance`.
    pub fn compute_with(hosts: &[(Host, HostClass)], balance: &Balance) -> Self {
        let mut priorities: Vec<PriorityRouting> = Vec::new();
        for (host, class) in hosts {
            let idx = match priorities.binary_search_by_key(&host.priority, |p| p.priority) {
                Ok(i) => i,
                Err(i) => {
                    let p = PriorityRouting {
                        priority: host.priority,
                        ..Default::default()
                    };
                    priorities.insert(i, p);
                    i
                }
            };
            let p = &mut priorities[idx];
            match class {
                HostClass::Excluded => continue,
                HostClass::Healthy => p.healthy.push(host.clone()),
                HostClass::Degraded => p.degraded.push(host.clone()),
                HostClass::Unhealthy => {}
            }
            p.all.push(host.clone());
        }
        // A routing is kept until the next change, and copied into each view: no spare capacity.
        for p in &mut priorities {
            p.healthy.shrink_to_fit();
            p.degraded.shrink_to_fit();
            p.all.shrink_to_fit();
        }
        assign_load(&mut priorities, balance);
        Self {
            priorities,
            overprovisioning_factor: balance.overprovisioning_factor,
            locality_weighted: balance.locality_weighted,
            zone: None,
            drop_overload: balance.drop_overload,
        }
    }
}

/// A priority's health (or degraded share) in percent: Envoy's
/// `min(100, factor * eligible / total)`, in hosts or, with `weighted`, in host weights.
fn availability(eligible: &[Host], all: &[Host], balance: &Balance) -> u64 {
    let size = |hosts: &[Host]| -> u64 {
        if balance.weighted_priority_health {
            hosts.iter().map(|h| u64::from(h.weight)).sum()
        } else {
            hosts.len() as u64
        }
    };
    let total = size(all);
    if total == 0 {
        return 0;
    }
    (u64::from(balance.overprovisioning_factor) * size(eligible) / total).min(100)
}

fn assign_load(priorities: &mut [PriorityRouting], balance: &Balance) {
    let panic_threshold = balance.panic_threshold;
    let healthy: Vec<u64> = priorities
        .iter()
        .map(|p| availability(&p.healthy, &p.all, balance))
        .collect();
    let degraded: Vec<u64> = priorities
        .iter()
        .map(|p| availability(&p.degraded, &p.all, balance))
        .collect();
    let total = (healthy.iter().sum::<u64>() + degraded.iter().sum::<u64>()).min(100);
    for p in priorities.iter_mut() {
        let usable = p.healthy.len() + p.degraded.len();
        let share = if p.all.is_empty() {
            0.0
        } else {
            100.0 * usable as f64 / p.all.len() as f64
        };
        p.panic = total < 100 && panic_threshold > 0.0 && share < panic_threshold;
    }
    if total == 0 {
        // Nothing available anywhere: the first priority with hosts takes all traffic (it is in
        // panic unless panic is disabled, in which case nothing routes).
        if let Some(p) = priorities.iter_mut().find(|p| !p.all.is_empty()) {
            p.healthy_load = 100;
        }
        return;
    }
    let mut remaining = 100u64;
    for (p, h) in priorities.iter_mut().zip(&healthy) {
        let load = (h * 100 / total).min(remaining);
        p.healthy_load = load as u32;
        remaining -= load;
    }
    for (p, d) in priorities.iter_mut().zip(&degraded) {
        let load = (d * 100 / total).min(remaining);
        p.degraded_load = load as u32;
        remaining -= load;
    }
    // Rounding leftovers go to the first priority that has any availability.
    if remaining > 0 {
        let first = healthy.iter().zip(&degraded).position(|(h, d)| h + d > 0);
        if let Some(p) = first.and_then(|i| priorities.get_mut(i)) {
            if p.healthy_load > 0 || p.degraded_load == 0 {
                p.healthy_load += remaining as u32;
            } else {
                p.degraded_load += remaining as u32;
            }
        }
    }
}
