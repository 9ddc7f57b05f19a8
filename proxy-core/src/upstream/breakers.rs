//! A running cluster's circuit breakers for the proxy path: Envoy's resource manager of the
//! `DEFAULT` priority (all traffic here), with its overflow counters and gauges.
//!
//! Pending requests, requests and retries are held through [`Held`] guards that give their
//! place back when dropped; connections are the cluster's open connections
//! ([`super::UpstreamTraffic::try_open`]), so the count cannot leak on any path.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use tokio::sync::Notify;

use crate::config::circuit_breakers::{Limits, Priority};

/// A resource the breakers count, other than connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource {
    /// A request waiting for an upstream connection (`max_pending_requests`).
    Pending,
    /// A request in flight (`max_requests`).
    Request,
    /// A retry in flight, from its decision until its attempt is answered (`max_retries`).
    Retry,
}

/// A cluster's limits, the counts held against them, and the overflow counters.
#[derive(Debug)]
pub struct Breakers {
    limits: Limits,
    /// The `HIGH` priority's limits: shown (`/clusters`), holding nothing, since no traffic
    /// here has that priority.
    high: Limits,
    pending: AtomicU64,
    requests: AtomicU64,
    retries: AtomicU64,
    /// Connections a limit kept from opening (`upstream_cx_overflow`).
    pub cx_overflow: AtomicU64,
    /// Requests refused by `max_pending_requests` (`upstream_rq_pending_overflow`).
    pub rq_pending_overflow: AtomicU64,
    /// Requests refused by `max_requests` once they had a connection
    /// (`upstream_rq_active_overflow`, where Envoy counts them since 1.38).
    pub rq_active_overflow: AtomicU64,
    /// Retries refused by `max_retries` (`upstream_rq_retry_overflow`).
    pub rq_retry_overflow: AtomicU64,
    /// Woken when a connection of the cluster closes.
    freed: Notify,
}

/// A place held against a limit until dropped.
#[derive(Debug)]
pub struct Held {
    breakers: Arc<Breakers>,
    resource: Resource,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.breakers
            .count(self.resource)
            .fetch_sub(1, Ordering::Relaxed);
    }
}

impl Default for Breakers {
    fn default() -> Self {
        Self::new(Limits::default())
    }
}

impl Breakers {
    /// Breakers with `limits` and nothing held.
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            high: Limits::default(),
            pending: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            cx_overflow: AtomicU64::new(0),
            rq_pending_overflow: AtomicU64::new(0),
            rq_active_overflow: AtomicU64::new(0),
            rq_retry_overflow: AtomicU64::new(0),
            freed: Notify::new(),
        }
    }

    /// These breakers with `high` as the `HIGH` priority's limits.
    #[must_use]
    pub fn with_high(mut self, high: Limits) -> Self {
        self.high = high;
        self
    }

    /// The limits (of the `DEFAULT` priority, all traffic here).
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The limits of each priority, `DEFAULT` first, as Envoy's `/clusters` lists them.
    pub fn thresholds(&self) -> [(Priority, Limits); 2] {
        [
            (Priority::Default, self.limits),
            (Priority::High, self.high),
        ]
    }

    fn count(&self, resource: Resource) -> &AtomicU64 {
        match resource {
            Resource::Pending => &self.pending,
            Resource::Request => &self.requests,
            Resource::Retry => &self.retries,
        }
    }

    fn max(&self, resource: Resource) -> u64 {
        match resource {
            Resource::Pending => self.limits.max_pending_requests,
            Resource::Request => self.limits.max_requests,
            Resource::Retry => self.limits.max_retries,
        }
    }

    /// A place for `resource`, or `None` when its limit is reached (not counted: the caller
    /// counts the overflow Envoy counts for it).
    pub fn try_hold(self: &Arc<Self>, resource: Resource) -> Option<Held> {
        let max = self.max(resource);
        self.count(resource)
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        Some(Held {
            breakers: self.clone(),
            resource,
        })
    }

    /// Places of `resource` held now.
    pub fn held(&self, resource: Resource) -> u64 {
        self.count(resource).load(Ordering::Relaxed)
    }

    /// Adds one to an overflow counter.
    pub fn overflowed(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Completes when a connection of the cluster closes after this call (enable it before
    /// checking, so no close is missed); every waiter wakes and checks again.
    pub fn freed(&self) -> tokio::sync::futures::Notified<'_> {
        self.freed.notified()
    }

    /// Wakes the waiters of [`Breakers::freed`] (a connection closed).
    pub fn wake(&self) {
        self.freed.notify_waiters();
    }

    /// Envoy's names and values, `connections` being the cluster's open connections: the
    /// overflow counters, the `circuit_breakers.default.*_open` gauges (1 while the limit is
    /// reached) and, with `track_remaining`, the `remaining_*` gauges.
    pub fn named(&self, connections: u64) -> Vec<(&'static str, u64)> {
        let l = &self.limits;
        let levels = [
            (connections, l.max_connections),
            (self.held(Resource::Pending), l.max_pending_requests),
            (self.held(Resource::Request), l.max_requests),
            (self.held(Resource::Retry), l.max_retries),
        ];
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = vec![
            ("upstream_cx_overflow", load(&self.cx_overflow)),
            (
                "upstream_rq_pending_overflow",
                load(&self.rq_pending_overflow),
            ),
            (
                "upstream_rq_active_overflow",
                load(&self.rq_active_overflow),
            ),
            ("upstream_rq_retry_overflow", load(&self.rq_retry_overflow)),
            // Connection pools are not limited here (Envoy's default: unlimited).
            ("circuit_breakers.default.cx_pool_open", 0),
        ];
        let open = [
            "circuit_breakers.default.cx_open",
            "circuit_breakers.default.rq_pending_open",
            "circuit_breakers.default.rq_open",
            "circuit_breakers.default.rq_retry_open",
        ];
        out.extend(
            open.into_iter()
                .zip(levels)
                .map(|(n, (c, m))| (n, u64::from(c >= m))),
        );
        if l.track_remaining {
            out.extend(remaining(levels));
        }
        out
    }
}

/// The `remaining_*` gauges of the (held, limit) levels of connections, pending requests,
/// requests and retries; connection pools are unlimited.
fn remaining(levels: [(u64, u64); 4]) -> Vec<(&'static str, u64)> {
    let names = [
        "circuit_breakers.default.remaining_cx",
        "circuit_breakers.default.remaining_pending",
        "circuit_breakers.default.remaining_rq",
        "circuit_breakers.default.remaining_retries",
    ];
    let mut out: Vec<_> = names
        .into_iter()
        .zip(levels)
        .map(|(n, (held, max))| (n, max.saturating_sub(held)))
        .collect();
    out.push(("circuit_breakers.default.remaining_cx_pools", u64::MAX));
    out
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn limits(max: u64) -> Limits {
        Limits {
            max_connections: max,
            max_pending_requests: max,
            max_requests: max,
            max_retries: max,
            track_remaining: true,
        }
    }

    #[test]
    fn holds_stop_at_the_limit_and_give_their_place_back_when_dropped() {
        let b = Arc::new(Breakers::new(limits(2)));
        for resource in [Resource::Pending, Resource::Request, Resource::Retry] {
            let first = b.try_hold(resource).expect("first");
            let second = b.try_hold(resource).expect("second");
            assert!(b.try_hold(resource).is_none(), "{resource:?}");
            assert_eq!(b.held(resource), 2);
            drop(first);
            let third = b.try_hold(resource).expect("a freed place");
            drop((second, third));
            assert_eq!(b.held(resource), 0);
        }
    }

    #[test]
    fn gauges_show_open_breakers_and_what_remains() {
        let b = Arc::new(Breakers::new(limits(1)));
        let _request = b.try_hold(Resource::Request).expect("request");
        Breakers::overflowed(&b.rq_active_overflow);
        let named: HashMap<_, _> = b.named(0).into_iter().collect();
        assert_eq!(named["upstream_rq_active_overflow"], 1);
        assert_eq!(named["upstream_rq_pending_overflow"], 0);
        assert_eq!(named["circuit_breakers.default.rq_open"], 1);
        assert_eq!(named["circuit_breakers.default.remaining_rq"], 0);
        assert_eq!(named["circuit_breakers.default.cx_open"], 0);
        assert_eq!(named["circuit_breakers.default.remaining_cx"], 1);
        assert_eq!(named["circuit_breakers.default.remaining_pending"], 1);
    }

    #[test]
    fn remaining_gauges_need_track_remaining() {
        let b = Breakers::default();
        let named: HashMap<_, _> = b.named(0).into_iter().collect();
        assert_eq!(named["circuit_breakers.default.rq_open"], 0);
        assert!(!named.keys().any(|k| k.contains("remaining")));
    }
}
