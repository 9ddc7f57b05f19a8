//! The root-only integration tests (package `integration-tests`), built once and run as lanes:
//! the binaries whose tests mostly wait on protocol clocks (health checks at Envoy's default
//! intervals, side by side with a real Envoy) run beside the others, each in a lane of its own, and `load`, which wants the
//! machine to itself, runs alone after both. Every binary runs even when one fails; the run
//! fails if any did.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::bail;

use crate::util::{self, detail};

/// Binaries that spend their time waiting for timers, not CPU: each runs in a lane of its own
/// beside the others (its output is shown when it ends).
const TIMER_BOUND: &[&str] = &["envoy_side_by_side", "daemon_health"];

/// Binaries that run alone, after both lanes: `load` drives a million connections and needs
/// the CPUs.
const ALONE: &[&str] = &["load"];

/// How one lane runs its binaries.
struct Lane<'a> {
    proxy: &'a Path,
    python: &'a Path,
    filter: Option<&'a str>,
}

impl Lane<'_> {
    fn command(&self, exe: &Path) -> Command {
        let mut cmd = Command::new(exe);
        cmd.current_dir(util::workspace_root().join("tests"))
            .env("PROXY_BIN", self.proxy)
            .env("PROXY_TEST_PYTHON", self.python);
        cmd.args(self.filter);
        cmd
    }

    /// Runs `binaries` one after the other with the output shown as it comes; the names of
    /// those that failed.
    fn run(&self, binaries: &[(String, PathBuf)]) -> Vec<String> {
        let mut failed = Vec::new();
        for (name, exe) in binaries {
            eprintln!("     Running {name}");
            let ok = self.command(exe).status().is_ok_and(|s| s.success());
            if !ok {
                failed.push(name.clone());
            }
        }
        failed
    }

    /// Like [`Lane::run`], but each binary's output is kept and printed when it ends, so two
    /// lanes do not interleave their lines.
    fn run_quietly(&self, binaries: &[(String, PathBuf)]) -> Vec<String> {
        let mut failed = Vec::new();
        for (name, exe) in binaries {
            let start = Instant::now();
            let out = self.command(exe).stdin(Stdio::null()).output();
            let ok = out.as_ref().is_ok_and(|o| o.status.success());
            eprintln!(
                "     [timer lane] {name} ended after {:.0} s ({}); its output:",
                start.elapsed().as_secs_f64(),
                if ok { "passed" } else { "FAILED" }
            );
            match out {
                Ok(o) => {
                    eprint!("{}", String::from_utf8_lossy(&o.stdout));
                    eprint!("{}", String::from_utf8_lossy(&o.stderr));
                }
                Err(e) => eprintln!("     could not start {}: {e}", exe.display()),
            }
            if !ok {
                failed.push(name.clone());
            }
        }
        failed
    }
}

/// Runs the test binaries of `integration-tests` (built by [`util::Suite`]) in lanes.
pub fn run(
    binaries: &[(String, PathBuf)],
    proxy: &Path,
    python: &Path,
    filter: Option<&str>,
) -> anyhow::Result<()> {
    let pick = |names: &[&str], inside: bool| -> Vec<(String, PathBuf)> {
        binaries
            .iter()
            .filter(|(n, _)| names.contains(&n.as_str()) == inside)
            .cloned()
            .collect()
    };
    let timer = pick(TIMER_BOUND, true);
    let alone = pick(ALONE, true);
    let rest: Vec<_> = pick(TIMER_BOUND, false)
        .into_iter()
        .filter(|(n, _)| !ALONE.contains(&n.as_str()))
        .collect();
    let lane = Lane {
        proxy,
        python,
        filter,
    };
    detail(format!(
        "{} binaries; beside them, in a lane of their own: {}; alone at the end: {}",
        rest.len(),
        names(&timer),
        names(&alone)
    ));
    let lane = &lane;
    let mut failed = std::thread::scope(|s| {
        // One thread per timer-bound binary: each mostly sleeps.
        let beside: Vec<_> = timer
            .iter()
            .map(|binary| s.spawn(move || lane.run_quietly(std::slice::from_ref(binary))))
            .collect();
        let mut failed = lane.run(&rest);
        for (thread, binary) in beside.into_iter().zip(&timer) {
            failed.extend(thread.join().unwrap_or_else(|_| vec![binary.0.clone()]));
        }
        failed
    });
    failed.extend(lane.run(&alone));
    if !failed.is_empty() {
        bail!("integration test binaries failed: {}", failed.join(", "));
    }
    Ok(())
}

fn names(binaries: &[(String, PathBuf)]) -> String {
    names_of(binaries).join(", ")
}

fn names_of(binaries: &[(String, PathBuf)]) -> Vec<String> {
    binaries.iter().map(|(n, _)| n.clone()).collect()
}
