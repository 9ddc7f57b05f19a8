//! The TCP path: connect to the original destination or a cluster host, then the copy loop (or,
//! with `splice: kernel`, the kernel's splicing), until both sides are done, a side resets, the
//! host's drain deadline passes, or shutdown's.

use tokio::net::TcpStream;
use tracing::{debug, field};

use super::{
    Shared,
    cluster::{ClusterHandle, HostClose},
    SpliceMode,
    copy::{self, Copied, CopyError, Meter},
    drain::DrainWatcher,
    orig_dst::{BackendAddr, HostLease, OrigDstAddr},
    pool::connect_tcp,
    splice::{self, Baseline, SpliceError, SpliceGuard},
    stats::ProxyStats,
};

/// Where a TCP connection goes.
pub(super) enum Target {
    /// ORIGINAL_DST: the destination itself.
    Original(OrigDstAddr),
    /// A host of the cluster.
    Cluster(ClusterHandle),
}

/// Connects upstream and copies; the client is reset when no upstream can be had.
pub(super) async fn forward(
    client: TcpStream,
    target: Target,
    shared: &Shared,
    drain: &DrainWatcher,
) {
    let stats = &shared.stats;
    let (host, cluster, _lease): (BackendAddr, Option<ClusterHandle>, Option<HostLease>) =
        match target {
            Target::Original(orig) => {
                let host = BackendAddr(orig.0);
                (host, None, Some(shared.orig_dst_cluster.lease(host)))
            }
            Target::Cluster(cluster) => match cluster.pick(&[]) {
                Some(host) => (host, Some(cluster), None),
                None => {
                    ProxyStats::inc(&stats.upstream_cx_none_healthy);
                    debug!(cluster = cluster.name(), "no healthy host: refused");
                    copy::abort(&client);
                    return;
                }
            },
        };
    tracing::Span::current().record("host", field::display(host));
    let upstream = match connect_tcp(host, shared.config.connect_timeout, stats).await {
        Ok(s) => s,
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
    let _ = upstream.set_nodelay(true);
    let policy = shared.drain_policy();
    let close = async {
        let host_closed = async {
            match &cluster {
                Some(c) => c.host_closed(host, policy).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = drain.closing() => {
                ProxyStats::inc(&stats.upstream_cx_shutdown_close);
                "shutdown deadline passed"
            }
            why = host_closed => match why {
                HostClose::Drained => {
                    ProxyStats::inc(&stats.upstream_cx_drain_close);
                    "host removed and drain timeout passed"
                }
                HostClose::HealthFailure => {
                    ProxyStats::inc(&stats.upstream_cx_health_close);
                    "host failed health checking"
                }
            },
        }
    };
    let meter = Meter {
        tx: &stats.upstream_cx_tx_bytes_total,
        rx: &stats.upstream_cx_rx_bytes_total,
    };
    let (copied, result) = match hand_to_kernel(&client, &upstream, shared) {
        Some((guard, base)) => {
            tracing::Span::current().record("spliced", true);
            // Boxed: kept inline, its state would size every connection's task, spliced or
            // not (5.7 KiB instead of 3.4 KiB per connection).
            let result =
                Box::pin(splice::run(client, upstream, guard, base, meter, close)).await;
            (Copied::default(), result)
        }
        None => copy::bidirectional(client, upstream, meter, close).await,
    };
    let span = tracing::Span::current();
    span.record("sent", copied.sent);
    span.record("received", copied.received);
    match result {
        Ok(()) => {}
        Err(CopyError::Closed(why)) => debug!(why, "connection closed by the proxy"),
        Err(err @ CopyError::Io { .. }) => {
            ProxyStats::inc(&stats.upstream_cx_destroy_with_reset);
            debug!(%err, "connection reset");
        }
    }
}

/// With `splice: kernel`, hands the pair to the splicer; `None` means copy (copy mode, or the
/// splicer refused: counted `downstream_cx_splice_fallback`).
fn hand_to_kernel(
    client: &TcpStream,
    upstream: &TcpStream,
    shared: &Shared,
) -> Option<(SpliceGuard, Baseline)> {
    let splicer = match (shared.config.splice, &shared.splicer) {
        (SpliceMode::Kernel, Some(s)) => s,
        _ => return None,
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
