//! Test doubles: a scripted checker and spec builders.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::time::Instant;

use crate::health::{
    checker::{CheckFuture, Checker, CheckerFactory},
    spec::{CheckKind, HealthCheckSpec, TcpSpec},
    state::CheckOutcome,
};

/// Answers each address with the outcome set for it (default healthy) and records call times.
#[derive(Default)]
pub struct Script {
    outcomes: Mutex<HashMap<SocketAddr, CheckOutcome>>,
    calls: Mutex<Vec<(SocketAddr, Instant)>>,
    pub builds: AtomicUsize,
}

impl Script {
    pub fn set(&self, addr: SocketAddr, outcome: CheckOutcome) {
        self.outcomes.lock().unwrap().insert(addr, outcome);
    }

    pub fn calls(&self, addr: SocketAddr) -> Vec<Instant> {
        let calls = self.calls.lock().unwrap();
        calls
            .iter()
            .filter(|(a, _)| *a == addr)
            .map(|(_, t)| *t)
            .collect()
    }
}

pub struct ScriptChecker(Arc<Script>);

impl Checker for ScriptChecker {
    fn check(&self, addr: SocketAddr) -> CheckFuture<'_> {
        self.0.calls.lock().unwrap().push((addr, Instant::now()));
        let outcome = self
            .0
            .outcomes
            .lock()
            .unwrap()
            .get(&addr)
            .copied()
            .unwrap_or(CheckOutcome::Healthy);
        Box::pin(async move { outcome })
    }
}

pub struct ScriptFactory(pub Arc<Script>);

impl CheckerFactory for ScriptFactory {
    fn build(&self, _spec: &Arc<HealthCheckSpec>) -> Arc<dyn Checker> {
        self.0.builds.fetch_add(1, Ordering::Relaxed);
        Arc::new(ScriptChecker(Arc::clone(&self.0)))
    }
}

pub fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// A TCP spec: timeout 1 s, interval 5 s, thresholds 3/2, no jitter, other intervals default.
pub fn spec() -> HealthCheckSpec {
    HealthCheckSpec {
        timeout: secs(1),
        interval: secs(5),
        initial_jitter: Duration::ZERO,
        interval_jitter: Duration::ZERO,
        interval_jitter_percent: 0,
        unhealthy_threshold: 3,
        healthy_threshold: 2,
        no_traffic_interval: secs(60),
        no_traffic_healthy_interval: secs(60),
        unhealthy_interval: secs(5),
        unhealthy_edge_interval: secs(5),
        healthy_edge_interval: secs(5),
        kind: CheckKind::Tcp(TcpSpec::default()),
    }
}

pub fn addr(last: u8) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, last], 8080))
}
