//! The attempts of one routed request: a host per attempt (another one per retry when there
//! is one), a pooled or new connection, and the route's retry policy deciding what is tried
//! again.

use std::{sync::Arc, time::Duration};

use http::{Request, Response};

use super::{
    Answer, Reconnect,
    body::Payload,
    exchange, failure_reply, no_healthy_upstream,
    pending::{self, Refused},
};
use crate::{
    addr::BackendAddr,
    cluster::{ClusterHandle, random_u64},
    pool::{Body, ConnectError, Proto},
    route::{AttemptFailure, RetryPolicy, backoff},
    stats::ProxyStats,
};

/// An attempt that got no response: the reply the client gets if it is the last one.
struct Failed {
    host: Option<BackendAddr>,
    /// `None`: nothing to retry (no host, or no body left to send).
    failure: Option<AttemptFailure>,
    reply: Response<Body>,
}

/// The attempts of one routed request.
pub(super) struct Attempts<'a> {
    pub(super) cluster: &'a ClusterHandle,
    /// The host of the attempt under way, while it waits for its connection or response.
    pub(super) in_flight: &'a std::sync::Mutex<Option<BackendAddr>>,
    pub(super) proto: Proto,
    pub(super) connect_timeout: Duration,
    pub(super) policy: &'a RetryPolicy,
    /// The request's hash for RING_HASH and MAGLEV (`None`: a random one per pick).
    pub(super) hash: Option<u64>,
    pub(super) parts: http::request::Parts,
    pub(super) payload: Payload,
    pub(super) stats: &'a Arc<ProxyStats>,
}

impl Attempts<'_> {
    fn set_in_flight(&self, host: Option<BackendAddr>) {
        *self
            .in_flight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = host;
    }

    /// Tries hosts (a host not tried yet when there is one) until a response the policy does
    /// not retry, a failure it does not retry, or the retries run out; the last response or
    /// failure is the answer. Retries wait for Envoy's default back-off.
    pub(super) async fn run(mut self) -> Result<Answer, Response<Body>> {
        let mut tried = Vec::new();
        let mut retries = 0;
        // The retry in flight (`max_retries`), from its decision until its attempt is answered.
        let mut retry = None;
        loop {
            let outcome = self.attempt(&tried).await;
            drop(retry.take());
            let retriable = match &outcome {
                Ok(a) => self
                    .policy
                    .retries_response(a.resp.status(), a.resp.headers()),
                Err(f) => f.failure.is_some_and(|f| self.policy.retries_failure(f)),
            };
            if !retriable {
                if retries > 0 && outcome.is_ok() {
                    ProxyStats::inc(&self.stats.upstream_rq_retry_success);
                }
                return outcome.map_err(|f| f.reply);
            }
            if retries >= self.policy.num_retries {
                ProxyStats::inc(&self.stats.upstream_rq_retry_limit_exceeded);
                return outcome.map_err(|f| f.reply);
            }
            if !self.payload.available() {
                // A streamed body went to this attempt: it cannot be sent again.
                return outcome.map_err(|f| f.reply);
            }
            retry = match pending::hold_retry(self.cluster) {
                Some(held) => Some(held),
                None => return outcome.map_err(|f| f.reply),
            };
            let host = match &outcome {
                Ok(a) => Some(a.host),
                Err(f) => f.host,
            };
            tried.extend(host);
            drop(outcome);
            retries += 1;
            ProxyStats::inc(&self.stats.upstream_rq_retry);
            ProxyStats::inc(&self.stats.upstream_rq_retry_backoff_exponential);
            tokio::time::sleep(backoff(retries, random_u64())).await;
        }
    }

    async fn attempt(&mut self, tried: &[BackendAddr]) -> Result<Answer, Failed> {
        // LEAST_REQUEST counts the request against its host until the answer is in.
        let Some((host, _active)) = self.cluster.pick_leased_hashed(tried, self.hash) else {
            ProxyStats::inc(&self.stats.upstream_cx_none_healthy);
            return Err(Failed {
                host: None,
                failure: None,
                reply: no_healthy_upstream(),
            });
        };
        let failed = |failure| Failed {
            host: Some(host),
            failure: Some(failure),
            reply: failure_reply(failure),
        };
        self.set_in_flight(Some(host));
        let started = std::time::Instant::now();
        let connecting = pending::connection(
            self.cluster,
            host,
            self.proto,
            self.connect_timeout,
            self.stats,
        );
        let (sender, request) = match connecting.await {
            Ok(connected) => connected,
            Err(refused) => {
                self.set_in_flight(None);
                return Err(match refused {
                    Refused::Connect(err) => failed(attempt_failure(&err)),
                    // Envoy does not retry an overflow.
                    Refused::Overflow => Failed {
                        host: Some(host),
                        failure: None,
                        reply: pending::overflow_reply(),
                    },
                });
            }
        };
        let Some(body) = self.payload.body() else {
            self.set_in_flight(None);
            return Err(Failed {
                failure: None,
                ..failed(AttemptFailure::ConnectFailure)
            });
        };
        let req = Request::from_parts(self.parts.clone(), body);
        let reconnect = Reconnect {
            pool: self.cluster.pool(),
            timeout: self.connect_timeout,
            cluster: Some(self.cluster),
        };
        let exchanged = exchange(sender, host, req, self.proto, &reconnect, self.stats).await;
        // Outlier detection judges the exchange by its status; a reset before the response is
        // a 503, as Envoy's router reports it.
        let status = exchanged
            .as_ref()
            .map_or(503, |(resp, _)| resp.status().as_u16());
        self.cluster.report_response(host, status);
        if exchanged.is_ok() {
            // Envoy's `upstream_rq_time`, here to the response's headers.
            let responses = &self.cluster.traffic().responses;
            responses.time.record(started.elapsed());
        }
        self.set_in_flight(None);
        let (resp, sender) = exchanged.map_err(failed)?;
        Ok(Answer {
            resp,
            sender,
            host,
            request: Some(request),
        })
    }
}

pub(super) fn attempt_failure(err: &ConnectError) -> AttemptFailure {
    if err.is_connect_failure() {
        AttemptFailure::ConnectFailure
    } else {
        // TCP connected, the HTTP handshake failed: the upstream went away.
        AttemptFailure::Reset {
            refused_stream: false,
        }
    }
}
