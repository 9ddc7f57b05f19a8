//! The listener: accepts redirected connections, finds each one's original destination, refuses
//! what has none, and hands the rest to the TCP or HTTP path, each in a span of its own.

use std::{io, net::SocketAddr, sync::Arc, time::Duration};

use tokio::{
    net::{TcpListener, TcpSocket, TcpStream},
    time::Instant,
};
use tracing::{Instrument, debug, debug_span, field, warn};

use super::{
    ProxyProtocolMode, Service, Shared, copy,
    drain::DrainWatcher,
    http,
    orig_dst::{ClientAddr, OrigDstAddr, so_original_dst_at},
    proxy_protocol,
    stats::{ActiveConnection, ProxyStats},
    tcp,
};

/// Pending connections the kernel queues per listener before `accept()` (redirected
/// connections arrive in bursts when an application opens a pool).
const BACKLOG: u32 = 1024;
/// Pause after a failed `accept()` (EMFILE and the like) so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Binds one listener address (IPv6 addresses are v6-only, so `[::]` and `0.0.0.0` can both be
/// configured).
pub(super) fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => {
            let s = TcpSocket::new_v6()?;
            socket2::SockRef::from(&s).set_only_v6(true)?;
            s
        }
    };
    socket.set_reuseaddr(true)?;
    socket.set_nodelay(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// Accepts until draining starts, then drops the listener (new connects are refused).
pub(super) async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, drain: DrainWatcher) {
    // A listener on one address gives every accepted socket that local address: no
    // getsockname per connection (a wildcard listener still asks each socket).
    let local = listener
        .local_addr()
        .ok()
        .filter(|a| !a.ip().is_unspecified());
    loop {
        let accepted = tokio::select! {
            biased;
            () = drain.draining() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                tokio::spawn(handle(
                    stream,
                    ClientAddr(peer),
                    local,
                    shared.clone(),
                    drain.clone(),
                ));
            }
            Err(err) => {
                warn!(%err, "accept on the proxy listener failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// One accepted connection, from its original destination to its end.
async fn handle(
    mut stream: TcpStream,
    client: ClientAddr,
    local: Option<SocketAddr>,
    shared: Arc<Shared>,
    drain: DrainWatcher,
) {
    let _active = ActiveConnection::new(&shared.stats);
    // At debug level, like every event inside it: at the default level an enabled span would
    // cost each connection its creation and the formatting of its fields for nothing.
    let span = debug_span!(
        "proxy_conn",
        client = %client,
        orig_dst = field::Empty,
        host = field::Empty,
        sent = field::Empty,
        received = field::Empty,
        spliced = field::Empty,
        duration_ms = field::Empty,
    );
    let start = Instant::now();
    async {
        // TCP_NODELAY came with the socket: accept() copies it from the listener (`bind`).
        let Some(orig) = original_destination(&mut stream, client, local, &shared).await else {
            ProxyStats::inc(&shared.stats.downstream_cx_no_original_dst);
            debug!("no original destination: refused");
            copy::abort(&stream);
            return;
        };
        tracing::Span::current().record("orig_dst", field::display(orig));
        match shared.services.get(orig.0).cloned() {
            None => {
                ProxyStats::inc(&shared.stats.downstream_cx_no_route);
                debug!("no service at the original destination: refused");
                copy::abort(&stream);
            }
            Some(Service::OriginalDst { http: false }) => {
                tcp::forward(stream, tcp::Target::Original(orig), &shared, &drain).await;
            }
            Some(Service::Tcp(cluster)) => {
                tcp::forward(stream, tcp::Target::Cluster(cluster), &shared, &drain).await;
            }
            Some(service) => http::serve(stream, orig, service, shared.clone(), &drain).await,
        }
        let ms = start.elapsed().as_millis() as u64;
        tracing::Span::current().record("duration_ms", ms);
        debug!("connection closed");
    }
    .instrument(span)
    .await
}

/// The destination the client dialled: from a PROXY protocol header when configured, else
/// (when enabled) `SO_ORIGINAL_DST`, else the kernel's map. A destination that is the proxy
/// itself counts as unknown.
async fn original_destination(
    stream: &mut TcpStream,
    client: ClientAddr,
    local: Option<SocketAddr>,
    shared: &Shared,
) -> Option<OrigDstAddr> {
    let config = &shared.config;
    let dst = if config.proxy_protocol != ProxyProtocolMode::Off {
        let header = proxy_protocol::read_header(
            stream,
            config.proxy_protocol,
            config.proxy_protocol_timeout,
        )
        .await;
        match header {
            Ok(h) => h.destination,
            Err(err) => {
                ProxyStats::inc(&shared.stats.downstream_cx_proxy_proto_error);
                debug!(%err, "PROXY protocol header rejected");
                None
            }
        }
    } else {
        let local = match local {
            Some(l) => l,
            None => stream.local_addr().ok()?,
        };
        // With `iptables_redirect` NAT is what the user runs, so its answer is asked first: a
        // REDIRECTed connection then costs one getsockopt and no bpf syscall. A connection the
        // kernel redirected has no NAT entry (or, when conntrack follows it, one whose original
        // destination is this listener itself) and goes on to the kernel's map.
        let nat = || so_original_dst_at(stream, local).filter(|d| *d != local);
        config
            .iptables_redirect
            .then(nat)
            .flatten()
            .or_else(|| shared.original_dst.lookup(client.0, local))
    };
    let dst = dst?;
    if shared.is_self(dst) {
        debug!(%dst, "original destination is the proxy itself: refused");
        return None;
    }
    Some(OrigDstAddr(dst))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn accepted_sockets_inherit_nodelay() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        assert!(
            !client.unwrap().nodelay().unwrap(),
            "a socket starts with Nagle on"
        );
        assert!(accepted.unwrap().0.nodelay().unwrap());
    }
}
