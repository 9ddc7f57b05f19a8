//! Passive health: consecutive connect failures eject a host for a backed-off time.
//!
//! Envoy's consecutive-5xx detector with a connect failure as the error signal: the
//! `consecutive_5xx`-th failure in a row ejects the host (if the `enforcing_consecutive_5xx` roll
//! passes and fewer than `max_ejection_percent` of hosts are ejected, though one host may always
//! be ejected). An ejection lasts `base_ejection_time x backoff`, capped by
//! `max_ejection_time`; the backoff grows with each ejection and decays by one for each
//! `base_ejection_time` a host stays in. Unejection happens on the periodic
//! [`tick`](OutlierDetector::tick) (every `interval`), as in Envoy. Time is
//! `tokio::time::Instant`, so paused-time tests drive it.

use std::{collections::HashMap, net::SocketAddr, sync::Arc, time::Duration};

use tokio::time::Instant;
use tracing::info;

use super::{cluster_config::OutlierDetection, random::Random, stats::OutlierStats};

#[derive(Debug, Default, Clone)]
struct Monitor {
    consecutive_failures: u32,
    ejected_at: Option<Instant>,
    unejected_at: Option<Instant>,
    backoff: u32,
}

/// The outlier detector of one cluster.
#[derive(Debug)]
pub struct OutlierDetector {
    config: OutlierDetection,
    monitors: HashMap<SocketAddr, Monitor>,
    stats: OutlierStats,
    random: Arc<dyn Random>,
}

/// What [`OutlierDetector::record_connect_failure`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureVerdict {
    /// Below the threshold, already ejected, or unknown host.
    Counted,
    /// The host was ejected.
    Ejected,
    /// Threshold reached but not enforced (enforcement roll or `max_ejection_percent`).
    NotEnforced,
}

impl OutlierDetector {
    /// A detector with no hosts.
    pub fn new(config: OutlierDetection, random: Arc<dyn Random>) -> Self {
        Self {
            config,
            monitors: HashMap::new(),
            stats: OutlierStats::default(),
            random,
        }
    }

    /// Tracks exactly `addrs`: new hosts start clean, gone hosts are forgotten.
    pub fn sync_hosts(&mut self, addrs: impl IntoIterator<Item = SocketAddr>) {
        let keep: HashMap<SocketAddr, Monitor> = addrs
            .into_iter()
            .map(|a| (a, self.monitors.remove(&a).unwrap_or_default()))
            .collect();
        self.monitors = keep;
        self.stats.ejections_active = self
            .monitors
            .values()
            .filter(|m| m.ejected_at.is_some())
            .count() as u64;
    }

    /// Whether `addr` is ejected now.
    pub fn is_ejected(&self, addr: SocketAddr) -> bool {
        self.monitors
            .get(&addr)
            .is_some_and(|m| m.ejected_at.is_some())
    }

    /// Counters.
    pub fn stats(&self) -> &OutlierStats {
        &self.stats
    }

    /// A successful connect resets the host's consecutive-failure count.
    pub fn record_connect_success(&mut self, addr: SocketAddr) {
        if let Some(m) = self.monitors.get_mut(&addr) {
            m.consecutive_failures = 0;
        }
    }

    /// A failed connect; may eject the host.
    pub fn record_connect_failure(&mut self, addr: SocketAddr, now: Instant) -> FailureVerdict {
        let threshold = self.config.consecutive_5xx;
        let Some(m) = self.monitors.get_mut(&addr) else {
            return FailureVerdict::Counted;
        };
        if m.ejected_at.is_some() || threshold == 0 {
            return FailureVerdict::Counted;
        }
        m.consecutive_failures += 1;
        if m.consecutive_failures < threshold {
            return FailureVerdict::Counted;
        }
        m.consecutive_failures = 0;
        self.stats.ejections_detected_consecutive_5xx += 1;
        self.try_eject(addr, now)
    }

    fn try_eject(&mut self, addr: SocketAddr, now: Instant) -> FailureVerdict {
        let active = self.stats.ejections_active;
        let total = self.monitors.len() as u64;
        let max_pct = u64::from(self.config.max_ejection_percent.min(100));
        // Envoy compares the share already ejected; one host may always be ejected.
        if active > 0 && active * 100 >= max_pct * total {
            self.stats.ejections_overflow += 1;
            return FailureVerdict::NotEnforced;
        }
        if self.random.below(100) >= u64::from(self.config.enforcing_consecutive_5xx) {
            return FailureVerdict::NotEnforced;
        }
        let (base, max) = (
            self.config.base_ejection_time,
            self.config.max_ejection_time,
        );
        let Some(m) = self.monitors.get_mut(&addr) else {
            return FailureVerdict::Counted;
        };
        m.ejected_at = Some(now);
        // Saturating: both times come from configuration, as large as a user writes them.
        if base.saturating_mul(m.backoff) < max.saturating_add(base) {
            m.backoff += 1;
        }
        self.stats.ejections_active += 1;
        self.stats.ejections_enforced_total += 1;
        self.stats.ejections_enforced_consecutive_5xx += 1;
        info!(%addr, backoff = m.backoff, "outlier detection ejected host");
        FailureVerdict::Ejected
    }

    /// How long the current ejection of a host with this backoff lasts.
    fn ejection_time(&self, backoff: u32) -> Duration {
        (self.config.base_ejection_time.saturating_mul(backoff)).min(self.config.max_ejection_time)
    }

    /// The periodic sweep: unejects hosts whose time is up and decays idle backoffs.
    /// Returns the unejected hosts.
    pub fn tick(&mut self, now: Instant) -> Vec<SocketAddr> {
        let base = self.config.base_ejection_time;
        let mut unejected = Vec::new();
        let times: Vec<(SocketAddr, Duration)> = self
            .monitors
            .iter()
            .map(|(a, m)| (*a, self.ejection_time(m.backoff)))
            .collect();
        for (addr, eject_for) in times {
            let Some(m) = self.monitors.get_mut(&addr) else {
                continue;
            };
            match m.ejected_at {
                Some(at) if now.duration_since(at) >= eject_for => {
                    m.ejected_at = None;
                    m.unejected_at = Some(now);
                    unejected.push(addr);
                }
                Some(_) => {}
                None => {
                    if m.unejected_at
                        .is_some_and(|u| now.duration_since(u) >= base)
                        && m.backoff > 0
                    {
                        m.backoff -= 1;
                        m.unejected_at = Some(now);
                    }
                }
            }
        }
        self.stats.ejections_active -= unejected.len() as u64;
        for addr in &unejected {
            info!(%addr, "outlier detection unejected host");
        }
        unejected
    }

    /// Unejects a host at once (a successful active health check does this in Envoy, with
    /// `successful_active_health_check_uneject_host`, default true).
    pub fn uneject(&mut self, addr: SocketAddr, now: Instant) -> bool {
        let Some(m) = self.monitors.get_mut(&addr) else {
            return false;
        };
        if m.ejected_at.take().is_none() {
            return false;
        }
        m.unejected_at = Some(now);
        self.stats.ejections_active -= 1;
        true
    }
}
