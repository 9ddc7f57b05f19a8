//! Shared fixtures of the proxy path tests: the proxy in-process on 127.0.0.1 with a fake
//! original-destination table (client 4-tuple -> destination), real TCP and HTTP servers on
//! loopback, and a client that registers its 4-tuple before it connects. No root needed.

#![allow(
    dead_code,
    reason = "each test file uses a different part of the fixtures"
)]

pub mod scripted;
pub mod websocket;

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, body::Incoming, service::service_fn};
use hyper_util::rt::{TokioExecutor, TokioIo};
use proxy_core::{
    health::{HostClass, Routing},
    host::Host,
};
use proxy_relay::{
    ClusterHandle, OriginalDstTable, ProxyConfig, ProxyDeps, ProxyHandle, ServiceTable, serve,
};
use tokio::{
    net::{TcpListener, TcpSocket, TcpStream},
    sync::watch,
    task::JoinHandle,
};

/// Upper bound for any single wait in these tests.
pub const WAIT: Duration = Duration::from_secs(10);

/// The proxy under test and its fake kernel map.
pub struct TestProxy {
    pub handle: ProxyHandle,
    pub table: Arc<OriginalDstTable>,
    pub addr: SocketAddr,
}

impl TestProxy {
    /// Starts the proxy on 127.0.0.1:<ephemeral> with `config` (its listeners replaced).
    pub async fn start(mut config: ProxyConfig, services: ServiceTable) -> Self {
        config.listeners = vec!["127.0.0.1:0".parse().unwrap()];
        let table = Arc::new(OriginalDstTable::default());
        let deps = ProxyDeps {
            original_dst: table.clone(),
            services,
            splicer: None,
        };
        let handle = serve(config, deps).await.expect("proxy starts");
        let addr = handle.local_addrs()[0];
        Self {
            handle,
            table,
            addr,
        }
    }

    /// Connects to the proxy as if the kernel had redirected a connect to `dst`.
    pub async fn connect(&self, dst: SocketAddr) -> TcpStream {
        self.try_connect(dst).await.unwrap()
    }

    /// [`Self::connect`] for a connection the proxy refuses: its reset may arrive before the
    /// connect has returned (the proxy's threads accept while this one waits), and then the
    /// connect reports it.
    pub async fn try_connect(&self, dst: SocketAddr) -> std::io::Result<TcpStream> {
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let local = socket.local_addr().unwrap();
        self.table.insert(local, self.addr, dst);
        tokio::time::timeout(WAIT, socket.connect(self.addr))
            .await
            .expect("connect in time")
    }

    /// A stat by name.
    pub fn stat(&self, name: &str) -> u64 {
        self.handle
            .stats()
            .into_iter()
            .find(|(k, _)| k == name)
            .unwrap_or_else(|| panic!("no stat {name}"))
            .1
    }

    /// Waits (bounded) until `stat` reaches `value`.
    pub async fn wait_stat(&self, name: &str, value: u64) {
        let start = std::time::Instant::now();
        while self.stat(name) != value {
            assert!(
                start.elapsed() < WAIT,
                "{name} stayed {} (want {value}); stats: {:?}",
                self.stat(name),
                self.handle.stats()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Routing with every host healthy at priority 0.
pub fn routing(hosts: &[SocketAddr]) -> Routing {
    let hosts: Vec<(Host, HostClass)> = hosts
        .iter()
        .map(|a| (Host::new(*a), HostClass::Healthy))
        .collect();
    Routing::compute(&hosts, 50.0)
}

/// A cluster whose hosts the test sets through the returned sender.
pub fn cluster(
    name: &str,
    hosts: &[SocketAddr],
    drain_on_removal: bool,
) -> (watch::Sender<Routing>, ClusterHandle) {
    let (tx, rx) = watch::channel(routing(hosts));
    (
        tx,
        ClusterHandle::new(name, rx, drain_on_removal, Duration::from_secs(60)),
    )
}

/// An address where nothing listens: connects to it are refused. Its socket stays bound (never
/// listening) for the life of the test process, so no other socket can take the port. A port
/// bound and closed at once was free again: a proxy listener that another test (or this one)
/// bound next could get it, and a connect meant for a dead host then reached that proxy.
pub fn dead_addr() -> SocketAddr {
    static HELD: std::sync::Mutex<Vec<tokio::net::TcpSocket>> = std::sync::Mutex::new(Vec::new());
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    HELD.lock().unwrap().push(socket);
    addr
}

/// A TCP server whose connections a test takes one by one.
pub struct TcpServer {
    pub addr: SocketAddr,
    listener: TcpListener,
}

impl TcpServer {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self {
            addr: listener.local_addr().unwrap(),
            listener,
        }
    }

    /// The next connection (bounded wait).
    pub async fn accept(&self) -> TcpStream {
        tokio::time::timeout(WAIT, self.listener.accept())
            .await
            .expect("a connection in time")
            .unwrap()
            .0
    }

    /// Whether a connection arrives within `d`.
    pub async fn accepts_within(&self, d: Duration) -> bool {
        tokio::time::timeout(d, self.listener.accept())
            .await
            .is_ok()
    }
}

/// An HTTP server (HTTP/1.1 and HTTP/2 cleartext) answering `<name> <method> <path> <version>`;
/// `/slow` answers after 2 s. Counts its connections.
pub struct HttpServer {
    pub addr: SocketAddr,
    pub connections: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl HttpServer {
    pub async fn start(name: &'static str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let count = connections.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| async move {
                        if req.uri().path() == "/slow" {
                            tokio::time::sleep(Duration::from_secs(2)).await;
                        }
                        let text =
                            format!("{name} {} {} {:?}", req.method(), req.uri(), req.version());
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(text))))
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self {
            addr,
            connections,
            task,
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An HTTP/1.1 client connection through the proxy to `dst`.
pub async fn http1_client(
    proxy: &TestProxy,
    dst: SocketAddr,
) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
    let stream = proxy.connect(dst).await;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

/// Sends a GET (bounded) and returns (status, body).
pub async fn get(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, String) {
    request(sender, "GET", path, headers).await
}

/// Sends a request (bounded) and returns (status, body).
pub async fn request(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, String) {
    let mut b = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "svc");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(Full::new(Bytes::new())).unwrap();
    let resp = tokio::time::timeout(WAIT, sender.send_request(req))
        .await
        .expect("response in time")
        .unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// FNV-1a over a stream of chunks (enough to tell megabytes apart).
#[derive(Clone, Copy)]
pub struct Fnv(pub u64);

impl Fnv {
    pub fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    pub fn update(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x100_0000_01b3);
        }
    }
}

/// `len` bytes of a deterministic pseudo-random stream seeded with `seed`.
pub fn payload(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
