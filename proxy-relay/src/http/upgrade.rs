//! HTTP/1.1 upgrades (WebSocket and others) on the HTTP path, as Envoy's `upgrade_configs`: an
//! upgrade type the service allows goes to one host with its `Upgrade` and `Connection`
//! headers, the upstream's `101 Switching Protocols` is relayed, and from then on bytes flow
//! raw both ways until both sides have closed (or the shutdown deadline has passed). Any other
//! upgrade is answered 403 and the connection closed, as Envoy does
//! (`downstream_rq_ws_on_non_ws_route`).

use std::sync::{Arc, atomic::Ordering};

use http::{
    HeaderValue, Request, Response, StatusCode,
    header::{CONNECTION, UPGRADE},
};
use http_body_util::BodyExt;
use hyper::{body::Incoming, upgrade::OnUpgrade};
use hyper_util::rt::TokioIo;
use proxy_core::config::{UpgradeConfig, default_upgrade_configs};
use tracing::debug;

use super::{Answer, BoxError, Ctx, local_reply, strip_hop_by_hop};
use crate::{
    drain::DrainWatcher,
    pool::{Body, Sender},
    stats::ProxyStats,
};

/// The upgrade types one service lets through.
#[derive(Clone, Debug)]
pub struct UpgradePolicy {
    /// Enabled types, lowercase.
    allowed: Vec<String>,
}

impl UpgradePolicy {
    /// The enabled types of `configs` (a service's `upgrade_configs`).
    pub fn from_config(configs: &[UpgradeConfig]) -> Self {
        let allowed = configs
            .iter()
            .filter(|c| c.enabled)
            .map(|c| c.upgrade_type.to_ascii_lowercase())
            .collect();
        Self { allowed }
    }

    /// Whether an `Upgrade` header value is allowed (compared without regard to case).
    pub fn allows(&self, kind: &HeaderValue) -> bool {
        let kind = String::from_utf8_lossy(kind.as_bytes())
            .trim()
            .to_ascii_lowercase();
        self.allowed.contains(&kind)
    }
}

impl Default for UpgradePolicy {
    /// `websocket` only, as Consul configures HTTP services.
    fn default() -> Self {
        Self::from_config(&default_upgrade_configs())
    }
}

/// The upgrade a request asks for: its `Upgrade` value when `Connection` names `upgrade`
/// (HTTP/1.1; HTTP/2 has no such headers). `h2c` is not an upgrade here: like Envoy, the
/// request is served as plain HTTP/1.1 and the headers are dropped on the way.
pub(super) fn requested<B>(req: &Request<B>) -> Option<HeaderValue> {
    let upgrade = req.headers().get(UPGRADE)?;
    let connection_upgrade = req.headers().get_all(CONNECTION).iter().any(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
        })
    });
    let h2c = upgrade.as_bytes().eq_ignore_ascii_case(b"h2c");
    (connection_upgrade && !h2c).then(|| upgrade.clone())
}

/// Marks a request whose upgrade headers go upstream (read by `upstream_request`).
#[derive(Clone)]
pub(super) struct KeepUpgrade(pub HeaderValue);

/// Envoy's answer to an upgrade the service does not allow: 403 with an empty body, and the
/// connection closed (upgrade payload might follow the request).
pub(super) fn refused(ctx: &Ctx) -> Response<Body> {
    ProxyStats::inc(&ctx.shared.stats.downstream_rq_ws_on_non_ws_route);
    let mut resp = local_reply(StatusCode::FORBIDDEN, "");
    resp.headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// Takes the client side of an upgrade request (to await once the 101 has gone out) and marks
/// the request so its upgrade headers are forwarded.
pub(super) fn prepare(req: &mut Request<Incoming>, kind: HeaderValue) -> OnUpgrade {
    req.extensions_mut().insert(KeepUpgrade(kind));
    hyper::upgrade::on(req)
}

/// The upstream's answer for the client. A 101 starts the tunnel between `client` and the
/// upstream connection (kept in `ctx` so the client connection lasts as long as the tunnel);
/// any other answer is relayed as it is and nothing is upgraded (the upstream connection is
/// not pooled again).
pub(super) fn answer(answer: Answer, client: OnUpgrade, ctx: &Ctx) -> Response<Body> {
    let Answer {
        mut resp, sender, ..
    } = answer;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let upstream = hyper::upgrade::on(&mut resp);
        let stats = ctx.shared.stats.clone();
        ProxyStats::inc(&stats.downstream_cx_upgrades_total);
        let task = tokio::spawn(tunnel(client, upstream, sender, stats));
        *ctx.tunnel
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(task);
    }
    let kind = resp.headers().get(UPGRADE).cloned();
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    if let (StatusCode::SWITCHING_PROTOCOLS, Some(kind)) = (parts.status, kind) {
        parts
            .headers
            .insert(CONNECTION, HeaderValue::from_static("upgrade"));
        parts.headers.insert(UPGRADE, kind);
    }
    Response::from_parts(parts, body.map_err(BoxError::from).boxed())
}

/// Waits for the tunnel of an upgraded client connection, if it has one, until it ends or the
/// shutdown deadline passes (then it is dropped, closing both sides).
pub(super) async fn finish(ctx: &Ctx, drain: &DrainWatcher) {
    let tunnel = ctx
        .tunnel
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    if let Some(mut tunnel) = tunnel {
        tokio::select! {
            _ = &mut tunnel => {}
            () = drain.closing() => {
                tunnel.abort();
                debug!("shutdown deadline passed: upgraded connection dropped");
            }
        }
    }
}

/// Copies bytes both ways between the upgraded client and upstream connections until each side
/// has closed its half (a close is passed on to the other side as a TCP half-close).
/// `sender` is held until both upgrades are in.
async fn tunnel(client: OnUpgrade, upstream: OnUpgrade, sender: Sender, stats: Arc<ProxyStats>) {
    let _active = Active::new(stats);
    let joined = tokio::try_join!(client, upstream);
    drop(sender);
    let (client, upstream) = match joined {
        Ok(pair) => pair,
        Err(err) => {
            debug!(%err, "upgrade did not complete");
            return;
        }
    };
    let (mut client, mut upstream) = (TokioIo::new(client), TokioIo::new(upstream));
    match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
        Ok((up, down)) => debug!(up, down, "upgraded connection closed"),
        Err(err) => debug!(%err, "upgraded connection ended with an error"),
    }
}

/// Holds `downstream_cx_upgrades_active` up while a tunnel lives.
struct Active(Arc<ProxyStats>);

impl Active {
    fn new(stats: Arc<ProxyStats>) -> Self {
        ProxyStats::inc(&stats.downstream_cx_upgrades_active);
        Self(stats)
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.0
            .downstream_cx_upgrades_active
            .fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(headers: &[(&str, &str)]) -> Request<()> {
        let mut b = Request::builder().uri("/ws");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn what_counts_as_an_upgrade() {
        let ws = req(&[
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "WebSocket"),
        ]);
        assert_eq!(requested(&ws).unwrap(), "WebSocket");
        assert!(requested(&req(&[("upgrade", "websocket")])).is_none());
        assert!(requested(&req(&[("connection", "upgrade")])).is_none());
        let h2c = req(&[
            ("connection", "Upgrade, HTTP2-Settings"),
            ("upgrade", "h2c"),
        ]);
        assert!(requested(&h2c).is_none());
    }

    #[test]
    fn policy_of_the_config() {
        let default = UpgradePolicy::default();
        assert!(default.allows(&HeaderValue::from_static("WebSocket")));
        assert!(!default.allows(&HeaderValue::from_static("spdy/3.1")));
        let configs = [
            UpgradeConfig {
                upgrade_type: "websocket".to_owned(),
                enabled: false,
            },
            UpgradeConfig {
                upgrade_type: "Spdy/3.1".to_owned(),
                enabled: true,
            },
        ];
        let policy = UpgradePolicy::from_config(&configs);
        assert!(!policy.allows(&HeaderValue::from_static("websocket")));
        assert!(policy.allows(&HeaderValue::from_static("spdy/3.1")));
        assert!(!UpgradePolicy::from_config(&[]).allows(&HeaderValue::from_static("websocket")));
    }
}
