//! A minimal HTTP/1.1 client for Consul's API over tokio: one request per connection
//! (`Connection: close`), the whole exchange bounded by one timeout, bodies with
//! `Content-Length`, chunked transfer coding, or read to the end of the connection.
//!
//! Consul's HTTP API is plain request/response JSON on a local agent, and blocking queries hold
//! a request open for up to `wait`, so connection reuse would save little; this keeps the
//! dependency set to tokio.

use std::{fmt::Write as _, io, time::Duration};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
};

/// Largest response accepted: a catalog of tens of thousands of instances fits.
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
    /// The connection broke.
    #[error("{address}: {source}")]
    Io {
        /// `host:port`.
        address: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// No complete response in time.
    #[error("{address}: no complete response within {after:?}")]
    Timeout {
        /// `host:port`.
        address: String,
        /// The bound.
        after: Duration,
    },
    /// The response is not valid HTTP/1.x.
    #[error("{address}: malformed HTTP response: {reason}")]
    Malformed {
        /// `host:port`.
        address: String,
        /// What is wrong.
        reason: &'static str,
    },
}

/// Sends `method target` (e.g. `GET /v1/health/service/web?index=7`) with an optional ACL
/// token (`X-Consul-Token`) and an optional JSON body to `address` and reads the whole
/// response, all within `timeout`. The token must be visible ASCII ([`ConsulToken`]
/// guarantees it).
///
/// [`ConsulToken`]: super::ConsulToken
pub async fn request(
    address: &str,
    method: &str,
    target: &str,
    token: Option<&str>,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<HttpResponse, HttpError> {
    let exchange = exchange(address, method, target, token, body);
    match tokio::time::timeout(timeout, exchange).await {
        Ok(result) => result,
        Err(_) => Err(HttpError::Timeout {
            address: address.to_owned(),
            after: timeout,
        }),
    }
}

async fn exchange(
    address: &str,
    method: &str,
    target: &str,
    token: Option<&str>,
    body: Option<&[u8]>,
) -> Result<HttpResponse, HttpError> {
    let mut stream = TcpStream::connect(address)
        .await
        .map_err(|source| HttpError::Connect {
            address: address.to_owned(),
            source,
        })?;
    let io_error = |source| HttpError::Io {
        address: address.to_owned(),
        source,
    };
    let mut head = format!(
        "{method} {target} HTTP/1.1\r\nHost: {address}\r\nUser-Agent: proxy\r\n\
         Accept: application/json\r\nConnection: close\r\n"
    );
    if let Some(token) = token.filter(|t| t.bytes().all(|b| b.is_ascii_graphic())) {
        let _ = write!(head, "X-Consul-Token: {token}\r\n");
    }
    if let Some(body) = body {
        let _ = write!(
            head,
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.map_err(io_error)?;
    if let Some(body) = body {
        stream.write_all(body).await.map_err(io_error)?;
    }
    let mut raw = Vec::new();
    (&mut stream)
        .take(MAX_RESPONSE as u64 + 1)
        .read_to_end(&mut raw)
        .await
        .map_err(io_error)?;
    parse(&raw).map_err(|reason| HttpError::Malformed {
        address: address.to_owned(),
        reason,
    })
}

/// Parses a complete response (the connection was closed after it).
pub(crate) fn parse(raw: &[u8]) -> Result<HttpResponse, &'static str> {
    if raw.len() > MAX_RESPONSE {
        return Err("response larger than 64 MiB");
    }
    let split = find(raw, b"\r\n\r\n").ok_or("no end of headers")?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|_| "headers are not UTF-8")?;
    let rest = &raw[split + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or("no status line")?;
    let mut parts = status_line.splitn(3, ' ');
    if !parts.next().is_some_and(|v| v.starts_with("HTTP/1.")) {
        return Err("status line is not HTTP/1.x");
    }
    let status = parts
        .next()
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or("bad status code")?;
    let mut headers = Vec::new();
    for line in lines {
        let (name, value) = line.split_once(':').ok_or("header line without colon")?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
    }
    let mut response = HttpResponse {
        status,
        headers,
        body: Vec::new(),
    };
    let chunked = response
        .header("transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    response.body = if chunked {
        dechunk(rest)?
    } else if let Some(length) = response.header("content-length") {
        let length: usize = length.parse().map_err(|_| "bad Content-Length")?;
        rest.get(..length)
            .ok_or("body shorter than Content-Length")?
            .to_vec()
    } else {
        rest.to_vec()
    };
    Ok(response)
}

/// Decodes a chunked body; trailers are ignored.
fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, &'static str> {
    let mut body = Vec::new();
    loop {
        let end = find(rest, b"\r\n").ok_or("chunk size line not terminated")?;
        let line = std::str::from_utf8(&rest[..end]).map_err(|_| "bad chunk size")?;
        let size_text = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16).map_err(|_| "bad chunk size")?;
        rest = &rest[end + 2..];
        if size == 0 {
            return Ok(body);
        }
        let chunk = rest.get(..size).ok_or("chunk shorter than its size")?;
        body.extend_from_slice(chunk);
        rest = rest.get(size..).ok_or("chunk shorter than its size")?;
        rest = rest
            .strip_prefix(b"\r\n")
            .ok_or("chunk not followed by CRLF")?;
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
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
