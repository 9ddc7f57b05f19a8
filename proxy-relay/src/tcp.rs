//! The tokio driver of a TCP connection: the start (`conn.rs`: host, connect with the client's
//! first bytes, outcome), then the copy (`copy.rs` driving `flow.rs`) or, with
//! `splice: kernel`, the kernel's splicing, until both sides are done, a side resets, the
//! host's drain deadline passes, or shutdown's.

use std::{io, time::Duration};

use proxy_core::config::proxy::SpliceMode;
use tokio::net::TcpStream;
use tracing::{debug, field, warn};

use crate::{
    client::Client,
    cluster::HostClose,
    conn::{self, Chosen, ConnectFailure, ProxyClose, Target},
    connect_attempts::{self, Attempts},
    copy,
    drain::DrainWatcher,
    flow::{self, End},
    shared::Shared,
    splice::{self, Baseline, SpliceError, SpliceGuard},
    stats::ProxyStats,
};

/// Connects upstream and relays; the client is reset when no upstream can be had.
pub(crate) async fn forward(
    client: Client,
    target: Target<'_>,
    shared: &Shared,
    drain: &DrainWatcher,
) {
    let (stats, cluster) = (&shared.stats, target.cluster());
    let Some((
        Chosen {
            host,
            lease: _lease,
            active: _active,
            open,
        },
        upstream,
        unsent,
        sent_first,
    )) = connect(&client, target, shared).await
    else {
        return;
    };
    conn::connected(host, cluster, open.as_ref());
    let client = match client.register() {
        Ok(c) => c,
        Err(err) => {
            warn!(%err, "could not register a connection with the event loop");
            flow::abort(&upstream);
            return;
        }
    };
    let policy = shared.drain_policy();
    let close = async {
        let host_closed = async {
            match cluster {
                Some(c) => c.host_closed(host, policy).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = drain.closing() => ProxyClose::Shutdown,
            why = host_closed => match why {
                HostClose::Drained => ProxyClose::Drained,
                HostClose::HealthFailure => ProxyClose::HealthFailure,
            },
        }
    };
    if let Some((guard, base)) = hand_to_kernel(&client, &upstream, shared) {
        if let Some(span) = conn_span() {
            span.record("spliced", true);
        }
        // Boxed: kept inline, its state would size every connection's task, spliced or
        // not.
        let end = Box::pin(splice::run(client, upstream, guard, base, stats, close)).await;
        debug!(?end, "spliced connection ended");
    } else {
        let (copied, end) = copy::relay(&client, &upstream, unsent, stats, close).await;
        if let Some(span) = conn_span() {
            span.record("sent", copied.sent + sent_first);
            span.record("received", copied.received);
        }
        if let End::Done = end {
            debug!("connection ended");
        }
    }
}

/// Connects to a host of `target`, and to another on a failed connect while the service's
/// `max_connect_attempts` allow (`connect_attempts.rs`); the host, the connection, the client's bytes
/// still to send and those sent. `None`: the client was reset (counted).
async fn connect(
    client: &Client,
    target: Target<'_>,
    shared: &Shared,
) -> Option<(Chosen, TcpStream, Vec<u8>, u64)> {
    let (stats, cluster) = (&shared.stats, target.cluster());
    // Spliced pairs are handed over before any byte moves; others start with what the client
    // has sent already.
    let first_bytes = !(shared.config.splice == SpliceMode::Kernel && shared.splicer.is_some());
    let mut attempts = Attempts::new(target, first_bytes);
    let mut carried = Vec::new();
    // Bounded: every turn makes at least one attempt, and `retry` ends them at the maximum.
    loop {
        let (chosen, up) = flow::with_scratch(|s| {
            connect_attempts::start(client, target, &mut attempts, carried, s, shared)
        })?;
        if let Some(span) = conn_span() {
            span.record("host", field::display(chosen.host));
        }
        let (failure, unsent) = match TcpStream::from_std(up.socket) {
            Ok(upstream) if !up.connecting => return Some((chosen, upstream, up.unsent, up.sent)),
            Ok(upstream) => match handshake(&upstream, shared.connect_timeout(cluster)).await {
                Ok(()) => return Some((chosen, upstream, up.unsent, up.sent)),
                Err(failure) => (failure, up.unsent),
            },
            Err(err) => (ConnectFailure::Error(err), up.unsent),
        };
        conn::connect_failed(&failure, chosen.host, cluster, stats);
        if up.sent > 0 {
            // Bytes that went out with the connect cannot be sent again: no retry.
            flow::abort(client);
            return None;
        }
        if !attempts.retry(cluster, client, stats) {
            return None;
        }
        carried = unsent;
    }
}

/// Waits for a connect in progress to end, within `timeout`: writable, then the outcome from
/// `SO_ERROR` (the engine waits for the same on its epoll, with a timer).
async fn handshake(upstream: &TcpStream, timeout: Duration) -> Result<(), ConnectFailure> {
    let ended = async {
        upstream.writable().await?;
        match upstream.take_error()? {
            Some(e) => Err(e),
            None => Ok::<_, io::Error>(()),
        }
    };
    match tokio::time::timeout(timeout, ended).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(err)) => Err(ConnectFailure::Error(err)),
        Err(_) => Err(ConnectFailure::TimedOut(timeout)),
    }
}

/// With `splice: kernel`, hands the pair to the splicer; `None` means copy (copy mode, or the
/// splicer refused: counted `downstream_cx_splice_fallback`).
fn hand_to_kernel(
    client: &TcpStream,
    upstream: &TcpStream,
    shared: &Shared,
) -> Option<(SpliceGuard, Baseline)> {
    let (SpliceMode::Kernel, Some(splicer)) = (shared.config.splice, &shared.splicer) else {
        return None;
    };
    let stats = &shared.stats;
    let spliced = splice::baseline(client, upstream)
        .map_err(SpliceError::from)
        .and_then(|base| Ok((splicer.splice(client, upstream)?, base)));
    match spliced {
        Ok(pair) => {
            ProxyStats::inc(&stats.downstream_cx_splice_total);
            Some(pair)
        }
        Err(err) => {
            ProxyStats::inc(&stats.downstream_cx_splice_fallback);
            debug!(%err, "the kernel refused to splice the connection: copying it");
            None
        }
    }
}

/// The current connection's span, when debug logging is on: `Span::current` asks the
/// subscriber, which every connection would pay for at the default level for nothing.
fn conn_span() -> Option<tracing::Span> {
    tracing::enabled!(tracing::Level::DEBUG).then(tracing::Span::current)
}

#[cfg(test)]
mod tests {
    use std::{os::fd::AsFd, sync::atomic::Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::{
        addr::BackendAddr,
        connect_attempts::{StartFailed, Started, start_upstream},
    };

    const TIMEOUT: Duration = Duration::from_secs(5);

    /// A client connection as the listener hands it over (accepted, not registered), and the
    /// application's end of it.
    async fn accepted_client() -> (Client, TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let app = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (accepted, _) = listener.accept().unwrap();
        accepted.set_nonblocking(true).unwrap();
        (Client::Raw(accepted), app)
    }

    /// Waits until the accepted socket has something to report (bytes, an end, a reset),
    /// without taking it: poll() leaves a pending error where it is.
    fn wait_readable(client: &Client) {
        let ready = crate::sys::poll_readable(client.as_fd(), TIMEOUT).expect("poll");
        assert!(ready, "nothing arrived on the client's socket");
    }

    fn dead_addr() -> BackendAddr {
        BackendAddr(crate::testing::dead_addr())
    }

    fn start(
        client: &Client,
        host: BackendAddr,
        stats: &ProxyStats,
    ) -> Result<Started, StartFailed> {
        flow::with_scratch(|s| start_upstream(client, host, true, Vec::new(), s, stats))
    }

    #[tokio::test]
    async fn first_bytes_reach_the_host_and_are_counted() {
        let (client, mut app) = accepted_client().await;
        let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let host = BackendAddr(server.local_addr().unwrap());
        app.write_all(b"hello").await.unwrap();
        wait_readable(&client);
        let stats = ProxyStats::default();
        let Ok(Started::Upstream {
            socket,
            unsent,
            sent,
            connecting,
        }) = start(&client, host, &stats)
        else {
            panic!("not started");
        };
        // On loopback the handshake is done when connect() returns: the bytes went out in the
        // same turn (a busy machine may defer it, and then they wait in `unsent`).
        assert_eq!(sent + unsent.len() as u64, 5);
        assert_eq!(connecting, sent == 0);
        assert_eq!(
            stats.upstream_cx_tx_bytes_total.load(Ordering::Relaxed),
            sent
        );
        assert_eq!(stats.upstream_cx_total.load(Ordering::Relaxed), 1);
        let upstream = TcpStream::from_std(socket).unwrap();
        assert!(upstream.nodelay().unwrap());
        handshake(&upstream, TIMEOUT).await.unwrap();
        let (mut conn, peer) = server.accept().await.unwrap();
        assert_eq!(peer, upstream.local_addr().unwrap());
        let mut got = vec![0u8; sent as usize];
        conn.read_exact(&mut got).await.unwrap();
        assert_eq!([got, unsent].concat(), b"hello");
    }

    #[tokio::test]
    async fn refused_with_and_without_first_bytes() {
        for first in [&b"hello"[..], b""] {
            let (client, mut app) = accepted_client().await;
            if !first.is_empty() {
                app.write_all(first).await.unwrap();
                wait_readable(&client);
            }
            let stats = ProxyStats::default();
            let host = dead_addr();
            // The refusal comes from connect() or send() at once, or from the handshake.
            let err = match start(&client, host, &stats) {
                Err(StartFailed { err, unsent }) => {
                    assert_eq!(unsent, first, "the bytes read come back");
                    err
                }
                Ok(Started::Upstream {
                    socket,
                    connecting: true,
                    ..
                }) => {
                    let upstream = TcpStream::from_std(socket).unwrap();
                    match handshake(&upstream, TIMEOUT).await {
                        Err(ConnectFailure::Error(err)) => err,
                        other => panic!("{first:?}: {other:?}"),
                    }
                }
                Ok(_) => panic!("{first:?}: connected to a closed port"),
            };
            assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{first:?}");
            assert_eq!(stats.upstream_cx_total.load(Ordering::Relaxed), 1);
            assert_eq!(stats.upstream_cx_tx_bytes_total.load(Ordering::Relaxed), 0);
        }
    }

    #[tokio::test]
    async fn a_client_reset_before_the_start_is_reported_once() {
        let (client, app) = accepted_client().await;
        app.set_zero_linger().unwrap();
        drop(app);
        wait_readable(&client);
        let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let host = BackendAddr(server.local_addr().unwrap());
        let stats = ProxyStats::default();
        let Ok(Started::ClientFailed(err)) = start(&client, host, &stats) else {
            panic!("the client's reset was not reported");
        };
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset);
        assert_eq!(stats.upstream_cx_tx_bytes_total.load(Ordering::Relaxed), 0);
        assert_eq!(
            stats.upstream_cx_destroy_with_reset.load(Ordering::Relaxed),
            1
        );
    }
}
