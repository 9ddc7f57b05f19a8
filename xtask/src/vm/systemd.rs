//! `cargo xtask vm --systemd`: the shipped units under a real systemd, in QEMU.
//!
//! The host's systemd (PID 1 of the VM; its programs and libraries as ldd resolves them here)
//! boots an initramfs that holds the daemon at the path the units name
//! (`/usr/local/bin/proxy`), `docs/deploy/proxy.service` and `proxy@.service` as they are, a
//! configuration with a kernel-path and a proxy-mode service in front of a busybox httpd, and
//! a check unit (`systemd/check.sh`) that drives the units with systemctl: readiness, status,
//! the watchdog (fed, and killing a wedged daemon), a restart and a takeover under a connect
//! loop, and what a stop leaves. It prints `PROXY-VM-RESULT: pass N fail M skip 0` and powers
//! the VM off. The init (`systemd/init.sh`) copies the image into a tmpfs and switches root to
//! it, so the units' sandboxing runs on an ordinary mount.

use std::{
    collections::BTreeMap,
    fs,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::{
    Accel, KernelLine, boot,
    initramfs::{busybox, libraries, stripped, write_image},
    kernel,
};
use crate::util::{self, detail, step};

const INIT: &str = include_str!("systemd/init.sh");
const CHECK: &str = include_str!("systemd/check.sh");
const CONFIG: &str = include_str!("systemd/proxy.yaml");
const DEFAULT_TARGET: &str = include_str!("systemd/default.target");
const BACKEND_UNIT: &str = include_str!("systemd/proxy-vm-backend.service");
const CHECK_UNIT: &str = include_str!("systemd/proxy-vm-check.service");

/// The units of the repository that run in the VM, unchanged, from `docs/deploy/`.
const SHIPPED_UNITS: &[&str] = &["proxy.service", "proxy@.service"];

/// systemd's programs the VM runs, at the host's paths (Debian: systemd 252 in bookworm).
const SYSTEMD_PROGRAMS: &[&str] = &[
    "/lib/systemd/systemd",
    "/lib/systemd/systemd-journald",
    "/lib/systemd/systemd-shutdown",
    "/usr/bin/systemctl",
    "/usr/bin/journalctl",
];

/// The host's unit files the boot and the power-off need, copied as they are: the targets
/// up to basic.target, those the shipped units name, the power-off, and journald.
const HOST_UNITS: &[&str] = &[
    "sysinit.target",
    "basic.target",
    "sockets.target",
    "paths.target",
    "timers.target",
    "slices.target",
    "local-fs-pre.target",
    "local-fs.target",
    "swap.target",
    "network-pre.target",
    "network.target",
    "network-online.target",
    "multi-user.target",
    "shutdown.target",
    "umount.target",
    "final.target",
    "poweroff.target",
    "systemd-poweroff.service",
    "systemd-journald.service",
    "systemd-journald.socket",
    "systemd-journald-dev-log.socket",
    "systemd-journald-audit.socket",
];

/// The users the VM knows: the units' `--user ebpf-proxy` (as docs/deploy/proxy.sysusers
/// creates it) and nobody.
const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh
ebpf-proxy:x:999:999:eBPF transparent proxy daemon:/nonexistent:/usr/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
";
const GROUP: &str = "root:x:0:\nebpf-proxy:x:999:\nnogroup:x:65534:\n";
/// journald copies every record to the serial console, so the harness's log has the daemon's
/// lines as systemd saw them.
const JOURNALD: &str =
    "[Journal]\nForwardToConsole=yes\nTTYPath=/dev/console\nMaxLevelConsole=info\n";
const NSSWITCH: &str = "passwd: files\ngroup: files\nshadow: files\nhosts: files\n";

/// Options of `cargo xtask vm --systemd`.
pub struct Options {
    pub kernels: Vec<KernelLine>,
    pub accel: Accel,
    /// Wall-clock limit per boot.
    pub timeout: Duration,
    pub memory_mib: u32,
}

impl Options {
    /// Automatic accelerator, 1 GiB, 10 minutes per boot (about two and a half under TCG,
    /// most of it the check's watchdog waits).
    pub fn new(kernels: Vec<KernelLine>) -> Self {
        Self {
            kernels,
            accel: Accel::Auto,
            timeout: Duration::from_secs(600),
            memory_mib: 1024,
        }
    }
}

/// Boots each selected kernel with systemd and the units; fails if a check failed or the
/// result line is missing. `proxy`: the daemon to run (built here when `None`).
pub fn run(opts: &Options, proxy: Option<&Path>) -> anyhow::Result<()> {
    let start = Instant::now();
    boot::require_qemu()?;
    let proxy = match proxy {
        Some(path) => path.to_owned(),
        None => util::build_proxy()?,
    };
    let dir = util::target_dir()?.join("vm");
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    step("gathering the systemd VM's files (systemd, its units, the daemon, busybox)");
    let files = gather(&proxy)?;
    let mut failed = Vec::new();
    for &line in &opts.kernels {
        let kernel = kernel::fetch(line)?;
        let image = dir.join(format!("systemd-{}.cpio.gz", kernel.release));
        write_image(&files, &image)?;
        let accel = boot::choose_accel(opts.accel, &kernel.vmlinuz, &dir)?;
        step(format!(
            "kernel {}: booting {} with systemd as PID 1 ({accel:?}, limit {} s)",
            line.label(),
            kernel.release,
            opts.timeout.as_secs()
        ));
        let prefix = format!("    [{} systemd] ", line.label());
        let machine = boot::Machine {
            vmlinuz: &kernel.vmlinuz,
            initrd: &image,
            accel,
            memory_mib: opts.memory_mib,
            timeout: opts.timeout,
            echo: Some(&prefix),
        };
        let (boot, lines) = machine.run(boot::RESULT_MARKER)?;
        let secs = boot.elapsed.as_secs_f64();
        let what = match (boot.result, &boot.problem) {
            (Some((p, f, _)), _) => format!("{p} checks passed, {f} failed"),
            (None, Some(problem)) => problem.clone(),
            (None, None) => "no result".to_owned(),
        };
        step(format!(
            "kernel {} with systemd: {what} ({secs:.1} s)",
            line.label()
        ));
        if !matches!(boot.result, Some((_, 0, _))) {
            let mut what = line.label().to_owned();
            for failure in boot::failures(&lines) {
                what.push_str("\n    ");
                what.push_str(failure);
            }
            failed.push(what);
        }
    }
    detail(format!(
        "systemd VM runs took {:.0} s in all",
        start.elapsed().as_secs_f64()
    ));
    if !failed.is_empty() {
        bail!(
            "the systemd units failed their checks on kernel {}",
            failed.join(", ")
        );
    }
    Ok(())
}

/// Everything the image holds, by path in the image.
fn gather(proxy: &Path) -> anyhow::Result<BTreeMap<String, (u32, Vec<u8>)>> {
    let mut files = BTreeMap::new();
    let mut add = |path: &str, mode: u32, bytes: Vec<u8>| {
        files.insert(path.trim_start_matches('/').to_owned(), (mode, bytes));
    };
    add("init", 0o755, INIT.into());
    add("bin/busybox", 0o755, read(&busybox()?)?);
    let mut dynamic = vec![proxy.to_owned()];
    for program in SYSTEMD_PROGRAMS {
        let path = Path::new(program);
        if !path.is_file() {
            bail!(
                "{program} is missing: the systemd VM runs the host's systemd (apt-get install systemd)"
            );
        }
        add(program, 0o755, read(path)?);
        dynamic.push(path.to_owned());
    }
    for lib in libraries(&dynamic)? {
        add(&lib.to_string_lossy(), 0o755, read(&lib)?);
    }
    add("usr/local/bin/proxy", 0o755, stripped(proxy)?);
    let deploy = util::workspace_root().join("docs/deploy");
    for unit in SHIPPED_UNITS {
        add(
            &format!("etc/systemd/system/{unit}"),
            0o644,
            read(&deploy.join(unit))?,
        );
    }
    for unit in HOST_UNITS {
        let path = Path::new("/lib/systemd/system").join(unit);
        add(&format!("lib/systemd/system/{unit}"), 0o644, read(&path)?);
    }
    add(
        "etc/systemd/system/default.target",
        0o644,
        DEFAULT_TARGET.into(),
    );
    add(
        "etc/systemd/system/proxy-vm-backend.service",
        0o644,
        BACKEND_UNIT.into(),
    );
    add(
        "etc/systemd/system/proxy-vm-check.service",
        0o644,
        CHECK_UNIT.into(),
    );
    add("usr/local/lib/proxy-vm/check.sh", 0o755, CHECK.into());
    add("etc/proxy/proxy.yaml", 0o644, CONFIG.into());
    add("etc/systemd/journald.conf", 0o644, JOURNALD.into());
    add("srv/www/index.html", 0o644, b"proxy-vm-backend\n".to_vec());
    add("etc/passwd", 0o644, PASSWD.into());
    add("etc/group", 0o644, GROUP.into());
    add("etc/nsswitch.conf", 0o644, NSSWITCH.into());
    add("etc/hostname", 0o644, b"proxy-vm\n".to_vec());
    add(
        "etc/machine-id",
        0o444,
        b"5e6d9a3c1f7b4e2a8d0c6b4a29f1e3d7\n".to_vec(),
    );
    add("etc/os-release", 0o644, read(Path::new("/etc/os-release"))?);
    let size: usize = files.values().map(|(_, b)| b.len()).sum();
    detail(format!(
        "{} files, {} MiB before compression",
        files.len(),
        size >> 20
    ));
    Ok(files)
}

fn read(path: &Path) -> anyhow::Result<Vec<u8>> {
    fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// The kernels `--systemd` boots when `--kernel` is not given: the newest line.
pub fn default_kernels() -> Vec<KernelLine> {
    vec![KernelLine::V6_12]
}
