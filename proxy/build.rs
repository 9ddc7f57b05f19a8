//! Builds the kernel programs (`proxy-ebpf`) with aya-build in a directory shared by every
//! build of this crate ([`shared_dir`]) and copies the object to OUT_DIR, where
//! `proxy::dataplane` embeds it.
//!
//! The eBPF crate is built with the same toolchain as this crate (`RUSTUP_TOOLCHAIN`, set by
//! rustup for everything cargo runs), and `RUSTC_BOOTSTRAP=1` lets that stable toolchain use
//! `-Z build-std=core` for the nested build only. bpf-linker must be built against this
//! toolchain's LLVM: `cargo xtask setup` does that.
#![allow(
    unsafe_code,
    reason = "set_var for the nested eBPF build, in this single-threaded build script"
)]

use std::{
    fs::File,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, anyhow};
use aya_build::Toolchain;

fn main() -> anyhow::Result<()> {
    let cargo_metadata::Metadata { packages, .. } = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("MetadataCommand::exec")?;
    let ebpf = packages
        .into_iter()
        .find(|p| p.name.as_str() == "proxy-ebpf")
        .ok_or_else(|| anyhow!("proxy-ebpf package not found"))?;
    let root_dir = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("no parent for {}", ebpf.manifest_path))?;
    println!("cargo:rerun-if-env-changed=RUSTUP_TOOLCHAIN");
    let toolchain = std::env::var("RUSTUP_TOOLCHAIN").unwrap_or_else(|_| "stable".to_owned());
    // SAFETY: build scripts are single-threaded; the variable is read by aya-build and inherited
    // by the nested cargo only.
    unsafe { std::env::set_var("RUSTC_BOOTSTRAP", "1") };
    which_bpf_linker()?;
    stamp_version();
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").context("OUT_DIR is not set")?);
    let shared = shared_dir(&out_dir);
    std::fs::create_dir_all(&shared).with_context(|| format!("creating {}", shared.display()))?;
    // One build at a time in the shared directory: the nested cargo locks its own target
    // directory, and this lock also covers the object's copy in and out.
    let lock = File::create(shared.join(".lock"))
        .with_context(|| format!("creating {}", shared.join(".lock").display()))?;
    lock.lock()
        .context("locking the shared eBPF build directory")?;
    // SAFETY: as above; aya-build reads OUT_DIR as where its nested target directory and the
    // object go, and nothing else in this process reads it after the copy below.
    unsafe { std::env::set_var("OUT_DIR", &shared) };
    aya_build::build_ebpf(
        [aya_build::Package {
            name: ebpf.name.as_str(),
            root_dir: root_dir.as_str(),
            ..Default::default()
        }],
        Toolchain::Custom(&toolchain),
    )
    .context("building the kernel programs (proxy-ebpf) failed; `cargo xtask setup` installs the eBPF toolchain")?;
    // SAFETY: as above.
    unsafe { std::env::set_var("OUT_DIR", &out_dir) };
    let object = shared.join(OBJECT);
    std::fs::copy(&object, out_dir.join(OBJECT))
        .with_context(|| format!("copying {} into OUT_DIR", object.display()))?;
    Ok(())
}

/// The kernel object's name (`proxy-ebpf`'s binary), which `proxy::dataplane` embeds.
const OBJECT: &str = "proxy-programs";

/// Where the kernel programs are built: one directory per profile directory of the target
/// directory (`target/debug/ebpf`), not this run's OUT_DIR. Cargo gives every variant of this
/// crate's build (`cargo build`, `cargo test`, clippy, another feature set) an OUT_DIR of its
/// own, so building there compiled the kernel programs and their dependencies from nothing
/// each time; in the shared directory the nested cargo build is incremental and a variant
/// whose kernel sources did not change costs a second. OUT_DIR is
/// `<profile dir>/build/<crate>-<hash>/out`; an unexpected shape falls back to OUT_DIR itself.
fn shared_dir(out_dir: &Path) -> PathBuf {
    match out_dir.ancestors().nth(3) {
        Some(profile)
            if out_dir
                .ancestors()
                .nth(2)
                .is_some_and(|b| b.ends_with("build")) =>
        {
            profile.join("ebpf")
        }
        _ => out_dir.to_path_buf(),
    }
}

/// Fails early with a pointer to the fix when bpf-linker is not on PATH.
fn which_bpf_linker() -> anyhow::Result<()> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    if std::env::split_paths(&path).any(|dir| dir.join("bpf-linker").exists()) {
        return Ok(());
    }
    Err(anyhow!(
        "bpf-linker is not on PATH; run `cargo xtask setup` (it builds bpf-linker against this toolchain's LLVM)"
    ))
}

/// Sets `PROXY_COMMIT` (the checkout's HEAD, `unknown` outside a git checkout) and `PROXY_PROFILE` (`debug` or `release`) for `proxy --version`, and
/// asks cargo to re-run this script when HEAD moves.
fn stamp_version() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|out| out.status.success())
            .and_then(|out| String::from_utf8(out.stdout).ok())
            .map(|text| text.trim().to_owned())
    };
    // No `-dirty` mark: the script re-runs when HEAD moves, not when a file is edited, so the
    // mark would go stale.
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=PROXY_COMMIT={commit}");
    let profile = std::env::var("PROFILE").unwrap_or_else(|_| "unknown".to_owned());
    println!("cargo:rustc-env=PROXY_PROFILE={profile}");
    // HEAD names the branch; the branch's ref (loose or packed) names the commit.
    for (flag, file) in [("--git-dir", "HEAD"), ("--git-common-dir", "packed-refs")] {
        if let Some(dir) = git(&["rev-parse", flag]) {
            println!("cargo:rerun-if-changed={dir}/{file}");
        }
    }
    if let (Some(dir), Some(head)) = (
        git(&["rev-parse", "--git-common-dir"]),
        git(&["symbolic-ref", "-q", "HEAD"]),
    ) {
        println!("cargo:rerun-if-changed={dir}/{head}");
    }
}
