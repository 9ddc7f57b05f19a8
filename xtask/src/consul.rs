//! The `consul` binary for the Consul catalog tests (`tests/tests/consul_real.rs`), installed by
//! `cargo xtask setup` when missing.
//!
//! Consul 1.8.7 is a Debian bullseye package (bookworm dropped it), so it is fetched through a
//! private apt directory ([`crate::apt`]), unpacked without installing anything, and only the
//! binary is kept at [`INSTALL_PATH`] under the workspace root: `target/tools/consul`, whatever
//! `CARGO_TARGET_DIR` says, so the test harness finds it at a fixed place (it also honours
//! `PROXY_TEST_CONSUL`). A present binary is kept: a second run only checks one path.

use std::{fs, path::Path, process::Command};

use anyhow::{Context as _, bail};

use crate::{
    apt,
    util::{self, detail, step},
};

/// Where the binary goes, relative to the workspace root. The harness reads the same path.
pub const INSTALL_PATH: &str = "target/tools/consul";

/// The Debian suite that still ships Consul.
const SUITE: &str = "bullseye";

/// Installs `target/tools/consul` from Debian bullseye unless it is already there.
pub fn ensure_consul() -> anyhow::Result<()> {
    let dest = util::workspace_root().join(INSTALL_PATH);
    if is_executable(&dest) {
        detail(format!("consul: installed ({})", dest.display()));
        return Ok(());
    }
    step(format!(
        "installing consul from Debian {SUITE} into {INSTALL_PATH}"
    ));
    let deb = apt::Suite::new(SUITE)
        .and_then(|suite| suite.download("consul"))
        .with_context(|| {
            format!(
                "could not download the consul package from Debian {SUITE}; check that this \
                 machine's apt mirror serves {SUITE}, then rerun `cargo xtask setup`"
            )
        })?;
    let parent = dest.parent().context("install path has a parent")?;
    let unpacked = parent.join(".consul-deb");
    let _ = fs::remove_dir_all(&unpacked);
    apt::extract(&deb, &unpacked)?;
    let binary = unpacked.join("usr/bin/consul");
    if !binary.is_file() {
        bail!("{} has no usr/bin/consul", deb.display());
    }
    // Copy then rename, so an interrupted run never leaves a half-written binary at `dest`.
    let partial = parent.join(".consul.partial");
    fs::copy(&binary, &partial)
        .with_context(|| format!("copying {} to {}", binary.display(), partial.display()))?;
    fs::rename(&partial, &dest).with_context(|| format!("installing {}", dest.display()))?;
    let _ = fs::remove_dir_all(&unpacked);
    let version = util::output(Command::new(&dest).arg("version"), "consul version")
        .with_context(|| format!("the installed {} does not run", dest.display()))?;
    detail(version.lines().next().unwrap_or("consul: installed"));
    Ok(())
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
