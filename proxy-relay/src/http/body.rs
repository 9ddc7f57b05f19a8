//! Bodies on the routed HTTP path and the clock of a request's timeouts.
//!
//! - [`Clock`]: Envoy's route `timeout` runs from the end of the downstream request to the end of
//!   the upstream response, body included, across all retries; the route `idle_timeout` from the
//!   last request or response activity.
//! - [`Payload`]: the request body. While the request may be retried it is read ahead up to
//!   [`RETRY_BUFFER_LIMIT`] and kept, so each attempt sends it again; a longer body streams
//!   through once and its request is not retried once sent.
//! - [`TimedBody`]: the response body under both timeouts; when one fires the body ends with an
//!   error, so the server aborts the downstream stream (HTTP/1.1: the connection is closed,
//!   HTTP/2: the stream is reset).

use std::{
    collections::VecDeque,
    fmt,
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll, ready},
    time::Duration,
};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use proxy_core::time::after_tokio;
use tokio::{sync::watch, time::Instant};

use crate::{pool::Body, stats::ProxyStats};

/// Errors of the proxy's bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Request bodies up to this many bytes are kept in memory so a retry can send them again
/// (the role of Envoy's per-request buffer limit); a bigger body is streamed to the first
/// attempt only, and the request is not retried after it was sent (`retry_or_shadow_abandoned`).
/// 64 KiB covers typical API requests while bounding memory per request in flight.
pub const RETRY_BUFFER_LIMIT: usize = 64 * 1024;

/// The timeouts of one routed request.
pub struct Clock {
    timeout: Option<Duration>,
    idle: Option<Duration>,
    start: Instant,
    /// When the downstream request ended (`None`: still arriving).
    complete: watch::Sender<Option<Instant>>,
    /// Last request or response activity, in nanoseconds after `start`.
    activity: AtomicU64,
}

/// Which timeout ended a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expired {
    /// The route's request timeout.
    Request,
    /// The route's idle timeout.
    Idle,
}

impl Clock {
    /// A clock for a request arriving now.
    pub fn new(timeout: Option<Duration>, idle: Option<Duration>) -> Arc<Self> {
        Arc::new(Self {
            timeout,
            idle,
            start: Instant::now(),
            complete: watch::Sender::new(None),
            activity: AtomicU64::new(0),
        })
    }

    /// The downstream request has ended: the request timeout starts (once).
    pub fn request_complete(&self) {
        self.complete.send_if_modified(|at| {
            let first = at.is_none();
            if first {
                *at = Some(Instant::now());
            }
            first
        });
    }

    /// Request or response bytes moved: the idle timeout starts over.
    pub fn touch(&self) {
        let nanos = self.start.elapsed().as_nanos() as u64;
        self.activity.fetch_max(nanos, Ordering::Relaxed);
    }

    /// Resolves when a timeout has passed; never when none is configured.
    pub async fn expired(self: Arc<Self>) -> Expired {
        tokio::select! {
            () = self.request_expired() => Expired::Request,
            () = self.idle_expired() => Expired::Idle,
        }
    }

    async fn request_expired(&self) {
        let Some(timeout) = self.timeout else {
            return std::future::pending().await;
        };
        let mut complete = self.complete.subscribe();
        let at = loop {
            if let Some(at) = *complete.borrow_and_update() {
                break at;
            }
            // The sender lives in `self`: `changed` cannot fail while we borrow it.
            let _ = complete.changed().await;
        };
        tokio::time::sleep_until(after_tokio(at, timeout)).await;
    }

    async fn idle_expired(&self) {
        let Some(idle) = self.idle else {
            return std::future::pending().await;
        };
        loop {
            let last = self.start + Duration::from_nanos(self.activity.load(Ordering::Relaxed));
            let deadline = after_tokio(last, idle);
            if Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline).await;
        }
    }
}

/// A request body as the attempts send it.
pub enum Payload {
    /// Read to the end and kept: every attempt sends it.
    Replayable {
        /// The data frames.
        data: Vec<Bytes>,
        /// Trailers, if the request had any.
        trailers: Option<HeaderMap>,
    },
    /// Streamed: the first attempt that sends the request takes it.
    Streaming(Option<Body>),
}

impl Payload {
    /// Reads the body ahead (up to [`RETRY_BUFFER_LIMIT`]) when `keep` is set; streams it
    /// otherwise. Tells `clock` when the downstream request ends.
    pub async fn read(
        mut body: Incoming,
        keep: bool,
        clock: &Arc<Clock>,
    ) -> Result<Self, hyper::Error> {
        if body.is_end_stream() {
            // No body (a GET): hyper may never poll it, so the request is complete now.
            clock.request_complete();
        }
        let mut head = VecDeque::new();
        let mut len = 0;
        let mut trailers = None;
        while keep && len <= RETRY_BUFFER_LIMIT {
            let Some(frame) = body.frame().await else {
                clock.request_complete();
                let data = head
                    .into_iter()
                    .filter_map(|f: Frame<Bytes>| f.into_data().ok());
                return Ok(Self::Replayable {
                    data: data.collect(),
                    trailers,
                });
            };
            let frame = frame?;
            clock.touch();
            match frame.into_trailers() {
                Ok(t) => trailers = Some(t),
                Err(frame) => {
                    len += frame.data_ref().map_or(0, Bytes::len);
                    head.push_back(frame);
                }
            }
        }
        if let Some(t) = trailers {
            head.push_back(Frame::trailers(t));
        }
        let streamed = Chained {
            head,
            rest: Some(body),
            clock: Some(clock.clone()),
            exact: None,
        };
        Ok(Self::Streaming(Some(streamed.boxed())))
    }

    /// Whether every attempt can send the body.
    pub fn replayable(&self) -> bool {
        matches!(self, Self::Replayable { .. })
    }

    /// Whether there is a body for another attempt.
    pub fn available(&self) -> bool {
        match self {
            Self::Replayable { .. } => true,
            Self::Streaming(body) => body.is_some(),
        }
    }

    /// The body for the next attempt; `None` when a streamed body was already taken.
    pub fn body(&mut self) -> Option<Body> {
        match self {
            Self::Replayable { data, trailers } => {
                let len = data.iter().map(Bytes::len).sum::<usize>() as u64;
                let mut head: VecDeque<_> = data.iter().cloned().map(Frame::data).collect();
                head.extend(trailers.clone().map(Frame::trailers));
                let body = Chained {
                    head,
                    rest: None,
                    clock: None,
                    exact: trailers.is_none().then_some(len),
                };
                Some(body.boxed())
            }
            Self::Streaming(body) => body.take(),
        }
    }
}

/// Frames read ahead, then the rest of the downstream body (if any). With a clock, it reports
/// the end of the request (or its abandonment) and every frame's activity.
struct Chained {
    head: VecDeque<Frame<Bytes>>,
    rest: Option<Incoming>,
    clock: Option<Arc<Clock>>,
    exact: Option<u64>,
}

impl http_body::Body for Chained {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(frame) = self.head.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        let Some(rest) = self.rest.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = ready!(Pin::new(rest).poll_frame(cx));
        if let Some(clock) = &self.clock {
            match &polled {
                Some(Ok(_)) => clock.touch(),
                _ => clock.request_complete(),
            }
        }
        Poll::Ready(polled.map(|r| r.map_err(BoxError::from)))
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_empty()
            && self
                .rest
                .as_ref()
                .is_none_or(http_body::Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        match self.exact {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

impl Drop for Chained {
    fn drop(&mut self) {
        // A body dropped before its end (the upstream answered early, or failed): the request
        // will not arrive any further, so its timeout starts now.
        if let Some(clock) = &self.clock {
            clock.request_complete();
        }
    }
}

/// A timeout ended the response body.
#[derive(Debug)]
pub struct TimedOut(pub Expired);

impl fmt::Display for TimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Expired::Request => f.write_str("upstream request timeout during the response body"),
            Expired::Idle => f.write_str("stream idle timeout during the response body"),
        }
    }
}

impl std::error::Error for TimedOut {}

/// The upstream response body under the route's timeouts (counted when they fire).
pub struct TimedBody {
    inner: Incoming,
    clock: Arc<Clock>,
    expired: Pin<Box<dyn Future<Output = Expired> + Send + Sync>>,
    stats: Arc<ProxyStats>,
    done: bool,
}

impl TimedBody {
    /// Wraps `inner`.
    pub fn new(inner: Incoming, clock: Arc<Clock>, stats: Arc<ProxyStats>) -> Self {
        let expired = Box::pin(clock.clone().expired());
        Self {
            inner,
            clock,
            expired,
            stats,
            done: false,
        }
    }
}

impl http_body::Body for TimedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        if let Poll::Ready(which) = self.expired.as_mut().poll(cx) {
            self.done = true;
            ProxyStats::inc(match which {
                Expired::Request => &self.stats.upstream_rq_timeout,
                Expired::Idle => &self.stats.downstream_rq_idle_timeout,
            });
            return Poll::Ready(Some(Err(Box::new(TimedOut(which)))));
        }
        let polled = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match &polled {
            Some(Ok(_)) => self.clock.touch(),
            Some(Err(_)) => {
                ProxyStats::inc(&self.stats.upstream_rq_rx_reset);
                self.done = true;
            }
            None => self.done = true,
        }
        Poll::Ready(polled.map(|r| r.map_err(BoxError::from)))
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn request_timeout_starts_when_the_request_is_complete() {
        let clock = Clock::new(Some(Duration::from_secs(2)), None);
        let expired = tokio::spawn(clock.clone().expired());
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(!expired.is_finished(), "the request is still arriving");
        let at = Instant::now();
        clock.request_complete();
        assert_eq!(expired.await.unwrap(), Expired::Request);
        assert_eq!(at.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn idle_timeout_restarts_on_activity() {
        let clock = Clock::new(None, Some(Duration::from_secs(1)));
        let start = Instant::now();
        let expired = tokio::spawn(clock.clone().expired());
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_millis(600)).await;
            clock.touch();
        }
        assert_eq!(expired.await.unwrap(), Expired::Idle);
        assert_eq!(start.elapsed(), Duration::from_millis(4000));
    }

    #[tokio::test(start_paused = true)]
    async fn no_timeouts_never_expire() {
        let clock = Clock::new(None, None);
        clock.request_complete();
        let expired = tokio::spawn(clock.clone().expired());
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert!(!expired.is_finished());
        expired.abort();
    }

    #[tokio::test]
    async fn replayed_body_is_identical_each_time() {
        let mut p = Payload::Replayable {
            data: vec![Bytes::from_static(b"ab"), Bytes::from_static(b"cd")],
            trailers: None,
        };
        for _ in 0..3 {
            let body = p.body().expect("replayable");
            assert_eq!(body.size_hint().exact(), Some(4));
            assert_eq!(&body.collect().await.unwrap().to_bytes()[..], b"abcd");
        }
        let mut s = Payload::Streaming(None);
        assert!(s.body().is_none() && !s.replayable());
    }
}
