//! The kernel's passive health signal, fed to outlier detection: sockops counts, per backend,
//! connects that failed and connections that were reset (`abi::maps::PASSIVE`, cumulative), and
//! keeps the backend's current run of failures since its last established connect
//! (`abi::maps::PASSIVE_RUN`).
//! This task turns each period's change into `PassiveSignal`s for every cluster that has the
//! backend: failures as `ConnectFailure`; a run that ended (a connect got established) as a
//! `ConnectSuccess` followed by the failures of the new run, so "consecutive" means what it
//! means in Envoy, at the resolution of one period.

use std::{collections::HashMap, net::SocketAddr, time::Duration};

use proxy_core::health::PassiveSignal;
use tokio::sync::watch;
use tracing::debug;

use crate::daemon::state::{Live, SharedDataplane};

/// How often the counters are read.
pub const PERIOD: Duration = Duration::from_millis(250);
/// At most this many failures are reported per backend and period (a burst beyond it ejects the
/// host just the same).
const MAX_SIGNALS: u64 = 16;

/// One backend's counters at one reading.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Reading {
    /// Failures ever (connect failures and resets).
    total: u64,
    /// Failures since the last established connect.
    run: u64,
}

fn read(dp: &SharedDataplane) -> Option<HashMap<SocketAddr, Reading>> {
    let guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let reports = guard.as_ref()?.passive_counters().ok()?;
    Some(
        reports
            .into_iter()
            .map(|r| {
                (
                    r.backend,
                    Reading {
                        total: r.connect_failures + r.resets,
                        run: r.run,
                    },
                )
            })
            .collect(),
    )
}

/// The signals one period's change of `backend`'s counters stands for, in order.
fn signals(backend: SocketAddr, last: Reading, now: Reading) -> Vec<PassiveSignal> {
    let new = now.total.saturating_sub(last.total);
    // Without a success the run grew by exactly the new failures; if it is shorter, a connect
    // got established in between and the run restarted (it holds the failures since then).
    let restarted = now.run < last.run + new;
    let failures = if restarted { now.run } else { new };
    let mut out = Vec::new();
    if restarted {
        out.push(PassiveSignal::ConnectSuccess(backend));
    }
    out.extend((0..failures.min(MAX_SIGNALS)).map(|_| PassiveSignal::ConnectFailure(backend)));
    out
}

/// Runs until the data path is shut down. Counts present at start (a previous run's, adopted
/// with the pins) are the baseline, not new failures.
/// The clusters are read from `live` at each tick, so a reload's clusters get their signals.
pub async fn run(dp: SharedDataplane, live: watch::Receiver<Live>) {
    let Some(mut last) = read(&dp) else { return };
    let mut ticker = tokio::time::interval(PERIOD);
    loop {
        ticker.tick().await;
        let Some(now) = read(&dp) else { return };
        // Taken once per tick, and only when a backend has signals (failures are rare).
        let mut upstreams = None;
        for (backend, reading) in &now {
            let before = last.get(backend).copied().unwrap_or_default();
            if *reading == before {
                continue;
            }
            let signals = signals(*backend, before, *reading);
            if signals.is_empty() {
                continue;
            }
            let upstreams = upstreams.get_or_insert_with(|| live.borrow().upstreams.clone());
            for upstream in upstreams.values() {
                if !upstream
                    .host_statuses()
                    .iter()
                    .any(|s| s.host.addr == *backend)
                {
                    continue;
                }
                debug!(%backend, cluster = upstream.name(), ?signals, "passive signals");
                for signal in &signals {
                    let _ = upstream.passive().try_send(*signal);
                }
            }
        }
        last = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(s: &[PassiveSignal]) -> String {
        s.iter()
            .map(|s| match s {
                PassiveSignal::ConnectSuccess(_) => 'S',
                PassiveSignal::ConnectFailure(_) => 'F',
                PassiveSignal::Traffic => 'T',
                PassiveSignal::Response(..) => 'R',
            })
            .collect()
    }

    fn r(total: u64, run: u64) -> Reading {
        Reading { total, run }
    }

    fn signals(last: Reading, now: Reading) -> Vec<PassiveSignal> {
        super::signals(SocketAddr::from(([127, 0, 0, 1], 80)), last, now)
    }

    #[test]
    fn failures_without_a_success_extend_the_run() {
        assert_eq!(kinds(&signals(r(0, 0), r(3, 3))), "FFF");
        assert_eq!(kinds(&signals(r(3, 3), r(5, 5))), "FF");
        assert_eq!(kinds(&signals(r(5, 5), r(5, 5))), "");
    }

    #[test]
    fn an_established_connect_restarts_the_run() {
        // Two failures, then a success, then one failure, all within one period.
        assert_eq!(kinds(&signals(r(3, 3), r(6, 1))), "SF");
        // A success alone.
        assert_eq!(kinds(&signals(r(3, 3), r(3, 0))), "S");
        // Failures before the success only: the run is empty again.
        assert_eq!(kinds(&signals(r(0, 0), r(4, 0))), "S");
    }

    #[test]
    fn bursts_are_capped() {
        assert_eq!(signals(r(0, 0), r(100, 100)).len() as u64, MAX_SIGNALS);
        assert_eq!(signals(r(0, 5), r(100, 50)).len() as u64, 1 + MAX_SIGNALS);
    }
}
