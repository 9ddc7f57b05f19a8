//! Active health checking, outlier detection and the health matrix that decides which hosts route.
//!
//! Data flow: discovery produces a [`HostSet`](crate::host::HostSet) per cluster;
//! [`ClusterHealth`] feeds it to a [`ClusterMembership`] and registers one probe per host with
//! the node's [`HealthCheckManager`], which shares probes between clusters. Probe transitions,
//! passive connect results (outlier detection) and EDS health decide each host's
//! [`HostFlags`]; [`Routing`] turns them into routable hosts per priority, with Envoy's
//! overprovisioning and panic rules.

pub mod checker;
pub mod cluster;
pub mod cluster_config;
pub mod config;
pub mod drop_overload;
/// Durations as the whole configuration reads and writes them (one grammar: Envoy's `"0.5s"`
/// and the `"500ms"` shorthand).
pub use crate::config::duration;
pub mod grpc;
pub mod http;
pub mod manager;
pub mod matrix;
pub mod outlier;
pub mod priority;
pub mod random;
pub mod spec;
pub mod state;
pub mod stats;
pub mod tcp;
pub mod udp;
pub mod udp_config;

#[cfg(test)]
pub(crate) mod tests;

pub use checker::{Checker, CheckerFactory, NetworkCheckers, ProtocolChecker};
pub use cluster::{ClusterHealth, PassiveSignal};
pub use cluster_config::{
    AssignmentPolicy, ClusterHealthConfig, CommonLbConfig, LocalityWeightedLbConfig,
    OutlierDetection, Percent,
};
pub use config::{HealthCheck, HealthConfigError, MIN_TIMER_INTERVAL};
pub use drop_overload::DropOverload;
pub use manager::{HealthCheckManager, HealthEvent, ProbeId};
pub use matrix::{ClusterMembership, HostFlags, HostStatus, MembershipChange};
pub use outlier::{FailureVerdict, OutlierDetector, PassiveResult};
pub use priority::{Balance, HostClass, PriorityRouting, Routing};
pub use random::{ExtremeRandom, Random, SeededRandom};
pub use spec::HealthCheckSpec;
pub use state::{CheckOutcome, FailureKind, HostHealth, Transition};
pub use stats::{HealthCheckStats, MembershipStats, OutlierStats};
