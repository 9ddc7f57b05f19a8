//! The kernels of the matrix: Debian's cloud kernel packages, downloaded and extracted (never
//! installed) under `<target>/vm/kernels/`, and the modules the tests need from them.
//!
//! The packages ship no `modules.dep` (depmod runs at install time), so dependencies are read
//! from each module's `.modinfo` section (`depends=`), the way modinfo(8) does.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use crate::{
    apt,
    util::{self, detail, step},
};

/// One kernel of the matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelLine {
    /// Debian bullseye's 5.10.
    V5_10,
    /// Debian bookworm's 6.1.
    V6_1,
    /// Debian bookworm-backports' 6.12.
    V6_12,
}

impl KernelLine {
    /// Every line, oldest first.
    pub const ALL: [Self; 3] = [Self::V5_10, Self::V6_1, Self::V6_12];

    pub fn label(self) -> &'static str {
        match self {
            Self::V5_10 => "5.10",
            Self::V6_1 => "6.1",
            Self::V6_12 => "6.12",
        }
    }

    fn suite(self) -> &'static str {
        match self {
            Self::V5_10 => "bullseye",
            Self::V6_1 => "bookworm",
            Self::V6_12 => "bookworm-backports",
        }
    }
}

/// Modules the kernel tests may need (veth pairs, tc with cls_bpf on an ingress qdisc). Each is
/// loaded with its dependencies when the kernel builds it as a module; built-ins are skipped.
pub const WANTED_MODULES: &[&str] = &["veth", "cls_bpf", "sch_ingress"];

/// An extracted kernel package.
pub struct Kernel {
    /// The package, e.g. `linux-image-5.10.0-32-cloud-amd64`.
    pub package: String,
    /// `uname -r` of the kernel, e.g. `5.10.0-32-cloud-amd64`.
    pub release: String,
    pub vmlinuz: PathBuf,
    modules: PathBuf,
}

/// Finds the newest cloud kernel of `line`, downloads and extracts it (both cached).
pub fn fetch(line: KernelLine) -> anyhow::Result<Kernel> {
    let suite = apt::Suite::new(line.suite())?;
    let package = suite.newest_matching("linux-image-", "-cloud-amd64")?;
    let root = util::target_dir()?.join("vm/kernels").join(&package);
    let stamp = root.join(".extracted");
    if stamp.exists() {
        detail(format!("{package}: extracted ({})", root.display()));
    } else {
        let deb = suite.download(&package)?;
        step(format!("extracting {package}"));
        let _ = fs::remove_dir_all(&root);
        apt::extract(&deb, &root)?;
        fs::write(&stamp, "").context("writing the extraction stamp")?;
    }
    let release = package
        .strip_prefix("linux-image-")
        .unwrap_or(&package)
        .to_owned();
    let vmlinuz = root.join("boot").join(format!("vmlinuz-{release}"));
    if !vmlinuz.is_file() {
        bail!(
            "{package} has no boot/vmlinuz-{release} (extracted under {})",
            root.display()
        );
    }
    let modules = root.join("lib/modules").join(&release);
    Ok(Kernel {
        package,
        release,
        vmlinuz,
        modules,
    })
}

impl Kernel {
    /// The modules to load for [`WANTED_MODULES`], dependencies first, as (name, .ko bytes).
    pub fn modules(&self) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
        let builtin = self.builtin()?;
        let mut index = BTreeMap::new();
        index_modules(&self.modules.join("kernel"), &mut index)?;
        let mut order = Vec::new();
        let mut seen = BTreeSet::new();
        for name in WANTED_MODULES {
            self.resolve(&normalize(name), &builtin, &index, &mut seen, &mut order)?;
        }
        Ok(order)
    }

    fn builtin(&self) -> anyhow::Result<BTreeSet<String>> {
        let path = self.modules.join("modules.builtin");
        let text =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        Ok(text.lines().map(module_name).collect())
    }

    fn resolve(
        &self,
        name: &str,
        builtin: &BTreeSet<String>,
        index: &BTreeMap<String, PathBuf>,
        seen: &mut BTreeSet<String>,
        order: &mut Vec<(String, Vec<u8>)>,
    ) -> anyhow::Result<()> {
        if builtin.contains(name) || !seen.insert(name.to_owned()) {
            return Ok(());
        }
        let path = index.get(name).with_context(|| {
            format!(
                "{}: module {name} is neither built in nor shipped",
                self.package
            )
        })?;
        let bytes = read_module(path)?;
        for dep in modinfo(&bytes, "depends")
            .split(',')
            .filter(|d| !d.is_empty())
        {
            self.resolve(&normalize(dep), builtin, index, seen, order)?;
        }
        order.push((name.to_owned(), bytes));
        Ok(())
    }
}

/// `kernel/net/sched/cls_bpf.ko.xz` -> `cls_bpf`.
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    normalize(file.split(".ko").next().unwrap_or(file))
}

/// Module names treat `-` and `_` alike; the kernel uses `_`.
fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

fn index_modules(dir: &Path, index: &mut BTreeMap<String, PathBuf>) -> anyhow::Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            index_modules(&path, index)?;
        } else if path.to_string_lossy().contains(".ko") {
            index.insert(module_name(&path.to_string_lossy()), path);
        }
    }
    Ok(())
}

/// A module's ELF bytes, decompressed (`.ko.xz`, `.ko.zst`, `.ko.gz`) so busybox insmod can
/// load it on any kernel.
fn read_module(path: &Path) -> anyhow::Result<Vec<u8>> {
    let name = path.to_string_lossy();
    let tool = ["xz", "zstd", "gzip"]
        .into_iter()
        .zip([".xz", ".zst", ".gz"])
        .find_map(|(tool, ext)| name.ends_with(ext).then_some(tool));
    match tool {
        None => fs::read(path).with_context(|| format!("reading {name}")),
        Some(tool) => {
            let out = Command::new(tool)
                .arg("-dc")
                .arg(path)
                .output()
                .with_context(|| format!("running {tool} (is it installed?)"))?;
            if !out.status.success() {
                bail!(
                    "{tool} -dc {name} failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            Ok(out.stdout)
        }
    }
}

/// The value of `key` in an ELF64 module's `.modinfo` section (NUL-separated `key=value`
/// strings); empty when absent.
fn modinfo(elf: &[u8], key: &str) -> String {
    let section = modinfo_section(elf).unwrap_or_default();
    let prefix = format!("{key}=");
    section
        .split(|&b| b == 0)
        .filter_map(|s| std::str::from_utf8(s).ok())
        .find_map(|s| s.strip_prefix(&prefix))
        .unwrap_or_default()
        .to_owned()
}

fn modinfo_section(elf: &[u8]) -> Option<&[u8]> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(elf.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?));
    if elf.get(..5)? != b"\x7fELF\x02" {
        return None;
    }
    let shoff = usize::try_from(u64_at(0x28)?).ok()?;
    let (shentsize, shnum, shstrndx) = (
        usize::from(u16_at(0x3a)?),
        usize::from(u16_at(0x3c)?),
        usize::from(u16_at(0x3e)?),
    );
    let header = |i: usize| -> Option<(usize, usize, usize)> {
        let h = shoff + i * shentsize;
        let name = usize::try_from(u32_at(h)?).ok()?;
        let offset = usize::try_from(u64_at(h + 0x18)?).ok()?;
        let size = usize::try_from(u64_at(h + 0x20)?).ok()?;
        Some((name, offset, size))
    };
    let (_, strtab, _) = header(shstrndx)?;
    (0..shnum).find_map(|i| {
        let (name, offset, size) = header(i)?;
        let rest = elf.get(strtab + name..)?;
        let end = rest.iter().position(|&b| b == 0)?;
        (&rest[..end] == b".modinfo").then(|| elf.get(offset..offset + size))?
    })
}
