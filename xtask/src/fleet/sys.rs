//! The system calls the fleet harness makes itself: entering a network namespace, the monotonic
//! clock that the harness and its probes share, signals, and stopping a process by its PID.

use std::{
    fs,
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    process::{Child, Command},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::Context as _;

/// Moves the calling thread (only it) into the network namespace of `file` (a `/run/netns`
/// entry or `/proc/self/ns/net`).
pub fn enter_netns(file: &fs::File) -> anyhow::Result<()> {
    // SAFETY: `file` is open for the duration of the call; CLONE_NEWNET moves only the calling
    // thread.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error()).context("setns(CLONE_NEWNET)");
    }
    Ok(())
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process on the machine, so a probe's
/// observation and the harness's change can be subtracted.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is valid for writes; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// SIGINT and SIGTERM only set a flag: every loop of the harness checks it and returns an
/// error, and the drops on the way out tear the fleet down.
pub fn catch_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

/// Fails once SIGINT or SIGTERM arrived.
pub fn check_interrupted() -> anyhow::Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        anyhow::bail!("interrupted: tearing the fleet down");
    }
    Ok(())
}

/// A started process, stopped by its PID on drop: SIGTERM, then SIGKILL after `grace`.
pub struct Proc {
    pub child: Child,
    pub what: String,
    grace: Duration,
}

impl Proc {
    /// Starts `cmd` in a process group of its own, so a Ctrl-C on the terminal reaches only
    /// the harness, which then stops everything in order.
    pub fn spawn(mut cmd: Command, what: &str, grace: Duration) -> anyhow::Result<Self> {
        cmd.process_group(0);
        let child = cmd.spawn().with_context(|| format!("starting {what}"))?;
        Ok(Self {
            child,
            what: what.to_owned(),
            grace,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails if the process has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            anyhow::bail!("{} exited ({status})", self.what);
        }
        Ok(())
    }

    /// Sends SIGTERM (unless the child has exited already); [`Proc::stop`] then waits. Many
    /// processes stop in parallel this way.
    pub fn terminate(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        // SAFETY: kill(2) on the PID of our own unreaped child, which cannot have been reused.
        unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGTERM) };
    }

    /// SIGTERM, wait up to the grace time, then SIGKILL; reaps the child.
    pub fn stop(&mut self) {
        self.terminate();
        let deadline = Instant::now() + self.grace;
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Raises the soft RLIMIT_NOFILE to the hard one, for us and what we start: a daemon of a
/// thousand Consul clusters holds a blocking query (a socket) per cluster, and each agent the
/// other ends. Returns the soft limit now in force.
pub fn raise_nofile() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is valid for writes.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut lim) } != 0 {
        return 0;
    }
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: `lim` is a valid rlimit not above the hard limit.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const lim) };
    lim.rlim_cur
}
