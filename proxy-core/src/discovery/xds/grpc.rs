//! gRPC xDS streams: ADS or EDS, state of the world or delta, with ACK/NACK and reconnects.
//!
//! Protocol as Envoy speaks it:
//! * SotW: the first request of every stream carries the subscribed names, the last accepted
//!   `version_info` and no nonce. ACK = next request with the response's `version_info` and
//!   `nonce`; NACK = the previous good `version_info`, the response's `nonce` and
//!   `error_detail` (code 13 INTERNAL, as Envoy, with the reason as message).
//! * Delta: the first request subscribes the names and lists the versions we hold in
//!   `initial_resource_versions`; ACK = `response_nonce`; NACK = `response_nonce` and
//!   `error_detail`.
//! * Every request carries `node` and its `type_url`. An ADS stream with CDS and LDS enabled
//!   also subscribes Cluster and Listener resources (wildcard, as Envoy), RouteConfigurations
//!   by the names the listeners give, and ACKs or NACKs each type on its own
//!   ([`ResourceState`]); responses of types not subscribed are ignored.
//! * A failed or closed stream counts `update_failure`, keeps every host, and is retried after
//!   a jittered exponential backoff, reset by the next accepted response; a response over the
//!   decode limit counts `control_plane.oversized_responses` and backs off on its own count
//!   (see `backoff`).

use std::{
    error::Error as StdError,
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use envoy_types::pb::{
    envoy::{
        config::core::v3::Node,
        service::{
            discovery::v3::{
                DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
                aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
            },
            endpoint::v3::endpoint_discovery_service_client::EndpointDiscoveryServiceClient,
        },
    },
    google::rpc::Status,
};
use hyper_util::rt::TokioIo;
use thiserror::Error;
use tokio::{
    net::TcpStream,
    sync::{Notify, mpsc},
};
use tokio_rustls::client::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use crate::{
    config::sources::xds::GrpcApi,
    discovery::xds::{
        backoff::Backoff,
        resources::ResourceState,
        state::{CLA_TYPE_URL, EdsState},
        stats::ControlPlaneStats,
    },
    tls::{self, TlsError, TlsSettings},
};

/// gRPC status code Envoy puts in a NACK's `error_detail`.
const NACK_CODE: i32 = 13;
/// How long connecting to the control plane may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Requests queued towards the server; one per response at most, so a few suffice.
const REQUEST_QUEUE: usize = 8;
/// The largest xDS response this daemon decodes: 64 MiB, about 4 million endpoints. gRPC's
/// default of 4 MiB (about 300,000) is a size real clusters reach, and a response over the
/// limit cannot even be NACKed (its nonce is in the part not read).
pub(crate) const MAX_MESSAGE: usize = 64 << 20;

/// Why a stream ended.
#[derive(Debug, Error)]
pub(crate) enum StreamError {
    /// Connecting failed.
    #[error("cannot connect to the control plane at {uri}, is it running?")]
    Connect {
        /// The server.
        uri: String,
        /// The transport's error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The server ended the stream with an error status.
    #[error("the control plane ended the stream")]
    Status(#[source] tonic::Status),
    /// A response was over [`MAX_MESSAGE`]: this daemon's limit, not the server's fault.
    #[error(
        "an xDS response was larger than this daemon decodes ({} MiB); the hosts are kept. Fewer endpoints per resource, or a delta stream, keeps responses under it ({detail})",
        MAX_MESSAGE >> 20
    )]
    TooLarge {
        /// gRPC's words (the size found).
        detail: String,
    },
    /// The server closed the stream.
    #[error("the control plane closed the stream")]
    Closed,
}

impl From<tonic::Status> for StreamError {
    fn from(status: tonic::Status) -> Self {
        if status.code() == tonic::Code::OutOfRange
            && status.message().contains("message length too large")
        {
            return Self::TooLarge {
                detail: status.message().to_owned(),
            };
        }
        Self::Status(status)
    }
}

/// A gRPC subscription's fixed parts.
pub(crate) struct GrpcSubscription {
    pub(crate) uri: String,
    pub(crate) api: GrpcApi,
    pub(crate) delta: bool,
    pub(crate) node: Node,
    /// TLS to the server; `uri` is then `https://`.
    pub(crate) tls: Option<Arc<TlsSettings>>,
    pub(crate) state: Arc<Mutex<EdsState>>,
    /// ADS only: the CDS and LDS resources, when enabled.
    pub(crate) resources: Option<Arc<Mutex<ResourceState>>>,
    pub(crate) control: Arc<ControlPlaneStats>,
    /// Woken when a reload changed the subscribed resources.
    pub(crate) resources_changed: Arc<Notify>,
}

/// Runs streams forever (until the task is aborted), reconnecting with `backoff`.
pub(crate) async fn run(sub: GrpcSubscription, mut backoff: Backoff) {
    loop {
        sub.control
            .stream_attempts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let error = match connect(&sub.uri, sub.tls.as_ref()).await {
            Ok(channel) if sub.delta => run_delta(&sub, channel, &mut backoff).await,
            Ok(channel) => run_sotw(&sub, channel, &mut backoff).await,
            Err(error) => error,
        };
        sub.control.set_connected(false);
        let tls = sub
            .control
            .count_tls_failure(&error)
            .map(tls::TlsFailure::hint);
        tracing::warn!(uri = %sub.uri, error = %error_chain(&error), tls, "xDS stream failed, hosts kept");
        lock(&sub.state).on_failure();
        let delay = if matches!(error, StreamError::TooLarge { .. }) {
            sub.control
                .oversized_responses
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            backoff.next_oversized_delay()
        } else {
            backoff.clear_oversized();
            backoff.next_delay()
        };
        tokio::time::sleep(delay).await;
    }
}

async fn connect(uri: &str, tls: Option<&Arc<TlsSettings>>) -> Result<Channel, StreamError> {
    let connect_error = |source| StreamError::Connect {
        uri: uri.to_owned(),
        source,
    };
    let endpoint = Endpoint::from_shared(uri.to_owned())
        .map_err(connect_error)?
        .connect_timeout(CONNECT_TIMEOUT);
    match tls {
        None => endpoint.connect().await,
        Some(settings) => {
            let connector = TlsConnector(Arc::clone(settings));
            endpoint.connect_with_connector(connector).await
        }
    }
    .map_err(connect_error)
}

/// Connects tonic's channel over TLS, reading the settings' files at every connection.
#[derive(Clone)]
struct TlsConnector(Arc<TlsSettings>);

type TlsFuture =
    Pin<Box<dyn Future<Output = Result<TokioIo<TlsStream<TcpStream>>, TlsError>> + Send>>;

impl tower_service::Service<http::Uri> for TlsConnector {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = TlsError;
    type Future = TlsFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), TlsError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> TlsFuture {
        let settings = Arc::clone(&self.0);
        Box::pin(async move {
            let host = uri.host().unwrap_or_default();
            let port = uri.port_u16().unwrap_or(443);
            let stream = tls::connect(&settings, host, port, &[b"h2"]).await?;
            Ok(TokioIo::new(stream))
        })
    }
}

/// One state-of-the-world stream; returns why it ended.
async fn run_sotw(sub: &GrpcSubscription, channel: Channel, backoff: &mut Backoff) -> StreamError {
    let (tx, rx) = mpsc::channel(REQUEST_QUEUE);
    let first = {
        let mut state = lock(&sub.state);
        // The first request names every resource: nothing is pending on a new stream.
        let _ = state.take_pending();
        sotw_request(
            sub,
            state.version_info(),
            state.names(),
            String::new(),
            None,
        )
    };
    let mut asked = first.resource_names.clone();
    let mut last_nonce = String::new();
    // With CDS and LDS on the stream, no EDS request until a cluster needs one: an empty
    // first request would be a wildcard subscription of every assignment.
    if sub.resources.is_none() || !asked.is_empty() {
        let _ = tx.send(first).await;
    }
    for request in resource_first_sotw(sub) {
        let _ = tx.send(request).await;
    }
    let outbound = tonic::Request::new(ReceiverStream::new(rx));
    let response = match sub.api {
        GrpcApi::Aggregated => {
            let mut client = AggregatedDiscoveryServiceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE);
            client.stream_aggregated_resources(outbound).await
        }
        GrpcApi::Endpoint => {
            EndpointDiscoveryServiceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE)
                .stream_endpoints(outbound)
                .await
        }
    };
    let mut inbound = match response {
        Ok(response) => response.into_inner(),
        Err(status) => return status.into(),
    };
    sub.control.set_connected(true);
    loop {
        let response = tokio::select! {
            message = inbound.message() => match message {
                Ok(Some(response)) => response.received(),
                Ok(None) => return StreamError::Closed,
                Err(status) => return status.into(),
            },
            () = sub.resources_changed.notified() => {
                // As Envoy: the new resource names, with the version and nonce we hold.
                let request = {
                    let mut state = lock(&sub.state);
                    let _ = state.take_pending();
                    sotw_request(sub, state.version_info(), state.names(), last_nonce.clone(), None)
                };
                if request.resource_names != asked {
                    asked.clone_from(&request.resource_names);
                    tracing::info!(resources = ?asked, "EDS subscription changed on the running stream");
                    if tx.send(request).await.is_err() {
                        return StreamError::Closed;
                    }
                }
                continue;
            }
        };
        if let Some(request) = resource_reply_sotw(sub, &response) {
            backoff.reset();
            // A listener change may change the route configurations to ask for.
            let routes = sub
                .resources
                .as_ref()
                .and_then(|r| lock_resources(r).route_request_sotw(&sub.node));
            for request in std::iter::once(request).chain(routes) {
                if tx.send(request).await.is_err() {
                    return StreamError::Closed;
                }
            }
            continue;
        }
        if response.type_url != CLA_TYPE_URL {
            tracing::debug!(type_url = %response.type_url, "ignoring a response of another type");
            continue;
        }
        last_nonce.clone_from(&response.nonce);
        let request = {
            let mut state = lock(&sub.state);
            let detail = state.apply_sotw(&response).err().map(|e| nack_status(&e));
            backoff.reset();
            sotw_request(
                sub,
                state.version_info(),
                state.names(),
                response.nonce,
                detail,
            )
        };
        log_decision(request.error_detail.as_ref(), &request.version_info);
        asked.clone_from(&request.resource_names);
        if tx.send(request).await.is_err() {
            return StreamError::Closed;
        }
    }
}

/// One delta stream; returns why it ended.
async fn run_delta(sub: &GrpcSubscription, channel: Channel, backoff: &mut Backoff) -> StreamError {
    let (tx, rx) = mpsc::channel(REQUEST_QUEUE);
    let first = {
        let mut state = lock(&sub.state);
        let _ = state.take_pending();
        DeltaDiscoveryRequest {
            node: Some(sub.node.clone()),
            type_url: CLA_TYPE_URL.to_owned(),
            resource_names_subscribe: state.names(),
            initial_resource_versions: state.delta_versions(),
            ..Default::default()
        }
    };
    if sub.resources.is_none() || !first.resource_names_subscribe.is_empty() {
        let _ = tx.send(first).await;
    }
    for request in resource_first_delta(sub) {
        let _ = tx.send(request).await;
    }
    let outbound = tonic::Request::new(ReceiverStream::new(rx));
    let response = match sub.api {
        GrpcApi::Aggregated => {
            let mut client = AggregatedDiscoveryServiceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE);
            client.delta_aggregated_resources(outbound).await
        }
        GrpcApi::Endpoint => {
            EndpointDiscoveryServiceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE)
                .delta_endpoints(outbound)
                .await
        }
    };
    let mut inbound = match response {
        Ok(response) => response.into_inner(),
        Err(status) => return status.into(),
    };
    sub.control.set_connected(true);
    loop {
        let response = tokio::select! {
            message = inbound.message() => match message {
                Ok(Some(response)) => response.received(),
                Ok(None) => return StreamError::Closed,
                Err(status) => return status.into(),
            },
            () = sub.resources_changed.notified() => {
                let (subscribe, unsubscribe) = lock(&sub.state).take_pending();
                if subscribe.is_empty() && unsubscribe.is_empty() {
                    continue;
                }
                tracing::info!(?subscribe, ?unsubscribe, "EDS subscription changed on the running stream");
                let request = DeltaDiscoveryRequest {
                    node: Some(sub.node.clone()),
                    type_url: CLA_TYPE_URL.to_owned(),
                    resource_names_subscribe: subscribe,
                    resource_names_unsubscribe: unsubscribe,
                    ..Default::default()
                };
                if tx.send(request).await.is_err() {
                    return StreamError::Closed;
                }
                continue;
            }
        };
        if let Some(request) = resource_reply_delta(sub, &response) {
            backoff.reset();
            let routes = sub
                .resources
                .as_ref()
                .and_then(|r| lock_resources(r).route_request_delta(&sub.node, false));
            for request in std::iter::once(request).chain(routes) {
                if tx.send(request).await.is_err() {
                    return StreamError::Closed;
                }
            }
            continue;
        }
        if response.type_url != CLA_TYPE_URL {
            tracing::debug!(type_url = %response.type_url, "ignoring a response of another type");
            continue;
        }
        let error_detail = lock(&sub.state)
            .apply_delta(&response)
            .err()
            .map(|e| nack_status(&e));
        backoff.reset();
        log_decision(error_detail.as_ref(), &response.system_version_info);
        let request = DeltaDiscoveryRequest {
            node: Some(sub.node.clone()),
            type_url: CLA_TYPE_URL.to_owned(),
            response_nonce: response.nonce,
            error_detail,
            ..Default::default()
        };
        if tx.send(request).await.is_err() {
            return StreamError::Closed;
        }
    }
}

/// A response just decoded, before anything is done with it, logged at debug level: the
/// receipt time the scale benchmark measures from (`cargo xtask bench`).
trait Received: Sized {
    fn received(self) -> Self;
}

impl Received for DiscoveryResponse {
    fn received(self) -> Self {
        log_received(&self.type_url, self.resources.len());
        self
    }
}

impl Received for DeltaDiscoveryResponse {
    fn received(self) -> Self {
        log_received(&self.type_url, self.resources.len());
        self
    }
}

fn log_received(type_url: &str, resources: usize) {
    tracing::debug!(type_url, resources, "xDS response received");
}

fn sotw_request(
    sub: &GrpcSubscription,
    version_info: &str,
    names: Vec<String>,
    nonce: String,
    error_detail: Option<Status>,
) -> DiscoveryRequest {
    DiscoveryRequest {
        version_info: version_info.to_owned(),
        node: Some(sub.node.clone()),
        resource_names: names,
        type_url: CLA_TYPE_URL.to_owned(),
        response_nonce: nonce,
        error_detail,
        ..Default::default()
    }
}

/// ADS with CDS and LDS: the first request of each type, wildcard, with the version held.
fn resource_first_sotw(sub: &GrpcSubscription) -> Vec<DiscoveryRequest> {
    let Some(resources) = &sub.resources else {
        return Vec::new();
    };
    let mut state = lock_resources(resources);
    let request = |type_url: &str| DiscoveryRequest {
        version_info: state.version_info(type_url).to_owned(),
        node: Some(sub.node.clone()),
        type_url: type_url.to_owned(),
        ..Default::default()
    };
    let mut requests: Vec<_> = state.types().iter().map(|t| request(t)).collect();
    state.stream_started();
    requests.extend(state.route_request_sotw(&sub.node));
    requests
}

/// The ACK or NACK of a CDS or LDS response; `None` for a response of another type.
fn resource_reply_sotw(
    sub: &GrpcSubscription,
    response: &DiscoveryResponse,
) -> Option<DiscoveryRequest> {
    let mut state = lock_resources(sub.resources.as_ref()?);
    if !state.handles(&response.type_url) {
        return None;
    }
    let detail = state.apply_sotw(response).err().map(|e| nack_status(&e));
    log_decision(detail.as_ref(), &response.version_info);
    Some(DiscoveryRequest {
        version_info: state.version_info(&response.type_url).to_owned(),
        node: Some(sub.node.clone()),
        resource_names: state.asked_names(&response.type_url),
        type_url: response.type_url.clone(),
        response_nonce: response.nonce.clone(),
        error_detail: detail,
        ..Default::default()
    })
}

/// Delta: the first request of each type, with the versions held.
fn resource_first_delta(sub: &GrpcSubscription) -> Vec<DeltaDiscoveryRequest> {
    let Some(resources) = &sub.resources else {
        return Vec::new();
    };
    let mut state = lock_resources(resources);
    let request = |type_url: &str| DeltaDiscoveryRequest {
        node: Some(sub.node.clone()),
        type_url: type_url.to_owned(),
        initial_resource_versions: state.delta_versions(type_url),
        ..Default::default()
    };
    let mut requests: Vec<_> = state.types().iter().map(|t| request(t)).collect();
    state.stream_started();
    requests.extend(state.route_request_delta(&sub.node, true));
    requests
}

/// Delta: the ACK or NACK of a CDS or LDS response; `None` for another type.
fn resource_reply_delta(
    sub: &GrpcSubscription,
    response: &DeltaDiscoveryResponse,
) -> Option<DeltaDiscoveryRequest> {
    let mut state = lock_resources(sub.resources.as_ref()?);
    if !state.handles(&response.type_url) {
        return None;
    }
    let result = state.apply_delta(response);
    drop(state);
    let error_detail = result.err().map(|e| nack_status(&e));
    log_decision(error_detail.as_ref(), &response.system_version_info);
    Some(DeltaDiscoveryRequest {
        node: Some(sub.node.clone()),
        type_url: response.type_url.clone(),
        response_nonce: response.nonce.clone(),
        error_detail,
        ..Default::default()
    })
}

/// Locks the CDS and LDS state (a poisoned lock holds consistent data: a response is checked
/// whole before anything is kept).
pub(crate) fn lock_resources(
    state: &Mutex<ResourceState>,
) -> std::sync::MutexGuard<'_, ResourceState> {
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The longest NACK message sent, in bytes, as Envoy bounds it (gRPC's trailers default to
/// 8 KiB); a longer one is cut at a character boundary and marked `...(truncated)`.
const MAX_NACK_MESSAGE: usize = 4096;

/// The `error_detail` of a NACK.
pub(crate) fn nack_status(error: &dyn StdError) -> Status {
    let mut message = error_chain(error);
    if message.len() > MAX_NACK_MESSAGE {
        let mut end = MAX_NACK_MESSAGE;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str("...(truncated)");
    }
    Status {
        code: NACK_CODE,
        message,
        details: Vec::new(),
    }
}

fn log_decision(error_detail: Option<&Status>, version: &str) {
    match error_detail {
        None => tracing::debug!(version, "xDS update accepted (ACK)"),
        Some(status) => {
            tracing::warn!(reason = %status.message, "xDS update rejected (NACK), last good state kept");
        }
    }
}

/// `error: cause: cause`.
pub(crate) fn error_chain(error: &dyn StdError) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text = format!("{text}: {cause_text}");
        }
        source = cause.source();
    }
    text
}

/// Locks the state; a poisoned lock (a panic elsewhere) still holds consistent data, because
/// every update is validated before anything is written.
pub(crate) fn lock(state: &Mutex<EdsState>) -> std::sync::MutexGuard<'_, EdsState> {
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
