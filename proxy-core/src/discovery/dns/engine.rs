//! The refresh loop shared by all DNS cluster kinds: one tokio task per target, results applied
//! to one cluster state under a lock, host-set changes published as [`SourceUpdate`]s on the watch
//! channel the cluster's event loop reads.
//!
//! This is Envoy's `ResolveTarget::startResolve` callback, step for step: count the attempt,
//! resolve, on success diff this target's hosts and reset the (cluster-wide) failure backoff and
//! pick the refresh from the TTL or `dns_refresh_rate` plus jitter, on failure keep the hosts and
//! take the next backoff delay; then mark the cluster initialized and sleep.
//!
//! One addition, `dns_stale_bound`: a target whose lookups keep failing serves its last hosts for
//! at most that long after its first failure, then its hosts are dropped and published as an
//! empty answer's would be. The deadline is watched during the lookup and the sleep alike, so it
//! holds whatever the refresh rate, the backoff or the query timeouts.

use std::{
    future::Future,
    net::SocketAddr,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use tokio::{sync::watch, time::Instant};
use tracing::{debug, warn};

use super::{
    backoff::FailureBackoff,
    resolver::{DnsResolve, ResolveError},
    stats::DnsClusterStats,
    target::{Answer, Target},
};
use crate::{
    config::sources::dns::DnsSettings,
    discovery::{SourceStats, SourceUpdate},
    host::{Host, HostSet},
};

/// How answers become hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Every address is a host; empty answers mean no hosts; removed hosts are drained.
    Strict,
    /// The first address is the host; empty answers are failures; nothing is drained.
    Logical,
}

struct State {
    per_target: Vec<TargetState>,
    backoff: FailureBackoff,
    rng: fastrand::Rng,
    initialized: bool,
}

#[derive(Default)]
struct TargetState {
    hosts: Vec<Host>,
    /// LOGICAL_DNS: every address of the last accepted answer (a change rebuilds, like Envoy).
    addresses: Vec<SocketAddr>,
    /// When the first failed lookup since the last success came back; `None` after a success.
    failing_since: Option<Instant>,
}

/// The shared state of one cluster.
pub(crate) struct Engine {
    pub cluster: String,
    pub settings: DnsSettings,
    pub mode: Mode,
    pub stats: Arc<DnsClusterStats>,
    state: Mutex<State>,
    tx: watch::Sender<SourceUpdate>,
}

impl Engine {
    pub fn new(cluster: String, settings: DnsSettings, mode: Mode, targets: usize) -> Self {
        let state = State {
            per_target: (0..targets).map(|_| TargetState::default()).collect(),
            backoff: FailureBackoff::from_settings(&settings),
            rng: fastrand::Rng::new(),
            initialized: false,
        };
        Self {
            cluster,
            settings,
            mode,
            stats: Arc::default(),
            state: Mutex::new(state),
            tx: watch::Sender::new(SourceUpdate::default()),
        }
    }

    pub fn subscribe(&self) -> watch::Receiver<SourceUpdate> {
        self.tx.subscribe()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A cluster with no targets is initialized at once, with no hosts.
    pub fn initialize_empty(&self) {
        let mut state = self.lock();
        state.initialized = true;
        self.publish(&state, false);
    }

    /// Applies one resolution of target `index`; returns the delay before its next one.
    pub fn apply(
        &self,
        index: usize,
        target: &str,
        result: Result<Answer, ResolveError>,
    ) -> Duration {
        let mut state = self.lock();
        let first_resolution = !state.initialized;
        state.initialized = true;
        let (delay, published) = match result {
            Ok(answer) if self.mode == Mode::Strict || !answer.hosts.is_empty() => {
                SourceStats::inc(&self.stats.source.update_success);
                self.recovered(&mut state, index);
                let published = self.accept(&mut state, index, target, &answer);
                state.backoff.reset();
                (self.success_refresh(&mut state, &answer), published)
            }
            Ok(_) => {
                SourceStats::inc(&self.stats.source.update_failure);
                debug!(cluster = %self.cluster, target, "empty answer, keeping the logical host");
                let dropped = self.failed(&mut state, index, target);
                (Self::failure_refresh(&mut state), dropped)
            }
            Err(err) => {
                SourceStats::inc(&self.stats.source.update_failure);
                let had_hosts = !state.per_target[index].hosts.is_empty();
                let dropped = self.failed(&mut state, index, target);
                // A drop at the bound logs its own line; otherwise say what the name still has.
                if !dropped {
                    let hosts = if had_hosts { "last hosts kept" } else { "none" };
                    warn!(cluster = %self.cluster, target, %err, hosts, "dns resolution failed");
                }
                (Self::failure_refresh(&mut state), dropped)
            }
        };
        if first_resolution && !published {
            self.publish(&state, false);
        }
        debug!(cluster = %self.cluster, target, ?delay, "next dns refresh");
        delay
    }

    /// A success of target `index`: it is no longer failing, its hosts no longer stale.
    fn recovered(&self, state: &mut State, index: usize) {
        if state.per_target[index].failing_since.take().is_some() {
            self.stats.stale_end(index, Instant::now());
        }
    }

    /// A failure of target `index`: from the first one on, its hosts (if any) are stale; once
    /// stale for `dns_stale_bound` they are dropped. Returns true if that published.
    fn failed(&self, state: &mut State, index: usize, target: &str) -> bool {
        let now = Instant::now();
        let slot = &mut state.per_target[index];
        let since = *slot.failing_since.get_or_insert(now);
        if slot.hosts.is_empty() {
            return false;
        }
        self.stats.stale_begin(index, since);
        if self.deadline(slot).is_some_and(|deadline| deadline <= now) {
            self.drop_stale(state, index, target);
            return true;
        }
        false
    }

    /// When `slot`'s stale hosts are to be dropped: never without a bound, without hosts, while
    /// its lookups succeed, or past the clock's range.
    fn deadline(&self, slot: &TargetState) -> Option<Instant> {
        let bound = self.settings.dns_stale_bound?;
        let since = slot.failing_since.filter(|_| !slot.hosts.is_empty())?;
        since.checked_add(bound)
    }

    /// Drops target `index`'s hosts as an empty answer would: they were stale for the bound.
    fn drop_stale(&self, state: &mut State, index: usize, target: &str) {
        let slot = &mut state.per_target[index];
        slot.hosts.clear();
        slot.addresses.clear();
        self.stats.stale_end(index, Instant::now());
        SourceStats::inc(&self.stats.stale_expired);
        warn!(
            cluster = %self.cluster,
            target,
            bound = ?self.settings.dns_stale_bound,
            "dns lookups have failed for dns_stale_bound, the name's stale hosts are dropped"
        );
        self.publish(state, true);
    }

    /// Runs `work` (target `index`'s lookup, or its sleep after one); if the target's stale
    /// hosts come due meanwhile, they are dropped then, not when `work` ends.
    async fn bounded<F: Future>(&self, index: usize, target: &str, work: F) -> F::Output {
        let deadline = self.deadline(&self.lock().per_target[index]);
        let Some(deadline) = deadline else {
            return work.await;
        };
        tokio::pin!(work);
        tokio::select! {
            output = &mut work => output,
            () = tokio::time::sleep_until(deadline) => {
                self.expire(index, target);
                work.await
            }
        }
    }

    /// The deadline of target `index` has come: drops its hosts if they are still stale.
    fn expire(&self, index: usize, target: &str) {
        let mut state = self.lock();
        if self.deadline(&state.per_target[index]).is_some() {
            self.drop_stale(&mut state, index, target);
        }
    }

    /// Stores a successful answer; publishes and returns true if the hosts changed.
    fn accept(&self, state: &mut State, index: usize, target: &str, answer: &Answer) -> bool {
        let slot = &mut state.per_target[index];
        let changed = match self.mode {
            Mode::Strict => {
                let changed = !same_hosts(&slot.hosts, &answer.hosts);
                slot.hosts.clone_from(&answer.hosts);
                changed
            }
            Mode::Logical => {
                let addresses: Vec<SocketAddr> = answer.hosts.iter().map(|h| h.addr).collect();
                let changed = slot.addresses != addresses;
                slot.addresses = addresses;
                slot.hosts = answer.hosts.iter().take(1).cloned().collect();
                changed
            }
        };
        if !changed {
            SourceStats::inc(&self.stats.source.update_no_rebuild);
            return false;
        }
        debug!(cluster = %self.cluster, target, hosts = answer.hosts.len(), "dns hosts changed");
        self.publish(state, true);
        true
    }

    fn success_refresh(&self, state: &mut State, answer: &Answer) -> Duration {
        let ttl = match self.mode {
            Mode::Strict => answer.min_ttl,
            Mode::Logical => answer.first_ttl,
        };
        let mut delay = self.settings.dns_refresh_rate;
        let ttl = ttl.filter(|ttl| !ttl.is_zero());
        if let Some(ttl) = ttl.filter(|_| self.settings.respect_dns_ttl && !answer.hosts.is_empty())
        {
            delay = ttl;
        }
        let jitter_ms = self.settings.dns_jitter.map_or(0, |j| j.as_millis() as u64);
        if jitter_ms > 0 {
            delay += Duration::from_millis(state.rng.u64(0..jitter_ms));
        }
        delay
    }

    fn failure_refresh(state: &mut State) -> Duration {
        let State { backoff, rng, .. } = state;
        backoff.next_delay(rng)
    }

    fn publish(&self, state: &State, membership_changed: bool) {
        let hosts: HostSet = state
            .per_target
            .iter()
            .flat_map(|t| t.hosts.iter().cloned())
            .collect();
        SourceStats::set(&self.stats.source.membership_total, hosts.len() as u64);
        if membership_changed {
            SourceStats::inc(&self.stats.source.membership_change);
        }
        // Only called once the cluster is initialized (a first resolution, or no targets).
        debug_assert!(state.initialized);
        self.tx.send_modify(|update| update.advance(hosts));
    }
}

/// Same hosts regardless of order (hosts of one target have distinct addresses).
fn same_hosts(old: &[Host], new: &[Host]) -> bool {
    old.len() == new.len() && new.iter().all(|host| old.contains(host))
}

/// The task of one target: resolve, apply, sleep, forever (until aborted).
pub(crate) async fn run_target(
    engine: Arc<Engine>,
    index: usize,
    target: Target,
    resolver: Arc<dyn DnsResolve>,
) {
    let family = engine.settings.dns_lookup_family;
    loop {
        SourceStats::inc(&engine.stats.source.update_attempt);
        let lookup = target.resolve(resolver.as_ref(), family);
        let result = engine.bounded(index, target.name(), lookup).await;
        let delay = engine.apply(index, target.name(), result);
        let sleep = tokio::time::sleep(delay);
        engine.bounded(index, target.name(), sleep).await;
    }
}
