//! Checks of what `dist` built: the package installed into a scratch root and purged again,
//! and the image unpacked by another tool and run.
//!
//! The scratch root is a directory with a dpkg database of its own (`dpkg --root`). Its status
//! file holds the packages the package depends on, copied from the host's database (their
//! files are not there: the binary runs against the host's libraries), so that dpkg checks the
//! Depends field as on a real system. The maintainer scripts run outside the root
//! (`--force-script-chrootless`, as dpkg does for foreign roots) with `DPKG_ROOT` set, which
//! they honour: the user goes into the root's /etc/passwd, and the host's systemd is not told.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail, ensure};

use super::{Facts, deb, oci};
use crate::util::{self, detail};

/// What may remain in the scratch root after the purge, each with why: the dpkg database,
/// and the user the postinst created (Debian leaves system users behind on purge).
const LEFT_AFTER_PURGE: &[(&str, &str)] = &[
    ("var", "the dpkg database's parents"),
    ("var/lib", "the dpkg database's parents"),
    ("var/lib/dpkg", "the dpkg database"),
    ("etc", "the user database's directory"),
    ("etc/passwd", "the user `ebpf-proxy`, kept on purge"),
    ("etc/group", "the group `proxy`, kept on purge"),
    ("etc/shadow", "the user `ebpf-proxy`, kept on purge"),
    ("etc/gshadow", "the group `proxy`, kept on purge"),
    (
        "etc/.pwd.lock",
        "the lock file of the user database, as on any system",
    ),
];

/// Installs `deb` into a fresh root under `scratch`, runs the installed binary's `check` on the
/// installed example, purges it and checks that only [`LEFT_AFTER_PURGE`] remains.
pub fn install_and_purge(deb: &Path, facts: &Facts, scratch: &Path) -> anyhow::Result<()> {
    let root = scratch.join("root");
    let admin = root.join("var/lib/dpkg");
    for dir in ["info", "updates", "triggers"] {
        fs::create_dir_all(admin.join(dir))?;
    }
    fs::write(admin.join("available"), "")?;
    // Every root has an /etc (systemd-sysusers locks /etc/passwd there).
    fs::create_dir(root.join("etc"))?;
    fs::write(admin.join("status"), host_status(deb, &admin)?)?;
    let dpkg = |args: &[&str]| {
        let mut cmd = Command::new("dpkg");
        cmd.arg(format!("--root={}", root.display()))
            .arg(format!("--log={}", scratch.join("dpkg.log").display()))
            .arg("--force-script-chrootless")
            .args(args);
        cmd
    };
    util::run(dpkg(&["--install"]).arg(deb), "dpkg --root --install")?;
    ensure!(
        status(&admin)? == "install ok installed",
        "dpkg did not record proxy as installed"
    );
    let binary = root.join(deb::BINARY);
    let version = util::output(Command::new(&binary).arg("--version"), "proxy --version")?;
    ensure!(
        version.contains(&facts.commit),
        "the installed binary says {version:?}, not commit {}",
        facts.commit
    );
    let example = root.join(deb::EXAMPLE);
    util::run(
        Command::new(&binary)
            .arg("check")
            .arg("--config")
            .arg(&example),
        "the installed `proxy check` of the installed example",
    )?;
    if Path::new("/usr/bin/systemd-sysusers").exists() {
        let passwd = fs::read_to_string(root.join("etc/passwd")).unwrap_or_default();
        ensure!(
            passwd.lines().any(|l| l.starts_with("ebpf-proxy:")),
            "the postinst created no user `ebpf-proxy` in the scratch root"
        );
    } else {
        detail("no systemd-sysusers here: the postinst's user is not checked");
    }
    detail(format!("installed: {}", version.trim()));
    util::run(&mut dpkg(&["--purge", "proxy"]), "dpkg --root --purge")?;
    let after = status(&admin)?;
    ensure!(
        after.is_empty() || after.ends_with("not-installed"),
        "dpkg still records proxy after the purge"
    );
    let left: Vec<String> = deb::walk(&root)?
        .into_iter()
        .map(|e| e.path)
        .filter(|p| {
            !p.starts_with("var/lib/dpkg/") && !LEFT_AFTER_PURGE.iter().any(|(l, _)| l == p)
        })
        .collect();
    if !left.is_empty() {
        bail!("the purge left {}", left.join(", "));
    }
    detail("purged: only the dpkg database and the user `ebpf-proxy` remain");
    fs::remove_dir_all(scratch).with_context(|| format!("removing {}", scratch.display()))
}

/// dpkg's status of `proxy` in the database at `admin` (empty when it has none).
fn status(admin: &Path) -> anyhow::Result<String> {
    let out = Command::new("dpkg-query")
        .arg(format!("--admindir={}", admin.display()))
        .args(["--show", "--showformat=${Status}", "proxy"])
        .output()
        .context("running dpkg-query")?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The host's status entries of the packages `deb` depends on, for the scratch database; their
/// file lists are copied too, so that dpkg would see a clash with one of their files.
fn host_status(deb: &Path, admin: &Path) -> anyhow::Result<String> {
    let depends = util::output(
        Command::new("dpkg-deb")
            .args(["--field"])
            .arg(deb)
            .arg("Depends"),
        "dpkg-deb --field Depends",
    )?;
    let mut status = String::new();
    for name in depends_names(&depends) {
        let Ok(out) = Command::new("dpkg-query")
            .args(["--status", &name])
            .output()
        else {
            continue;
        };
        if !out.status.success() {
            continue;
        }
        status.push_str(&String::from_utf8_lossy(&out.stdout));
        status.push('\n');
        let lists = fs::read_dir("/var/lib/dpkg/info")?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            // `name.list`, or `name:arch.list` for a Multi-Arch: same package.
            .filter(|f| {
                f.strip_prefix(name.as_str())
                    .and_then(|rest| rest.strip_suffix(".list"))
                    .is_some_and(|arch| arch.is_empty() || arch.starts_with(':'))
            });
        for list in lists {
            fs::copy(
                Path::new("/var/lib/dpkg/info").join(&list),
                admin.join("info").join(&list),
            )?;
        }
    }
    Ok(status)
}

/// Package names of a Depends field, alternatives included, without versions or architectures.
fn depends_names(field: &str) -> Vec<String> {
    field
        .split([',', '|'])
        .filter_map(|alt| alt.split_whitespace().next())
        .map(|name| name.split(':').next().unwrap_or(name).to_owned())
        .filter(|name| !name.is_empty())
        .collect()
}

/// Unpacks `image` with umoci (which checks every blob against its digest and size), checks
/// that its binary is `binary` byte for byte, and runs it from the image's root file system.
pub fn image(image: &oci::Image, binary: &Path, bundle: &Path) -> anyhow::Result<()> {
    util::run(
        Command::new("umoci")
            .arg("unpack")
            .arg("--image")
            .arg(format!("{}:{}", image.layout.display(), image.tag))
            .arg(bundle),
        "umoci unpack",
    )?;
    let rootfs: PathBuf = bundle.join("rootfs");
    let inside = rootfs.join(oci::BINARY.trim_start_matches('/'));
    ensure!(
        fs::read(&inside)? == fs::read(binary)?,
        "the image's {} is not the packaged binary",
        oci::BINARY
    );
    let version = util::output(
        Command::new("chroot")
            .arg(&rootfs)
            .args([oci::BINARY, "--version"]),
        "proxy --version in the image",
    )?;
    util::run(
        Command::new("chroot")
            .arg(&rootfs)
            .args([oci::BINARY, "check", "--config", oci::EXAMPLE]),
        "proxy check in the image",
    )?;
    detail(format!("the image runs: {}", version.trim()));
    fs::remove_dir_all(bundle).with_context(|| format!("removing {}", bundle.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depends_names_drop_versions_and_keep_alternatives() {
        assert_eq!(
            depends_names("libc6 (>= 2.34), libgcc-s1 (>= 4.2) | libgcc1, foo:any"),
            ["libc6", "libgcc-s1", "libgcc1", "foo"]
        );
        assert!(depends_names("").is_empty());
    }
}
