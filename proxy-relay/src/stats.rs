//! Counters of the proxy path, with Envoy's listener, cluster and HTTP stat names so dashboards
//! carry over. Lock-free: every connection task adds to them directly.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! stats {
    ($($(#[doc = $doc:literal])* $name:ident),* $(,)?) => {
        /// The proxy's counters and gauges.
        #[derive(Debug, Default)]
        pub struct ProxyStats {
            $($(#[doc = $doc])* pub $name: AtomicU64,)*
        }

        impl ProxyStats {
            /// Every stat as (Envoy name, value), in declaration order.
            pub fn snapshot(&self) -> Vec<(String, u64)> {
                vec![$((stringify!($name).to_owned(), self.$name.load(Ordering::Relaxed)),)*]
            }

            /// The description of the stat `name` (its doc comment), for a `# HELP` line.
            pub fn help(name: &str) -> Option<&'static str> {
                match name {
                    $(stringify!($name) => Some(concat!($($doc),*).trim_ascii_start()),)*
                    _ => None,
                }
            }
        }
    };
}

stats! {
    /// Connections accepted.
    downstream_cx_total,
    /// Connections open now (gauge).
    downstream_cx_active,
    /// Connections closed.
    downstream_cx_destroy,
    /// Connections refused because their original destination is unknown (never an open relay).
    downstream_cx_no_original_dst,
    /// Connections refused because their PROXY protocol header was missing or malformed.
    downstream_cx_proxy_proto_error,
    /// Connections refused because no service is configured at their original destination.
    downstream_cx_no_route,
    /// TCP connections handed to the kernel (`splice: kernel`); their bytes are not in the
    /// `upstream_cx_*_bytes_total` counters.
    downstream_cx_splice_total,
    /// TCP connections that `splice: kernel` could not hand to the kernel and that were copied
    /// in userspace instead.
    downstream_cx_splice_fallback,
    /// HTTP requests received.
    downstream_rq_total,
    /// HTTP requests that matched no route or had no host (answered 404 / 503).
    downstream_rq_no_route,
    /// HTTP connections upgraded (`101 Switching Protocols` relayed; bytes flow raw after it).
    downstream_cx_upgrades_total,
    /// Upgraded HTTP connections open now (gauge).
    downstream_cx_upgrades_active,
    /// Upgrade requests refused with 403 because the service does not allow their upgrade
    /// type (Envoy counts WebSocket and other upgrades under this name).
    downstream_rq_ws_on_non_ws_route,
    /// Upstream connections attempted.
    upstream_cx_total,
    /// Connections or requests with no healthy host to go to (Envoy's cluster stat).
    upstream_cx_none_healthy,
    /// Upstream connects that failed (refused, unreachable, timed out).
    upstream_cx_connect_fail,
    /// Upstream connects that timed out (also counted in `upstream_cx_connect_fail`).
    upstream_cx_connect_timeout,
    /// TCP connections reset because all their connects failed (`max_connect_attempts` of
    /// them, one by default); a retried connect is in `upstream_cx_connect_fail`.
    upstream_cx_connect_attempts_exceeded,
    /// Connections that ended with a reset from either side.
    upstream_cx_destroy_with_reset,
    /// Connections closed at the drain deadline after their host was removed.
    upstream_cx_drain_close,
    /// Connections closed because their host failed health checking.
    upstream_cx_health_close,
    /// Connections closed by a shutdown deadline.
    upstream_cx_shutdown_close,
    /// Bytes received from upstreams and copied to clients (spliced connections not included).
    upstream_cx_rx_bytes_total,
    /// Bytes copied from clients to upstreams (spliced connections not included).
    upstream_cx_tx_bytes_total,
    /// HTTP requests sent upstream (retries included).
    upstream_rq_total,
    /// HTTP request retries.
    upstream_rq_retry,
    /// Retried HTTP requests whose last attempt got a response the policy accepts.
    upstream_rq_retry_success,
    /// HTTP requests still retriable when their retries ran out.
    upstream_rq_retry_limit_exceeded,
    /// Retries that waited for Envoy's default jittered exponential back-off.
    upstream_rq_retry_backoff_exponential,
    /// Requests on a route with retries whose body was larger than the retry buffer
    /// (`RETRY_BUFFER_LIMIT`): streamed, and not retried once sent.
    retry_or_shadow_abandoned,
    /// HTTP requests that hit their route's request timeout (before the response headers: 504;
    /// during the body: the downstream stream is aborted).
    upstream_rq_timeout,
    /// HTTP requests whose route idle timeout fired (before the response headers: 408; during
    /// the body: the downstream stream is aborted).
    downstream_rq_idle_timeout,
    /// HTTP requests whose upstream connection or stream was reset (before or during the
    /// response).
    upstream_rq_rx_reset,
    /// Pooled HTTP connections reused.
    upstream_cx_pool_reuse,
}

impl ProxyStats {
    /// Adds one to a counter.
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds `n` to a counter (nothing is touched for 0).
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        if n > 0 {
            counter.fetch_add(n, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::Admitted;

    #[test]
    fn active_gauge_and_names() {
        let s = ProxyStats::default();
        {
            let _a = Admitted::new(&s);
            let _b = Admitted::new(&s);
            assert_eq!(s.downstream_cx_active.load(Ordering::Relaxed), 2);
        }
        let snap = s.snapshot();
        let get = |n: &str| snap.iter().find(|(k, _)| k == n).unwrap().1;
        assert_eq!(
            (
                get("downstream_cx_total"),
                get("downstream_cx_active"),
                get("downstream_cx_destroy")
            ),
            (2, 0, 2)
        );
        assert!(snap.iter().any(|(k, _)| k == "upstream_cx_rx_bytes_total"));
        assert_eq!(
            ProxyStats::help("downstream_cx_total"),
            Some("Connections accepted.")
        );
        assert!(ProxyStats::help("upstream_rq_timeout").is_some_and(|h| h.contains("504; during")));
        assert_eq!(ProxyStats::help("nope"), None);
    }
}
