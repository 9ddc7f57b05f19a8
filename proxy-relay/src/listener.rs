//! The listener: accepts redirected connections, finds each one's original destination, refuses
//! what has none, and hands the rest to the TCP or HTTP path, each in a span of its own.

use std::{collections::BTreeMap, io, net::SocketAddr, os::fd::AsFd, sync::Arc, time::Duration};

use proxy_core::config::proxy::ProxyProtocolMode;
use socket2::{Domain, Socket, Type};
use tokio::{io::unix::AsyncFd, net::TcpStream, time::Instant};
use tracing::{Instrument, debug, debug_span, field, warn};

use crate::{
    ProxyError,
    addr::{ClientAddr, OrigDstAddr},
    client::Client,
    conn::{Action, Admitted, Target},
    drain::DrainWatcher,
    flow, http,
    orig_dst::so_original_dst_at,
    proxy_protocol,
    service::Service,
    shared::Shared,
    stats::ProxyStats,
    sys, tcp,
};

/// Pending connections the kernel queues per listener before `accept()` (redirected
/// connections arrive in bursts when an application opens a pool).
const BACKLOG: i32 = 1024;
/// Pause after a failed `accept()` (EMFILE and the like) so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// A bound listener, registered with the event loop for readability; the sockets it accepts
/// are not (see [`Client`]).
pub(crate) type Listener = AsyncFd<std::net::TcpListener>;

/// Binds one listener address (IPv6 addresses are v6-only, so `[::]` and `0.0.0.0` can both be
/// configured).
#[cfg(test)]
pub(crate) fn bind(addr: SocketAddr) -> io::Result<Listener> {
    let listener = bind_std(addr, false)?;
    sys::register_readable(listener)
}

/// The sockets of one listener address for `n` engine threads: `SO_REUSEPORT`, so the kernel
/// spreads new connections over them, each accepted by one thread only. Port 0 becomes the
/// first socket's port for all.
pub(crate) fn bind_reuseport(addr: SocketAddr, n: usize) -> io::Result<Vec<std::net::TcpListener>> {
    let first = bind_std(addr, true)?;
    let addr = first.local_addr()?;
    let mut all = vec![first];
    for _ in 1..n.max(1) {
        all.push(bind_std(addr, true)?);
    }
    Ok(all)
}

fn bind_std(addr: SocketAddr, reuse_port: bool) -> io::Result<std::net::TcpListener> {
    let socket = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.nonblocking().cloexec(),
        None,
    )?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.set_reuse_address(true)?;
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    socket.set_tcp_nodelay(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

/// The listening sockets of every configured address, bound here or handed over, sorted for
/// the tokio accept loops or the epoll engine's threads.
pub(crate) struct Bound {
    /// One accept loop each (the tokio path).
    pub(crate) tokio: Vec<Listener>,
    /// Per engine thread, its sockets (the epoll engine).
    pub(crate) engine: Vec<Vec<std::net::TcpListener>>,
    /// The bound address of each configured one, in order.
    pub(crate) local_addrs: Vec<SocketAddr>,
    /// A second descriptor of every socket, for handing them over in turn.
    pub(crate) handover: Vec<std::net::TcpListener>,
}

/// Where a proxy's listening sockets come from.
pub(crate) enum Sockets {
    /// Bound here.
    Bind,
    /// Handed over by the daemon this one takes over from (or by the proxy a reload
    /// replaces): every configured address must be among them, and each of them configured.
    HandedOver(Vec<std::net::TcpListener>),
    /// Kept by the service manager across a restart: those of configured addresses are taken,
    /// configured addresses without one are bound, and the others are closed (the
    /// configuration changed).
    Stored(Vec<std::net::TcpListener>),
}

impl Bound {
    /// Binds `addrs` (`engine_threads`: `SO_REUSEPORT` sockets for that many engine threads,
    /// `None`: one socket each for the tokio path), or takes them from `given`.
    pub(crate) fn new(
        addrs: &[SocketAddr],
        engine_threads: Option<usize>,
        given: Sockets,
    ) -> Result<Self, ProxyError> {
        let (mut inherited, stored) = match given {
            Sockets::Bind => (None, false),
            Sockets::HandedOver(sockets) => (Some(by_address(sockets)?), false),
            Sockets::Stored(sockets) => (Some(by_address(sockets)?), true),
        };
        let mut bound = Self {
            tokio: Vec::new(),
            engine: std::iter::repeat_with(Vec::new)
                .take(engine_threads.unwrap_or(0))
                .collect(),
            local_addrs: Vec::new(),
            handover: Vec::new(),
        };
        for &addr in addrs {
            let bind_error = |source| ProxyError::Bind { addr, source };
            let handed = match inherited.as_mut() {
                Some(handed) => match take_handed_over(handed, addr, engine_threads) {
                    Ok(sockets) => Some(sockets),
                    Err(ProxyError::NotHandedOver { .. }) if stored => None,
                    Err(err) => return Err(err),
                },
                None => None,
            };
            let sockets = match (handed, engine_threads) {
                (Some(sockets), _) => sockets,
                (None, Some(n)) => bind_reuseport(addr, n).map_err(bind_error)?,
                (None, None) => vec![bind_std(addr, false).map_err(bind_error)?],
            };
            bound
                .local_addrs
                .push(sockets[0].local_addr().map_err(bind_error)?);
            for (i, socket) in sockets.into_iter().enumerate() {
                bound.handover.push(socket.try_clone().map_err(bind_error)?);
                match engine_threads {
                    Some(n) => bound.engine[i % n].push(socket),
                    None => bound
                        .tokio
                        .push(sys::register_readable(socket).map_err(bind_error)?),
                }
            }
        }
        match inherited {
            Some(left) if !left.is_empty() && stored => {
                let addrs: Vec<SocketAddr> = left.into_keys().collect();
                warn!(
                    ?addrs,
                    "closing stored listening sockets of addresses no longer configured"
                );
                Ok(bound)
            }
            Some(left) if !left.is_empty() => Err(ProxyError::HandedOverUnused {
                addrs: left.into_keys().collect(),
            }),
            _ => Ok(bound),
        }
    }
}

/// Handed-over sockets by their bound address; each must be a listening TCP socket.
fn by_address(
    sockets: Vec<std::net::TcpListener>,
) -> Result<BTreeMap<SocketAddr, Vec<std::net::TcpListener>>, ProxyError> {
    let mut by_addr: BTreeMap<SocketAddr, Vec<std::net::TcpListener>> = BTreeMap::new();
    for socket in sockets {
        let check = || -> io::Result<SocketAddr> {
            let sock = socket2::SockRef::from(&socket);
            if sock.r#type()? != Type::STREAM || !sock.is_listener()? {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "not a listening TCP socket",
                ));
            }
            socket.set_nonblocking(true)?;
            socket.local_addr()
        };
        let addr = check().map_err(ProxyError::HandedOverSocket)?;
        by_addr.entry(addr).or_default().push(socket);
    }
    Ok(by_addr)
}

/// The handed-over sockets of the configured `addr` (port 0: any port of its IP), plus, for an
/// engine with more threads than there are sockets and when they are `SO_REUSEPORT` sockets,
/// new ones in their group (best effort: the handed-over ones serve either way).
fn take_handed_over(
    handed: &mut BTreeMap<SocketAddr, Vec<std::net::TcpListener>>,
    addr: SocketAddr,
    engine_threads: Option<usize>,
) -> Result<Vec<std::net::TcpListener>, ProxyError> {
    let found = handed
        .keys()
        .copied()
        .find(|a| *a == addr || (addr.port() == 0 && a.ip() == addr.ip()));
    let Some((actual, mut sockets)) = found
        .and_then(|a| handed.remove_entry(&a))
        .filter(|(_, sockets)| !sockets.is_empty())
    else {
        return Err(ProxyError::NotHandedOver { addr });
    };
    let reuse_port = socket2::SockRef::from(&sockets[0])
        .reuse_port()
        .unwrap_or(false);
    let want = engine_threads.unwrap_or(0);
    while reuse_port && sockets.len() < want {
        match bind_std(actual, true) {
            Ok(socket) => sockets.push(socket),
            Err(err) => {
                warn!(%err, addr = %actual, "binding one more listening socket per engine thread failed; the handed-over ones serve");
                break;
            }
        }
    }
    Ok(sockets)
}

/// Accepts until draining starts, then drops the listener (new connects are refused).
pub(crate) async fn accept_loop(listener: Listener, shared: Arc<Shared>, drain: DrainWatcher) {
    // A listener on one address gives every accepted socket that local address: no
    // getsockname per connection (a wildcard listener still asks each socket).
    let local = listener
        .get_ref()
        .local_addr()
        .ok()
        .filter(|a| !a.ip().is_unspecified());
    // One wait for the drain, not one per accept: each new one would register with the
    // phase channel and leave it again.
    let draining = drain.draining();
    tokio::pin!(draining);
    loop {
        let mut ready = tokio::select! {
            biased;
            () = &mut draining => return,
            ready = listener.readable() => match ready {
                Ok(guard) => guard,
                Err(err) => {
                    warn!(%err, "waiting on the proxy listener failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        match ready.try_io(|l| sys::accept_nonblocking(l.get_ref())) {
            Ok(Ok((stream, peer))) => {
                tokio::spawn(handle(
                    Client::Raw(stream),
                    ClientAddr(peer),
                    local,
                    shared.clone(),
                    drain.clone(),
                ));
            }
            Ok(Err(err)) => {
                warn!(%err, "accept on the proxy listener failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
            // Nothing left to accept: the readiness was cleared, wait for the next.
            Err(_would_block) => {}
        }
    }
}

/// One accepted connection, from its original destination to its end.
async fn handle(
    stream: Client,
    client: ClientAddr,
    local: Option<SocketAddr>,
    shared: Arc<Shared>,
    drain: DrainWatcher,
) {
    let _admitted = Admitted::new(&*shared.stats);
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
    // The span's fields are filled in only when it is enabled: the default level pays neither
    // the clock nor the subscriber's lookup of the current span.
    let start = (!span.is_disabled()).then(Instant::now);
    let recorder = span.clone();
    async {
        // TCP_NODELAY came with the socket: accept() copies it from the listener (`bind`).
        let (stream, orig) = match original_destination(stream, client, local, &shared).await {
            Ok(found) => found,
            Err(err) => {
                warn!(%err, "could not register a connection with the event loop");
                return;
            }
        };
        let Some(orig) = orig else {
            ProxyStats::inc(&shared.stats.downstream_cx_no_original_dst);
            debug!("no original destination: refused");
            flow::abort(&stream);
            return;
        };
        if start.is_some() {
            recorder.record("orig_dst", field::display(orig));
        }
        match shared.actions.lookup(orig) {
            None => {
                ProxyStats::inc(&shared.stats.downstream_cx_no_route);
                debug!("no service at the original destination: refused");
                flow::abort(&stream);
            }
            Some(Action::Original) => {
                tcp::forward(stream, Target::Original(orig), &shared, &drain).await;
            }
            Some(Action::Cluster(cluster)) => {
                tcp::forward(stream, Target::Cluster(cluster), &shared, &drain).await;
            }
            Some(Action::Http(service)) => match stream.register() {
                Ok(stream) => {
                    http::serve(stream, orig, service.clone(), shared.clone(), &drain).await;
                }
                Err(err) => warn!(%err, "could not register a connection with the event loop"),
            },
        }
        if let Some(start) = start {
            recorder.record("duration_ms", start.elapsed().as_millis() as u64);
        }
        debug!("connection closed");
    }
    .instrument(span)
    .await;
}

/// The destination the client dialled: from a PROXY protocol header when configured, else
/// (when enabled) `SO_ORIGINAL_DST`, else the kernel's map. A destination that is the proxy
/// itself counts as unknown. An error means the socket could not join the event loop to read
/// the PROXY header (it is closed).
async fn original_destination(
    stream: Client,
    client: ClientAddr,
    local: Option<SocketAddr>,
    shared: &Shared,
) -> io::Result<(Client, Option<OrigDstAddr>)> {
    let config = &shared.config;
    // A header is read only from a trusted peer: it names where the proxy connects. Any other
    // peer is served only if the kernel (or NAT) recorded its destination.
    let trusted = config.proxy_protocol != ProxyProtocolMode::Off
        && config
            .proxy_protocol_trusted_sources
            .iter()
            .any(|net| net.contains(client.0.ip()));
    let (stream, dst) = if trusted {
        let mut stream = stream.register()?;
        let header = proxy_protocol::read_header(
            &mut stream,
            config.proxy_protocol,
            config.proxy_protocol_timeout,
        )
        .await;
        let dst = match header {
            Ok(h) => h.destination,
            Err(err) => {
                ProxyStats::inc(&shared.stats.downstream_cx_proxy_proto_error);
                debug!(%err, "PROXY protocol header rejected");
                None
            }
        };
        (Client::Registered(stream), dst)
    } else {
        let dst = nat_or_map(&stream, client, local, shared);
        (stream, dst)
    };
    Ok((stream, not_self(dst, shared)))
}

/// The original destination of a connection without a PROXY protocol header (the engine's
/// accept; see [`original_destination`]).
pub(crate) fn redirected_destination(
    stream: &impl AsFd,
    client: ClientAddr,
    local: Option<SocketAddr>,
    shared: &Shared,
) -> Option<OrigDstAddr> {
    not_self(nat_or_map(stream, client, local, shared), shared)
}

fn nat_or_map(
    stream: &impl AsFd,
    client: ClientAddr,
    local: Option<SocketAddr>,
    shared: &Shared,
) -> Option<SocketAddr> {
    let local = match local {
        Some(l) => Some(l),
        None => socket2::SockRef::from(stream)
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket()),
    };
    let local = local?;
    // With `iptables_redirect` NAT is what the user runs, so its answer is asked first: a
    // REDIRECTed connection then costs one getsockopt and no bpf syscall. A connection the
    // kernel redirected has no NAT entry (or, when conntrack follows it, one whose original
    // destination is this listener itself) and goes on to the kernel's map.
    let nat = || so_original_dst_at(stream, local).filter(|d| *d != local);
    shared
        .config
        .iptables_redirect
        .then(nat)
        .flatten()
        .or_else(|| shared.original_dst.lookup(client.0, local))
}

/// A destination that is the proxy itself counts as unknown (a connection to it would loop).
fn not_self(dst: Option<SocketAddr>, shared: &Shared) -> Option<OrigDstAddr> {
    match dst {
        Some(dst) if shared.is_self(dst) => {
            debug!(%dst, "original destination is the proxy itself: refused");
            None
        }
        dst => dst.map(OrigDstAddr),
    }
}

/// A connection the engine accepted (and counted in `admitted`) for an HTTP service: the tokio
/// path from here, like one accepted by [`accept_loop`].
pub(crate) async fn serve_http_accepted(
    stream: std::net::TcpStream,
    client: ClientAddr,
    orig: OrigDstAddr,
    service: Service,
    shared: Arc<Shared>,
    drain: DrainWatcher,
    admitted: Admitted<Arc<ProxyStats>>,
) {
    let _admitted = admitted;
    let span = debug_span!("proxy_conn", client = %client, orig_dst = %orig);
    async {
        match TcpStream::from_std(stream) {
            Ok(stream) => http::serve(stream, orig, service, shared.clone(), &drain).await,
            Err(err) => warn!(%err, "could not register a connection with the event loop"),
        }
        debug!("connection closed");
    }
    .instrument(span)
    .await;
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    #[tokio::test]
    async fn accepted_sockets_inherit_nodelay_and_are_nonblocking() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.get_ref().local_addr().unwrap();
        let client = TcpStream::connect(addr).await.unwrap();
        assert!(!client.nodelay().unwrap(), "a socket starts with Nagle on");
        let mut ready = listener.readable().await.unwrap();
        let (accepted, peer) = ready
            .try_io(|l| sys::accept_nonblocking(l.get_ref()))
            .expect("readable")
            .expect("accepted");
        assert_eq!(peer, client.local_addr().unwrap());
        assert!(accepted.nodelay().unwrap());
        let mut buf = [0u8; 1];
        let err = (&accepted).read(&mut buf).expect_err("nothing sent yet");
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock, "SOCK_NONBLOCK");
        assert!(Client::Raw(accepted).register().is_ok());
    }
}
