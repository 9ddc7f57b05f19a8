//! Style gates of `cargo xtask test` (and `cargo xtask lint` alone): formatting with the
//! repository's `rustfmt.toml`, clippy with the workspace lint set (`[workspace.lints]` in
//! the root Cargo.toml) on every crate, the kernel programs included (their functions at most 30
//! lines through `proxy-ebpf/clippy.toml`, their files at most 250 here), the configuration
//! schema and the pages (`docs.rs`: the schema valid and accepting every example; the README
//! and ARCHITECTURE.md within their sizes, every relative link resolving) and the dependency
//! policy (`deps.rs`).
//!
//! Formatting needs nightly rustfmt: `group_imports` and `imports_granularity` are unstable
//! options that stable rustfmt ignores with a warning, so a stable check would pass code the
//! nightly formatter rewrites. `cargo xtask setup` installs the component when it is missing.
//!
//! The kernel programs are linted on their own target: `cargo clippy --workspace` would build
//! `proxy-ebpf` for the host, where its `#![no_std]` panic handler clashes with std's.

use std::process::Command;

use anyhow::bail;

use crate::util::{self, step};

/// The toolchain whose rustfmt formats the repository.
pub const FMT_TOOLCHAIN: &str = "nightly";

/// Runs every gate and reports all failures at once, so one run shows everything to fix.
pub fn run() -> anyhow::Result<()> {
    let mut failed = Vec::new();
    step(format!(
        "style: cargo +{FMT_TOOLCHAIN} fmt --all --check (the repository's rustfmt.toml)"
    ));
    if util::run(&mut fmt_check(), "rustfmt --check").is_err() {
        failed.push(format!(
            "formatting (fix with: cargo +{FMT_TOOLCHAIN} fmt --all)"
        ));
    }
    step("style: clippy on the userspace crates, all targets, warnings denied");
    let mut host = util::cargo();
    host.args([
        "clippy",
        "--workspace",
        "--exclude",
        "proxy-ebpf",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]);
    if util::run(&mut host, "clippy (userspace)").is_err() {
        failed.push("clippy on the userspace crates".to_owned());
    }
    step("style: clippy on the kernel programs (bpfel-unknown-none), warnings denied");
    if util::run(&mut ebpf_clippy(), "clippy (kernel programs)").is_err() {
        failed.push("clippy on proxy-ebpf".to_owned());
    }
    step(format!(
        "style: kernel program files at most {EBPF_FILE_LINES} lines (functions: proxy-ebpf/clippy.toml)"
    ));
    if let Err(err) = ebpf_file_sizes() {
        eprintln!("{err:#}");
        failed.push("the kernel programs' file sizes".to_owned());
    }
    if let Err(err) = crate::docs::check() {
        eprintln!("{err:#}");
        failed.push("the configuration schema (docs/config.schema.json)".to_owned());
    }
    if let Err(err) = crate::docs::check_pages() {
        eprintln!("{err:#}");
        failed.push("the pages' sizes and links".to_owned());
    }
    step("dependencies: one registry, allowed licences, duplicates explained (xtask/src/deps.rs)");
    if let Err(err) = crate::deps::check() {
        eprintln!("{err:#}");
        failed.push("the dependency policy".to_owned());
    }
    if !failed.is_empty() {
        bail!("style gates failed: {}", failed.join("; "));
    }
    Ok(())
}

/// The most lines a kernel program source file may have (the house style: the verifier's
/// view of a hook family fits on a screen or two).
const EBPF_FILE_LINES: usize = 250;

/// Names every `proxy-ebpf/src` file over [`EBPF_FILE_LINES`].
fn ebpf_file_sizes() -> anyhow::Result<()> {
    let src = util::workspace_root().join("proxy-ebpf/src");
    let mut over = Vec::new();
    let mut seen = 0;
    for entry in std::fs::read_dir(&src)? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        seen += 1;
        let lines = std::fs::read_to_string(&path)?.lines().count();
        if lines > EBPF_FILE_LINES {
            over.push(format!("{}: {lines} lines", path.display()));
        }
    }
    if seen == 0 {
        bail!("no kernel program sources under {}", src.display());
    }
    if !over.is_empty() {
        bail!(
            "over {EBPF_FILE_LINES} lines (split by hook family or helper): {}",
            over.join(", ")
        );
    }
    Ok(())
}

fn fmt_check() -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(util::workspace_root())
        .arg(format!("+{FMT_TOOLCHAIN}"))
        .args(["fmt", "--all", "--check"]);
    cmd
}

/// Clippy for the BPF target with the active (stable) toolchain: `-Z build-std=core` is
/// accepted on stable through `RUSTC_BOOTSTRAP=1`, exactly as `proxy/build.rs` builds the
/// object.
fn ebpf_clippy() -> Command {
    let mut cmd = util::cargo();
    cmd.env("RUSTC_BOOTSTRAP", "1").args([
        "clippy",
        "--package",
        "proxy-ebpf",
        "--target",
        "bpfel-unknown-none",
        "-Z",
        "build-std=core",
        "--",
        "-D",
        "warnings",
    ]);
    cmd
}
