//! Command line: `proxy run`, `proxy check`.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// eBPF-accelerated transparent proxy with Envoy-grade service discovery.
///
/// Applications in a cgroup connect to service addresses (VIP:port) as usual; kernel programs
/// attached to that cgroup pick a host from the host sets this daemon publishes and connect the
/// application straight to it.
#[derive(Debug, Parser)]
#[command(name = "proxy", version, propagate_version = true)]
pub struct Cli {
    /// Log filter, in tracing's EnvFilter syntax (e.g. `info`, `proxy=debug`). RUST_LOG also works.
    #[arg(long, global = true, env = "PROXY_LOG", default_value = "info")]
    pub log: String,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon (as root): load and attach the kernel programs, publish the configured
    /// services, serve the admin interface; SIGINT or SIGTERM detaches and removes everything.
    Run {
        /// Configuration file (YAML or JSON). Without it, the embedded default configuration
        /// (the demo's: one STATIC cluster of three loopback hosts behind 127.77.0.1:80) is used.
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Validate a configuration file and exit: status 0 if it is usable, 64 with
    /// file:line:column and the field if not. Needs no privileges and touches nothing.
    Check {
        /// Configuration file (YAML or JSON).
        #[arg(long, short)]
        config: PathBuf,
    },
}
