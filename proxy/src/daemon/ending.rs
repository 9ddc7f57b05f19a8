//! Host ending for one service's publisher (`SERVICE_F_END`, see
//! `proxy_core::kernel::ending`): after each publish, the hosts that left the routable set
//! have their kernel-path sockets ended, failed and ejected ones at once, removed ones after
//! `proxy.drain_timeout` unless they are routable again by then.

use std::{net::SocketAddr, time::Duration};

use proxy_core::{
    health::Routing,
    kernel::{
        ServiceSpec, ServiceTemplate,
        ending::{Leavers, routable},
    },
};
use tokio::time::Instant;
use tracing::{info, warn};

use super::state::SharedDataplane;
use crate::dataplane::backend_of;

/// What one service's host ending remembers between publishes.
pub(super) struct Ender {
    /// How long a removed host's sockets live on.
    drain: Duration,
    /// The last published spec and the routing it was made from.
    last: Option<(ServiceSpec, Vec<(String, Routing)>)>,
    /// Removed hosts and when their sockets are ended.
    pending: Vec<(Instant, SocketAddr)>,
    /// Host ending was found unavailable once (said once per service).
    warned: bool,
}

impl Ender {
    /// The ender of `template`'s service, `None` when it does not end hosts.
    pub(super) fn new(template: &ServiceTemplate, drain: Duration) -> Option<Self> {
        template.ends_hosts().then_some(Self {
            drain,
            last: None,
            pending: Vec::new(),
            warned: false,
        })
    }

    /// `spec`, made from `routings`, was published: ends the hosts that failed since the last
    /// publish and schedules the removed ones.
    pub(super) fn published(
        &mut self,
        template: &ServiceTemplate,
        spec: &ServiceSpec,
        routings: Vec<(String, Routing)>,
        dp: &SharedDataplane,
    ) {
        let Leavers { now, later } = match &self.last {
            Some((before, before_routings)) => {
                let b: Vec<_> = before_routings
                    .iter()
                    .map(|(n, r)| (n.as_str(), r))
                    .collect();
                let a: Vec<_> = routings.iter().map(|(n, r)| (n.as_str(), r)).collect();
                template.leavers(before, spec, &b, &a)
            }
            None => Leavers::default(),
        };
        let at = Instant::now() + self.drain;
        self.pending
            .extend(later.into_iter().map(|addr| (at, addr)));
        // A host routable again is not ended when its deadline comes.
        let still = routable(spec);
        self.pending.retain(|(_, addr)| !still.contains(addr));
        self.last = Some((spec.clone(), routings));
        self.end(&spec.name, &now, "failed or ejected", dp);
    }

    /// Sleeps until the earliest deadline of a removed host; forever when there is none.
    pub(super) async fn due(&self) {
        match self.pending.iter().map(|(at, _)| *at).min() {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    }

    /// Ends the removed hosts whose deadline passed.
    pub(super) fn fire(&mut self, service: &str, dp: &SharedDataplane) {
        let now = Instant::now();
        let (due, rest): (Vec<_>, Vec<_>) = self.pending.drain(..).partition(|(at, _)| *at <= now);
        self.pending = rest;
        let hosts: Vec<_> = due.into_iter().map(|(_, addr)| addr).collect();
        self.end(service, &hosts, "removed, drain deadline passed", dp);
    }

    fn end(&mut self, service: &str, hosts: &[SocketAddr], why: &str, dp: &SharedDataplane) {
        if hosts.is_empty() {
            return;
        }
        let backends: Vec<_> = hosts.iter().map(|addr| backend_of(*addr)).collect();
        let result = {
            let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match guard.as_mut() {
                Some(dp) => dp.end_hosts(&backends),
                None => return,
            }
        };
        match result {
            Ok(ended) => info!(service, ?hosts, ended, why, "ended kernel-path sockets"),
            Err(err) if !self.warned => {
                self.warned = true;
                warn!(service, ?hosts, %err, "kernel-path sockets of hosts that left stay open");
            }
            Err(_) => {}
        }
    }
}
