//! The daemon's pure logic: configuration, discovery state, health, and load assignment.
//!
//! Nothing here touches the kernel, so `cargo test -p proxy-core` runs in seconds without root
//! and without the eBPF toolchain. The `proxy` crate wires this logic to BPF maps and sockets.
#![forbid(unsafe_code)]

pub mod chain;
pub mod config;
pub mod desired;
pub mod discovery;
#[cfg(test)]
mod field_table;
pub mod health;
pub mod host;
pub mod kernel;
#[cfg(test)]
mod layers;
pub mod lb;
pub mod time;
pub mod tls;
pub mod upstream;
