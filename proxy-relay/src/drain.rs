//! Two-phase graceful shutdown: first *drain* (stop accepting, let open connections finish,
//! ask HTTP connections to close after their current request), then, at the deadline, *close*
//! (every connection still open is reset). The trigger learns that the last connection is gone
//! when the last watcher is dropped.

use std::time::Duration;

use tokio::sync::{mpsc, watch};

/// Where a shutdown is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Running,
    Draining,
    Closing,
}

/// Creates a trigger and the first watcher; clone the watcher into every listener and
/// connection task.
pub fn channel() -> (DrainTrigger, DrainWatcher) {
    let (phase_tx, phase_rx) = watch::channel(Phase::Running);
    let (alive_tx, alive_rx) = mpsc::channel(1);
    (
        DrainTrigger {
            phase: phase_tx,
            alive: alive_rx,
        },
        DrainWatcher {
            phase: phase_rx,
            _alive: alive_tx,
        },
    )
}

/// Starts and finishes a shutdown.
pub struct DrainTrigger {
    phase: watch::Sender<Phase>,
    alive: mpsc::Receiver<()>,
}

/// How a shutdown went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainOutcome {
    /// Every watcher was gone before the deadline.
    Graceful,
    /// The deadline passed; the remaining connections were told to close and were gone within
    /// the grace period.
    Forced,
    /// Some were still there after the grace period too (they are abandoned).
    Abandoned,
}

/// After the deadline, how long closing connections get to notice and go.
pub const CLOSE_GRACE: Duration = Duration::from_secs(1);

impl DrainTrigger {
    /// Phase one now, without waiting: stop accepting (and ask HTTP connections to close after
    /// their current request). [`DrainTrigger::drain`] continues from there.
    pub fn begin(&self) {
        self.phase.send_if_modified(|phase| {
            let running = *phase == Phase::Running;
            if running {
                *phase = Phase::Draining;
            }
            running
        });
    }

    /// Phase one, then phase two at `deadline`. The caller must have dropped its own watchers.
    pub async fn drain(mut self, deadline: Duration) -> DrainOutcome {
        self.phase.send_replace(Phase::Draining);
        if tokio::time::timeout(deadline, self.alive.recv())
            .await
            .is_ok()
        {
            return DrainOutcome::Graceful;
        }
        self.phase.send_replace(Phase::Closing);
        match tokio::time::timeout(CLOSE_GRACE, self.alive.recv()).await {
            Ok(_) => DrainOutcome::Forced,
            Err(_) => DrainOutcome::Abandoned,
        }
    }
}

/// Held by everything that must finish before the shutdown is complete.
#[derive(Clone, Debug)]
pub struct DrainWatcher {
    phase: watch::Receiver<Phase>,
    _alive: mpsc::Sender<()>,
}

impl DrainWatcher {
    /// Resolves once draining has started: stop accepting, stop reusing connections.
    pub async fn draining(&self) {
        self.reached(Phase::Draining).await;
    }

    /// Resolves once the deadline has passed: close now.
    pub async fn closing(&self) {
        self.reached(Phase::Closing).await;
    }

    /// Whether draining has started.
    pub fn is_draining(&self) -> bool {
        *self.phase.borrow() >= Phase::Draining
    }

    async fn reached(&self, phase: Phase) {
        reached(&self.phase, phase).await;
    }

    /// The phases alone, for a task that passes them on and must not hold the shutdown up.
    pub fn phases(&self) -> PhaseWatcher {
        PhaseWatcher(self.phase.clone())
    }
}

/// Sees the shutdown's phases like a [`DrainWatcher`], without being waited for.
pub struct PhaseWatcher(watch::Receiver<Phase>);

impl PhaseWatcher {
    /// Resolves once draining has started.
    pub async fn draining(&self) {
        reached(&self.0, Phase::Draining).await;
    }

    /// Resolves once the deadline has passed (or the trigger is gone).
    pub async fn closing(&self) {
        reached(&self.0, Phase::Closing).await;
    }
}

async fn reached(phase_rx: &watch::Receiver<Phase>, phase: Phase) {
    let mut rx = phase_rx.clone();
    // A dropped trigger (the proxy is gone without a shutdown) counts as closing: an error
    // here resolves just like reaching the phase.
    let _ = rx.wait_for(|p| *p >= phase).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn graceful_when_watchers_finish_in_time() {
        let (trigger, watcher) = channel();
        let conn = watcher.clone();
        drop(watcher);
        let task = tokio::spawn(async move {
            conn.draining().await;
            tokio::time::sleep(Duration::from_secs(2)).await;
            drop(conn);
        });
        assert_eq!(
            trigger.drain(Duration::from_secs(10)).await,
            DrainOutcome::Graceful
        );
        task.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn forced_at_the_deadline() {
        let (trigger, watcher) = channel();
        let task = tokio::spawn(async move {
            watcher.draining().await;
            assert!(watcher.is_draining());
            let start = tokio::time::Instant::now();
            watcher.closing().await;
            start.elapsed()
        });
        assert_eq!(
            trigger.drain(Duration::from_secs(5)).await,
            DrainOutcome::Forced
        );
        assert_eq!(task.await.unwrap(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn abandoned_when_a_watcher_ignores_closing() {
        let (trigger, watcher) = channel();
        let stuck = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(60)).await;
            drop(watcher);
        });
        assert_eq!(
            trigger.drain(Duration::from_secs(1)).await,
            DrainOutcome::Abandoned
        );
        stuck.abort();
    }
}
