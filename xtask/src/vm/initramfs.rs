//! The initramfs the VM boots: busybox, iproute2's `ip` and `tc`, the `proxy` binary, the kernel
//! test binaries, the libraries they load (from ldd), the kernel's modules and a small init.
//!
//! Written as a cpio "newc" archive by hand (so `/dev/console` can be a device node without
//! mknod on the host) and compressed with gzip.

use std::{
    collections::BTreeMap,
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail};

use super::kernel::Kernel;
use crate::{
    apt,
    util::{self, detail, step},
};

/// The init script; see the file for what it mounts and runs.
const INIT: &str = include_str!("init.sh");

/// Where the proxy binary lands in the VM (`PROXY_BIN` there).
const PROXY_PATH: &str = "bin/proxy";

/// What every image of a run carries, whatever the kernel.
pub struct Payload {
    /// Path in the image -> file contents.
    files: BTreeMap<String, (u32, Vec<u8>)>,
    /// The test binaries' names, for the report.
    pub tests: Vec<String>,
}

impl Payload {
    /// Builds the proxy and the kernel test binaries and gathers everything the VM needs.
    /// `binary_timeout` limits each test binary in the VM (it is killed and counted as a failure).
    pub fn build(filter: Option<&str>, binary_timeout: Duration) -> anyhow::Result<Self> {
        let suite = util::Suite::build()?;
        let proxy = suite.proxy;
        let tests = kernel_tests(suite.tests)?;
        let mut payload = Self {
            files: BTreeMap::new(),
            tests: Vec::new(),
        };
        step("gathering the VM's files (busybox, ip, proxy, tests, libraries)");
        payload.add_file("bin/busybox", 0o755, fs::read(busybox()?)?);
        let ip =
            find_on_path("ip").context("`ip` (iproute2) is missing: run `cargo xtask setup`")?;
        let mut dynamic = vec![ip.clone(), proxy.clone()];
        payload.add_file("usr/sbin/ip", 0o755, fs::read(&ip)?);
        // iproute2's tc, for tests that attach tc programs (cls_bpf on an ingress qdisc).
        if let Some(tc) = find_on_path("tc") {
            payload.add_file("usr/sbin/tc", 0o755, fs::read(&tc)?);
            dynamic.push(tc);
        }
        payload.add_file(PROXY_PATH, 0o755, stripped(&proxy)?);
        for test in &tests {
            let name = test
                .file_name()
                .and_then(|n| n.to_str())
                .context("test binary name")?;
            payload.add_file(&format!("tests/{name}"), 0o755, stripped(test)?);
            payload.tests.push(name.to_owned());
            dynamic.push(test.clone());
        }
        for lib in libraries(&dynamic)? {
            let bytes = fs::read(&lib).with_context(|| format!("reading {}", lib.display()))?;
            payload.add_file(lib.to_string_lossy().trim_start_matches('/'), 0o755, bytes);
        }
        payload.add_file("init", 0o755, INIT.as_bytes().to_vec());
        payload.add_file(
            "etc/vm-filter",
            0o644,
            filter.unwrap_or_default().as_bytes().to_vec(),
        );
        let limit = binary_timeout.as_secs().to_string();
        payload.add_file("etc/vm-binary-timeout", 0o644, limit.into_bytes());
        let size: usize = payload.files.values().map(|(_, b)| b.len()).sum();
        detail(format!(
            "{} files, {} MiB before compression",
            payload.files.len(),
            size >> 20
        ));
        Ok(payload)
    }

    fn add_file(&mut self, path: &str, mode: u32, bytes: Vec<u8>) {
        self.files.insert(path.to_owned(), (mode, bytes));
    }

    /// Writes `<dir>/initramfs-<release>.cpio.gz` with this payload and `kernel`'s modules.
    pub fn write(&self, kernel: &Kernel, dir: &Path) -> anyhow::Result<PathBuf> {
        let mut files = self.files.clone();
        let modules = kernel.modules()?;
        let names: Vec<&str> = modules.iter().map(|(n, _)| n.as_str()).collect();
        detail(format!(
            "modules for {}: {}",
            kernel.release,
            names.join(" ")
        ));
        let mut order = String::new();
        for (name, bytes) in modules {
            order.push_str(&name);
            order.push('\n');
            files.insert(format!("lib/modules/{name}.ko"), (0o644, bytes));
        }
        files.insert("etc/vm-modules".to_owned(), (0o644, order.into_bytes()));
        let path = dir.join(format!("initramfs-{}.cpio.gz", kernel.release));
        write_image(&files, &path)?;
        Ok(path)
    }
}

/// A minimal image for the KVM probe: busybox and an init that prints `marker` and powers off.
pub fn probe_image(dir: &Path, marker: &str) -> anyhow::Result<PathBuf> {
    let mut files = BTreeMap::new();
    files.insert("bin/busybox".to_owned(), (0o755, fs::read(busybox()?)?));
    let init = format!("#!/bin/busybox sh\n/bin/busybox echo {marker}\n/bin/busybox poweroff -f\n");
    files.insert("init".to_owned(), (0o755, init.into_bytes()));
    let path = dir.join("probe.cpio.gz");
    write_image(&files, &path)?;
    Ok(path)
}

/// Debian's statically linked busybox (bookworm `busybox-static`), fetched and extracted once.
pub(super) fn busybox() -> anyhow::Result<PathBuf> {
    let dir = util::target_dir()?.join("vm/busybox");
    let bin = dir.join("bin/busybox");
    if !bin.is_file() {
        let suite = apt::Suite::new("bookworm")?;
        let deb = suite.download("busybox-static")?;
        apt::extract(&deb, &dir)?;
    }
    Ok(bin)
}

/// The test executables named `kernel_*`.
fn kernel_tests(all: Vec<(String, PathBuf)>) -> anyhow::Result<Vec<PathBuf>> {
    let tests: Vec<PathBuf> = all
        .into_iter()
        .filter(|(name, _)| name.starts_with("kernel_"))
        .map(|(_, exe)| exe)
        .collect();
    if tests.is_empty() {
        bail!("integration-tests has no test binaries named kernel_*");
    }
    Ok(tests)
}

/// The binary's bytes without debug info (a debug test binary shrinks by about 80 %; symbols
/// stay, so panics still show function names). Falls back to the file as it is.
pub(super) fn stripped(path: &Path) -> anyhow::Result<Vec<u8>> {
    let out = std::env::temp_dir().join(format!("proxy-vm-strip-{}", std::process::id()));
    let ok = Command::new("strip")
        .arg("--strip-debug")
        .arg("-o")
        .arg(&out)
        .arg(path)
        .status()
        .is_ok_and(|s| s.success());
    let bytes = if ok { fs::read(&out) } else { fs::read(path) };
    let _ = fs::remove_file(&out);
    bytes.with_context(|| format!("reading {}", path.display()))
}

/// The shared libraries (and the dynamic loader) `binaries` load, as ldd resolves them here.
pub(super) fn libraries(binaries: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut libs = Vec::new();
    for binary in binaries {
        let text = util::output(Command::new("ldd").arg(binary), "ldd")?;
        for line in text.lines().map(str::trim) {
            if line.contains("not found") {
                bail!("{}: {line}", binary.display());
            }
            let path = line.split_once("=>").map_or(line, |(_, p)| p.trim());
            let path = path.split(" (").next().unwrap_or_default().trim();
            if path.starts_with('/') && !libs.iter().any(|l: &PathBuf| l == Path::new(path)) {
                libs.push(PathBuf::from(path));
            }
        }
    }
    Ok(libs)
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .chain(["/usr/sbin", "/sbin"])
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// Writes `files` (and their parent directories, and `/dev/console`) as cpio newc through
/// `gzip -1`.
pub(super) fn write_image(
    files: &BTreeMap<String, (u32, Vec<u8>)>,
    path: &Path,
) -> anyhow::Result<()> {
    let mut cpio = Cpio::default();
    let mut dirs = std::collections::BTreeSet::new();
    for base in ["dev", "proc", "sys", "tmp", "run", "root", "etc"] {
        dirs.insert(base.to_owned());
    }
    for name in files.keys() {
        let mut parent = Path::new(name).parent();
        while let Some(p) = parent.filter(|p| !p.as_os_str().is_empty()) {
            dirs.insert(p.to_string_lossy().into_owned());
            parent = p.parent();
        }
    }
    for dir in &dirs {
        cpio.entry(dir, 0o040_755, &[], (0, 0));
    }
    cpio.entry("dev/console", 0o020_600, &[], (5, 1));
    for (name, (mode, bytes)) in files {
        cpio.entry(name, 0o100_000 | mode, bytes, (0, 0));
    }
    cpio.entry("TRAILER!!!", 0, &[], (0, 0));
    let file = fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut gzip = Command::new("gzip")
        .arg("-1")
        .stdin(Stdio::piped())
        .stdout(file)
        .spawn()
        .context("starting gzip")?;
    gzip.stdin
        .take()
        .context("gzip stdin")?
        .write_all(&cpio.0)
        .context("writing to gzip")?;
    let status = gzip.wait().context("waiting for gzip")?;
    if !status.success() {
        bail!("gzip failed ({status}) writing {}", path.display());
    }
    Ok(())
}

/// A cpio "newc" archive in memory.
#[derive(Default)]
struct Cpio(Vec<u8>);

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, data: &[u8], rdev: (u32, u32)) {
        let ino = u32::try_from(self.0.len() / 4 % 0x7fff_ffff).unwrap_or(0) + 1;
        let nlink = if mode & 0o170_000 == 0o040_000 { 2 } else { 1 };
        let size = u32::try_from(data.len()).expect("a file in the initramfs is under 4 GiB");
        let namesize = u32::try_from(name.len() + 1).expect("short name");
        let fields = [
            ino, mode, 0, 0, nlink, 0, size, 0, 0, rdev.0, rdev.1, namesize, 0,
        ];
        self.0.extend_from_slice(b"070701");
        for field in fields {
            self.0.extend_from_slice(format!("{field:08x}").as_bytes());
        }
        self.0.extend_from_slice(name.as_bytes());
        self.0.push(0);
        self.pad();
        self.0.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.0.len().is_multiple_of(4) {
            self.0.push(0);
        }
    }
}
