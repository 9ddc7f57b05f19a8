//! Who may ask what, checked before any handler runs: on TCP the `Host` must name the admin
//! interface itself (a web page that a local browser shows, or a DNS name rebound to loopback,
//! cannot reach it); read-only endpoints take GET and HEAD only, state-changing ones POST only;
//! and state changes are served on a unix socket of mode 0600 (root's), on TCP only when the
//! operator turned them on there.

use std::net::SocketAddr;

use hyper::{HeaderMap, Method, Request, StatusCode, Uri, Version, header::HOST};

use super::{Response, routes};

/// What a listener's clients may do.
#[derive(Clone, Debug)]
pub(super) enum Access {
    /// A unix socket of mode 0600: only its owner connects; everything is served, no `Host`
    /// is checked.
    Owner,
    /// A TCP listener: anyone on the host (or beyond) may connect.
    Tcp {
        /// The configured address; `Host` must name it (or loopback at its port).
        address: SocketAddr,
        /// Whether state-changing endpoints are served here (`admin.allow_tcp_mutations`).
        mutations: bool,
        /// Where state changes go instead (the control socket), for the 403's text.
        control: String,
    },
}

/// What a request does, by its endpoint and method.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Effect {
    Read,
    Change,
}

/// The refusal of `request`'s head on a listener with `access`, if it is refused; `local` is
/// the address the TCP client connected to.
pub(super) fn admit<B>(
    head: &Request<B>,
    access: &Access,
    local: Option<SocketAddr>,
) -> Result<(), Response> {
    let Access::Tcp {
        address,
        mutations,
        control,
    } = access
    else {
        return effect(head.method(), head.uri().path(), head.uri().query()).map(drop);
    };
    check_host(head.version(), head.headers(), head.uri(), *address, local)?;
    let path = head.uri().path();
    if effect(head.method(), path, head.uri().query())? == Effect::Change && !mutations {
        return Err(forbidden(head.method(), path, *address, control));
    }
    Ok(())
}

/// The request's [`Effect`], or a 405 naming the methods its endpoint takes. An unknown path
/// passes (the handler answers 404 for any method).
fn effect(method: &Method, path: &str, query: Option<&str>) -> Result<Effect, Response> {
    let read = method == Method::GET || method == Method::HEAD;
    match routes::kind(path) {
        None => Ok(Effect::Read),
        Some(routes::Kind::Read) if read => Ok(Effect::Read),
        Some(routes::Kind::Read) => Err(not_allowed(method, path, "GET, HEAD", "it only shows")),
        Some(routes::Kind::Change) if method == Method::POST => Ok(Effect::Change),
        Some(routes::Kind::Change) => Err(not_allowed(method, path, "POST", CHANGES)),
        // `/logging` shows the filter (GET, HEAD) and sets it (POST with `?level=`).
        Some(routes::Kind::Both) if method == Method::POST => Ok(Effect::Change),
        Some(routes::Kind::Both) if read && query.is_none_or(str::is_empty) => Ok(Effect::Read),
        Some(routes::Kind::Both) if read => Err(not_allowed(method, path, "POST", CHANGES)),
        Some(routes::Kind::Both) => Err(not_allowed(
            method,
            path,
            "GET, HEAD, POST",
            "it shows (GET) and changes (POST) the server's state",
        )),
    }
}

const CHANGES: &str = "it changes the server's state, so it takes POST";

fn not_allowed(method: &Method, path: &str, allow: &'static str, why: &str) -> Response {
    tracing::debug!(%method, path, "admin: refused a method the endpoint does not take");
    let mut refused = Response::text(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("method {method} is not allowed on {path}: {why}\n"),
    );
    refused.allow = Some(allow);
    refused
}

/// The 403 of a state change on a TCP listener that does not serve them.
fn forbidden(method: &Method, path: &str, address: SocketAddr, control: &str) -> Response {
    tracing::info!(%method, path, "admin: refused a state change on the TCP listener");
    let cli = if path == "/reload" {
        "`proxy reload`, or "
    } else {
        ""
    };
    Response::text(
        StatusCode::FORBIDDEN,
        format!(
            "{method} {path} changes the daemon's state and is not served on the TCP admin \
             interface {address} (any local user can reach it); send it to the control socket \
             {control} as root ({cli}curl --unix-socket {control} -X {method} \
             http://localhost{path}), or set admin.allow_tcp_mutations: true\n"
        ),
    )
}

/// `Host` (and an absolute-form target's authority) must name this admin interface: its
/// configured address, the address the client connected to, or loopback at the port. A
/// HTTP/1.1 request without `Host` is refused as well; a HTTP/1.0 one may omit it.
fn check_host(
    version: Version,
    headers: &HeaderMap,
    uri: &Uri,
    address: SocketAddr,
    local: Option<SocketAddr>,
) -> Result<(), Response> {
    let mut hosts = headers.get_all(HOST).iter();
    let (host, more) = (hosts.next(), hosts.next());
    if more.is_some() {
        return Err(bad_host(
            StatusCode::BAD_REQUEST,
            "more than one Host header",
        ));
    }
    let host = match host.map(|h| h.to_str()) {
        Some(Ok(host)) => Some(host),
        Some(Err(_)) => return Err(bad_host(StatusCode::BAD_REQUEST, "a Host that is not text")),
        None if version == Version::HTTP_11 => {
            return Err(bad_host(
                StatusCode::BAD_REQUEST,
                "no Host header (HTTP/1.1 requires one; name this admin interface, e.g. \
                 Host: 127.0.0.1:15000)",
            ));
        }
        None => None,
    };
    for name in host
        .into_iter()
        .chain(uri.authority().map(hyper::http::uri::Authority::as_str))
    {
        if !names_admin(name, address, local) {
            return Err(bad_host(
                StatusCode::MISDIRECTED_REQUEST,
                &format!(
                    "host {name:?} is not this admin interface's; it answers requests addressed \
                     to {address}, localhost:{port}, 127.0.0.1:{port} or [::1]:{port} only (a \
                     guard against web pages and DNS rebinding)",
                    port = address.port()
                ),
            ));
        }
    }
    Ok(())
}

fn bad_host(status: StatusCode, why: &str) -> Response {
    tracing::debug!(why, "admin: refused a request by its Host");
    Response::text(status, format!("refused: {why}\n"))
}

/// Whether `host` (`name[:port]`, any case) names the admin interface at `address`.
fn names_admin(host: &str, address: SocketAddr, local: Option<SocketAddr>) -> bool {
    let port = address.port();
    let host = host.to_ascii_lowercase();
    let with_port = |name: String| host == format!("{name}:{port}") || (port == 80 && host == name);
    let ip_name = |addr: SocketAddr| match addr {
        SocketAddr::V4(v4) => v4.ip().to_string(),
        SocketAddr::V6(v6) => format!("[{}]", v6.ip()),
    };
    [
        "localhost".to_owned(),
        "127.0.0.1".to_owned(),
        "[::1]".to_owned(),
    ]
    .into_iter()
    .chain([ip_name(address)])
    .chain(local.map(ip_name))
    .any(with_port)
}

#[cfg(test)]
mod tests;
