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
    conn::{self, Chosen, ConnectFailure, ProxyClose, Started, Target},
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
    let stats = &shared.stats;
    let cluster = match target {
        Target::Cluster(c) => Some(c),
        Target::Original(_) => None,
    };
    let Some(Chosen {
        host,
        lease: _lease,
        active: _active,
        open: _open,
    }) = conn::choose(target, &client, shared)
    else {
        return;
    };
    if let Some(span) = conn_span() {
        span.record("host", field::display(host));
    }
    // Spliced pairs are handed over before any byte moves; others start with what the client
    // has sent already.
    let first_bytes = !(shared.config.splice == SpliceMode::Kernel && shared.splicer.is_some());
    let started =
        flow::with_scratch(|s| conn::start_upstream(&client, host, first_bytes, s, stats));
    let failed = |failure| conn::connect_failed(&failure, host, cluster, &client, stats);
    let (upstream, unsent, sent_first) = match started {
        Ok(Started::Upstream {
            socket,
            unsent,
            sent,
            connecting,
        }) => {
            let upstream = match TcpStream::from_std(socket) {
                Ok(upstream) => upstream,
                Err(err) => return failed(ConnectFailure::Error(err)),
            };
            if connecting
                && let Err(failure) = handshake(&upstream, shared.connect_timeout(cluster)).await
            {
                return failed(failure);
            }
            (upstream, unsent, sent)
        }
        Ok(Started::ClientFailed(err)) => {
            debug!(%err, "client failed before the upstream connection started: reset");
            return;
        }
        Err(err) => return failed(ConnectFailure::Error(err)),
    };
    conn::connected(host, cluster);
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
    use crate::addr::BackendAddr;

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
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        BackendAddr(l.local_addr().unwrap())
    }

    fn start(client: &Client, host: BackendAddr, stats: &ProxyStats) -> io::Result<Started> {
        flow::with_scratch(|s| conn::start_upstream(client, host, true, s, stats))
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
                Err(err) => err,
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
