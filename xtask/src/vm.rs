//! `cargo xtask vm`: the kernel tests on other kernels, in QEMU.
//!
//! For each kernel line (5.10, 6.1, 6.12): the newest Debian cloud kernel of that line is
//! downloaded and extracted (cached under `<target>/vm/`), an initramfs is written with the
//! `kernel_*` test binaries, the daemon, busybox, iproute2's `ip`, their libraries and the
//! modules the tests need, and QEMU boots it with no network device. The init runs the test
//! binaries in two lanes (one per vCPU), each binary with `--test-threads=1`, and prints
//! `PROXY-VM-RESULT: pass N fail M skip K`.
//!
//! Only the `kernel_*` binaries run in the VM: the DNS, health and xDS tests need unbound and
//! Python, which the initramfs does not carry; they run on the host in `cargo xtask test`.
//!
//! `--systemd` boots systemd instead, with the shipped units and a check of them
//! ([`systemd`]).

mod boot;
mod initramfs;
mod kernel;
pub mod systemd;

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
pub use boot::Accel;
pub use kernel::KernelLine;

use crate::util::{self, step};

/// Which kernels `--kernel` selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KernelChoice {
    #[value(name = "5.10")]
    V5_10,
    #[value(name = "6.1")]
    V6_1,
    #[value(name = "6.12")]
    V6_12,
    /// 5.10, 6.1 and 6.12, oldest first.
    All,
}

impl KernelChoice {
    pub fn lines(self) -> Vec<KernelLine> {
        match self {
            Self::V5_10 => vec![KernelLine::V5_10],
            Self::V6_1 => vec![KernelLine::V6_1],
            Self::V6_12 => vec![KernelLine::V6_12],
            Self::All => KernelLine::ALL.to_vec(),
        }
    }
}

/// Options of one matrix run.
pub struct Options<'a> {
    pub kernels: Vec<KernelLine>,
    /// Passed to the test binaries (a substring of test names).
    pub filter: Option<&'a str>,
    pub accel: Accel,
    /// Wall-clock limit per kernel, boot to power-off.
    pub timeout: Duration,
    /// Limit per test binary inside the VM (killed and counted as a failure after it).
    pub binary_timeout: Duration,
    pub memory_mib: u32,
}

impl Options<'_> {
    /// Defaults for `choice`: automatic accelerator, 1.5 GiB, 30 minutes per kernel and 10 per
    /// test binary (the slowest, kernel_publish, took about 4 minutes under TCG on 2 cores; the
    /// whole suite about 10).
    pub fn new(choice: KernelChoice) -> Self {
        Self {
            kernels: choice.lines(),
            filter: None,
            accel: Accel::Auto,
            timeout: Duration::from_secs(1800),
            binary_timeout: Duration::from_secs(600),
            memory_mib: 1536,
        }
    }
}

/// One kernel's outcome.
struct Outcome {
    label: &'static str,
    package: String,
    accel: Accel,
    boot: boot::Boot,
    /// The boot's lines that name a failure.
    failures: Vec<String>,
}

impl Outcome {
    fn passed(&self) -> bool {
        matches!(self.boot.result, Some((_, 0, _)))
    }

    fn summary(&self) -> String {
        let secs = self.boot.elapsed.as_secs_f64();
        let what = match (self.boot.result, &self.boot.problem) {
            (Some((p, f, s)), _) => format!("pass {p} fail {f} skip {s}"),
            (None, Some(problem)) => problem.clone(),
            (None, None) => "no result".to_owned(),
        };
        format!(
            "{:<5} {:<40} {:<4} {secs:>6.1} s  {what}",
            self.label,
            self.package,
            format!("{:?}", self.accel)
        )
    }
}

/// Runs the kernel tests on each selected kernel; fails if any kernel had a failure or no
/// result line.
pub fn run(opts: &Options<'_>) -> anyhow::Result<()> {
    let start = Instant::now();
    boot::require_qemu()?;
    let dir = util::target_dir()?.join("vm");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let payload = initramfs::Payload::build(opts.filter, opts.binary_timeout)?;
    let mut outcomes = Vec::new();
    for &line in &opts.kernels {
        step(format!("kernel {}: fetching", line.label()));
        let kernel = kernel::fetch(line)?;
        step(format!("kernel {}: building the initramfs", line.label()));
        let image = payload.write(&kernel, &dir)?;
        let accel = boot::choose_accel(opts.accel, &kernel.vmlinuz, &dir)?;
        step(format!(
            "kernel {}: booting {} ({accel:?}, {} test binaries, limit {} s)",
            line.label(),
            kernel.release,
            payload.tests.len(),
            opts.timeout.as_secs()
        ));
        let prefix = format!("    [{}] ", line.label());
        let machine = boot::Machine {
            vmlinuz: &kernel.vmlinuz,
            initrd: &image,
            accel,
            memory_mib: opts.memory_mib,
            timeout: opts.timeout,
            echo: Some(&prefix),
        };
        let (boot, lines) = machine.run(boot::RESULT_MARKER)?;
        let outcome = Outcome {
            label: line.label(),
            package: kernel.package,
            accel,
            failures: boot::failures(&lines)
                .into_iter()
                .map(str::to_owned)
                .collect(),
            boot,
        };
        step(format!("kernel {}: {}", line.label(), outcome.summary()));
        outcomes.push(outcome);
    }
    step(format!(
        "VM matrix ({:.0} s in all)",
        start.elapsed().as_secs_f64()
    ));
    for outcome in &outcomes {
        eprintln!("    {}", outcome.summary());
        for failure in &outcome.failures {
            eprintln!("        {failure}");
        }
    }
    let (pass, fail, skip) = outcomes.iter().fold((0, 0, 0), |(p, f, s), o| {
        let (op, of, os) = o.boot.result.unwrap_or((0, 1, 0));
        (p + op, f + of, s + os)
    });
    eprintln!("vm: {pass} passed, {fail} failed, {skip} skipped");
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|o| !o.passed())
        .map(|o| {
            let mut what = o.label.to_owned();
            for failure in &o.failures {
                what.push_str("\n    ");
                what.push_str(failure);
            }
            what
        })
        .collect();
    if !failed.is_empty() {
        bail!("the VM suite failed on kernel {}", failed.join(", "));
    }
    Ok(())
}
