//! Builds the kernel programs (`proxy-ebpf`) with aya-build and leaves the object in OUT_DIR,
//! where `proxy::dataplane` embeds it.
//!
//! The eBPF crate is built with the same toolchain as this crate (`RUSTUP_TOOLCHAIN`, set by
//! rustup for everything cargo runs), and `RUSTC_BOOTSTRAP=1` lets that stable toolchain use
//! `-Z build-std=core` for the nested build only. bpf-linker must be built against this
//! toolchain's LLVM: `cargo xtask setup` does that.
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
    aya_build::build_ebpf(
        [aya_build::Package {
            name: ebpf.name.as_str(),
            root_dir: root_dir.as_str(),
            ..Default::default()
        }],
        Toolchain::Custom(&toolchain),
    )
    .context("building the kernel programs (proxy-ebpf) failed; `cargo xtask setup` installs the eBPF toolchain")
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
