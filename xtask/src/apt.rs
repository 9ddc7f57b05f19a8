//! Fetching Debian packages without installing them: a private apt state directory per suite
//! (its own sources list, lists and cache), `apt-get download`, then `dpkg-deb -x`.
//!
//! Used for the VM kernels (bookworm, bookworm-backports, bullseye) and for Consul 1.8.7
//! (bullseye only). Downloads are cached under `target/apt/`; a second call finds them there.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use crate::util::{self, detail, step};

/// The Debian mirror this machine's own apt uses (the first `URIs:` or `deb` URI ending in
/// `/debian` in /etc/apt), so the private sources lists point where the machine already may go.
pub fn mirror() -> anyhow::Result<String> {
    let mut texts = vec![fs::read_to_string("/etc/apt/sources.list").unwrap_or_default()];
    if let Ok(dir) = fs::read_dir("/etc/apt/sources.list.d") {
        for entry in dir.flatten() {
            let path = entry.path();
            let name = path.to_string_lossy();
            if name.ends_with(".sources") || name.ends_with(".list") {
                texts.push(fs::read_to_string(&path).unwrap_or_default());
            }
        }
    }
    texts
        .iter()
        .flat_map(|t| t.lines())
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(|l| l.split_whitespace())
        .find(|word| word.starts_with("http") && word.trim_end_matches('/').ends_with("/debian"))
        .map(|uri| uri.trim_end_matches('/').to_owned())
        .context("no Debian mirror in /etc/apt (a `URIs: .../debian` or `deb .../debian` line)")
}

/// A Debian suite with its own apt state under `target/apt/<suite>/`.
pub struct Suite {
    name: String,
    dir: PathBuf,
}

impl Suite {
    /// A suite such as `bullseye`, `bookworm` or `bookworm-backports`, with the `main` component.
    pub fn new(name: &str) -> anyhow::Result<Self> {
        let dir = util::target_dir()?.join("apt").join(name);
        Ok(Self {
            name: name.to_owned(),
            dir,
        })
    }

    fn apt(&self) -> Command {
        let mut cmd = Command::new("apt-get");
        cmd.arg("-q")
            .arg("-o")
            .arg(format!(
                "Dir::Etc::SourceList={}",
                self.dir.join("sources.list").display()
            ))
            .args(["-o", "Dir::Etc::SourceParts=/dev/null"])
            .arg("-o")
            .arg(format!(
                "Dir::State::Lists={}",
                self.dir.join("lists").display()
            ))
            .arg("-o")
            .arg(format!("Dir::Cache={}", self.dir.join("cache").display()))
            .args(["-o", "APT::Sandbox::User=root"])
            .args(["-o", "Acquire::Check-Valid-Until=false"]);
        cmd
    }

    /// Writes the sources list and runs `apt-get update` once (skipped when a `Packages` index
    /// is there: apt leaves a `lock` file in the lists directory even when an update fails).
    fn update(&self) -> anyhow::Result<()> {
        let lists = self.dir.join("lists");
        let has_index = |d: fs::ReadDir| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().contains("_Packages"))
        };
        if fs::read_dir(&lists).is_ok_and(has_index) {
            return Ok(());
        }
        fs::create_dir_all(lists.join("partial"))?;
        fs::create_dir_all(self.dir.join("cache/archives/partial"))?;
        let mirror = mirror()?;
        fs::write(
            self.dir.join("sources.list"),
            format!("deb {mirror} {} main\n", self.name),
        )?;
        step(format!(
            "fetching the package lists of Debian {}",
            self.name
        ));
        util::run(
            self.apt().arg("update"),
            &format!("apt-get update ({})", self.name),
        )
        .with_context(|| format!("could not reach the Debian mirror for {}", self.name))
    }

    /// Downloads `package` (a name, optionally `name=version`) into `target/apt/<suite>/debs/`
    /// and returns the .deb's path; a cached download is reused.
    pub fn download(&self, package: &str) -> anyhow::Result<PathBuf> {
        let debs = self.dir.join("debs");
        let base = package.split('=').next().unwrap_or(package);
        if let Some(found) = find_deb(&debs, base) {
            detail(format!("{base}: cached ({})", found.display()));
            return Ok(found);
        }
        self.update()?;
        fs::create_dir_all(&debs)?;
        step(format!("downloading {package} from Debian {}", self.name));
        let fetch = || {
            util::run(
                self.apt().arg("download").arg(package).current_dir(&debs),
                "apt-get download",
            )
        };
        if fetch().is_err() {
            // Cached lists may name a version the mirror has dropped since: refresh once.
            detail(format!(
                "refreshing the package lists of Debian {} and retrying",
                self.name
            ));
            let _ = fs::remove_dir_all(self.dir.join("lists"));
            self.update()?;
            fetch().with_context(|| {
                format!("downloading {package} from Debian {} failed", self.name)
            })?;
        }
        find_deb(&debs, base).with_context(|| format!("apt-get download left no {base}_*.deb"))
    }

    /// The newest package whose name starts with `prefix` and ends with `suffix`, e.g.
    /// `linux-image-` ... `-cloud-amd64`, as this suite's package lists have it.
    pub fn newest_matching(&self, prefix: &str, suffix: &str) -> anyhow::Result<String> {
        self.update()?;
        let mut cmd = Command::new("apt-cache");
        cmd.arg("-o")
            .arg(format!(
                "Dir::Etc::SourceList={}",
                self.dir.join("sources.list").display()
            ))
            .args(["-o", "Dir::Etc::SourceParts=/dev/null"])
            .arg("-o")
            .arg(format!(
                "Dir::State::Lists={}",
                self.dir.join("lists").display()
            ))
            .arg("-o")
            .arg(format!("Dir::Cache={}", self.dir.join("cache").display()))
            .args(["pkgnames", prefix]);
        let names = util::output(&mut cmd, "apt-cache pkgnames")?;
        let mut matching: Vec<&str> = names
            .lines()
            .filter(|n| n.len() > prefix.len() + suffix.len() && n.ends_with(suffix))
            .filter(|n| !n.contains("-dbg") && !n.contains("unsigned"))
            .collect();
        let key = |n: &str| version_key(&n[prefix.len()..n.len() - suffix.len()]);
        matching.sort_by_key(|n| key(n));
        match matching.last() {
            Some(name) => Ok((*name).to_owned()),
            None => bail!("Debian {} has no package {prefix}*{suffix}", self.name),
        }
    }
}

/// Numeric parts of the version in a package name (`6.1.0-41`, `6.12.90+deb12.1`), for ordering
/// `6.1.0-9` before `6.1.0-41` and `6.12.90+deb12` before `6.12.90+deb12.1`.
fn version_key(name: &str) -> Vec<u64> {
    name.split(|c: char| !c.is_ascii_digit())
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn find_deb(dir: &Path, package: &str) -> Option<PathBuf> {
    let prefix = format!("{package}_");
    fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.extension().is_some_and(|e| e == "deb")
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&prefix))
        })
}

/// Extracts a .deb's files into `dest` (no maintainer scripts run, nothing is installed).
pub fn extract(deb: &Path, dest: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(dest)?;
    util::run(
        Command::new("dpkg-deb").arg("-x").arg(deb).arg(dest),
        "dpkg-deb -x",
    )
    .with_context(|| format!("extracting {}", deb.display()))
}
