//! An HTTP backend whose answer depends on the last segment of the request path, for the retry
//! and timeout tests:
//!
//! - `fail-once`: 503 the first time this exact path is asked for, then as `echo`;
//! - `fail`: always 503;
//! - `trickle`: headers at once, then 20 one-byte chunks 50 ms apart;
//! - `stall`: headers and one byte at once, the rest after 2 s;
//! - anything else (`echo`): 200 with [`echo_line`] of the request.
//!
//! A server started `failing` answers 503 to everything. Every request body is read to the end
//! before the answer; the server counts requests per path and keeps the last echo line.

use std::{
    collections::HashMap,
    convert::Infallible,
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{
    Request, Response,
    body::{Frame, Incoming},
    service::service_fn,
};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::{net::TcpListener, sync::mpsc, task::JoinHandle};

use super::{Fnv, WAIT};

/// Per path: requests seen and the last echo line.
type Seen = Arc<Mutex<HashMap<String, (u32, String)>>>;

/// The scripted backend.
pub struct Scripted {
    pub addr: SocketAddr,
    seen: Seen,
    task: JoinHandle<()>,
}

impl Scripted {
    /// Starts it on 127.0.0.1:<ephemeral>.
    pub async fn start(name: &'static str, failing: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Seen::default();
        let shared = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let seen = shared.clone();
                let svc = service_fn(move |req| answer(name, failing, seen.clone(), req));
                tokio::spawn(async move {
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self { addr, seen, task }
    }

    /// Requests seen for `path`.
    pub fn requests(&self, path: &str) -> u32 {
        self.seen.lock().unwrap().get(path).map_or(0, |(n, _)| *n)
    }

    /// The echo line of the last request for `path`.
    pub fn last_body(&self, path: &str) -> Option<String> {
        self.seen.lock().unwrap().get(path).map(|(_, l)| l.clone())
    }
}

impl Drop for Scripted {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What `echo` answers: `<name> <method> <path> <body length> <body FNV-1a in hex>`.
pub fn echo_line(name: &str, method: &str, path: &str, body: &[u8]) -> String {
    let mut h = Fnv::new();
    h.update(body);
    format!("{name} {method} {path} {} {:x}", body.len(), h.0)
}

async fn answer(
    name: &'static str,
    failing: bool,
    seen: Seen,
    req: Request<Incoming>,
) -> Result<Response<Chunks>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
        .unwrap_or_default();
    let path = parts.uri.path().to_owned();
    let line = echo_line(name, parts.method.as_str(), &path, &body);
    let count = {
        let mut seen = seen.lock().unwrap();
        let entry = seen.entry(path.clone()).or_insert((0, String::new()));
        entry.0 += 1;
        entry.1 = line.clone();
        entry.0
    };
    let script = path.rsplit('/').next().unwrap_or("");
    let (tx, body) = Chunks::new();
    let status = match script {
        _ if failing => 503,
        "fail" => 503,
        "fail-once" if count == 1 => 503,
        _ => 200,
    };
    let chunks: Vec<(Duration, Bytes)> = match (status, script) {
        (503, _) => vec![(Duration::ZERO, Bytes::from_static(b"failed"))],
        (_, "trickle") => (0..20)
            .map(|_| (Duration::from_millis(50), Bytes::from_static(b"x")))
            .collect(),
        (_, "stall") => vec![
            (Duration::ZERO, Bytes::from_static(b"a")),
            (Duration::from_secs(2), Bytes::from_static(b"b")),
        ],
        _ => vec![(Duration::ZERO, Bytes::from(line))],
    };
    tokio::spawn(async move {
        for (pause, chunk) in chunks {
            tokio::time::sleep(pause).await;
            if tx.send(chunk).await.is_err() {
                return;
            }
        }
    });
    let mut resp = Response::new(body);
    *resp.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
    Ok(resp)
}

/// A response body fed chunk by chunk from a channel; it ends when the sender is dropped.
pub struct Chunks(mpsc::Receiver<Bytes>);

impl Chunks {
    fn new() -> (mpsc::Sender<Bytes>, Self) {
        let (tx, rx) = mpsc::channel(32);
        (tx, Self(rx))
    }
}

impl hyper::body::Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|c| c.map(|b| Ok(Frame::data(b))))
    }
}

/// Sends a request with `body` over HTTP/1.1 (bounded) and returns the status and the body, or
/// the error that ended the body.
pub async fn send(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    method: &str,
    path: &str,
    body: &[u8],
) -> (u16, Result<String, hyper::Error>) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "svc")
        .body(Full::new(Bytes::copy_from_slice(body)))
        .unwrap();
    let resp = tokio::time::timeout(WAIT, sender.send_request(req))
        .await
        .expect("response in time")
        .expect("response headers");
    let status = resp.status().as_u16();
    let body = tokio::time::timeout(WAIT, resp.into_body().collect())
        .await
        .expect("body in time");
    let text = body.map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned());
    (status, text)
}
