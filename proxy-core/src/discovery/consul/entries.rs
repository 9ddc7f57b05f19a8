//! Consul's config entries, watched live: one blocking-query loop per kind on
//! `/v1/config/<kind>` (service-router, service-splitter, service-resolver, service-defaults,
//! proxy-defaults), their union published as the `config_entries` of an
//! [`Overlay`](crate::desired::Overlay) on a [`Feed`].
//!
//! Each loop follows the catalog watch's rules and shares its helpers: the index rules of
//! [`next_index`](super::next_index), at least [`MIN_QUERY_INTERVAL`] between two queries, the
//! `retry_backoff` after a failure, and the ACL check of an empty answer
//! ([`acl`](super::acl)), extended to every answer that drops a held entry: a token Consul
//! refuses, or one that may not read the service of an entry the answer leaves out (Consul
//! hides such entries, even from a non-empty answer), keeps the last entries and is logged
//! once.
//!
//! Publishing:
//! * nothing is published until every kind has been answered once (or failed once), so a
//!   chain is never compiled from a half-read set at start; that first union is sent even when
//!   it is empty (the daemon's start waits for it, see [`Feed`]);
//! * then the union (sorted by kind and name) is published whenever it changes; an answer that
//!   changes nothing counts `update_no_rebuild`;
//! * an element that is not an entry this daemon can decode (not an object, another kind, no
//!   name, a field it does not know or a value it cannot read) is skipped and logged, counted
//!   in `entries_skipped`; the last decoded version of the same entry, if there was one, stays;
//! * an entry that decodes but breaks a rule of this daemon's (one Consul does not apply) is
//!   published as Consul holds it: composition
//!   ([`compile_each`](crate::chain::compile_each)) leaves out only the chains that read it,
//!   each reported with the reason.
//!
//! Stats are `consul_entries.<stat>` (see [`EntriesStatValues`]).

pub mod decode;
mod stats;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use proxy_chain::{ConfigEntry, EntryKind};
use tokio::{sync::watch, task::AbortHandle, time::Instant};
use tracing::{debug, info, warn};

pub use self::{
    decode::SkippedEntry,
    stats::{EntriesStatValues, EntriesStats},
};
use super::{
    acl::{self, AclDenial},
    http,
    recovery::Recovery,
    watch::{
        CatalogFetch, HttpFetch, MIN_QUERY_INTERVAL, QueryError, RESPONSE_GRACE, go_duration,
        millis, next_index, send,
    },
};
use crate::{
    config::sources::consul::{
        ConsulConfig, ConsulConfigError,
        access::{self, TokenSource},
        entries::ConsulEntriesConfig,
    },
    desired::{Feed, Overlay},
    discovery::dns::FailureBackoff,
};

/// The kinds watched, in the order their entries are published.
pub const KINDS: [EntryKind; 5] = [
    EntryKind::ProxyDefaults,
    EntryKind::ServiceDefaults,
    EntryKind::ServiceRouter,
    EntryKind::ServiceSplitter,
    EntryKind::ServiceResolver,
];

/// The running watch. Dropping it stops its loops; the last published overlay stays on the
/// feed.
pub struct ConsulEntries {
    shared: Arc<Shared>,
    initialized: watch::Receiver<bool>,
    tasks: Vec<AbortHandle>,
}

impl ConsulEntries {
    /// Waits until every kind has been answered (or has failed) once.
    pub async fn initialized(&self) {
        let mut initialized = self.initialized.clone();
        // The sender lives in `Shared`, which this handle holds.
        let _ = initialized.wait_for(|done| *done).await;
    }

    /// The live counters and gauges, for `/stats`.
    pub fn stats_handle(&self) -> Arc<EntriesStats> {
        Arc::clone(&self.shared.stats)
    }

    /// Counters and gauges.
    pub fn stats(&self) -> EntriesStatValues {
        self.shared.stats.values()
    }

    /// `(consul_entries.<stat>, value)` pairs for `/stats`.
    pub fn named_stats(&self) -> Vec<(String, u64)> {
        self.shared.stats.named()
    }

    /// The entries of the last answers that were left out, by kind and name.
    pub fn skipped(&self) -> Vec<SkippedEntry> {
        let state = self.shared.lock();
        state.values().flat_map(|k| k.skipped.clone()).collect()
    }
}

impl Drop for ConsulEntries {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Validates `config`, resolves it against this process's `CONSUL_HTTP_*` variables, and starts
/// watching the five kinds, publishing on `feed`. Must be called within a tokio runtime.
pub fn spawn_consul_entries(
    config: &ConsulEntriesConfig,
    feed: Feed,
) -> Result<ConsulEntries, ConsulConfigError> {
    let connection = config.connection();
    connection.validate_fields()?;
    let access = access::resolve(&connection, &|name| std::env::var(name).ok())?;
    let fetch: Arc<dyn CatalogFetch> =
        Arc::new(HttpFetch::new(access.authority.clone(), access.tls.clone()));
    Ok(spawn_with(
        &connection,
        &access.token,
        &fetch,
        &mut fastrand::Rng::new(),
        feed,
    ))
}

/// [`spawn_consul_entries`] on a resolved connection and a given fetcher (scripted in tests).
pub(crate) fn spawn_with(
    connection: &ConsulConfig,
    token: &TokenSource,
    fetch: &Arc<dyn CatalogFetch>,
    rng: &mut fastrand::Rng,
    feed: Feed,
) -> ConsulEntries {
    let (initialized_tx, initialized) = watch::channel(false);
    let shared = Arc::new(Shared {
        feed,
        initialized: initialized_tx,
        state: Mutex::new(BTreeMap::new()),
        stats: Arc::default(),
    });
    let tasks = KINDS
        .iter()
        .map(|&kind| {
            let watch = KindWatch {
                kind,
                connection: connection.clone(),
                fetch: fetch.clone(),
                token: token.clone(),
                shared: shared.clone(),
                rng: rng.fork(),
                denied: None,
            };
            tokio::spawn(watch.run()).abort_handle()
        })
        .collect();
    ConsulEntries {
        shared,
        initialized,
        tasks,
    }
}

/// The request target for `kind` at `index`: `/v1/config/<kind>` with `dc` and, when `index`
/// is not 0, `index` and `wait`.
pub fn entries_target(connection: &ConsulConfig, kind: EntryKind, index: u64) -> String {
    let mut params = Vec::new();
    if let Some(dc) = &connection.datacenter {
        params.push(format!("dc={}", http::encode(dc)));
    }
    if index != 0 {
        params.push(format!("index={index}"));
        params.push(format!("wait={}", go_duration(connection.wait)));
    }
    let mut target = format!("/v1/config/{}", kind.as_str());
    if !params.is_empty() {
        target.push('?');
        target.push_str(&params.join("&"));
    }
    target
}

/// What one kind holds now.
#[derive(Default)]
struct KindState {
    /// Answered or failed at least once.
    answered: bool,
    entries: BTreeMap<String, ConfigEntry>,
    skipped: Vec<SkippedEntry>,
}

/// What the loops share.
struct Shared {
    feed: Feed,
    initialized: watch::Sender<bool>,
    state: Mutex<BTreeMap<EntryKind, KindState>>,
    stats: Arc<EntriesStats>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<EntryKind, KindState>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The entries of `kind` held now that an answer with `entries` (and `skipped`, whose last
    /// version stays) would drop.
    fn dropped(
        &self,
        kind: EntryKind,
        entries: &BTreeMap<String, ConfigEntry>,
        skipped: &[SkippedEntry],
    ) -> Vec<String> {
        let state = self.lock();
        let Some(held) = state.get(&kind) else {
            return Vec::new();
        };
        held.entries
            .keys()
            .filter(|name| {
                !entries.contains_key(*name) && !skipped.iter().any(|s| &s.name == *name)
            })
            .cloned()
            .collect()
    }

    /// Books a failed query of `kind`: its entries stay.
    fn failed(&self, kind: EntryKind) {
        let mut state = self.lock();
        state.entry(kind).or_default().answered = true;
        self.publish(&state);
    }

    /// Applies an answer of `kind`: `entries` replace the kind's, except that a skipped entry
    /// keeps its last usable version.
    fn apply(
        &self,
        kind: EntryKind,
        mut entries: BTreeMap<String, ConfigEntry>,
        skipped: Vec<SkippedEntry>,
    ) {
        let mut state = self.lock();
        let current = state.entry(kind).or_default();
        current.answered = true;
        for s in &skipped {
            if let Some(last) = current.entries.get(&s.name) {
                entries
                    .entry(s.name.clone())
                    .or_insert_with(|| last.clone());
            }
        }
        if skipped != current.skipped {
            for s in &skipped {
                warn!(kind = kind.as_str(), entry = %s.name, reason = %s.reason,
                    "consul config entry skipped; its last usable version, if any, stays");
            }
        }
        current.skipped = skipped;
        let changed = current.entries != entries;
        current.entries = entries;
        let skipped_total = state.values().map(|k| k.skipped.len() as u64).sum();
        EntriesStats::set(&self.stats.entries_skipped, skipped_total);
        if !changed {
            EntriesStats::inc(&self.stats.update_no_rebuild);
        }
        self.publish(&state);
    }

    /// Publishes the union once every kind has answered, if it differs from the feed's.
    fn publish(&self, state: &BTreeMap<EntryKind, KindState>) {
        if KINDS
            .iter()
            .any(|k| !state.get(k).is_some_and(|s| s.answered))
        {
            return;
        }
        let union: Vec<ConfigEntry> = KINDS
            .iter()
            .filter_map(|k| state.get(k))
            .flat_map(|s| s.entries.values().cloned())
            .collect();
        EntriesStats::set(&self.stats.entries_total, union.len() as u64);
        // The first union is always sent, even when empty: the daemon's start waits for it.
        let first = !*self.initialized.borrow();
        let changed = self.feed.send_if_modified(|overlay: &mut Overlay| {
            if overlay.config_entries == union && !first {
                return false;
            }
            overlay.config_entries = union;
            true
        });
        if changed {
            EntriesStats::inc(&self.stats.entries_change);
            debug!(
                entries = state.values().map(|k| k.entries.len()).sum::<usize>(),
                "consul config entries published"
            );
        }
        self.initialized
            .send_if_modified(|done| !std::mem::replace(done, true));
    }
}

/// The blocking-query loop of one kind.
struct KindWatch {
    kind: EntryKind,
    connection: ConsulConfig,
    fetch: Arc<dyn CatalogFetch>,
    token: TokenSource,
    shared: Arc<Shared>,
    rng: fastrand::Rng,
    /// The ACL denial logged last; `None` once an answer applies again.
    denied: Option<AclDenial>,
}

impl KindWatch {
    /// Runs until aborted.
    async fn run(mut self) {
        let backoff = self.connection.retry_backoff;
        let base_ms = millis(backoff.base_interval);
        let mut backoff = FailureBackoff::Jittered {
            base_ms,
            max_ms: millis(backoff.max_interval).max(base_ms),
            next_ms: base_ms,
        };
        let wait = self.connection.wait;
        let timeout = wait + wait / 16 + RESPONSE_GRACE;
        let mut index = 0;
        let mut last_start: Option<Instant> = None;
        let mut recovery = Recovery::new(self.fetch.agent());
        loop {
            if let Some(start) = last_start {
                tokio::time::sleep_until(start + MIN_QUERY_INTERVAL).await;
            }
            last_start = Some(Instant::now());
            EntriesStats::inc(&self.shared.stats.update_attempt);
            recovery.query_started();
            match self.query(index, timeout).await {
                Ok((returned, entries, skipped)) => {
                    index = self.succeeded(index, returned);
                    backoff.reset();
                    recovery.succeeded();
                    self.shared.apply(self.kind, entries, skipped);
                }
                Err(error) => {
                    let delay = backoff.next_delay(&mut self.rng);
                    self.failed(error, delay);
                    let base = self.connection.retry_backoff.base_interval;
                    recovery.wait(delay, base, &mut self.rng).await;
                }
            }
        }
    }

    /// Reads the token, sends the query for `index` and decodes the answer; an empty answer is
    /// checked against the ACLs first.
    async fn query(&self, index: u64, timeout: Duration) -> Result<Answer, QueryError> {
        let token = self.token.read()?;
        let target = entries_target(&self.connection, self.kind, index);
        let (returned, response) = send(&*self.fetch, &target, &token, timeout).await?;
        let (entries, skipped) =
            decode::decode(self.kind, &response.body).map_err(|reason| QueryError::EntryList {
                kind: self.kind.as_str(),
                reason,
            })?;
        // Consul shows a service's entries only to a token that may read the service: an
        // answer that drops a held entry is trusted only if the token may read its service
        // (proxy-defaults is readable by any token). An empty answer also checks the token.
        let dropped = match self.kind {
            EntryKind::ProxyDefaults => Vec::new(),
            kind => self.shared.dropped(kind, &entries, &skipped),
        };
        if !dropped.is_empty() || (entries.is_empty() && skipped.is_empty()) {
            let dropped: Vec<&str> = dropped.iter().map(String::as_str).collect();
            let dc = self.connection.datacenter.as_deref();
            acl::check_empty(&*self.fetch, &token, (&dropped, false), dc, timeout).await?;
        }
        Ok((returned, entries, skipped))
    }

    /// Books a successful answer; returns the next index.
    fn succeeded(&mut self, index: u64, returned: u64) -> u64 {
        let stats = &self.shared.stats;
        let (next, reset) = next_index(index, returned);
        if reset {
            EntriesStats::inc(&stats.index_reset);
            warn!(
                kind = self.kind.as_str(),
                sent = index,
                returned,
                "consul index went backwards; restarting the config entry watch from 0"
            );
        }
        if self.denied.take().is_some() {
            info!(
                kind = self.kind.as_str(),
                "consul's ACLs accept the token again; entries apply"
            );
        }
        EntriesStats::inc(&stats.update_success);
        next
    }

    /// Books a failed query (entries kept); an ACL denial is logged once until it changes.
    fn failed(&mut self, error: QueryError, delay: Duration) {
        let stats = &self.shared.stats;
        EntriesStats::inc(&stats.update_failure);
        let kind = self.kind.as_str();
        if let QueryError::AclDenied(denial) = error {
            EntriesStats::inc(&stats.acl_denied);
            if self.denied.as_ref() == Some(&denial) {
                debug!(kind, reason = %denial, retry_in = ?delay,
                    "consul ACLs still deny; keeping the current config entries");
            } else {
                warn!(kind, reason = %denial, retry_in = ?delay,
                    "consul ACLs deny the config entries; keeping the current ones until the token is fixed");
                self.denied = Some(denial);
            }
        } else {
            warn!(kind, %error, retry_in = ?delay,
                "consul config entry query failed; keeping the current entries");
        }
        self.shared.failed(self.kind);
    }
}

/// A decoded answer: `X-Consul-Index`, the usable entries by name, those left out.
type Answer = (u64, BTreeMap<String, ConfigEntry>, Vec<SkippedEntry>);
