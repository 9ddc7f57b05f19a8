//! `cargo xtask bench`: runs the benchmark harness, the `proxy-bench` crate in `bench/`. The
//! options are the harness's own (`cargo xtask bench --help` shows them); this builds it and
//! hands over.

use std::{
    ffi::OsString,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Context as _;

use crate::util;

/// Builds the harness and returns its path. The debug profile, as `cargo xtask` itself: a
/// measuring run builds the release daemon and its own release workers before it measures.
fn build() -> anyhow::Result<PathBuf> {
    util::run(
        util::cargo().args(["build", "--quiet", "--package", "proxy-bench"]),
        "cargo build -p proxy-bench",
    )?;
    Ok(util::target_dir()?.join("debug").join("proxy-bench"))
}

/// `cargo xtask bench ARGS`: replaces this process with `proxy-bench ARGS`, so Ctrl-C and
/// SIGTERM reach the harness itself, which stops what it started and puts the machine back
/// before it exits.
pub fn run(args: &[OsString]) -> anyhow::Result<()> {
    let bin = build()?;
    let err = Command::new(&bin).args(args).exec();
    Err(err).with_context(|| format!("running {}", bin.display()))
}

/// The smoke run of `cargo xtask test` (`proxy-bench --smoke`, the harness `bench` built with
/// the suite) against the daemon `proxy`.
pub fn smoke(bench: &Path, proxy: &Path) -> anyhow::Result<()> {
    util::run(
        Command::new(bench).arg("--smoke").env("PROXY_BIN", proxy),
        "the benchmark harness smoke run",
    )
}
