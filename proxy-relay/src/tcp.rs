//! The TCP path: connect to the original destination or a cluster host, then the copy loop (or,
//! with `splice: kernel`, the kernel's splicing), until both sides are done, a side resets, the
//! host's drain deadline passes, or shutdown's.

use std::{io, sync::atomic::Ordering, time::Duration};

use proxy_core::config::proxy::SpliceMode;
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::TcpStream;
use tracing::{debug, field, warn};

use crate::{
    addr::{BackendAddr, OrigDstAddr},
    client::Client,
    cluster::{ClusterHandle, HostClose},
    conn::ProxyClose,
    copy::{self, Copied, CopyError, Meter},
    drain::DrainWatcher,
    orig_dst::HostLease,
    pool::{ConnectError, connect_tcp, within_connect_timeout},
    shared::Shared,
    splice::{self, Baseline, SpliceError, SpliceGuard},
    stats::ProxyStats,
};

/// Where a TCP connection goes.
pub(crate) enum Target {
    /// ORIGINAL_DST: the destination itself.
    Original(OrigDstAddr),
    /// A host of the cluster.
    Cluster(ClusterHandle),
}

/// Connects upstream and copies; the client is reset when no upstream can be had.
#[expect(
    clippy::too_many_lines,
    reason = "the tokio driver of one connection; it splits with the shared relay core of issue 29 item 2"
)]
pub(crate) async fn forward(client: Client, target: Target, shared: &Shared, drain: &DrainWatcher) {
    let stats = &shared.stats;
    let (host, cluster, _lease): (BackendAddr, Option<ClusterHandle>, Option<HostLease>) =
        match target {
            Target::Original(orig) => {
                let host = BackendAddr(orig.0);
                (host, None, Some(shared.orig_dst_cluster.lease(host)))
            }
            Target::Cluster(cluster) => {
                if let Some(host) = cluster.pick(&[]) {
                    (host, Some(cluster), None)
                } else {
                    ProxyStats::inc(&stats.upstream_cx_none_healthy);
                    debug!(cluster = cluster.name(), "no healthy host: refused");
                    copy::abort(&client);
                    return;
                }
            }
        };
    if let Some(span) = conn_span() {
        span.record("host", field::display(host));
    }
    // Spliced pairs are handed over before any byte moves; others start with what the client
    // has sent already.
    let spliced = shared.config.splice == SpliceMode::Kernel && shared.splicer.is_some();
    let started = if spliced {
        connect_tcp(host, shared.config.connect_timeout, stats)
            .await
            .map(|upstream| {
                let _ = upstream.set_nodelay(true);
                Started::Connected {
                    upstream,
                    unsent: Vec::new(),
                    sent: 0,
                }
            })
    } else {
        connect_with_first_bytes(&client, host, shared.config.connect_timeout, stats).await
    };
    let (upstream, unsent, sent_first) = match started {
        Ok(Started::Connected {
            upstream,
            unsent,
            sent,
        }) => (upstream, unsent, sent),
        Ok(Started::ClientFailed(err)) => {
            debug!(%err, "client failed before the upstream connection started: reset");
            return;
        }
        Err(err) => {
            if let Some(c) = &cluster {
                c.report_connect(host, false);
            }
            debug!(%err, "upstream connect failed: client reset");
            copy::abort(&client);
            return;
        }
    };
    if let Some(c) = &cluster {
        c.report_connect(host, true);
    }
    let client = match client.register() {
        Ok(c) => c,
        Err(err) => {
            warn!(%err, "could not register a connection with the event loop");
            copy::abort(&upstream);
            return;
        }
    };
    let policy = shared.drain_policy();
    let close = async {
        let host_closed = async {
            match &cluster {
                Some(c) => c.host_closed(host, policy).await,
                None => std::future::pending().await,
            }
        };
        let end = tokio::select! {
            () = drain.closing() => ProxyClose::Shutdown,
            why = host_closed => match why {
                HostClose::Drained => ProxyClose::Drained,
                HostClose::HealthFailure => ProxyClose::HealthFailure,
            },
        };
        end.count(stats);
        end.why()
    };
    let meter = Meter {
        tx: &stats.upstream_cx_tx_bytes_total,
        rx: &stats.upstream_cx_rx_bytes_total,
        resets: &stats.upstream_cx_destroy_with_reset,
    };
    let (copied, result) = if let Some((guard, base)) = hand_to_kernel(&client, &upstream, shared) {
        if let Some(span) = conn_span() {
            span.record("spliced", true);
        }
        // Boxed: kept inline, its state would size every connection's task, spliced or
        // not (5.7 KiB instead of 3.4 KiB per connection).
        let result = Box::pin(splice::run(client, upstream, guard, base, meter, close)).await;
        (Copied::default(), result)
    } else {
        let (mut copied, result) =
            copy::bidirectional(client, upstream, unsent, meter, close).await;
        copied.sent += sent_first;
        (copied, result)
    };
    if let Some(span) = conn_span() {
        span.record("sent", copied.sent);
        span.record("received", copied.received);
    }
    match result {
        Ok(()) => {}
        Err(CopyError::Closed(why)) => debug!(why, "connection closed by the proxy"),
        // Counted in `upstream_cx_destroy_with_reset` by the copy, before the reset went on.
        Err(err @ CopyError::Io { .. }) => debug!(%err, "connection reset"),
    }
}

/// How an upstream connection started.
enum Started {
    /// Connected; `sent` bytes of the client's went upstream already, `unsent` holds those
    /// read from the client that still go first.
    Connected {
        upstream: TcpStream,
        unsent: Vec<u8>,
        sent: u64,
    },
    /// The client's socket failed (a reset) while the connection started; the upstream one
    /// was reset, and counted in `upstream_cx_destroy_with_reset`.
    ClientFailed(io::Error),
}

/// Connects to `host` and passes on what the client has sent already, in the same turn of the
/// event loop when it can: a connect to a local host (loopback, a namespace's veth) is
/// complete before `connect()` returns, so the client's first bytes go straight out, and the
/// turn that waits for the connect, the connect timer and `SO_ERROR` are saved. The `send()`
/// itself tells whether the connection is up: it fails with the connect's error (a refusal),
/// or with `EAGAIN` while the handshake is still on, and then the connect is awaited as
/// usual, within `timeout`, and the bytes follow in the copy.
async fn connect_with_first_bytes(
    client: &Client,
    host: BackendAddr,
    timeout: Duration,
    stats: &ProxyStats,
) -> Result<Started, ConnectError> {
    ProxyStats::inc(&stats.upstream_cx_total);
    let failed = |source: io::Error| {
        ProxyStats::inc(&stats.upstream_cx_connect_fail);
        ConnectError::Connect { host, source }
    };
    let socket = start_connect(host).map_err(failed)?;
    let mut unsent = match copy::read_now(client) {
        Ok(bytes) => bytes,
        Err(err) => {
            // Counted before the upstream socket closes with the reset.
            ProxyStats::inc(&stats.upstream_cx_destroy_with_reset);
            let _ = socket.set_linger(Some(Duration::ZERO));
            return Ok(Started::ClientFailed(err));
        }
    };
    let (mut connected, mut sent) = (false, 0);
    if !unsent.is_empty() {
        match socket.send_with_flags(&unsent, libc::MSG_NOSIGNAL) {
            Ok(n) => {
                connected = true;
                sent = n as u64;
                stats
                    .upstream_cx_tx_bytes_total
                    .fetch_add(sent, Ordering::Relaxed);
                unsent.drain(..n);
                if unsent.is_empty() {
                    // An idle connection holds no buffer.
                    copy::recycle(std::mem::take(&mut unsent));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(failed(e)),
        }
    }
    let upstream = TcpStream::from_std(socket.into()).map_err(failed)?;
    if !connected {
        // tokio's connect: writable, then the connect's outcome from SO_ERROR.
        let handshake = async {
            upstream.writable().await?;
            match upstream.take_error()? {
                Some(e) => Err(e),
                None => Ok(()),
            }
        };
        within_connect_timeout(host, timeout, stats, handshake).await?;
    }
    Ok(Started::Connected {
        upstream,
        unsent,
        sent,
    })
}

/// Starts a non-blocking connect to `host` with `TCP_NODELAY` set: when this returns, the
/// connect is done (a local host) or in progress (`EINPROGRESS`; the socket turns writable when
/// it ends, and `SO_ERROR` tells how). The tokio path and the epoll engine both connect this way.
pub(crate) fn start_connect(host: BackendAddr) -> io::Result<Socket> {
    let socket = Socket::new(
        Domain::for_address(host.0),
        Type::STREAM.nonblocking().cloexec(),
        Some(Protocol::TCP),
    )?;
    socket.set_tcp_nodelay(true)?;
    match socket.connect(&host.0.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    Ok(socket)
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
    use std::os::fd::AsFd;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

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

    #[tokio::test]
    async fn first_bytes_reach_the_host_and_are_counted() {
        let (client, mut app) = accepted_client().await;
        let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let host = BackendAddr(server.local_addr().unwrap());
        app.write_all(b"hello").await.unwrap();
        wait_readable(&client);
        let stats = ProxyStats::default();
        let started = connect_with_first_bytes(&client, host, TIMEOUT, &stats).await;
        let Ok(Started::Connected {
            upstream,
            unsent,
            sent,
        }) = started
        else {
            panic!("not connected");
        };
        // On loopback the handshake is done when connect() returns: the bytes went out in the
        // same turn (a busy machine may defer it, and then they wait in `unsent`).
        assert_eq!(sent + unsent.len() as u64, 5);
        assert_eq!(
            stats.upstream_cx_tx_bytes_total.load(Ordering::Relaxed),
            sent
        );
        assert_eq!(stats.upstream_cx_total.load(Ordering::Relaxed), 1);
        assert!(upstream.nodelay().unwrap());
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
            let err = match connect_with_first_bytes(&client, host, TIMEOUT, &stats).await {
                Err(ConnectError::Connect { source, .. }) => source,
                Err(other) => panic!("{first:?}: {other}"),
                Ok(_) => panic!("{first:?}: connected to a closed port"),
            };
            assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{first:?}");
            assert_eq!(stats.upstream_cx_connect_fail.load(Ordering::Relaxed), 1);
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
        let started = connect_with_first_bytes(&client, host, TIMEOUT, &stats).await;
        let Ok(Started::ClientFailed(err)) = started else {
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
