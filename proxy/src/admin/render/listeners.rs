//! `/listeners`: what the daemon serves at, in Envoy's terms. A service's address is where an
//! Envoy would have a listener (an LDS listener becomes a service), though the kernel serves
//! it without a socket; the proxy path's listening sockets follow. Text: `name::address`
//! lines, as Envoy prints them; `?format=json`: `envoy.admin.v3.Listeners`.

use std::{fmt::Write as _, net::SocketAddr};

use proxy_core::config::{Protocol, Service};
use serde_json::{Value, json};

use crate::admin::State;

/// The name of the proxy path's listener at `index` of its sockets.
fn proxy_listener_name(index: usize) -> String {
    match index {
        0 => "proxy_listener".to_owned(),
        n => format!("proxy_listener_{n}"),
    }
}

/// One listener: its name, address and transport.
pub(super) struct Listening<'a> {
    pub(super) name: String,
    pub(super) addr: SocketAddr,
    pub(super) udp: bool,
    /// The service, for a service's address.
    pub(super) service: Option<&'a Service>,
}

/// Every listener: the services' addresses, then the proxy's sockets.
pub(super) fn listening(state: &State) -> Vec<Listening<'_>> {
    let mut out: Vec<Listening<'_>> = state
        .config
        .services
        .iter()
        .map(|svc| Listening {
            name: svc.name.clone(),
            addr: SocketAddr::new(svc.address, svc.port),
            udp: svc.protocol == Protocol::Udp,
            service: Some(svc),
        })
        .collect();
    let sockets = state
        .proxy
        .as_ref()
        .map(proxy_relay::ProxyStatsHandle::listeners)
        .unwrap_or_default();
    out.extend(sockets.iter().enumerate().map(|(i, addr)| Listening {
        name: proxy_listener_name(i),
        addr: *addr,
        udp: false,
        service: None,
    }));
    out
}

/// `envoy.config.core.v3.Address` of `addr` (`protocol` only for UDP: TCP is proto3's zero).
pub(super) fn address(addr: SocketAddr, udp: bool) -> Value {
    let mut socket = json!({
        "address": addr.ip().to_string(),
        "port_value": addr.port(),
    });
    if udp {
        socket["protocol"] = json!("UDP");
    }
    json!({ "socket_address": socket })
}

/// `/listeners`: `name::address` lines.
pub(crate) fn listeners_text(state: &State) -> String {
    let mut out = String::new();
    for l in listening(state) {
        let _ = writeln!(out, "{}::{}", l.name, l.addr);
    }
    out
}

/// `/listeners?format=json`: `envoy.admin.v3.Listeners`.
pub(crate) fn listeners_json(state: &State) -> Value {
    let statuses: Vec<Value> = listening(state)
        .into_iter()
        .map(|l| json!({ "name": l.name, "local_address": address(l.addr, l.udp) }))
        .collect();
    json!({ "listener_statuses": statuses })
}
