//! The checker abstraction: one async check against one address, bounded by the spec's timeout.
//!
//! The manager builds checkers through a [`CheckerFactory`], so unit tests can inject scripted
//! outcomes while production uses [`NetworkCheckers`] (real TCP, HTTP/1.1, gRPC and UDP I/O).
//! Each check opens a fresh connection: Envoy's `reuse_connection` is not implemented.

use std::{future::Future, net::SocketAddr, pin::Pin, sync::Arc};

use tracing::debug;

use super::{
    grpc, http,
    spec::{CheckKind, HealthCheckSpec},
    state::{CheckOutcome, FailureKind},
    tcp, udp,
};

/// A boxed check future.
pub type CheckFuture<'a> = Pin<Box<dyn Future<Output = CheckOutcome> + Send + 'a>>;

/// Runs one health check against an address.
pub trait Checker: Send + Sync {
    /// One check; implementations need not enforce the timeout (the caller does).
    fn check(&self, addr: SocketAddr) -> CheckFuture<'_>;
}

/// Builds the checker for a probe.
pub trait CheckerFactory: Send + Sync {
    /// The checker that runs `spec` (one per probe).
    fn build(&self, spec: &Arc<HealthCheckSpec>) -> Arc<dyn Checker>;
}

/// The production factory: real network checks.
#[derive(Debug, Default, Clone, Copy)]
pub struct NetworkCheckers;

impl CheckerFactory for NetworkCheckers {
    fn build(&self, spec: &Arc<HealthCheckSpec>) -> Arc<dyn Checker> {
        Arc::new(ProtocolChecker {
            spec: Arc::clone(spec),
        })
    }
}

/// A checker speaking the spec's protocol.
#[derive(Debug, Clone)]
pub struct ProtocolChecker {
    spec: Arc<HealthCheckSpec>,
}

impl ProtocolChecker {
    /// A checker for `spec`.
    pub fn new(spec: Arc<HealthCheckSpec>) -> Self {
        Self { spec }
    }
}

impl Checker for ProtocolChecker {
    fn check(&self, addr: SocketAddr) -> CheckFuture<'_> {
        Box::pin(async move {
            let work = async {
                match &self.spec.kind {
                    CheckKind::Tcp(t) => tcp::check(addr, t).await,
                    CheckKind::Http(h) => http::check(addr, h).await,
                    CheckKind::Grpc(g) => grpc::check(addr, g).await,
                    CheckKind::Udp(u) => udp::check(addr, u).await,
                }
            };
            let outcome = tokio::time::timeout(self.spec.timeout, work)
                .await
                .unwrap_or(CheckOutcome::Failed(FailureKind::Timeout));
            debug!(%addr, ?outcome, "health check finished");
            outcome
        })
    }
}
