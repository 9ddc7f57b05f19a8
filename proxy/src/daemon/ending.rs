//! Host ending for one service's publisher (`SERVICE_F_END`, see
//! `proxy_core::kernel::ending`): after each publish, the hosts that left the routable set
//! have their kernel-path sockets ended, failed and ejected ones at once, removed ones after
//! `proxy.drain_timeout` unless they are routable again by then. Only the sockets that dialled
//! this service: the same host may still be healthy behind another.

use std::{net::SocketAddr, time::Duration};

use proxy_common::service::ServiceKey;
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
    /// The service's kernel key: only sockets that dialled it are ended.
    key: ServiceKey,
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
            key: template.key,
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
                Some(dp) => dp.end_hosts(self.key, &backends),
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

#[cfg(test)]
mod tests {
    use std::{
        path::Path,
        sync::{Arc, Mutex},
    };

    use proxy_core::{
        config::Config,
        health::{HostClass, Routing},
        host::Host,
    };

    use super::*;

    fn host(last: u8) -> Host {
        Host::new(SocketAddr::from(([127, 0, 0, last], 80)))
    }

    /// A removed host waits for the default drain deadline (a failed one does not: it is ended
    /// at the publish, which finds no data path here); one routable again before it is not
    /// ended.
    #[tokio::test(start_paused = true)]
    async fn a_removed_host_waits_for_the_drain_unless_it_returns() {
        let yaml = "clusters:\n  - name: on\n    close_connections_on_host_health_failure: true\n    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 1 } } } } ] } ] }\nservices:\n  - { name: a, address: 127.77.0.1, port: 80, cluster: on }\n";
        let config = Config::parse(yaml, Path::new("t.yaml")).expect("valid config");
        let t = &ServiceTemplate::all(&config)[0];
        let dp: SharedDataplane = Arc::new(Mutex::new(None));
        // The default drain (the file sets no `proxy.drain_timeout`): tests/daemon_end.rs
        // shortens it to 3 s, this shows the deadline users get.
        let drain = config.proxy.drain_timeout;
        assert_eq!(drain, Duration::from_secs(30), "the default drain");
        let mut ender = Ender::new(t, drain).expect("the option is on");
        let publish = |ender: &mut Ender, hosts: &[(Host, HostClass)]| {
            let routing = Routing::compute(hosts, 50.0);
            let spec = t.spec(&[("on", &routing)]);
            ender.published(t, &spec, vec![("on".to_owned(), routing)], &dp);
        };
        let healthy = |h: u8| (host(h), HostClass::Healthy);
        publish(&mut ender, &[healthy(1), healthy(2), healthy(3)]);
        assert!(ender.pending.is_empty(), "the first publish ends nothing");
        // 2 fails (ended now), 3 is removed (pending).
        publish(&mut ender, &[healthy(1), (host(2), HostClass::Unhealthy)]);
        let pending: Vec<_> = ender.pending.iter().map(|(_, a)| *a).collect();
        assert_eq!(pending, [host(3).addr]);
        let start = Instant::now();
        ender.due().await;
        assert_eq!(start.elapsed(), drain, "due at the deadline");
        ender.fire("a", &dp);
        assert!(ender.pending.is_empty(), "fired");
        // Removed again, then back before its deadline: never ended.
        publish(&mut ender, &[healthy(1), healthy(3)]);
        publish(&mut ender, &[healthy(1)]);
        assert_eq!(ender.pending.len(), 1);
        publish(&mut ender, &[healthy(1), healthy(3)]);
        assert!(ender.pending.is_empty(), "routable again: dropped");
    }
}
