//! An agent's recovery, shared by every watch on it. Each watch (a cluster's service, a kind of
//! config entry) backs off on its own after a failure, up to `retry_backoff.max_interval`
//! (30 s by default). When the agent itself was away (restarted, or its servers lost their
//! leader), every watch on it failed and drew its own delay; without a shared signal, some
//! services would stay stale for up to the cap after the agent is back. So the first watch on
//! an agent that succeeds after failing tells the others, and each one still waiting retries
//! after a fresh delay below `base_interval`: the node is current about a second after its
//! agent is, and the retries are spread over that second rather than sent at once.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError, Weak},
    time::Duration,
};

use tokio::sync::watch;

/// How many times the agent came back (a success after a failure on some watch).
pub(crate) type AgentSignal = Arc<watch::Sender<u64>>;

/// The signal of the agent at `address` (`host:port`, as dialled), shared by every watch this
/// process runs on it; dropped with the last of them.
pub(crate) fn agent(address: &str) -> AgentSignal {
    static AGENTS: Mutex<Option<HashMap<String, Weak<watch::Sender<u64>>>>> = Mutex::new(None);
    let mut agents = AGENTS.lock().unwrap_or_else(PoisonError::into_inner);
    let agents = agents.get_or_insert_with(HashMap::new);
    agents.retain(|_, signal| signal.strong_count() > 0);
    if let Some(signal) = agents.get(address).and_then(Weak::upgrade) {
        return signal;
    }
    let signal = Arc::new(watch::channel(0).0);
    agents.insert(address.to_owned(), Arc::downgrade(&signal));
    signal
}

/// A signal of its own, shared with nobody (an agent only one watch uses).
pub(crate) fn alone() -> AgentSignal {
    Arc::new(watch::channel(0).0)
}

/// One watch's side of its agent's signal.
pub(crate) struct Recovery {
    agent: AgentSignal,
    seen: watch::Receiver<u64>,
    failing: bool,
}

impl Recovery {
    pub(crate) fn new(agent: AgentSignal) -> Self {
        let seen = agent.subscribe();
        Self {
            agent,
            seen,
            failing: false,
        }
    }

    /// A query is about to be sent: what the agent did before it does not wake the watch.
    pub(crate) fn query_started(&mut self) {
        self.seen.borrow_and_update();
    }

    /// The query succeeded: if the watch was failing, the agent is back; the others are told.
    pub(crate) fn succeeded(&mut self) {
        if std::mem::replace(&mut self.failing, false) {
            self.agent.send_modify(|back| *back = back.wrapping_add(1));
            self.seen.borrow_and_update();
        }
    }

    /// The query failed: waits `delay`, or, if another watch on the agent succeeds after a
    /// failure meanwhile, a fresh delay below `base` from then (never longer than what was
    /// left). Whether it was woken early.
    pub(crate) async fn wait(
        &mut self,
        delay: Duration,
        base: Duration,
        rng: &mut fastrand::Rng,
    ) -> bool {
        self.failing = true;
        let until = tokio::time::Instant::now() + delay;
        tokio::select! {
            () = tokio::time::sleep_until(until) => false,
            changed = self.seen.changed() => {
                if changed.is_err() {
                    // Unreachable while this watch holds the sender; sleep out the delay.
                    tokio::time::sleep_until(until).await;
                    return false;
                }
                let spread = Duration::from_millis(rng.u64(0..millis(base).max(1)));
                let woken = tokio::time::Instant::now() + spread;
                tokio::time::sleep_until(woken.min(until)).await;
                true
            }
        }
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watches_on_one_address_share_a_signal_and_other_addresses_do_not() {
        let a = agent("127.0.0.1:18500");
        let b = agent("127.0.0.1:18500");
        let c = agent("127.0.0.2:18500");
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &c));
        drop((a, b));
        let again = agent("127.0.0.1:18500");
        assert_eq!(
            Arc::strong_count(&again),
            1,
            "the old signal went with its watches"
        );
    }

    /// A watch waiting out a long backoff is woken when another on its agent recovers, and
    /// retries within `base`; one whose agent nobody recovers waits the whole delay.
    #[tokio::test(start_paused = true)]
    async fn a_recovery_cuts_the_others_waits_to_below_base() {
        let signal = alone();
        let (mut waiting, mut recovering) = (Recovery::new(signal.clone()), Recovery::new(signal));
        let base = Duration::from_secs(1);
        let mut rng = fastrand::Rng::with_seed(7);
        let start = tokio::time::Instant::now();
        let wait = tokio::spawn(async move {
            waiting.query_started();
            let woken = waiting.wait(Duration::from_secs(25), base, &mut rng).await;
            (woken, start.elapsed())
        });
        recovering.query_started();
        // The recovering watch failed too, then succeeds 5 s in.
        recovering.failing = true;
        tokio::time::sleep(Duration::from_secs(5)).await;
        recovering.succeeded();
        let (woken, after) = wait.await.unwrap();
        assert!(woken);
        assert!(
            after >= Duration::from_secs(5) && after < Duration::from_secs(6),
            "{after:?}"
        );

        let mut lone = Recovery::new(alone());
        let mut rng = fastrand::Rng::with_seed(7);
        let start = tokio::time::Instant::now();
        assert!(!lone.wait(Duration::from_secs(25), base, &mut rng).await);
        assert_eq!(start.elapsed(), Duration::from_secs(25));
    }

    /// Only a success after a failure is a recovery: watches that never failed say nothing,
    /// and a recovery before a watch's query started does not wake it.
    #[tokio::test(start_paused = true)]
    async fn only_a_success_after_a_failure_wakes_and_only_later_ones() {
        let signal = alone();
        let mut healthy = Recovery::new(signal.clone());
        healthy.succeeded();
        assert_eq!(*signal.borrow(), 0, "no failure, no recovery");
        let mut early = Recovery::new(signal.clone());
        early.failing = true;
        early.succeeded();
        assert_eq!(*signal.borrow(), 1);
        let mut late = Recovery::new(signal);
        late.query_started();
        let mut rng = fastrand::Rng::with_seed(1);
        let start = tokio::time::Instant::now();
        let woken = late
            .wait(Duration::from_secs(3), Duration::from_secs(1), &mut rng)
            .await;
        assert!(!woken, "the earlier recovery does not wake it");
        assert_eq!(start.elapsed(), Duration::from_secs(3));
    }
}
