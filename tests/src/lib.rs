//! Harness for the root-only integration tests: network namespaces, cgroups, real servers.
//!
//! Every helper here creates what it needs and removes it on drop, so a failing test leaves
//! nothing behind. Tests live in `tests/tests/`; run them with `cargo xtask test`.

pub mod consul;
pub mod features;
pub mod health_servers;
pub mod kernel;
pub mod unbound;
pub mod xds_server;
