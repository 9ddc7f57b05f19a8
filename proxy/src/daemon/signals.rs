//! The signals the daemon handles: held from the first step of `proxy run`, taken by tokio
//! once the daemon runs (SIGINT and SIGTERM stop it, SIGHUP reloads, the rest are logged).

use anyhow::Context as _;
use tokio::signal::unix::{SignalKind, signal};
use tracing::{info, warn};

/// The signals the daemon handles ([`Signals`]): every one whose default action would kill it
/// with its pins half-written.
const HANDLED_SIGNALS: [libc::c_int; 6] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGALRM,
];

/// Holds every signal the daemon handles pending, from the first thing `proxy run` does until
/// [`Signals::install`] takes them: a SIGTERM or a SIGHUP in the first second of a start (a
/// `systemctl reload` right after `start`) then stops or reloads the daemon once it is up,
/// instead of killing it in the middle of its attach by the default action. Call it on the main
/// thread before any other thread exists (threads inherit the mask).
pub fn hold_signals() -> std::io::Result<()> {
    crate::sys::block_signals(&HANDLED_SIGNALS)
}

/// Takes the signals [`hold_signals`] kept pending (call it on the thread that installed
/// [`Signals`]).
pub(super) fn release_held() -> anyhow::Result<()> {
    crate::sys::unblock_signals(&HANDLED_SIGNALS).context("taking the held signals")
}

/// What a caught signal asks for.
pub(super) enum Signal {
    Stop,
    Reload,
}

/// SIGINT and SIGTERM, held from the first thing `proxy run` does ([`hold_signals`]): a signal
/// that arrives while the daemon is still starting is kept and makes it stop cleanly (drain the
/// proxy path, leave the data path serving) once it runs, instead of dying on the default
/// action in the middle of an attach, a publish or a drain. SIGHUP reloads the configuration
/// file (one that came during the start reloads once it runs).
/// SIGUSR1, SIGUSR2 and SIGALRM, whose default action would also kill it that way, are caught
/// and logged.
pub(super) struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
    usr2: tokio::signal::unix::Signal,
    alrm: tokio::signal::unix::Signal,
}

impl Signals {
    pub(super) fn install() -> anyhow::Result<Self> {
        Ok(Self {
            int: signal(SignalKind::interrupt()).context("catching SIGINT")?,
            term: signal(SignalKind::terminate()).context("catching SIGTERM")?,
            hup: signal(SignalKind::hangup()).context("catching SIGHUP")?,
            usr1: signal(SignalKind::user_defined1()).context("catching SIGUSR1")?,
            usr2: signal(SignalKind::user_defined2()).context("catching SIGUSR2")?,
            alrm: signal(SignalKind::alarm()).context("catching SIGALRM")?,
        })
    }

    /// Waits for SIGINT or SIGTERM (stop) or SIGHUP (reload); the others are logged on the way.
    pub(super) async fn wait(&mut self) -> Signal {
        loop {
            tokio::select! {
                _ = self.int.recv() => {
                    info!("SIGINT: shutting down");
                    return Signal::Stop;
                }
                _ = self.term.recv() => {
                    info!("SIGTERM: shutting down");
                    return Signal::Stop;
                }
                _ = self.hup.recv() => {
                    info!("SIGHUP: reloading the configuration");
                    return Signal::Reload;
                }
                _ = self.usr1.recv() => warn!("SIGUSR1: ignored (it has no meaning here)"),
                _ = self.usr2.recv() => warn!("SIGUSR2: ignored (it has no meaning here)"),
                _ = self.alrm.recv() => warn!("SIGALRM: ignored (it has no meaning here)"),
            }
        }
    }
}
