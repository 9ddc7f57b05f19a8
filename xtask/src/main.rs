//! `cargo xtask`: what cargo alone cannot do. `setup` installs the toolchain pieces and packages
//! the project needs, `demo` runs the embedded default end to end, `test` runs every test.

mod apt;
mod consul;
mod demo;
mod setup;
mod test;
mod util;

use clap::{Parser, Subcommand};

/// Project tasks. Run from anywhere in the workspace as `cargo xtask <task>`.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Install what a fresh machine lacks: rust-src for the active toolchain, bpf-linker built
    /// against that toolchain's own LLVM, the Debian packages and the Python venv the tests use.
    /// Idempotent: a second run checks and skips in seconds.
    Setup,
    /// The main job on the embedded default (root): local backends on 127.0.0.x, the daemon,
    /// a client in the attached cgroup making 1,000 connections to the VIP, and what happened;
    /// then everything it started is stopped and its cgroup and pins are removed.
    Demo {
        /// Connections the client makes.
        #[arg(long, default_value_t = 1000)]
        count: u32,
    },
    /// Every test: setup, unit tests of all crates, then the root-only integration tests
    /// (real kernel, real eBPF object, real servers). Fails if any test fails.
    Test {
        /// Only run tests whose name contains this (passed to the test harnesses).
        filter: Option<String>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.task {
        Task::Setup => setup::run(),
        Task::Demo { count } => demo::run(count),
        Task::Test { filter } => test::run(filter.as_deref()),
    }
}
