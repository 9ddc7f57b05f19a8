//! REST-JSON EDS: `POST {server}/v3/discovery:endpoints` every `refresh_delay`.
//!
//! Each poll sends the last accepted `version_info` and the last response's nonce; after a
//! rejected answer the next poll also carries `error_detail` (ours: Envoy's HTTP subscription
//! only counts `update_rejected` and sends its next poll unchanged). An answer with several
//! assignments for one cluster is rejected, as Envoy's HTTP subscription hands them all to the
//! EDS cluster, which takes exactly one ("Unexpected EDS resource length"). A transport failure, a timeout or a non-200 status counts `update_failure`,
//! keeps the hosts and retries after the jittered backoff; 304 Not Modified changes nothing.
//! One HTTP/1.1 connection per poll, plaintext or TLS (files read again at every poll).

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use thiserror::Error;
use tokio::net::TcpStream;

use crate::{
    config::sources::xds::NodeConfig,
    discovery::xds::{
        backoff::Backoff,
        grpc::{error_chain, lock, nack_status},
        json,
        state::{EdsState, UpdateError},
        stats::ControlPlaneStats,
    },
    tls::{self, TlsError, TlsFailure, TlsSettings},
};

/// The REST path of EDS.
pub const EDS_REST_PATH: &str = "/v3/discovery:endpoints";

/// Why a poll failed.
#[derive(Debug, Error)]
pub(crate) enum PollError {
    /// Bad server address.
    #[error("invalid REST server address {uri}")]
    Uri {
        /// The address.
        uri: String,
    },
    /// TCP connect failed.
    #[error("cannot connect to the REST control plane at {authority}, is it running?")]
    Connect {
        /// `host:port`.
        authority: String,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// The TLS connection failed.
    #[error("cannot reach the REST control plane at {authority} over TLS")]
    Tls {
        /// `host:port`.
        authority: String,
        /// Why.
        #[source]
        source: TlsError,
    },
    /// HTTP failed.
    #[error("HTTP exchange with the REST control plane failed")]
    Http(#[from] hyper::Error),
    /// Request building failed.
    #[error("cannot build the REST request")]
    Request(#[from] http::Error),
    /// The server answered something else than 200 or 304.
    #[error("the REST control plane answered {status}")]
    Status {
        /// The status.
        status: StatusCode,
    },
    /// The poll took longer than `request_timeout`.
    #[error("the REST poll timed out after {0:?}")]
    Timeout(Duration),
}

/// A REST subscription's fixed parts.
pub(crate) struct RestSubscription {
    pub(crate) uri: String,
    pub(crate) refresh_delay: Duration,
    pub(crate) request_timeout: Duration,
    pub(crate) node: NodeConfig,
    /// TLS to the server; `uri` is then `https://`.
    pub(crate) tls: Option<Arc<TlsSettings>>,
    pub(crate) state: Arc<Mutex<EdsState>>,
    pub(crate) control: Arc<ControlPlaneStats>,
}

/// What the next poll reports about the previous answer.
#[derive(Default)]
struct PollState {
    nonce: String,
    error: Option<String>,
}

/// Polls forever (until the task is aborted).
pub(crate) async fn run(sub: RestSubscription, mut backoff: Backoff) {
    let mut poll_state = PollState::default();
    loop {
        sub.control
            .stream_attempts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let body = request_body(&sub, &poll_state);
        let result = tokio::time::timeout(
            sub.request_timeout,
            post(&sub.uri, sub.tls.as_deref(), body),
        )
        .await;
        let answer = result.unwrap_or(Err(PollError::Timeout(sub.request_timeout)));
        let delay = match answer {
            Ok(Some(body)) => {
                sub.control.set_connected(true);
                backoff.reset();
                poll_state = apply(&sub, &body);
                sub.refresh_delay
            }
            Ok(None) => {
                sub.control.set_connected(true);
                backoff.reset();
                sub.refresh_delay
            }
            Err(error) => {
                sub.control.set_connected(false);
                let tls = sub.control.count_tls_failure(&error).map(TlsFailure::hint);
                tracing::warn!(uri = %sub.uri, error = %error_chain(&error), tls, "EDS REST poll failed, hosts kept");
                lock(&sub.state).on_failure();
                backoff.next_delay()
            }
        };
        tokio::time::sleep(delay).await;
    }
}

fn request_body(sub: &RestSubscription, poll: &PollState) -> Vec<u8> {
    let mut state = lock(&sub.state);
    // Every poll names every resource: a reload's changes need no request of their own.
    let _ = state.take_pending();
    let error = poll.error.as_deref().map(|message| (13, message));
    let request = json::discovery_request(
        &sub.node,
        state.version_info(),
        &state.names(),
        &poll.nonce,
        error,
    );
    request.to_string().into_bytes()
}

/// Applies an answer; returns what the next poll reports.
fn apply(sub: &RestSubscription, body: &[u8]) -> PollState {
    let response = json::discovery_response(body);
    let mut state = lock(&sub.state);
    let (nonce, result) = match response {
        Ok(response) => (response.nonce.clone(), state.apply_rest(&response)),
        // An unparsable answer is rejected like an invalid one: the next poll says why.
        Err(reason) => (String::new(), state.reject(UpdateError::Json { reason })),
    };
    let error = result.err().map(|e| nack_status(&e).message);
    match &error {
        None => tracing::debug!(version = state.version_info(), "EDS REST update accepted"),
        Some(reason) => tracing::warn!(%reason, "EDS REST update rejected, hosts kept"),
    }
    PollState { nonce, error }
}

/// One POST; `Ok(None)` for 304 Not Modified.
async fn post(
    uri: &str,
    tls: Option<&TlsSettings>,
    body: Vec<u8>,
) -> Result<Option<Bytes>, PollError> {
    let parsed: http::Uri =
        format!("{uri}{EDS_REST_PATH}")
            .parse()
            .map_err(|_| PollError::Uri {
                uri: uri.to_owned(),
            })?;
    let authority = parsed
        .authority()
        .map(std::string::ToString::to_string)
        .ok_or_else(|| PollError::Uri {
            uri: uri.to_owned(),
        })?;
    // Origin form (`POST /v3/discovery:endpoints`): an absolute URI is for proxies.
    let request = Request::post(EDS_REST_PATH)
        .header(http::header::HOST, &authority)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))?;
    if let Some(settings) = tls {
        let host = parsed.host().unwrap_or_default();
        let port = parsed.port_u16().unwrap_or(443);
        let stream = tls::connect(settings, host, port, &[b"http/1.1"])
            .await
            .map_err(|source| PollError::Tls { authority, source })?;
        return exchange(TokioIo::new(stream), request).await;
    }
    let stream = TcpStream::connect(&authority)
        .await
        .map_err(|source| PollError::Connect {
            authority: authority.clone(),
            source,
        })?;
    exchange(TokioIo::new(stream), request).await
}

/// Sends `request` on a new HTTP/1.1 connection over `io`.
async fn exchange<T>(io: T, request: Request<Full<Bytes>>) -> Result<Option<Bytes>, PollError>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io).await?;
    let driver = tokio::spawn(connection);
    let response = sender.send_request(request).await;
    let result = match response {
        Ok(response) if response.status() == StatusCode::OK => {
            Ok(Some(response.into_body().collect().await?.to_bytes()))
        }
        Ok(response) if response.status() == StatusCode::NOT_MODIFIED => Ok(None),
        Ok(response) => Err(PollError::Status {
            status: response.status(),
        }),
        Err(error) => Err(error.into()),
    };
    driver.abort();
    result
}
