//! Real TCP, HTTP/1.1 and gRPC-health servers on 127.0.0.1 that tests stop and restart.
//!
//! Each server binds a random port on first start and the same port on restart, so a health
//! checker pointed at it sees the host go away and come back. Stopping aborts the accept loop
//! and drops the listener; dropping a server stops it.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU16, Ordering},
    },
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};
use tonic_health::{ServingStatus, server::HealthReporter};

/// Loopback with an OS-chosen port.
const ANY_LOOPBACK: &str = "127.0.0.1:0";

async fn bind(addr: Option<SocketAddr>) -> TcpListener {
    let target = addr.map_or_else(|| ANY_LOOPBACK.to_owned(), |a| a.to_string());
    TcpListener::bind(&target)
        .await
        .unwrap_or_else(|e| panic!("bind {target}: {e}"))
}

/// A server whose accept loop is one task.
#[derive(Debug)]
struct Running {
    addr: SocketAddr,
    task: Option<JoinHandle<()>>,
}

impl Running {
    /// Aborts the accept loop and waits until it is gone, so its listener is closed.
    async fn stop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Answers every connection that sends `PING` with `PONG`, then closes it.
#[derive(Debug)]
pub struct PingServer(Running);

impl PingServer {
    /// Starts on a random port.
    pub async fn start() -> Self {
        let listener = bind(None).await;
        let addr = listener.local_addr().expect("local addr");
        Self(Running {
            addr,
            task: Some(tokio::spawn(ping_loop(listener))),
        })
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.0.addr
    }

    /// Stops accepting; connects are refused until [`restart`](Self::restart).
    pub async fn stop(&mut self) {
        self.0.stop().await;
    }

    /// Starts again on the same port.
    pub async fn restart(&mut self) {
        self.0.stop().await;
        let listener = bind(Some(self.0.addr)).await;
        self.0.task = Some(tokio::spawn(ping_loop(listener)));
    }
}

async fn ping_loop(listener: TcpListener) {
    while let Ok((mut stream, _)) = listener.accept().await {
        tokio::spawn(async move {
            let mut buf = [0u8; 64];
            if let Ok(n) = stream.read(&mut buf).await
                && buf[..n].windows(4).any(|w| w == b"PING")
            {
                let _ = stream.write_all(b"..PONG..").await;
            }
        });
    }
}

/// Answers every request with a settable status and optional extra header line.
#[derive(Debug)]
pub struct HttpServer {
    running: Running,
    status: Arc<AtomicU16>,
}

impl HttpServer {
    /// Starts on a random port, answering 200.
    pub async fn start() -> Self {
        let listener = bind(None).await;
        let addr = listener.local_addr().expect("local addr");
        let status = Arc::new(AtomicU16::new(200));
        let task = tokio::spawn(http_loop(listener, Arc::clone(&status)));
        Self {
            running: Running {
                addr,
                task: Some(task),
            },
            status,
        }
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.running.addr
    }

    /// The status later requests get. 299 means "200 with `x-envoy-degraded`", 298 means "503
    /// with `x-envoy-immediate-health-check-fail`".
    pub fn set_status(&self, status: u16) {
        self.status.store(status, Ordering::Relaxed);
    }

    /// Stops accepting.
    pub async fn stop(&mut self) {
        self.running.stop().await;
    }

    /// Starts again on the same port.
    pub async fn restart(&mut self) {
        self.running.stop().await;
        let listener = bind(Some(self.running.addr)).await;
        self.running.task = Some(tokio::spawn(http_loop(listener, Arc::clone(&self.status))));
    }
}

async fn http_loop(listener: TcpListener, status: Arc<AtomicU16>) {
    while let Ok((stream, _)) = listener.accept().await {
        let status = status.load(Ordering::Relaxed);
        tokio::spawn(answer_http(stream, status));
    }
}

async fn answer_http(mut stream: TcpStream, status: u16) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let (code, extra) = match status {
        299 => (200, "x-envoy-degraded: true\r\n"),
        298 => (503, "x-envoy-immediate-health-check-fail: true\r\n"),
        s => (s, ""),
    };
    let response =
        format!("HTTP/1.1 {code} X\r\n{extra}content-length: 2\r\nconnection: close\r\n\r\nok");
    let _ = stream.write_all(response.as_bytes()).await;
}

/// A tonic `grpc.health.v1` server.
pub struct GrpcHealthServer {
    running: Running,
    reporter: HealthReporter,
    /// Serves the same health service (same statuses) on a listener.
    serve: Box<dyn Fn(TcpListener) -> JoinHandle<()> + Send + Sync>,
}

impl std::fmt::Debug for GrpcHealthServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcHealthServer")
            .field("addr", &self.running.addr)
            .finish_non_exhaustive()
    }
}

impl GrpcHealthServer {
    /// Starts on a random port with `service` SERVING.
    pub async fn start(service_name: &str) -> Self {
        let (reporter, service) = tonic_health::server::health_reporter();
        reporter
            .set_service_status(service_name, ServingStatus::Serving)
            .await;
        let listener = bind(None).await;
        let addr = listener.local_addr().expect("local addr");
        let serve = Box::new(move |listener: TcpListener| {
            let service = service.clone();
            tokio::spawn(async move {
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
                let _ = tonic::transport::Server::builder()
                    .add_service(service)
                    .serve_with_incoming(incoming)
                    .await;
            })
        });
        let task = serve(listener);
        Self {
            running: Running {
                addr,
                task: Some(task),
            },
            reporter,
            serve,
        }
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.running.addr
    }

    /// Sets a service's status.
    pub async fn set_serving(&self, service_name: &str, serving: bool) {
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        self.reporter.set_service_status(service_name, status).await;
    }

    /// Stops the server.
    pub async fn stop(&mut self) {
        self.running.stop().await;
    }

    /// Starts again on the same port, with the statuses it had.
    pub async fn restart(&mut self) {
        self.running.stop().await;
        let listener = bind(Some(self.running.addr)).await;
        self.running.task = Some((self.serve)(listener));
    }
}
