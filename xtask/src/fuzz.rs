//! `cargo xtask fuzz`: the libFuzzer targets of `fuzz/` (package proxy-fuzz), built as cargo-fuzz
//! builds them (nightly, SanitizerCoverage with inline 8-bit counters, PC table and compare
//! tracing, `--cfg fuzzing`, debug assertions and overflow checks) without needing cargo-fuzz
//! installed, and run for a bounded time each.
//!
//! Each run starts from the target's corpus in the repository and writes what it finds new to a
//! scratch directory. With `--grow`, the corpus and the new inputs are then merged (libFuzzer's
//! `-set_cover_merge=1`: a small set of inputs that keeps every feature) back into the repository's
//! corpus, which stays small enough to commit. An input that
//! crashes a target is kept under `fuzz/artifacts/<target>/`; the step fails and names it, and it
//! belongs in `fuzz/regressions/<target>/` with the fix (plain `cargo test` replays those).

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::util::{self, detail, step};

/// The targets, as the binaries of proxy-fuzz are named.
pub const TARGETS: [&str; 6] = [
    "config",
    "chain",
    "xds_cla",
    "dns_answer",
    "proxy_protocol",
    "http_route",
];

/// The host triple the fuzz build names explicitly, so that its flags stay off build scripts and
/// proc macros and its artifacts off the ordinary build's.
const TRIPLE: &str = "x86_64-unknown-linux-gnu";

/// What cargo-fuzz passes to rustc for libFuzzer with no sanitizer.
const RUSTFLAGS: &str = "-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
    -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions \
    -Coverflow-checks -Cforce-frame-pointers";

/// How a run goes.
pub struct Options<'a> {
    /// Targets to run (all when empty).
    pub targets: Vec<&'a str>,
    /// Time per target.
    pub each: Duration,
    /// Add new inputs to the repository's corpus instead of a scratch directory.
    pub grow: bool,
}

/// Builds the targets and runs each for `each`; fails if any input crashed one.
pub fn run(opts: &Options) -> anyhow::Result<()> {
    let targets: Vec<&str> = if opts.targets.is_empty() {
        TARGETS.to_vec()
    } else {
        for t in &opts.targets {
            if !TARGETS.contains(t) {
                bail!(
                    "no fuzz target {t:?}; the targets are {}",
                    TARGETS.join(", ")
                );
            }
        }
        opts.targets.clone()
    };
    let bins = build()?;
    let root = util::workspace_root().join("fuzz");
    let scratch = std::env::temp_dir().join(format!("proxy-fuzz-{}", std::process::id()));
    // libFuzzer runs one thread: the targets run side by side, one per core, each writing to
    // its own log, which is shown (its last lines, or all of it after a crash) when it ends.
    let lanes = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    step(format!(
        "fuzzing {} targets for {} s each, {lanes} at a time (corpora in fuzz/corpus/<target>)",
        targets.len(),
        opts.each.as_secs()
    ));
    let mut crashed = Vec::new();
    for chunk in targets.chunks(lanes) {
        let outcomes = std::thread::scope(|s| {
            let runs: Vec<_> = chunk
                .iter()
                .map(|&target| {
                    let (bins, root, scratch) = (&bins, &root, &scratch);
                    s.spawn(move || fuzz_one(bins, root, scratch, target, opts))
                })
                .collect();
            runs.into_iter()
                .map(|r| {
                    r.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("a fuzz run panicked")))
                })
                .collect::<Vec<_>>()
        });
        for (target, outcome) in chunk.iter().zip(outcomes) {
            if let Some(crash) = outcome? {
                crashed.push(format!("{target}: {crash}"));
            }
        }
    }
    let _ = std::fs::remove_dir(root.join("artifacts"));
    let _ = std::fs::remove_dir_all(&scratch);
    if !crashed.is_empty() {
        for c in &crashed {
            detail(c);
        }
        bail!(
            "fuzzing found crashing inputs in {} target(s); fix them and keep each input under fuzz/regressions/<target>/",
            crashed.len()
        );
    }
    Ok(())
}

/// Runs one target for `opts.each`; `Some(why)` when an input crashed it. Its output goes to a
/// log in `scratch`, printed when the run ends: the final stats, or the whole log on a crash.
fn fuzz_one(
    bins: &Path,
    root: &Path,
    scratch: &Path,
    target: &str,
    opts: &Options,
) -> anyhow::Result<Option<String>> {
    let corpus = root.join("corpus").join(target);
    let out = scratch.join(target);
    let artifacts = root.join("artifacts").join(target);
    for dir in [&out, &artifacts] {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let log_path = scratch.join(format!("{target}.log"));
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let mut cmd = Command::new(bins.join(target));
    cmd.arg(format!("-max_total_time={}", opts.each.as_secs().max(1)))
        // A slow input is a finding too (a parser that hangs), as is unbounded memory.
        .arg("-timeout=10")
        .arg("-rss_limit_mb=2048")
        .arg("-print_final_stats=1")
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .arg(&out)
        .arg(&corpus)
        .stdout(log.try_clone()?)
        .stderr(log);
    let status = cmd
        .status()
        .with_context(|| format!("starting the {target} fuzzer"))?;
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    let shown: Vec<&str> = if status.success() {
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(12)..].to_vec()
    } else {
        text.lines().collect()
    };
    detail(format!(
        "fuzz target {target} ({status}):\n{}",
        shown.join("\n")
    ));
    // An empty artifacts directory is noise in the checkout.
    let crash = if status.success() {
        if opts.grow {
            merge(&bins.join(target), &corpus, &out)?;
        }
        None
    } else {
        Some(format!("{status}: see {}", artifacts.display()))
    };
    let _ = std::fs::remove_dir(&artifacts);
    Ok(crash)
}

/// Replaces `corpus` with the smallest set of its inputs and `found`'s that keeps every feature.
fn merge(bin: &Path, corpus: &Path, found: &Path) -> anyhow::Result<()> {
    let merged = found.with_extension("merged");
    std::fs::create_dir_all(&merged)?;
    let mut cmd = Command::new(bin);
    cmd.arg("-set_cover_merge=1")
        .arg(&merged)
        .arg(corpus)
        .arg(found);
    util::run(&mut cmd, "merging the corpus")?;
    let before = std::fs::read_dir(corpus)?.count();
    std::fs::remove_dir_all(corpus)?;
    std::fs::rename(&merged, corpus)
        .or_else(|_| copy_dir(&merged, corpus))
        .with_context(|| format!("replacing {}", corpus.display()))?;
    let after = std::fs::read_dir(corpus)?.count();
    detail(format!(
        "corpus {}: {before} inputs before, {after} after the merge",
        corpus.display()
    ));
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        std::fs::copy(entry.path(), to.join(entry.file_name()))?;
    }
    Ok(())
}

/// Builds every target with the instrumentation; returns the directory of the binaries.
fn build() -> anyhow::Result<PathBuf> {
    step("building the fuzz targets (nightly, SanitizerCoverage; a cold build takes minutes)");
    // rustup's nightly (SanitizerCoverage passes are a nightly -C option), not the toolchain
    // that runs xtask.
    let mut cmd = Command::new("cargo");
    cmd.current_dir(util::workspace_root())
        .env_remove("CARGO")
        .env_remove("RUSTC")
        .env_remove("RUSTUP_TOOLCHAIN")
        .args([
            "+nightly",
            "build",
            "--package",
            "proxy-fuzz",
            "--features",
            "fuzzing",
            "--bins",
            "--profile",
            "fuzz",
            "--target",
            TRIPLE,
        ])
        .env("RUSTFLAGS", RUSTFLAGS);
    util::run(&mut cmd, "building the fuzz targets")?;
    Ok(bin_dir(&util::target_dir()?))
}

fn bin_dir(target_dir: &Path) -> PathBuf {
    target_dir.join(TRIPLE).join("fuzz")
}
