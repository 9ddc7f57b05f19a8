//! An in-process xDS server (ADS and EDS, SotW and delta) on 127.0.0.1 that records every
//! request and lets the test script every response and stream drop.

use std::{
    net::SocketAddr,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use envoy_types::pb::envoy::service::{
    discovery::v3::{
        DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
        aggregated_discovery_service_server::{
            AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
        },
    },
    endpoint::v3::endpoint_discovery_service_server::{
        EndpointDiscoveryService, EndpointDiscoveryServiceServer,
    },
};
use tokio::{net::TcpListener, sync::mpsc, task::JoinHandle};
use tokio_stream::{
    StreamExt,
    wrappers::{ReceiverStream, TcpListenerStream, UnboundedReceiverStream},
};
use tonic::{Request, Response, Status, Streaming};

use super::fixtures::WAIT;

type SotwTx = mpsc::Sender<Result<DiscoveryResponse, Status>>;
type DeltaTx = mpsc::Sender<Result<DeltaDiscoveryResponse, Status>>;

/// A request the server received, with the RPC it came on.
#[derive(Debug)]
pub enum Received {
    /// A SotW request on `rpc`.
    Sotw(&'static str, DiscoveryRequest),
    /// A delta request on `rpc`.
    Delta(&'static str, DeltaDiscoveryRequest),
}

/// The server side of one open stream.
pub enum Opened {
    /// A SotW stream: push responses or an error status.
    Sotw(SotwTx),
    /// A delta stream.
    Delta(DeltaTx),
}

#[derive(Clone)]
struct Fake {
    requests: mpsc::UnboundedSender<Received>,
    streams: mpsc::UnboundedSender<Opened>,
}

impl Fake {
    fn sotw(
        &self,
        rpc: &'static str,
        mut inbound: Streaming<DiscoveryRequest>,
    ) -> ReceiverStream<Result<DiscoveryResponse, Status>> {
        let (tx, rx) = mpsc::channel(16);
        let _ = self.streams.send(Opened::Sotw(tx));
        let requests = self.requests.clone();
        tokio::spawn(async move {
            while let Ok(Some(request)) = inbound.message().await {
                let _ = requests.send(Received::Sotw(rpc, request));
            }
        });
        ReceiverStream::new(rx)
    }

    fn delta(
        &self,
        rpc: &'static str,
        mut inbound: Streaming<DeltaDiscoveryRequest>,
    ) -> ReceiverStream<Result<DeltaDiscoveryResponse, Status>> {
        let (tx, rx) = mpsc::channel(16);
        let _ = self.streams.send(Opened::Delta(tx));
        let requests = self.requests.clone();
        tokio::spawn(async move {
            while let Ok(Some(request)) = inbound.message().await {
                let _ = requests.send(Received::Delta(rpc, request));
            }
        });
        ReceiverStream::new(rx)
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Fake {
    type StreamAggregatedResourcesStream = ReceiverStream<Result<DiscoveryResponse, Status>>;
    type DeltaAggregatedResourcesStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        Ok(Response::new(self.sotw("ads", request.into_inner())))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Ok(Response::new(self.delta("ads", request.into_inner())))
    }
}

#[tonic::async_trait]
impl EndpointDiscoveryService for Fake {
    type StreamEndpointsStream = ReceiverStream<Result<DiscoveryResponse, Status>>;
    type DeltaEndpointsStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_endpoints(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamEndpointsStream>, Status> {
        Ok(Response::new(self.sotw("eds", request.into_inner())))
    }

    async fn delta_endpoints(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaEndpointsStream>, Status> {
        Ok(Response::new(self.delta("eds", request.into_inner())))
    }

    async fn fetch_endpoints(
        &self,
        _: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        Err(Status::unimplemented("fetch_endpoints is not used"))
    }
}

/// Turns Nagle's algorithm off on an accepted connection: with it, a small response can wait
/// for the peer's delayed ACK (40 ms), which a test on paused time takes for idleness and
/// skips over with the clock.
fn nodelay(
    accepted: std::io::Result<tokio::net::TcpStream>,
) -> std::io::Result<tokio::net::TcpStream> {
    let stream = accepted?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// A server-side TLS connection, as tonic's server takes it.
struct TlsIo(tokio_rustls::server::TlsStream<tokio::net::TcpStream>);

impl tonic::transport::server::Connected for TlsIo {
    type ConnectInfo = ();

    fn connect_info(&self) {}
}

impl tokio::io::AsyncRead for TlsIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for TlsIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// A running fake server; aborted on drop.
pub struct FakeServer {
    pub addr: SocketAddr,
    requests: mpsc::UnboundedReceiver<Received>,
    streams: mpsc::UnboundedReceiver<Opened>,
    task: JoinHandle<()>,
}

impl FakeServer {
    /// Starts the server on an ephemeral 127.0.0.1 port.
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().unwrap();
        Self::serve(addr, TcpListenerStream::new(listener).map(nodelay))
    }

    /// Starts the server behind TLS with `config`; a failed handshake closes that connection.
    pub async fn start_tls(config: Arc<rustls::ServerConfig>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let _ = tcp.set_nodelay(true);
                if let Ok(tls) = acceptor.accept(tcp).await {
                    let _ = tx.send(Ok::<_, std::io::Error>(TlsIo(tls)));
                }
            }
        });
        Self::serve(addr, UnboundedReceiverStream::new(rx))
    }

    fn serve<S, I>(addr: SocketAddr, incoming: S) -> Self
    where
        S: tokio_stream::Stream<Item = std::io::Result<I>> + Send + 'static,
        I: tonic::transport::server::Connected
            + tokio::io::AsyncRead
            + tokio::io::AsyncWrite
            + Unpin
            + Send
            + 'static,
    {
        let (requests_tx, requests) = mpsc::unbounded_channel();
        let (streams_tx, streams) = mpsc::unbounded_channel();
        let fake = Fake {
            requests: requests_tx,
            streams: streams_tx,
        };
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(AggregatedDiscoveryServiceServer::new(fake.clone()))
                .add_service(EndpointDiscoveryServiceServer::new(fake))
                .serve_with_incoming(incoming)
                .await
                .expect("fake xDS server");
        });
        Self {
            addr,
            requests,
            streams,
            task,
        }
    }

    /// The next stream opened by the client.
    pub async fn next_stream(&mut self) -> Opened {
        let next = tokio::time::timeout(WAIT, self.streams.recv()).await;
        next.expect("timed out waiting for the client to open a stream")
            .expect("server alive")
    }

    /// The next request received.
    pub async fn next_request(&mut self) -> Received {
        let next = tokio::time::timeout(WAIT, self.requests.recv()).await;
        next.expect("timed out waiting for a request")
            .expect("server alive")
    }

    /// The next SotW request, on `rpc`.
    pub async fn next_sotw(&mut self, rpc: &str) -> DiscoveryRequest {
        match self.next_request().await {
            Received::Sotw(got, request) if got == rpc => request,
            other => panic!("expected a SotW request on {rpc}, got {other:?}"),
        }
    }

    /// The next delta request, on `rpc`.
    pub async fn next_delta(&mut self, rpc: &str) -> DeltaDiscoveryRequest {
        match self.next_request().await {
            Received::Delta(got, request) if got == rpc => request,
            other => panic!("expected a delta request on {rpc}, got {other:?}"),
        }
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
