//! The kernel's passive health signal, fed to outlier detection: sockops counts, per backend,
//! connects that failed and connections that were reset; this task turns the growth of those
//! counters into `PassiveSignal::ConnectFailure` for every cluster that has the backend.
//!
//! The kernel reports failures only, so "consecutive" failures are failures not interrupted by
//! an ejection or a successful active check (a known gap: successful connects are not counted).

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    sync::Arc,
    time::Duration,
};

use proxy_core::{health::PassiveSignal, upstream::Upstream};
use tracing::debug;

use crate::daemon::SharedDataplane;

/// How often the counters are read.
pub const PERIOD: Duration = Duration::from_millis(250);
/// At most this many failures are reported per backend and period (a burst beyond it ejects the
/// host just the same).
const MAX_SIGNALS: u64 = 16;

fn read(dp: &SharedDataplane) -> Option<HashMap<SocketAddr, u64>> {
    let guard = dp.lock().unwrap_or_else(|e| e.into_inner());
    let reports = guard.as_ref()?.passive_counters().ok()?;
    Some(reports.into_iter().map(|r| (r.backend, r.connect_failures + r.resets)).collect())
}

/// Runs until the data path is shut down. Counts present at start (a previous run's, adopted
/// with the pins) are the baseline, not new failures.
pub async fn run(dp: SharedDataplane, upstreams: BTreeMap<String, Arc<Upstream>>) {
    let Some(mut last) = read(&dp) else { return };
    let mut ticker = tokio::time::interval(PERIOD);
    loop {
        ticker.tick().await;
        let Some(now) = read(&dp) else { return };
        for (backend, total) in &now {
            let new = total.saturating_sub(last.get(backend).copied().unwrap_or(0));
            if new == 0 {
                continue;
            }
            for upstream in upstreams.values() {
                if !upstream.host_statuses().iter().any(|s| s.host.addr == *backend) {
                    continue;
                }
                debug!(%backend, cluster = upstream.name(), failures = new, "passive failures");
                for _ in 0..new.min(MAX_SIGNALS) {
                    let _ = upstream.passive().try_send(PassiveSignal::ConnectFailure(*backend));
                }
            }
        }
        last = now;
    }
}
