//! Envoy's router drop overload on the proxy path: a request to a cluster whose host set has
//! `drop_overloads` is refused by chance at that share, before a host is chosen, with Envoy
//! 1.40's local reply.

use std::sync::atomic::Ordering;

use http::{HeaderValue, Response, StatusCode};
use tracing::debug;

use super::local_reply;
use crate::{cluster::ClusterHandle, pool::Body};

/// Envoy's router drop: with the host set's `drop_overloads`, a request is refused by chance
/// at that share before a host is chosen: a local 503, `drop overload` with
/// `x-envoy-drop-overload: true`, or at 100 % Envoy's unconditional drop (`unconditional drop
/// overload`, `x-envoy-unconditional-drop-overload: true`); counted in
/// `upstream_rq_drop_overload`.
pub(super) fn reply(cluster: &ClusterHandle) -> Option<Response<Body>> {
    let share = cluster.drop_overload();
    if share.is_none() || !share.drops(fastrand::u32(..)) {
        return None;
    }
    let traffic = cluster.traffic();
    traffic.rq_drop_overload.fetch_add(1, Ordering::Relaxed);
    debug!(
        cluster = cluster.name(),
        "request dropped by drop_overloads"
    );
    let (text, header) = if share.is_unconditional() {
        (
            "unconditional drop overload",
            "x-envoy-unconditional-drop-overload",
        )
    } else {
        ("drop overload", "x-envoy-drop-overload")
    };
    let mut resp = local_reply(StatusCode::SERVICE_UNAVAILABLE, text);
    resp.headers_mut()
        .insert(header, HeaderValue::from_static("true"));
    Some(resp)
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt as _;

    use super::*;

    /// A cluster whose routing drops `numerator` percent: Envoy's two answers, none at 0 %.
    #[test]
    fn answers_as_envoys_router() {
        use proxy_core::health::{
            Routing,
            drop_overload::{Denominator, DropOverload},
        };
        let handle = |numerator| {
            let routing = Routing {
                drop_overload: DropOverload::new(numerator, Denominator::Hundred).unwrap(),
                ..Routing::default()
            };
            let (_tx, rx) = tokio::sync::watch::channel(routing);
            ClusterHandle::new("c", rx, true, std::time::Duration::from_secs(1))
        };
        let all = handle(100);
        let answer = reply(&all).expect("100 % drops every request");
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(answer.headers().get("x-envoy-drop-overload").is_none());
        assert_eq!(
            answer.headers()["x-envoy-unconditional-drop-overload"],
            "true"
        );
        assert_eq!(body_text(answer), "unconditional drop overload");
        let count = || all.traffic().rq_drop_overload.load(Ordering::Relaxed);
        assert_eq!(count(), 1);
        let none = handle(0);
        assert!((0..1000).all(|_| reply(&none).is_none()));
        // At 99 %, 100 requests all pass with odds 1e-200: one is dropped, with Envoy's words.
        let most = handle(99);
        let answer = (0..100).find_map(|_| reply(&most)).expect("a drop at 99 %");
        assert_eq!(answer.headers()["x-envoy-drop-overload"], "true");
        let body = body_text(answer);
        assert_eq!(body, "drop overload");
    }

    fn body_text(answer: Response<Body>) -> String {
        let bytes = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(answer.into_body().collect())
            .unwrap()
            .to_bytes();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}
