//! `cargo xtask test`: every test. Setup, the style gates (`lint.rs`), unit tests of every crate
//! (no root needed), a bounded run of every fuzz target, then the root-only integration tests against the real kernel, the real eBPF
//! object and real servers, control-plane faults on a small fleet (`cargo xtask fleet --fault
//! all`), the package check of `cargo xtask dist` on the debug binary, then the
//! kernel tests on Linux 5.10 in QEMU, and the shipped systemd units under systemd there.

use anyhow::Context as _;

use crate::{
    bench, dist, fleet, fuzz, integration, lint, setup,
    util::{self, step},
    vm,
};

/// How long each fuzz target runs in the suite (`cargo xtask fuzz` runs longer).
const FUZZ_EACH: std::time::Duration = std::time::Duration::from_secs(10);

pub fn run(filter: Option<&str>) -> anyhow::Result<()> {
    setup::run()?;
    // The style gates run first but do not stop the tests: one run reports everything.
    let style = lint::run();
    step("unit tests (all crates but the kernel programs and the root-only suite)");
    let mut unit = util::cargo();
    unit.args([
        "test",
        "--workspace",
        "--exclude",
        "proxy-ebpf",
        "--exclude",
        "integration-tests",
    ]);
    unit.args(filter.map(|f| vec!["--", f]).unwrap_or_default());
    util::run(&mut unit, "unit tests")?;
    // Every fuzz target for a bounded time from its corpus (the corpora and the regressions
    // were replayed by the unit tests above); does not stop the other tests.
    let fuzzed = fuzz::run(&fuzz::Options {
        targets: Vec::new(),
        each: FUZZ_EACH,
        grow: false,
    });

    util::require_root("the integration tests")?;
    let suite = util::Suite::build()?;
    step("integration tests (root: network namespaces, cgroups, eBPF, real servers)");
    let python = util::workspace_root().join(".venv/bin/python");
    let integrated = integration::run(&suite.tests, &suite.proxy, &python, filter)
        .context("integration tests failed");
    // Control-plane faults (`cargo xtask fleet --fault all`) on a small fleet of real daemons,
    // Consul servers and agents, and an xDS server: each fault is a test (nothing lost, every
    // node converges after it). About a minute and a half.
    let faults = if filter.is_none_or(|f| "fleet".contains(f)) {
        fleet::suite_faults(&suite.proxy)
    } else {
        util::detail(format!(
            "the fleet's fault runs skipped: the filter {filter:?} leaves them out"
        ));
        Ok(())
    };
    // The package and the image of `cargo xtask dist`, from the debug binary just built: they
    // build, lintian accepts the package, it installs into a scratch root, runs `proxy check`
    // and purges cleanly, and the image unpacks and runs (no release build: that is dist's).
    step("package check (cargo xtask dist on the debug binary)");
    let packaged = dist::check(&suite.proxy);
    // The kernel tests again on the oldest supported kernel, in QEMU (about a minute, plus the
    // kernel download on a fresh target directory), whatever the host's own kernel is.
    step("kernel tests on Linux 5.10 in QEMU (cargo xtask vm --kernel 5.10)");
    let vm = vm::run(&vm::Options {
        filter,
        ..vm::Options::new(vm::KernelChoice::V5_10)
    });
    // The shipped systemd units under a real systemd on the same kernel (fetched above): about
    // three minutes under TCG, most of it the check's watchdog waits.
    step(
        "the systemd units under systemd on Linux 5.10 in QEMU (cargo xtask vm --systemd --kernel 5.10)",
    );
    let units = vm::systemd::run(
        &vm::systemd::Options::new(vec![vm::KernelLine::V5_10]),
        Some(&suite.proxy),
    );
    // The benchmark harness, once with tiny counts, so it cannot rot; numbers are not judged.
    let smoke = bench::smoke(&suite.bench, &suite.proxy);
    style.context("the style gates failed (cargo xtask lint)")?;
    fuzzed.context("fuzzing failed (cargo xtask fuzz)")?;
    integrated?;
    faults.context("the control-plane fault runs failed (cargo xtask fleet --fault all)")?;
    packaged.context("the package check (cargo xtask dist) failed")?;
    vm.context("the kernel tests failed on Linux 5.10 in QEMU")?;
    units.context("the systemd units failed their checks in QEMU (cargo xtask vm --systemd)")?;
    smoke.context("the benchmark harness smoke run (cargo xtask bench --smoke) failed")?;
    step("all tests passed");
    Ok(())
}
