//! The watch loop of one Consul cluster: blocking queries on `/v1/health/service/<name>`, the
//! index rules of Consul's blocking-query guidance, host sets published on a watch channel, and
//! jittered backoff after failures (hosts are kept meanwhile).
//!
//! Index rules (Consul API docs, "Blocking Queries", implementation details):
//! * the first query, and the first after a reset, carries no `index`: it answers at once;
//! * later queries send `index=<last X-Consul-Index>&wait=<wait>` and block until a change or
//!   the wait runs out (a return is no guarantee of a change);
//! * a returned index lower than the one sent means the index went backwards (snapshot restore,
//!   a server change): the next query starts again from 0;
//! * a returned index of 0 is a Consul bug that would turn the watch into a busy loop: it is
//!   treated as 1, which is always safe to block on.
//!
//! An empty answer is checked against Consul's ACLs before it is applied, and a 403 is never
//! applied either (see [`acl`](super::acl)): a missing or wrong token keeps the hosts, counts
//! `consul.acl_denied` and is logged once, until an answer is applied again.
//!
//! Two queries never start less than [`MIN_QUERY_INTERVAL`] apart, so even a server that
//! answers every blocking query at once cannot make the loop spin.

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

use tokio::{sync::watch, time::Instant};
use tracing::{debug, info, warn};

use super::{
    acl::{self, AclDenial},
    catalog::{ServiceEntry, Skipped, decode_entries, to_hosts},
    http::{self, HttpError, HttpResponse},
    recovery::{self, AgentSignal, Recovery},
    stats::ConsulStats,
};
use crate::{
    config::sources::consul::{
        ConsulConfig,
        access::{ConsulToken, SentToken, TokenError, TokenSource},
    },
    discovery::{SourceStats, dns::FailureBackoff, source::SourceUpdate},
    host::HostSet,
    tls::TlsSettings,
};

/// Time allowed beyond `wait + wait/16` (Consul adds up to wait/16 of jitter) for a blocking
/// query's response to arrive.
pub(crate) const RESPONSE_GRACE: Duration = Duration::from_secs(5);

/// Least time between the starts of two queries.
pub(crate) const MIN_QUERY_INTERVAL: Duration = Duration::from_millis(50);

/// A boxed future, for the object-safe [`CatalogFetch`].
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Sends one GET to the Consul agent: the HTTP client in production, a script in unit tests.
pub(crate) trait CatalogFetch: Send + Sync {
    /// GETs `target` (path and query) with `token` as `X-Consul-Token`, bounded by `timeout`.
    fn get<'a>(
        &'a self,
        target: &'a str,
        token: Option<&'a ConsulToken>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<HttpResponse, HttpError>>;

    /// POSTs `body` (JSON) to `target` with `token`, bounded by `timeout`.
    fn post<'a>(
        &'a self,
        target: &'a str,
        token: Option<&'a ConsulToken>,
        body: Vec<u8>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<HttpResponse, HttpError>>;

    /// The recovery signal of the agent it asks ([`recovery`]): one per agent address in
    /// production; a fetch that is the only one on its agent keeps the default.
    fn agent(&self) -> AgentSignal {
        recovery::alone()
    }
}

/// [`CatalogFetch`] over [`http::request_with`].
pub(crate) struct HttpFetch {
    address: String,
    tls: Option<TlsSettings>,
    agent: AgentSignal,
}

impl HttpFetch {
    /// The client of the agent at `address` (`host:port`).
    pub(crate) fn new(address: String, tls: Option<TlsSettings>) -> Self {
        let agent = recovery::agent(&address);
        Self {
            address,
            tls,
            agent,
        }
    }
}

impl CatalogFetch for HttpFetch {
    fn agent(&self) -> AgentSignal {
        self.agent.clone()
    }

    fn get<'a>(
        &'a self,
        target: &'a str,
        token: Option<&'a ConsulToken>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<HttpResponse, HttpError>> {
        let token = token.map(ConsulToken::expose);
        Box::pin(http::request_with(
            self.tls.as_ref(),
            &self.address,
            "GET",
            target,
            token,
            None,
            timeout,
        ))
    }

    fn post<'a>(
        &'a self,
        target: &'a str,
        token: Option<&'a ConsulToken>,
        body: Vec<u8>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<HttpResponse, HttpError>> {
        let token = token.map(ConsulToken::expose);
        Box::pin(async move {
            http::request_with(
                self.tls.as_ref(),
                &self.address,
                "POST",
                target,
                token,
                Some(&body),
                timeout,
            )
            .await
        })
    }
}

/// Why one query failed.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// No response.
    #[error(transparent)]
    Http(#[from] HttpError),
    /// A status other than 200 (e.g. 500 "No path to datacenter").
    #[error("consul answered {status}: {body}")]
    Status {
        /// The status code.
        status: u16,
        /// The first line of the body.
        body: String,
    },
    /// 200 without a usable `X-Consul-Index` (not a Consul agent, or a proxy stripped it).
    #[error("consul response has no numeric X-Consul-Index header ({value:?})")]
    Index {
        /// The header's value, if any.
        value: Option<String>,
    },
    /// No token could be read (its file is missing or holds no valid token).
    #[error(transparent)]
    Token(#[from] TokenError),
    /// Consul's ACLs refused the token or hid the catalog from a missing one.
    #[error(transparent)]
    AclDenied(#[from] AclDenial),
    /// The token check after an empty answer got an unexpected status (its body is not shown:
    /// it may hold the token).
    #[error("consul answered {status} to the ACL token check {}", acl::TOKEN_SELF)]
    AclCheck {
        /// The status code.
        status: u16,
    },
    /// The permission check after an empty answer got an unexpected status, or an answer that
    /// is not one decision.
    #[error("consul answered {status} to the ACL permission check {}{}", acl::AUTHORIZE, if *status == 200 { " with no single decision" } else { "" })]
    Authorize {
        /// The status code.
        status: u16,
    },
    /// The body is not the expected JSON array.
    #[error("consul response body is not a list of service entries: {source}")]
    Body {
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// The body of `/v1/config/<kind>` is not a JSON array, or holds more entries than this
    /// daemon takes.
    #[error("consul's {kind} config entries are not usable: {reason}")]
    EntryList {
        /// The config entry kind queried.
        kind: &'static str,
        /// Why.
        reason: String,
    },
}

/// The index to send next and whether the watch was reset, given the index sent (`previous`,
/// 0 for a non-blocking query) and the `X-Consul-Index` returned. Consul's blocking-query
/// guidance: an index lower than the one sent went backwards, so restart from 0 (a non-blocking
/// query that re-reads everything); a returned 0 is never blocked on (Consul would answer at
/// once, a busy loop) but taken as 1, which is always safe.
pub fn next_index(previous: u64, returned: u64) -> (u64, bool) {
    if returned < previous {
        (0, true)
    } else if returned == 0 {
        (1, false)
    } else {
        (returned, false)
    }
}

/// The request target for `config` at `index`: `/v1/health/service/<service>` with `dc`, `tag`
/// and, when `index` is not 0, `index` and `wait`. `passing` is never set: unhealthy instances
/// are reported with their health, not hidden.
pub fn query_target(config: &ConsulConfig, index: u64) -> String {
    let mut params = Vec::new();
    if let Some(dc) = &config.datacenter {
        params.push(format!("dc={}", http::encode(dc)));
    }
    if let Some(tag) = &config.tag {
        params.push(format!("tag={}", http::encode(tag)));
    }
    if index != 0 {
        params.push(format!("index={index}"));
        params.push(format!("wait={}", go_duration(config.wait)));
    }
    let mut target = format!("/v1/health/service/{}", http::encode(&config.service));
    if !params.is_empty() {
        target.push('?');
        target.push_str(&params.join("&"));
    }
    target
}

/// A duration in Go's `time.ParseDuration` syntax: whole seconds as `30s`, else milliseconds.
pub(crate) fn go_duration(duration: Duration) -> String {
    if duration.subsec_nanos() == 0 {
        format!("{}s", duration.as_secs())
    } else {
        format!("{}ms", duration.as_millis().max(1))
    }
}

/// A decoded answer: `X-Consul-Index`, the entries, and those that could not be decoded.
type Answer = (u64, Vec<ServiceEntry>, Vec<Skipped>);

/// Sends one query with `token` and decodes its answer; an empty answer is checked against the
/// ACLs first.
async fn query(
    fetch: &dyn CatalogFetch,
    target: &str,
    token: &SentToken,
    (service, datacenter): (&str, Option<&str>),
    timeout: Duration,
) -> Result<Answer, QueryError> {
    let (index, response) = send(fetch, target, token, timeout).await?;
    let (entries, skipped) =
        decode_entries(&response.body).map_err(|source| QueryError::Body { source })?;
    if entries.is_empty() && skipped.is_empty() {
        acl::check_empty(fetch, token, (&[service], true), datacenter, timeout).await?;
    }
    Ok((index, entries, skipped))
}

/// Sends one query with `token` and checks its status and `X-Consul-Index`: a 403 is an
/// [`AclDenial`], any other status but 200 a [`QueryError::Status`]. Returns the index and the
/// response, whose body is still to be decoded (and an empty one checked with
/// [`acl::check_empty`]).
pub(crate) async fn send(
    fetch: &dyn CatalogFetch,
    target: &str,
    token: &SentToken,
    timeout: Duration,
) -> Result<(u64, HttpResponse), QueryError> {
    let sent = token.as_ref().map(|(token, _)| token);
    let response = fetch.get(target, sent, timeout).await?;
    if response.status == 403 {
        return Err(acl::denial(&response.body, token).into());
    }
    if response.status != 200 {
        return Err(QueryError::Status {
            status: response.status,
            body: response.body_excerpt(),
        });
    }
    let header = response.header("x-consul-index");
    let index = header
        .and_then(|v| v.parse::<u64>().ok())
        .ok_or_else(|| QueryError::Index {
            value: header.map(str::to_owned),
        })?;
    Ok((index, response))
}

/// What the loop needs besides its configuration.
pub(crate) struct Watch {
    pub(crate) name: String,
    pub(crate) config: ConsulConfig,
    pub(crate) fetch: Arc<dyn CatalogFetch>,
    pub(crate) token: TokenSource,
    pub(crate) updates: watch::Sender<SourceUpdate>,
    pub(crate) stats: Arc<ConsulStats>,
    pub(crate) rng: fastrand::Rng,
    /// The ACL denial logged last; `None` once an answer applies again.
    pub(crate) denied: Option<AclDenial>,
}

impl Watch {
    /// Runs until aborted.
    pub(crate) async fn run(mut self) {
        let base_ms = millis(self.config.retry_backoff.base_interval);
        let mut backoff = FailureBackoff::Jittered {
            base_ms,
            max_ms: millis(self.config.retry_backoff.max_interval).max(base_ms),
            next_ms: base_ms,
        };
        let wait = self.config.wait;
        let timeout = wait + wait / 16 + RESPONSE_GRACE;
        let mut index = 0;
        let mut last_start: Option<Instant> = None;
        let mut recovery = Recovery::new(self.fetch.agent());
        loop {
            if let Some(start) = last_start {
                tokio::time::sleep_until(start + MIN_QUERY_INTERVAL).await;
            }
            last_start = Some(Instant::now());
            SourceStats::inc(&self.stats.source.update_attempt);
            recovery.query_started();
            match self.query_once(index, timeout).await {
                Ok((returned, entries, invalid)) => {
                    index = self.succeeded(index, returned);
                    backoff.reset();
                    recovery.succeeded();
                    self.apply(&entries, invalid);
                }
                Err(error) => {
                    let delay = backoff.next_delay(&mut self.rng);
                    self.failed(error, delay);
                    let base = self.config.retry_backoff.base_interval;
                    if recovery.wait(delay, base, &mut self.rng).await {
                        debug!(cluster = %self.name, "the consul agent is back; retrying early");
                    }
                }
            }
        }
    }

    /// Reads the token and sends the query for `index`.
    async fn query_once(&self, index: u64, timeout: Duration) -> Result<Answer, QueryError> {
        let token = self.token.read()?;
        let target = query_target(&self.config, index);
        let service = (
            self.config.service.as_str(),
            self.config.datacenter.as_deref(),
        );
        query(&*self.fetch, &target, &token, service, timeout).await
    }

    /// Books a successful answer; returns the next index.
    fn succeeded(&mut self, index: u64, returned: u64) -> u64 {
        let (next, reset) = next_index(index, returned);
        if reset {
            SourceStats::inc(&self.stats.index_reset);
            warn!(cluster = %self.name, sent = index, returned,
                "consul index went backwards; restarting the watch from 0");
        }
        if self.denied.take().is_some() {
            info!(cluster = %self.name, "consul's ACLs accept the token again; answers apply");
        }
        SourceStats::set(&self.stats.index, next);
        SourceStats::inc(&self.stats.source.update_success);
        next
    }

    /// Books a failed query (hosts kept); an ACL denial is logged once until it changes.
    fn failed(&mut self, error: QueryError, delay: Duration) {
        SourceStats::inc(&self.stats.source.update_failure);
        if let QueryError::AclDenied(denial) = error {
            SourceStats::inc(&self.stats.acl_denied);
            if self.denied.as_ref() == Some(&denial) {
                debug!(cluster = %self.name, reason = %denial, retry_in = ?delay,
                    "consul ACLs still deny; keeping the current hosts");
            } else {
                warn!(cluster = %self.name, reason = %denial, retry_in = ?delay,
                    "consul ACLs deny the catalog; keeping the current hosts until the token is fixed");
                self.denied = Some(denial);
            }
        } else {
            warn!(cluster = %self.name, %error, retry_in = ?delay,
                "consul query failed; keeping the current hosts");
        }
        self.updates.send_if_modified(|state| {
            let first = !state.initialized;
            if first {
                state.initialized = true;
                state.version += 1;
            }
            first
        });
    }

    /// Maps a successful answer and publishes it if the host set changed.
    /// `invalid`: entries the answer had that could not be decoded.
    fn apply(&self, entries: &[ServiceEntry], invalid: Vec<Skipped>) {
        let (hosts, mut skipped) = to_hosts(entries, self.config.only_passing);
        skipped.extend(invalid);
        let previous_skipped = self
            .stats
            .instances_skipped
            .load(std::sync::atomic::Ordering::Relaxed);
        if skipped.len() as u64 != previous_skipped {
            for s in &skipped {
                warn!(cluster = %self.name, instance = %s.instance, reason = %s.reason,
                    "consul instance skipped; the others are used");
            }
        }
        SourceStats::set(&self.stats.instances_skipped, skipped.len() as u64);
        let total = hosts.len() as u64;
        let mut membership_changed = false;
        let published = self
            .updates
            .send_if_modified(|state| publish(state, hosts, &mut membership_changed));
        if membership_changed {
            SourceStats::inc(&self.stats.source.membership_change);
        }
        SourceStats::set(&self.stats.source.membership_total, total);
        if published {
            debug!(cluster = %self.name, hosts = total, "consul host set published");
        } else {
            SourceStats::inc(&self.stats.source.update_no_rebuild);
        }
    }
}

/// Replaces `state`'s hosts unless they are equal and already initialized; reports whether the
/// hosts themselves changed.
fn publish(state: &mut SourceUpdate, hosts: HostSet, membership_changed: &mut bool) -> bool {
    if state.initialized && state.hosts == hosts {
        return false;
    }
    *membership_changed = state.hosts != hosts;
    state.advance(hosts);
    true
}

pub(crate) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
