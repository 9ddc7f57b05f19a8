//! `cargo xtask`: what cargo alone cannot do. `setup` installs the toolchain pieces and packages
//! the project needs, `demo` runs the embedded default end to end, `test` runs every test, `vm`
//! runs the kernel tests in QEMU, `docs` writes the configuration reference, `bench` runs the
//! benchmark harness (the `proxy-bench` crate), `fleet` measures convergence over many nodes on
//! this machine and `dist` builds the Debian package and the OCI image. xtask links no crate of
//! the product: it builds and runs the binaries.

mod apt;
mod bench;
mod consul;
#[allow(unsafe_code, reason = "kill(2) of the demo daemon by its PID")]
mod demo;
mod deps;
mod dist;
mod docs;
mod fleet;
mod fuzz;
mod integration;
mod lint;
mod qemu;
mod setup;
mod test;
#[allow(unsafe_code, reason = "geteuid(2), to tell root apart")]
mod util;
mod vm;

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
    /// Benchmarks against the peers (root): S0-S6 on loopback and veth, HAProxy, nginx, Envoy,
    /// nft DNAT; medians of `--runs` runs as ratios to S0; writes BENCHMARKS.md and charts.
    /// Runs the harness (`bench/`, package proxy-bench) with the arguments given; `cargo xtask
    /// bench --help` lists them.
    #[command(disable_help_flag = true)]
    Bench {
        /// The harness's options (`cargo xtask bench --help`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// A fleet on this machine (root): N nodes, each a network namespace with its own cgroup,
    /// daemon and probe, following a three-server Consul 1.8.7 cluster through a client agent
    /// each (or one xDS server); measures how long a registration, a deregistration, a check
    /// turning critical and a split moved by a config write (xDS: an endpoint added and
    /// removed) take to reach every node's kernel (p50, p99, max), writes target/fleet/ and
    /// tears everything down. See docs/fleet.md.
    Fleet(fleet::Options),
    /// The fleet's probe, run by `fleet` inside each node (not for direct use).
    #[command(hide = true)]
    FleetProbe {
        /// Milliseconds between tries while waiting.
        #[arg(long, default_value_t = 5)]
        interval_ms: u64,
    },
    /// The fuzz targets of `fuzz/` (config, chain entries, EDS assignments, DNS answers, PROXY
    /// headers, HTTP routing) under libFuzzer, each for a bounded time from its corpus; fails if
    /// an input crashes one (kept under fuzz/artifacts/). Needs the nightly toolchain.
    Fuzz {
        /// Targets to run (all by default).
        targets: Vec<String>,
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Add the new inputs the fuzzer finds to the repository's corpus (to commit).
        #[arg(long)]
        grow: bool,
    },
    /// The release package (root): builds the daemon in release mode and, from that one binary,
    /// a Debian package (daemon, systemd units, sysusers entry, man page, completions, example
    /// config) that lintian must accept and that is installed into a scratch root, run with
    /// `proxy check` and purged there, and an OCI image layout checked with umoci. Writes
    /// target/dist/.
    Dist {
        /// Package this daemon binary instead of a release build, into target/dist-check/
        /// (`cargo xtask test` does this with its debug build).
        #[arg(long)]
        binary: Option<std::path::PathBuf>,
    },
    /// The style gates alone: nightly rustfmt --check with the repository's rustfmt.toml, and
    /// clippy with the workspace lint set on every crate (the kernel programs on their target).
    Lint,
    /// The configuration reference from the code: writes docs/config-reference.md and the JSON
    /// Schema docs/config.schema.json (a unit test of proxy-core fails while they differ from
    /// what the code generates), then checks that the schema is valid and accepts every example.
    Docs,
    /// Every test: setup, the style gates, unit tests of all crates, then the root-only
    /// integration tests (real kernel, real eBPF object, real servers). Fails if any test fails.
    Test {
        /// Only run tests whose name contains this (passed to the test harnesses).
        filter: Option<String>,
    },
    /// The kernel tests (the `kernel_*` binaries of integration-tests) on Debian kernels in
    /// QEMU: downloads the kernel packages (cached under target/vm), builds an initramfs, boots
    /// it without network and fails if any test failed. Setup installs QEMU.
    Vm {
        /// Kernel line to boot, or `all` (default: 5.10; 6.12 with --systemd).
        #[arg(long, value_enum)]
        kernel: Option<vm::KernelChoice>,
        /// Boot systemd as PID 1 instead and check the shipped units (docs/deploy/*.service)
        /// under it: readiness, status, watchdog, restart, takeover, stop.
        #[arg(long)]
        systemd: bool,
        /// Only run tests whose name contains this.
        filter: Option<String>,
        /// Accelerator: `auto` uses KVM only if a probe boot with it finishes.
        #[arg(long, value_enum, default_value = "auto")]
        accel: vm::Accel,
        /// Wall-clock limit per kernel in seconds, boot to power-off; QEMU is killed after it
        /// (default: 1800; 600 with --systemd).
        #[arg(long)]
        timeout: Option<u64>,
        /// Limit per test binary in the VM, in seconds; a binary still running is killed and
        /// counted as a failure.
        #[arg(long, default_value_t = 600)]
        binary_timeout: u64,
        /// Guest memory in MiB (default: 1536; 1024 with --systemd).
        #[arg(long)]
        memory: Option<u32>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.task {
        Task::Setup => setup::run(),
        Task::Demo { count } => demo::run(count),
        Task::Lint => setup::run().and_then(|()| lint::run()),
        Task::Docs => docs::write(),
        Task::Dist { binary: None } => dist::run(),
        Task::Dist {
            binary: Some(binary),
        } => dist::check(&binary),
        Task::Fuzz {
            targets,
            seconds,
            grow,
        } => fuzz::run(&fuzz::Options {
            targets: targets.iter().map(String::as_str).collect(),
            each: std::time::Duration::from_secs(seconds),
            grow,
        }),
        Task::Test { filter } => test::run(filter.as_deref()),
        Task::Bench { args } => bench::run(&args),
        Task::Fleet(opts) => fleet::run(&opts),
        Task::FleetProbe { interval_ms } => {
            fleet::probe_main(std::time::Duration::from_millis(interval_ms))
        }
        Task::Vm {
            kernel,
            systemd: true,
            filter,
            accel,
            timeout,
            memory,
            ..
        } => {
            if let Some(filter) = filter {
                anyhow::bail!(
                    "--systemd runs the units' check, not the test binaries: drop the filter {filter:?}"
                );
            }
            let mut opts = vm::systemd::Options::new(
                kernel.map_or_else(vm::systemd::default_kernels, vm::KernelChoice::lines),
            );
            opts.accel = accel;
            opts.timeout = timeout.map_or(opts.timeout, std::time::Duration::from_secs);
            opts.memory_mib = memory.unwrap_or(opts.memory_mib);
            vm::systemd::run(&opts, None)
        }
        Task::Vm {
            kernel,
            systemd: false,
            filter,
            accel,
            timeout,
            binary_timeout,
            memory,
        } => {
            let mut opts = vm::Options::new(kernel.unwrap_or(vm::KernelChoice::V5_10));
            opts.filter = filter.as_deref();
            opts.accel = accel;
            opts.timeout = timeout.map_or(opts.timeout, std::time::Duration::from_secs);
            opts.binary_timeout = std::time::Duration::from_secs(binary_timeout);
            opts.memory_mib = memory.unwrap_or(opts.memory_mib);
            vm::run(&opts)
        }
    }
}
