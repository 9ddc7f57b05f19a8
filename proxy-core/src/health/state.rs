//! The per-host active health state machine and the choice of the next check interval.
//!
//! Rules (Envoy's `ActiveHealthCheckSession`): a new host starts failed and pending; the first
//! check result decides at once. After that `unhealthy_threshold` consecutive threshold-counted
//! failures (network errors, timeouts, retriable HTTP statuses) mark the host unhealthy, while a
//! non-retriable failure (unexpected HTTP status, `x-envoy-immediate-health-check-fail`, gRPC
//! NOT_SERVING) marks it unhealthy at once; `healthy_threshold` consecutive successes mark it
//! healthy again.

use std::time::Duration;

use serde::Serialize;

use super::{random::Random, spec::HealthCheckSpec};

/// Result of one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckOutcome {
    /// Passed.
    Healthy,
    /// Passed, but the host asked to be treated as degraded (`x-envoy-degraded`).
    Degraded,
    /// Failed.
    Failed(FailureKind),
}

/// How a check failed; decides threshold counting and which stat moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// Active, non-retriable: unhealthy immediately.
    Immediate,
    /// Active but retriable (a `retriable_statuses` status): counts towards the threshold.
    Retriable,
    /// Connect error, reset or protocol error: counts towards the threshold (`network_failure`).
    Network,
    /// The check did not finish within `timeout`: counts towards the threshold
    /// (`network_failure`, and `/active_hc_timeout` once the host is failed).
    Timeout,
}

impl FailureKind {
    /// Counted towards `unhealthy_threshold` rather than failing at once.
    pub fn counts_towards_threshold(self) -> bool {
        !matches!(self, Self::Immediate)
    }

    /// Counted in `health_check.network_failure`.
    pub fn is_network(self) -> bool {
        matches!(self, Self::Network | Self::Timeout)
    }
}

/// What a check did to the host's health (Envoy's `HealthTransition`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    /// No change and nothing pending.
    Unchanged,
    /// Counting towards a threshold.
    ChangePending,
    /// Health flipped (or the degraded bit flipped).
    Changed,
}

/// The active-HC view of one host, as published to clusters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HostHealth {
    /// `/failed_active_hc`: not routable.
    pub failed: bool,
    /// `/pending_active_hc`: no check has completed yet.
    pub pending: bool,
    /// `/degraded_active_hc`.
    pub degraded: bool,
    /// `/active_hc_timeout`: failed, and the last failure was a timeout.
    pub timeout: bool,
}

impl HostHealth {
    /// The state of a host that was never checked: failed and pending.
    pub const fn new_host() -> Self {
        Self {
            failed: true,
            pending: true,
            degraded: false,
            timeout: false,
        }
    }
}

/// Per-host counters behind [`HostHealth`].
#[derive(Clone, Debug)]
pub struct HealthState {
    health: HostHealth,
    num_healthy: u32,
    num_unhealthy: u32,
}

impl Default for HealthState {
    fn default() -> Self {
        Self {
            health: HostHealth::new_host(),
            num_healthy: 0,
            num_unhealthy: 0,
        }
    }
}

impl HealthState {
    /// Current health.
    pub fn health(&self) -> HostHealth {
        self.health
    }

    /// Applies one check result.
    pub fn apply(&mut self, outcome: CheckOutcome, spec: &HealthCheckSpec) -> Transition {
        let first = self.health.pending;
        self.health.pending = false;
        let mut transition = match outcome {
            CheckOutcome::Healthy | CheckOutcome::Degraded => self.on_success(first, spec),
            CheckOutcome::Failed(kind) => self.on_failure(kind, spec),
        };
        if first && transition != Transition::Changed {
            // The first result always publishes (pending is cleared).
            transition = Transition::Changed;
        }
        if let CheckOutcome::Healthy | CheckOutcome::Degraded = outcome {
            let degraded = outcome == CheckOutcome::Degraded;
            if degraded != self.health.degraded {
                self.health.degraded = degraded;
                if transition == Transition::Unchanged {
                    transition = Transition::Changed;
                }
            }
        }
        transition
    }

    fn on_success(&mut self, first: bool, spec: &HealthCheckSpec) -> Transition {
        self.num_unhealthy = 0;
        if !self.health.failed {
            return Transition::Unchanged;
        }
        self.num_healthy += 1;
        if first || self.num_healthy >= spec.healthy_threshold {
            self.health.failed = false;
            self.health.timeout = false;
            self.num_healthy = 0;
            Transition::Changed
        } else {
            Transition::ChangePending
        }
    }

    fn on_failure(&mut self, kind: FailureKind, spec: &HealthCheckSpec) -> Transition {
        self.num_healthy = 0;
        let mut transition = Transition::Unchanged;
        if !self.health.failed {
            self.num_unhealthy += 1;
            if !kind.counts_towards_threshold() || self.num_unhealthy >= spec.unhealthy_threshold {
                self.health.failed = true;
                self.num_unhealthy = 0;
                transition = Transition::Changed;
            } else {
                transition = Transition::ChangePending;
            }
        }
        self.health.timeout = kind == FailureKind::Timeout && self.health.failed;
        transition
    }
}

/// The base interval before the next check, without jitter (Envoy's `interval()`):
/// before traffic, `no_traffic_healthy_interval` for a settled healthy host and
/// `no_traffic_interval` otherwise; with traffic, the edge intervals while a threshold is being
/// counted, `unhealthy_interval` after a failure and `interval` after a success.
pub fn base_interval(
    spec: &HealthCheckSpec,
    had_traffic: bool,
    last_succeeded: bool,
    transition: Transition,
) -> Duration {
    let pending = transition == Transition::ChangePending;
    match (had_traffic, last_succeeded, pending) {
        (false, true, false) => spec.no_traffic_healthy_interval,
        (false, _, _) => spec.no_traffic_interval,
        (true, true, true) => spec.healthy_edge_interval,
        (true, true, false) => spec.interval,
        (true, false, true) => spec.unhealthy_edge_interval,
        (true, false, false) => spec.unhealthy_interval,
    }
}

/// Adds jitter to a base interval: a random part in `[0, base * pct / 100)` and another in
/// `[0, interval_jitter)`, both at millisecond granularity as Envoy does; never below 1 ms.
pub fn with_jitter(base: Duration, spec: &HealthCheckSpec, random: &dyn Random) -> Duration {
    let base_ms = millis(base);
    let pct_bound = u64::from(spec.interval_jitter_percent).saturating_mul(base_ms) / 100;
    let jitter = random.below(pct_bound) + random.below(millis(spec.interval_jitter));
    Duration::from_millis(base_ms.saturating_add(jitter).max(1))
}

/// The delay before the first check: random in `[0, initial_jitter)`.
pub fn initial_delay(spec: &HealthCheckSpec, random: &dyn Random) -> Duration {
    Duration::from_millis(random.below(millis(spec.initial_jitter)))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
