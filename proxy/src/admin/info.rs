//! `/server_info`: what the daemon is, how it was started, and the state it is in (Envoy's
//! `ServerInfo`, with the fields that mean something here).

use std::{path::PathBuf, sync::atomic::Ordering, time::SystemTime};

use serde::Serialize;

use super::State;
use crate::logging::LogControl;

/// What the daemon was started with: `/server_info` shows it, `/logging` changes the filter.
#[derive(Clone)]
pub struct Launch {
    /// The `--config` file (`None`: the embedded default).
    pub config_path: Option<PathBuf>,
    /// The log filter at start (`--log`, or RUST_LOG).
    pub log_level: String,
    /// The runtime's worker threads (`--concurrency`, or the CPUs).
    pub concurrency: usize,
    /// When the daemon started.
    pub started: SystemTime,
    /// The global log filter, when this process installed one.
    pub logging: Option<LogControl>,
    /// `--takeover`: take over from the running daemon of the instance (`daemon::takeover`).
    pub takeover: bool,
    /// `--user` and `--no-seccomp`, which a reload applies over the file again.
    pub run_flags: crate::RunFlags,
    /// The service manager's notification socket (sd_notify), connected at the start.
    pub notifier: std::sync::Arc<crate::notify::Notifier>,
}

impl Default for Launch {
    fn default() -> Self {
        Self {
            config_path: None,
            log_level: String::new(),
            concurrency: 0,
            started: SystemTime::now(),
            logging: None,
            takeover: false,
            run_flags: crate::RunFlags::default(),
            notifier: std::sync::Arc::default(),
        }
    }
}

/// Envoy's `ServerInfo` JSON, the fields that apply.
#[derive(Serialize)]
pub(super) struct ServerInfo {
    version: String,
    state: &'static str,
    uptime_current_epoch: String,
    uptime_all_epochs: String,
    command_line_options: CommandLineOptions,
}

/// Envoy's `CommandLineOptions`, those this daemon has.
#[derive(Serialize)]
struct CommandLineOptions {
    /// Empty for the embedded default, as Envoy leaves an unset path empty.
    config_path: String,
    log_level: String,
    concurrency: usize,
}

pub(super) fn server_info(state: &State) -> ServerInfo {
    let launch = &state.launch;
    // Whole seconds, as Envoy fills the protobuf Duration; no hot restart, so both epochs are
    // this process's.
    let uptime = SystemTime::now()
        .duration_since(launch.started)
        .unwrap_or_default()
        .as_secs();
    ServerInfo {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        state: server_state(state),
        uptime_current_epoch: format!("{uptime}s"),
        uptime_all_epochs: format!("{uptime}s"),
        command_line_options: CommandLineOptions {
            config_path: launch
                .config_path
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            log_level: launch.log_level.clone(),
            concurrency: launch.concurrency,
        },
    }
}

/// Envoy's server states: INITIALIZING until every service is published (the admin interface
/// starts after the data path is attached, so PRE_INITIALIZING is never seen), LIVE, DRAINING
/// after `/healthcheck/fail` and after a part of the daemon failed (it is on its way out).
fn server_state(state: &State) -> &'static str {
    if state.failed() {
        "DRAINING"
    } else if !state.ready() {
        "INITIALIZING"
    } else if state.health_failed.load(Ordering::Relaxed) {
        "DRAINING"
    } else {
        "LIVE"
    }
}
