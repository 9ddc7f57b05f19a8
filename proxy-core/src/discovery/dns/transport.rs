//! How [`super::HickoryResolver`] talks to name servers: UDP sockets connected to the server,
//! one datagram per try, and hickory's own TCP for answers that come back truncated.
//!
//! Two hickory defaults make it unlike Envoy's c-ares, and both are replaced here:
//! * hickory's UDP sockets are not connected, so Linux never reports the ICMP "port
//!   unreachable" (or "host unreachable") of a server that is down to them: the lookup waits for
//!   its whole timeout, again for every attempt. c-ares connects its UDP sockets and fails the
//!   try at once. With a connected socket, the lookup's own `recv` returns `ECONNREFUSED`; this
//!   is the refusal the lookup itself observed, not a separate probe of the server. tokio only
//!   wakes a reader for data, not for a pending socket error (`EPOLLERR` alone), so the socket
//!   here waits for either ([`ConnectedSocket`]).
//! * hickory resends a UDP query on a fresh socket every ~333 ms (up to 3 datagrams per try);
//!   c-ares sends one per try and waits for that try's timeout. Retransmission is off here, so
//!   a server that drops queries receives exactly one datagram per try.

use std::{
    future::Future,
    io,
    net::{IpAddr, SocketAddr},
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use hickory_resolver::{
    ConnectionProvider, PoolContext,
    config::{ConnectionConfig, ProtocolConfig},
    net::{
        NetError,
        runtime::{DnsUdpSocket, RuntimeProvider, TokioHandle, TokioRuntimeProvider, TokioTime},
        udp::UdpClientStream,
        xfer::DnsExchange,
    },
};
use tokio::io::Interest;
use tracing::debug;

/// Datagrams per UDP try: the first send only, no retransmission.
const UDP_SENDS_PER_TRY: u8 = 1;

/// Tokio's runtime, with UDP sockets connected to the name server they query.
#[derive(Clone, Default)]
pub(crate) struct ConnectedUdp(TokioRuntimeProvider);

type BoxedIo<T> = Pin<Box<dyn Send + Future<Output = Result<T, io::Error>>>>;

impl RuntimeProvider for ConnectedUdp {
    type Handle = TokioHandle;
    type Timer = TokioTime;
    type Udp = ConnectedSocket;
    type Tcp = <TokioRuntimeProvider as RuntimeProvider>::Tcp;

    fn create_handle(&self) -> Self::Handle {
        self.0.create_handle()
    }

    fn connect_tcp(
        &self,
        server_addr: SocketAddr,
        bind_addr: Option<SocketAddr>,
        timeout: Option<Duration>,
    ) -> BoxedIo<Self::Tcp> {
        self.0.connect_tcp(server_addr, bind_addr, timeout)
    }

    /// hickory asks for an unconnected socket because it sends with `send_to` and filters
    /// answers by source itself; both still work on a connected socket (Linux accepts a
    /// destination equal to the peer), and only a connected socket is told about ICMP errors.
    fn bind_udp(&self, local_addr: SocketAddr, server_addr: SocketAddr) -> BoxedIo<Self::Udp> {
        Box::pin(async move {
            let socket = tokio::net::UdpSocket::bind(local_addr).await?;
            socket.connect(server_addr).await?;
            Ok(ConnectedSocket {
                socket,
                server: server_addr,
            })
        })
    }
}

/// A UDP socket connected to its name server, whose reads end with the socket's pending error
/// (`ECONNREFUSED` after an ICMP port unreachable, `EHOSTUNREACH`, ...) as soon as it arrives.
pub(crate) struct ConnectedSocket {
    socket: tokio::net::UdpSocket,
    server: SocketAddr,
}

impl ConnectedSocket {
    /// The next datagram, or the socket's pending error.
    async fn recv_or_error(&self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr)> {
        loop {
            let ready = self
                .socket
                .ready(Interest::READABLE | Interest::ERROR)
                .await?;
            if ready.is_error() {
                // tokio's reads wait for readable data, so the error is taken with SO_ERROR
                // (which clears it); none pending clears the readiness instead of spinning on it.
                let pending = self.socket.try_io(Interest::ERROR, || {
                    self.socket
                        .take_error()?
                        .ok_or_else(|| io::ErrorKind::WouldBlock.into())
                });
                match pending {
                    Ok(error) => {
                        // hickory reports only "no connections available" once its pool has
                        // tried the server; the cause is logged here.
                        debug!(server = %self.server, %error, "dns try failed at once");
                        return Err(error);
                    }
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                    Err(err) => return Err(err),
                }
            }
            if ready.is_readable() {
                match self.socket.try_recv_from(buf) {
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                    done => return done,
                }
            }
        }
    }
}

impl DnsUdpSocket for ConnectedSocket {
    type Time = TokioTime;

    /// Only readiness for data wakes this one; hickory's client reads through
    /// [`DnsUdpSocket::recv_from`], which also wakes for errors.
    fn poll_recv_from(
        &self,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<(usize, SocketAddr)>> {
        DnsUdpSocket::poll_recv_from(&self.socket, cx, buf)
    }

    // Spelled out as the `async_trait` the trait is declared with expands it.
    fn recv_from<'life0, 'life1, 'async_trait>(
        &'life0 self,
        buf: &'life1 mut [u8],
    ) -> Pin<Box<dyn Future<Output = io::Result<(usize, SocketAddr)>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.recv_or_error(buf))
    }

    fn poll_send_to(
        &self,
        cx: &mut Context<'_>,
        buf: &[u8],
        target: SocketAddr,
    ) -> Poll<io::Result<usize>> {
        self.socket.poll_send_to(cx, buf, target)
    }
}

/// The connections of [`super::HickoryResolver`]: UDP through [`ConnectedUdp`] without
/// retransmission, every other protocol (TCP after a truncated answer) as hickory makes it.
#[derive(Clone, Default)]
pub(crate) struct Transport(ConnectedUdp);

type BoxedConn = Pin<Box<dyn Future<Output = Result<DnsExchange<ConnectedUdp>, NetError>> + Send>>;

impl ConnectionProvider for Transport {
    type Conn = DnsExchange<ConnectedUdp>;
    type FutureConn = BoxedConn;
    type RuntimeProvider = ConnectedUdp;

    fn new_connection(
        &self,
        ip: IpAddr,
        config: &ConnectionConfig,
        cx: &PoolContext,
    ) -> Result<Self::FutureConn, NetError> {
        if !matches!(config.protocol, ProtocolConfig::Udp) {
            return self.0.new_connection(ip, config, cx);
        }
        let builder = UdpClientStream::builder(SocketAddr::new(ip, config.port), self.0.clone())
            .with_timeout(Some(cx.options.timeout))
            .with_os_port_selection(cx.options.os_port_selection)
            .avoid_local_ports(cx.options.avoid_local_udp_ports.clone())
            .with_bind_addr(config.bind_addr)
            .with_max_retries(UDP_SENDS_PER_TRY);
        // `exchange` spawns the connection's task, so it runs when polled, inside the runtime.
        Ok(Box::pin(async move { Ok(builder.exchange()) }))
    }

    fn runtime_provider(&self) -> &Self::RuntimeProvider {
        &self.0
    }
}
