//! `qemu-system-x86_64` for `cargo xtask vm`, installed by `cargo xtask setup` when missing.
//!
//! On Debian bookworm the package comes from bookworm-backports: bookworm's own qemu-system-x86
//! (7.2) conflicts with the qemu-utils 10.0 from backports that these machines ship with. The
//! backports sources entry points at the mirror this machine's apt already uses; no mirror host
//! is written into the project. On other releases the release's own package is installed.

use std::{fs, path::Path, process::Command};

use anyhow::{Context as _, bail};

use crate::{
    apt,
    util::{self, detail, step},
};

/// The binary `cargo xtask vm` boots kernels with.
pub const QEMU: &str = "qemu-system-x86_64";

/// The sources entry this function adds on bookworm.
const BACKPORTS_LIST: &str = "/etc/apt/sources.list.d/proxy-bookworm-backports.list";

/// Installs qemu-system-x86 unless `qemu-system-x86_64` is already on PATH.
pub fn ensure_qemu() -> anyhow::Result<()> {
    if let Some(path) = find_qemu() {
        detail(format!("{QEMU}: installed ({path})"));
        return Ok(());
    }
    if !util::is_root() {
        bail!("{QEMU} is missing (cargo xtask vm needs it); run `cargo xtask setup` as root");
    }
    let codename = codename()?;
    let mut install = Command::new("apt-get");
    install.args(["install", "-y", "-q", "--no-install-recommends"]);
    if codename == "bookworm" {
        add_backports()?;
        install.args(["-t", "bookworm-backports"]);
    } else {
        util::run(
            Command::new("apt-get").args(["update", "-q"]),
            "apt-get update",
        )?;
    }
    step(format!(
        "installing qemu-system-x86 (Debian {codename}); about a minute"
    ));
    util::run(
        install
            .arg("qemu-system-x86")
            .env("DEBIAN_FRONTEND", "noninteractive"),
        "apt-get install",
    )
    .context(
        "apt-get could not install qemu-system-x86; check access to the Debian mirror, then \
             rerun `cargo xtask setup`",
    )?;
    find_qemu()
        .map(drop)
        .with_context(|| format!("qemu-system-x86 installed no {QEMU}"))
}

/// The path of `qemu-system-x86_64` on PATH, if any.
pub fn find_qemu() -> Option<String> {
    let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".to_owned());
    path.split(':')
        .map(|dir| Path::new(dir).join(QEMU))
        .find(|p| p.is_file())
        .map(|p| p.display().to_string())
}

/// This machine's Debian codename, from /etc/os-release.
fn codename() -> anyhow::Result<String> {
    let text = fs::read_to_string("/etc/os-release").context("reading /etc/os-release")?;
    text.lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .map(|c| c.trim_matches('"').to_owned())
        .context("/etc/os-release names no VERSION_CODENAME (is this Debian?)")
}

/// Adds a bookworm-backports entry on the machine's own mirror and fetches only its lists.
fn add_backports() -> anyhow::Result<()> {
    let entry = format!("deb {} bookworm-backports main\n", apt::mirror()?);
    if fs::read_to_string(BACKPORTS_LIST).ok().as_deref() != Some(entry.as_str()) {
        fs::write(BACKPORTS_LIST, &entry).with_context(|| format!("writing {BACKPORTS_LIST}"))?;
    }
    step("fetching the package lists of Debian bookworm-backports");
    util::run(
        Command::new("apt-get")
            .args(["update", "-q", "-o", "APT::Get::List-Cleanup=0"])
            .args(["-o", "Dir::Etc::SourceParts=/dev/null", "-o"])
            .arg(format!("Dir::Etc::SourceList={BACKPORTS_LIST}")),
        "apt-get update (bookworm-backports)",
    )
    .context("could not reach the Debian mirror for bookworm-backports")
}
