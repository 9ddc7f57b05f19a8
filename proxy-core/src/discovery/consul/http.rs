//! Consul's HTTP API over hyper's HTTP/1.1 client, plain or over rustls (the TLS files are read
//! again for every connection): one request per connection
//! (`Connection: close`), the whole exchange bounded by one timeout, the body bounded by
//! [`MAX_RESPONSE`], every error naming the agent's address.
//!
//! Blocking queries hold a request open for up to `wait`, so connection reuse would save little;
//! a fresh connection per request also means a restarted agent is never asked on a dead one.

use std::{fmt::Write as _, io, time::Duration};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::{
    Request,
    body::{Body as _, Incoming},
    header::{ACCEPT, CONNECTION, CONTENT_TYPE, HOST, HeaderValue, USER_AGENT},
};
use hyper_util::rt::TokioIo;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpStream,
    task::JoinHandle,
};

use crate::tls::{TlsError, TlsSettings};

/// Largest response body accepted: a catalog of tens of thousands of instances fits.
const MAX_RESPONSE: usize = 64 << 20;

/// A response: status, headers in order (names lowercased), decoded body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// `(lowercased name, value)` pairs.
    pub headers: Vec<(String, String)>,
    /// The body after transfer decoding.
    pub body: Vec<u8>,
}

impl HttpResponse {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The start of the body as text, for error messages.
    pub fn body_excerpt(&self) -> String {
        let text = String::from_utf8_lossy(&self.body);
        let line = text.lines().next().unwrap_or("").trim();
        line.chars().take(200).collect()
    }
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// No TCP connection.
    #[error("cannot connect to {address}: {source} (is the Consul agent running there?)")]
    Connect {
        /// `host:port`.
        address: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The exchange failed: the connection broke, or the answer is not HTTP/1.x.
    #[error("{address}: {source}{cause}")]
    Http {
        /// `host:port`.
        address: String,
        /// The reasons under `source` (a TLS alert, an I/O error), each after `: `.
        cause: String,
        /// Why.
        #[source]
        source: hyper::Error,
    },
    /// TLS failed: the files, or the handshake (wrong CA, refused client certificate, ...).
    #[error("{address}: {source}: {cause}")]
    Tls {
        /// `host:port`.
        address: String,
        /// The reason under `source`, spelled out (rustls's words).
        cause: String,
        /// Why.
        #[source]
        source: TlsError,
    },
    /// No complete response in time.
    #[error("{address}: no complete response within {after:?}")]
    Timeout {
        /// `host:port`.
        address: String,
        /// The bound.
        after: Duration,
    },
    /// The request could not be built (a method, target or token a request cannot carry).
    #[error("{address}: cannot build the request: {source}")]
    Request {
        /// `host:port`.
        address: String,
        /// Why.
        #[source]
        source: hyper::http::Error,
    },
    /// The response is unusable.
    #[error("{address}: malformed HTTP response: {reason}")]
    Malformed {
        /// `host:port`.
        address: String,
        /// What is wrong.
        reason: &'static str,
    },
}

/// Sends `method target` (e.g. `GET /v1/health/service/web?index=7`) with an optional ACL
/// token (`X-Consul-Token`) and an optional JSON body to `address` over plain HTTP and reads
/// the whole response, all within `timeout`.
pub async fn request(
    address: &str,
    method: &str,
    target: &str,
    token: Option<&str>,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<HttpResponse, HttpError> {
    request_with(None, address, method, target, token, body, timeout).await
}

/// [`request`] over https with `tls` when given.
pub async fn request_with(
    tls: Option<&TlsSettings>,
    address: &str,
    method: &str,
    target: &str,
    token: Option<&str>,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<HttpResponse, HttpError> {
    let exchange = exchange(tls, address, method, target, token, body);
    match tokio::time::timeout(timeout, exchange).await {
        Ok(result) => result,
        Err(_) => Err(HttpError::Timeout {
            address: address.to_owned(),
            after: timeout,
        }),
    }
}

/// Aborts the connection's task when the exchange ends, however it ends (a timeout included).
struct Driver(JoinHandle<()>);

impl Drop for Driver {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn exchange(
    tls: Option<&TlsSettings>,
    address: &str,
    method: &str,
    target: &str,
    token: Option<&str>,
    body: Option<&[u8]>,
) -> Result<HttpResponse, HttpError> {
    let request =
        build(address, method, target, token, body).map_err(|source| HttpError::Request {
            address: address.to_owned(),
            source,
        })?;
    let stream = TcpStream::connect(address)
        .await
        .map_err(|source| HttpError::Connect {
            address: address.to_owned(),
            source,
        })?;
    let Some(tls) = tls else {
        return send(address, stream, request).await;
    };
    let tls_error = |source: TlsError| HttpError::Tls {
        address: address.to_owned(),
        cause: causes(&source).trim_start_matches(": ").to_owned(),
        source,
    };
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
    let client = tls.client_config(host, &[b"http/1.1"]).map_err(tls_error)?;
    let stream = client.connect(stream).await.map_err(tls_error)?;
    send(address, stream, request).await
}

/// The reasons under `error`, each after `: ` ("" when there are none; at most 8).
fn causes(error: &dyn std::error::Error) -> String {
    let mut text = String::new();
    let mut next = error.source();
    for _ in 0..8 {
        let Some(cause) = next else { break };
        let _ = write!(text, ": {cause}");
        next = cause.source();
    }
    text
}

/// Sends `request` over `io` and reads the response.
async fn send<IO>(
    address: &str,
    io: IO,
    request: Request<Full<Bytes>>,
) -> Result<HttpResponse, HttpError>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let http_error = |source: hyper::Error| HttpError::Http {
        address: address.to_owned(),
        cause: causes(&source),
        source,
    };
    let (mut sender, connection) = hyper::client::conn::http1::Builder::new()
        .title_case_headers(true)
        .handshake(TokioIo::new(io))
        .await
        .map_err(http_error)?;
    let _driver = Driver(tokio::spawn(async move {
        let _ = connection.await;
    }));
    let response = sender.send_request(request).await.map_err(http_error)?;
    read(address, response).await
}

/// The request, headers in the order Consul's clients send them.
fn build(
    address: &str,
    method: &str,
    target: &str,
    token: Option<&str>,
    body: Option<&[u8]>,
) -> Result<Request<Full<Bytes>>, hyper::http::Error> {
    let mut builder = Request::builder()
        .method(method)
        .uri(target)
        .header(HOST, address)
        .header(USER_AGENT, "proxy")
        .header(ACCEPT, "application/json")
        .header(CONNECTION, "close");
    if let Some(token) = token {
        let mut value = HeaderValue::from_str(token)?;
        value.set_sensitive(true);
        builder = builder.header("x-consul-token", value);
    }
    let body = match body {
        Some(body) => {
            builder = builder.header(CONTENT_TYPE, "application/json");
            builder = builder.header("content-length", body.len());
            Bytes::copy_from_slice(body)
        }
        None => Bytes::new(),
    };
    builder.body(Full::new(body))
}

/// Status, headers and the whole body, at most [`MAX_RESPONSE`] bytes of it.
async fn read(
    address: &str,
    response: hyper::Response<Incoming>,
) -> Result<HttpResponse, HttpError> {
    let malformed = |reason| HttpError::Malformed {
        address: address.to_owned(),
        reason,
    };
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(name, value)| {
            let value = String::from_utf8_lossy(value.as_bytes()).trim().to_owned();
            (name.as_str().to_owned(), value)
        })
        .collect();
    let body = response.into_body();
    if body.size_hint().lower() > MAX_RESPONSE as u64 {
        return Err(malformed("response larger than 64 MiB"));
    }
    let body = Limited::new(body, MAX_RESPONSE)
        .collect()
        .await
        .map_err(|error| match error.downcast::<hyper::Error>() {
            Ok(source) => HttpError::Http {
                address: address.to_owned(),
                cause: causes(&*source),
                source: *source,
            },
            Err(_) => malformed("response larger than 64 MiB"),
        })?;
    Ok(HttpResponse {
        status,
        headers,
        body: body.to_bytes().to_vec(),
    })
}

/// Percent-encodes `text` for a path segment or a query value: everything but RFC 3986
/// unreserved characters.
pub fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}
