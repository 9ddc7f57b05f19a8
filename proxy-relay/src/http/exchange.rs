//! One exchange with an upstream: the request sent on a pooled or new connection, a pooled
//! connection found closed before the request went out replaced once (counted against the
//! cluster's `max_connections`), and the failure as the retry policy sees it.

use std::{sync::Arc, time::Duration};

use http::{Request, Response};
use hyper::body::Incoming;
use tracing::debug;

use super::{attempts::attempt_failure, upstream_request};
use crate::{
    addr::BackendAddr,
    cluster::ClusterHandle,
    pool::{self, Body, Pool, Proto, Sender},
    route::AttemptFailure,
    stats::ProxyStats,
};

/// How [`exchange`] replaces a pooled connection found closed: into which pool, within which
/// connect timeout, counted in which cluster's open connections (none for ORIGINAL_DST).
pub(super) struct Reconnect<'a> {
    pub(super) pool: &'a Arc<Pool>,
    pub(super) timeout: Duration,
    pub(super) cluster: Option<&'a ClusterHandle>,
}

/// Sends the request on `sender` (a pooled connection found closed before the request went
/// out is replaced once, on the same host, and the replacement counted against the cluster's
/// `max_connections` like any: it takes the place the closed one gave back).
pub(super) async fn exchange(
    mut sender: Sender,
    host: BackendAddr,
    req: Request<Body>,
    proto: Proto,
    reconnect: &Reconnect<'_>,
    stats: &Arc<ProxyStats>,
) -> Result<(Response<Incoming>, Sender), AttemptFailure> {
    let req = upstream_request(req, proto, host);
    ProxyStats::inc(&stats.upstream_rq_total);
    if let Some(cluster) = reconnect.cluster {
        cluster.traffic().responses.sent();
    }
    let result = match sender.try_send(req).await {
        Err((err, Some(req))) => {
            debug!(%err, "pooled connection unusable; reconnecting");
            let open = reconnect.cluster.map(|c| c.open_connection(host));
            let Reconnect { pool, timeout, .. } = *reconnect;
            sender = pool::connect(host, proto, timeout, stats, pool, open)
                .await
                .map_err(|err| attempt_failure(&err))?;
            sender.try_send(req).await
        }
        other => other,
    };
    match result {
        Ok(resp) => Ok((resp, sender)),
        Err((err, _)) => {
            debug!(%err, %host, "upstream request failed");
            ProxyStats::inc(&stats.upstream_rq_rx_reset);
            Err(AttemptFailure::Reset {
                refused_stream: is_refused_stream(&err),
            })
        }
    }
}

/// Whether an upstream error is an HTTP/2 `REFUSED_STREAM` reset.
fn is_refused_stream(err: &hyper::Error) -> bool {
    let mut source = std::error::Error::source(err);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return h2.reason() == Some(h2::Reason::REFUSED_STREAM);
        }
        source = e.source();
    }
    false
}

impl Sender {
    /// Sends, giving the request back when it was not sent at all.
    async fn try_send(
        &mut self,
        req: Request<Body>,
    ) -> Result<Response<Incoming>, (hyper::Error, Option<Request<Body>>)> {
        let result = match self {
            Sender::Http1(s) => s.try_send_request(req).await,
            Sender::Http2(s) => s.try_send_request(req).await,
        };
        result.map_err(|mut e| {
            let req = e.take_message();
            (e.into_error(), req)
        })
    }
}
