//! Booting a kernel and an initramfs in QEMU: serial console on stdout, no network device,
//! a wall-clock limit after which QEMU is killed by its PID.
//!
//! KVM is used only when /dev/kvm opens and a probe boot with it prints its marker in time: on
//! some hosts KVM guests hang. Otherwise TCG (`-accel tcg -cpu max`).

use std::{
    fs,
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::initramfs;
use crate::{
    qemu::QEMU,
    util::{detail, step},
};

/// How the guest CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Accel {
    /// KVM if it works here (a probe boot decides), else TCG.
    Auto,
    /// Hardware virtualization; fails the run if the guest hangs.
    Kvm,
    /// Emulation (`-cpu max`): slower, works everywhere.
    Tcg,
}

/// The result line the init prints.
pub const RESULT_MARKER: &str = "PROXY-VM-RESULT:";

/// The probe's marker line.
const PROBE_MARKER: &str = "PROXY-VM-PROBE-OK";

/// How long the KVM probe may take before KVM is judged not to work.
const PROBE_TIMEOUT: Duration = Duration::from_secs(20);

/// What one boot showed.
pub struct Boot {
    /// The result line's counts (pass, fail, skip), if it appeared.
    pub result: Option<(u32, u32, u32)>,
    /// Why the boot ended without a result, if it did.
    pub problem: Option<String>,
    pub elapsed: Duration,
}

/// One QEMU invocation.
pub struct Machine<'a> {
    pub vmlinuz: &'a Path,
    pub initrd: &'a Path,
    pub accel: Accel,
    pub memory_mib: u32,
    pub timeout: Duration,
    /// Prefix for the serial lines echoed to our stderr; `None` keeps them quiet.
    pub echo: Option<&'a str>,
}

impl Machine<'_> {
    fn command(&self) -> Command {
        let mut cmd = Command::new(QEMU);
        match self.accel {
            Accel::Kvm => cmd.args(["-accel", "kvm", "-cpu", "host"]),
            Accel::Tcg | Accel::Auto => cmd.args(["-accel", "tcg", "-cpu", "max"]),
        };
        cmd.args(["-smp", "2", "-m", &self.memory_mib.to_string()])
            .args([
                "-nographic",
                "-monitor",
                "none",
                "-no-reboot",
                "-nic",
                "none",
            ])
            .arg("-kernel")
            .arg(self.vmlinuz)
            .arg("-initrd")
            .arg(self.initrd)
            .args([
                "-append",
                "console=ttyS0 panic=-1 quiet random.trust_cpu=on",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// Boots, streams the serial console until the result marker (or `marker`) appears and
    /// QEMU exits, or until the timeout, when QEMU is killed by its PID.
    pub fn run(&self, marker: &str) -> anyhow::Result<(Boot, Vec<String>)> {
        let start = Instant::now();
        let mut child = self
            .command()
            .spawn()
            .with_context(|| format!("starting {QEMU}"))?;
        let (tx, rx) = mpsc::channel();
        for pipe in [
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).split(b'\n').map_while(Result::ok) {
                    let text = printable(&String::from_utf8_lossy(&line));
                    if tx.send(text).is_err() {
                        return;
                    }
                }
            });
        }
        drop(tx);
        let deadline = start + self.timeout;
        let (mut lines, mut result, mut problem) = (Vec::new(), None, None);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(prefix) = self.echo {
                        eprintln!("{prefix}{line}");
                    }
                    if let Some(rest) = line.split(marker).nth(1) {
                        result = Some(parse_counts(rest));
                    }
                    lines.push(line);
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    problem = Some(format!(
                        "timed out after {} s; QEMU killed",
                        self.timeout.as_secs()
                    ));
                    let _ = child.kill();
                    break;
                }
            }
        }
        let status = wait_bounded(&mut child);
        if result.is_none() && problem.is_none() {
            problem = Some(format!(
                "QEMU exited ({status}) without printing `{marker}`"
            ));
        }
        let boot = Boot {
            result,
            problem,
            elapsed: start.elapsed(),
        };
        Ok((boot, lines))
    }
}

/// The line without terminal control sequences (SeaBIOS clears the screen) or other control
/// characters.
fn printable(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => {
                // ESC [ parameters final-byte, or ESC and one character.
                if chars.next_if_eq(&'[').is_some() {
                    while chars.next().is_some_and(|c| !c.is_ascii_alphabetic()) {}
                } else {
                    chars.next();
                }
            }
            '\t' => out.push(' '),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out.trim_end().to_owned()
}

/// The lines of a boot that name a failure: a failed check of the systemd VM, a failed test
/// of libtest, a panic, or the init's own notes of a test binary that died. Printed again after
/// the run, so the end of a long log (all a CI summary may show) says what failed.
pub fn failures(lines: &[String]) -> Vec<&str> {
    lines
        .iter()
        .map(String::as_str)
        .filter(|line| {
            line.contains("PROXY-VM-CHECK FAILED")
                || line.ends_with("... FAILED")
                || line.contains("panicked at")
                || line.contains("no failed test: counted as one failure")
        })
        .collect()
}

/// Waits for QEMU after its output ended; kills it by PID if it lingers.
fn wait_bounded(child: &mut std::process::Child) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return status.to_string();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    child
        .wait()
        .map_or_else(|e| e.to_string(), |s| s.to_string())
}

/// `pass 3 fail 0 skip 1` -> (3, 0, 1); missing numbers count as a failure.
fn parse_counts(text: &str) -> (u32, u32, u32) {
    let words: Vec<&str> = text.split_whitespace().collect();
    let get = |key: &str| {
        words
            .iter()
            .position(|w| *w == key)
            .and_then(|i| words.get(i + 1)?.parse().ok())
    };
    match (get("pass"), get("fail"), get("skip")) {
        (Some(p), Some(f), Some(s)) => (p, f, s),
        _ => (0, 1, 0),
    }
}

/// Resolves `Auto`: KVM when /dev/kvm opens and a probe boot of `vmlinuz` prints its marker
/// within [`PROBE_TIMEOUT`]. The answer is cached per host boot under `dir`.
pub fn choose_accel(wanted: Accel, vmlinuz: &Path, dir: &Path) -> anyhow::Result<Accel> {
    if wanted != Accel::Auto {
        return Ok(wanted);
    }
    if fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        detail("accelerator: TCG (/dev/kvm is missing or not usable)");
        return Ok(Accel::Tcg);
    }
    let boot_id = fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let cache = dir.join("kvm-probe");
    if let Some(answer) = fs::read_to_string(&cache)
        .ok()
        .and_then(|t| t.strip_prefix(boot_id.trim()).map(|a| a.trim().to_owned()))
    {
        let accel = if answer == "kvm" {
            Accel::Kvm
        } else {
            Accel::Tcg
        };
        detail(format!(
            "accelerator: {accel:?} (probed earlier since this host booted)"
        ));
        return Ok(accel);
    }
    step(format!(
        "probing KVM: a minimal boot must finish within {} s",
        PROBE_TIMEOUT.as_secs()
    ));
    let image = initramfs::probe_image(dir, PROBE_MARKER)?;
    let machine = Machine {
        vmlinuz,
        initrd: &image,
        accel: Accel::Kvm,
        memory_mib: 256,
        timeout: PROBE_TIMEOUT,
        echo: None,
    };
    let (boot, lines) = machine.run(PROBE_MARKER)?;
    let works = lines.iter().any(|l| l.contains(PROBE_MARKER));
    let accel = if works { Accel::Kvm } else { Accel::Tcg };
    let why = match (works, lines.iter().rev().find(|l| !l.is_empty())) {
        (true, _) => "booted".to_owned(),
        (false, Some(last)) => format!("did not finish; last line: {last}"),
        (false, None) => "did not finish".to_owned(),
    };
    detail(format!(
        "accelerator: {accel:?} (KVM probe {why}, {:.1} s)",
        boot.elapsed.as_secs_f64()
    ));
    fs::write(
        &cache,
        format!("{} {}\n", boot_id.trim(), if works { "kvm" } else { "tcg" }),
    )
    .context("caching the KVM probe")?;
    Ok(accel)
}

/// Fails unless QEMU is installed.
pub fn require_qemu() -> anyhow::Result<()> {
    if crate::qemu::find_qemu().is_none() {
        bail!(
            "{QEMU} is not installed; run `cargo xtask setup` as root (it installs qemu-system-x86)"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::failures;

    #[test]
    fn the_lines_naming_a_failure_are_picked_out() {
        let lines: Vec<String> = [
            "PROXY-VM-CHECK ok: Type (notify)",
            "PROXY-VM-CHECK FAILED: restarts: expected '1', got '2'",
            "test kernel_end::ends ... ok",
            "test kernel_end::ends_all ... FAILED",
            "thread 'x' panicked at tests/tests/kernel_end.rs:10:5:",
            "PROXY-VM: kernel_end exited with status 101 and no failed test: counted as one failure",
            "test result: FAILED. 3 passed; 1 failed",
        ]
        .map(str::to_owned)
        .into();
        assert_eq!(
            failures(&lines),
            [lines[1].as_str(), &lines[3], &lines[4], &lines[5]]
        );
    }
}
