//! The upstream connect of a TCP connection and its attempts, written once for both drivers.
//! [`start_upstream`] makes one non-blocking connect and sends the client's first bytes with it.
//! Envoy's tcp_proxy `max_connect_attempts`: a connect that fails (refused, unreachable, timed
//! out) is counted
//! (`conn::connect_failed`), then [`Attempts::retry`] says whether another host gets a turn; the
//! next connect goes to a host the connection has not tried while the cluster has one, and
//! starts with the client's bytes the failed one had read ([`start`]). When the attempts are
//! spent the client is reset and `upstream_cx_connect_attempts_exceeded` counted, the proxy's
//! and the cluster's, as Envoy counts it: with the default of one attempt, once per failed
//! connect. Like Envoy's tcp_proxy, no `upstream_rq_retry` is counted (that is HTTP's); every
//! attempt is in `upstream_cx_total` and every failed one in `upstream_cx_connect_fail`.

use std::{io, os::fd::AsFd};

use socket2::{Domain, Protocol, Socket, Type};
use tracing::debug;

use crate::{
    addr::BackendAddr,
    cluster::ClusterHandle,
    conn::{self, Chosen, ConnectFailure, Target},
    flow,
    shared::Shared,
    stats::ProxyStats,
};

/// How the upstream connect started.
pub(crate) enum Started {
    /// The connect is done, or in progress (`connecting`: the socket turns writable when it
    /// ends, and `SO_ERROR` tells how). `sent` bytes of the client's went upstream already;
    /// `unsent` holds those read that still go first.
    Upstream {
        socket: std::net::TcpStream,
        unsent: Vec<u8>,
        sent: u64,
        connecting: bool,
    },
    /// The client's socket failed (a reset) before the connection started: the upstream
    /// socket was closed with a reset, and counted in `upstream_cx_destroy_with_reset`.
    ClientFailed(io::Error),
}

/// A connect that failed as it started: its error (hand it to [`conn::connect_failed`]) and the
/// client's bytes it had read, which go first on the next attempt.
#[derive(Debug)]
pub(crate) struct StartFailed {
    pub(crate) err: io::Error,
    pub(crate) unsent: Vec<u8>,
}

/// Starts the connect to `host` (counted in `upstream_cx_total`) and passes on what the client
/// has sent already, in the same turn of the event loop when it can: a connect to a local host
/// (loopback, a namespace's veth) is complete before `connect()` returns, so the client's first
/// bytes go straight out, and the turn that waits for the connect, the connect timer and
/// `SO_ERROR` are saved. The `send()` itself tells whether the connection is up: it fails with
/// the connect's error (a refusal), or with `EAGAIN` while the handshake is still on, and then
/// the bytes wait for the connect.
///
/// The bytes are `carried` (read by an earlier attempt whose connect failed; nothing more is
/// read then), else with `first_bytes` what the client's socket holds. Spliced pairs start
/// without (they are handed to the kernel before any byte moves). A failure gives the bytes
/// back, never sent: a connect that fails has sent nothing.
pub(crate) fn start_upstream(
    client: &impl AsFd,
    host: BackendAddr,
    first_bytes: bool,
    carried: Vec<u8>,
    scratch: &mut [u8],
    stats: &ProxyStats,
) -> Result<Started, StartFailed> {
    ProxyStats::inc(&stats.upstream_cx_total);
    let socket = match connect_socket(host) {
        Ok(socket) => socket,
        Err(err) => {
            return Err(StartFailed {
                err,
                unsent: carried,
            });
        }
    };
    let first: &[u8] = if !carried.is_empty() {
        &carried
    } else if first_bytes {
        match read_first(client, scratch) {
            Ok(n) => &scratch[..n],
            Err(err) => {
                // Counted before the upstream socket closes with the reset.
                ProxyStats::inc(&stats.upstream_cx_destroy_with_reset);
                flow::abort(&socket);
                return Ok(Started::ClientFailed(err));
            }
        }
    } else {
        &[]
    };
    let (sent, connecting) = if first.is_empty() {
        (0, true)
    } else {
        match crate::sys::send(socket.as_fd(), first) {
            Ok(n) => (n, false),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => (0, true),
            Err(err) => {
                let unsent = first.to_vec();
                return Err(StartFailed { err, unsent });
            }
        }
    };
    ProxyStats::add(&stats.upstream_cx_tx_bytes_total, sent as u64);
    Ok(Started::Upstream {
        unsent: first[sent..].to_vec(),
        socket,
        sent: sent as u64,
        connecting,
    })
}

/// A non-blocking socket whose connect to `host` is done or on its way.
fn connect_socket(host: BackendAddr) -> io::Result<std::net::TcpStream> {
    let socket = Socket::new(
        Domain::for_address(host.0),
        Type::STREAM.nonblocking().cloexec(),
        Some(Protocol::TCP),
    )?;
    socket.set_tcp_nodelay(true)?;
    match socket.connect(&host.0.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    Ok(socket.into())
}

/// Reads what the client has sent already into `scratch`, without waiting (0: nothing yet).
fn read_first(client: &impl AsFd, scratch: &mut [u8]) -> io::Result<usize> {
    match crate::sys::recv(client.as_fd(), scratch, libc::MSG_DONTWAIT) {
        Ok(n) => Ok(n),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
        Err(err) => Err(err),
    }
}

/// The connects a connection made and may still make.
pub(crate) struct Attempts {
    /// `max_connect_attempts` of the connection's service (1 for ORIGINAL_DST: one host).
    max: u32,
    /// Connects started.
    made: u32,
    /// The hosts tried, kept only when there can be a retry (no allocation otherwise).
    tried: Vec<BackendAddr>,
    /// A connect starts with what the client has sent (not for a spliced pair: it is handed
    /// to the kernel before any byte moves).
    first_bytes: bool,
}

impl Attempts {
    /// No connect made yet to `target`; with `first_bytes`, each starts with the client's.
    pub(crate) fn new(target: Target<'_>, first_bytes: bool) -> Self {
        let max = match target {
            Target::Cluster(cluster) => cluster.connect_attempts(),
            Target::Original(_) => 1,
        };
        Self {
            max,
            made: 0,
            tried: Vec::new(),
            first_bytes,
        }
    }

    /// The hosts tried so far (the next pick avoids them while it can).
    pub(crate) fn tried(&self) -> &[BackendAddr] {
        &self.tried
    }

    /// A connect to `host` starts.
    pub(crate) fn made(&mut self, host: BackendAddr) {
        self.made += 1;
        if self.max > 1 {
            self.tried.push(host);
        }
    }

    /// A connect failed (and was counted): whether another one is due. If not, the attempts
    /// are spent: counted in `upstream_cx_connect_attempts_exceeded` (the proxy's, and the
    /// cluster's) and the client reset.
    pub(crate) fn retry(
        &self,
        cluster: Option<&ClusterHandle>,
        client: &impl AsFd,
        stats: &ProxyStats,
    ) -> bool {
        if self.made < self.max {
            debug!(made = self.made, max = self.max, "trying another host");
            return true;
        }
        ProxyStats::inc(&stats.upstream_cx_connect_attempts_exceeded);
        if let Some(cluster) = cluster {
            cluster.count_connect_attempts_exceeded();
        }
        debug!(
            attempts = self.made,
            "every connect attempt failed: client reset"
        );
        flow::abort(client);
        false
    }
}

/// An upstream connect done or on its way (`Started::Upstream`'s parts).
pub(crate) struct Upstream {
    pub(crate) socket: std::net::TcpStream,
    /// The client's bytes read and not sent yet: they go first.
    pub(crate) unsent: Vec<u8>,
    /// The client's bytes sent with the connect.
    pub(crate) sent: u64,
    /// The handshake is still on.
    pub(crate) connecting: bool,
}

/// Picks a host (not one in `attempts` while another is left) and starts a connect to it with
/// `carried` (the client's bytes a failed connect had read) or what the client has sent (when
/// the attempts start with the first bytes); again for each connect that fails at once, while
/// the attempts allow. `None`: no connect is on (no host, the client failed, or the attempts
/// are spent); the client was reset and it was counted.
pub(crate) fn start(
    client: &impl AsFd,
    target: Target<'_>,
    attempts: &mut Attempts,
    mut carried: Vec<u8>,
    scratch: &mut [u8],
    shared: &Shared,
) -> Option<(Chosen, Upstream)> {
    let (stats, cluster) = (&*shared.stats, target.cluster());
    // Bounded: every turn makes an attempt, and `retry` ends them at `max`.
    loop {
        let chosen = conn::choose(target, attempts.tried(), client, shared)?;
        attempts.made(chosen.host);
        let first = attempts.first_bytes;
        match start_upstream(client, chosen.host, first, carried, scratch, stats) {
            Ok(Started::Upstream {
                socket,
                unsent,
                sent,
                connecting,
            }) => {
                let upstream = Upstream {
                    socket,
                    unsent,
                    sent,
                    connecting,
                };
                return Some((chosen, upstream));
            }
            Ok(Started::ClientFailed(err)) => {
                debug!(%err, "client failed before the upstream connection started: reset");
                return None;
            }
            Err(StartFailed { err, unsent }) => {
                let failure = ConnectFailure::Error(err);
                conn::connect_failed(&failure, chosen.host, cluster, stats);
                if !attempts.retry(cluster, client, stats) {
                    return None;
                }
                carried = unsent;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{net::SocketAddr, sync::Arc, time::Duration};

    use proxy_core::{
        config::LbPolicy,
        health::{HostClass, Routing},
        host::Host,
    };
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::{TcpListener, TcpStream},
        sync::watch,
    };

    use super::*;
    use crate::{
        EventLoop, OriginalDst, ProxyConfig, ProxyDeps,
        service::{Service, ServiceTable},
    };

    const TIMEOUT: Duration = Duration::from_secs(5);

    /// Every connection was redirected to `.0` (the service is the fallback: any will do).
    struct RedirectedTo(SocketAddr);

    impl OriginalDst for RedirectedTo {
        fn lookup(&self, _: SocketAddr, _: SocketAddr) -> Option<SocketAddr> {
            Some(self.0)
        }
    }

    /// A loopback port nothing listens on: connects to it are refused.
    fn dead() -> SocketAddr {
        crate::testing::dead_addr()
    }

    /// A server that greets every connection with `hi` and then echoes it. The client waits
    /// for the greeting before it writes, so the proxy starts each connect with no byte of the
    /// client's: a refusal then comes from the handshake (the driver's event loop), not from
    /// the first `send()`.
    async fn greeter() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let _ = s.write_all(b"hi").await;
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    /// A ROUND_ROBIN cluster of healthy `hosts` with `attempts` connect attempts.
    fn cluster(hosts: &[SocketAddr], attempts: u32) -> ClusterHandle {
        let hosts: Vec<_> = hosts
            .iter()
            .map(|&a| (Host::new(a), HostClass::Healthy))
            .collect();
        let (tx, rx) = watch::channel(Routing::compute(&hosts, 50.0));
        std::mem::forget(tx);
        ClusterHandle::new("c", rx, true, Duration::from_secs(1))
            .with_policy(None, LbPolicy::RoundRobin)
            .with_connect_attempts(attempts)
    }

    /// One client's exchange through the proxy: the greeting, then `ping` echoed. Whether it
    /// got through.
    async fn exchange(proxy: SocketAddr) -> bool {
        let talk = async {
            let mut client = TcpStream::connect(proxy).await?;
            let mut hi = [0u8; 2];
            client.read_exact(&mut hi).await?;
            client.write_all(b"ping").await?;
            let mut echo = [0u8; 4];
            client.read_exact(&mut echo).await?;
            Ok::<_, std::io::Error>(&hi == b"hi" && &echo == b"ping")
        };
        matches!(tokio::time::timeout(TIMEOUT, talk).await, Ok(Ok(true)))
    }

    fn stat(stats: &[(String, u64)], name: &str) -> u64 {
        stats.iter().find(|(k, _)| k == name).map_or(0, |(_, v)| *v)
    }

    /// Runs `n` connections one after another through `event_loop` to `handle`'s cluster;
    /// how many got through, and the proxy's stats once every one was closed.
    async fn connect_loop(
        event_loop: EventLoop,
        handle: &ClusterHandle,
        n: u64,
    ) -> (u64, Vec<(String, u64)>) {
        let mut services = ServiceTable::new();
        services.set_fallback(Service::Tcp(handle.clone()));
        let config = ProxyConfig {
            listeners: vec!["127.0.0.1:0".parse().unwrap()],
            event_loop,
            engine_threads: std::num::NonZeroUsize::new(1),
            ..ProxyConfig::default()
        };
        let deps = ProxyDeps {
            original_dst: Arc::new(RedirectedTo(dead())),
            services,
            splicer: None,
        };
        let proxy = crate::serve(config, deps).await.expect("serving");
        let mut through = 0;
        for _ in 0..n {
            through += u64::from(exchange(proxy.local_addrs()[0]).await);
        }
        let deadline = tokio::time::Instant::now() + TIMEOUT;
        let mut stats = proxy.stats();
        while stat(&stats, "downstream_cx_destroy") < n && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
            stats = proxy.stats();
        }
        proxy.shutdown().await;
        (through, stats)
    }

    /// The cluster's (total, connect_fail, attempts_exceeded).
    fn cluster_counts(handle: &ClusterHandle) -> (u64, u64, u64) {
        let t = handle.traffic();
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        (
            load(&t.cx_total),
            load(&t.cx_connect_fail),
            load(&t.cx_connect_attempts_exceeded),
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn by_default_a_refused_connect_resets_the_client_and_counts_as_exceeded() {
        let live = greeter().await;
        let n = 10;
        for event_loop in [EventLoop::Epoll, EventLoop::Tokio] {
            let handle = cluster(&[dead(), live], 1);
            let (through, stats) = connect_loop(event_loop, &handle, n).await;
            let failed = n - through;
            // ROUND_ROBIN over one dead host of two: every other connection hits it.
            assert_eq!(failed, n / 2, "{event_loop:?}");
            assert_eq!(
                cluster_counts(&handle),
                (n, failed, failed),
                "{event_loop:?}"
            );
            let exceeded = stat(&stats, "upstream_cx_connect_attempts_exceeded");
            assert_eq!(exceeded, failed, "{event_loop:?}");
            assert_eq!(stat(&stats, "upstream_cx_connect_fail"), failed);
            assert_eq!(stat(&stats, "downstream_cx_destroy"), n, "{event_loop:?}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn with_two_attempts_a_refused_connect_goes_to_the_other_host() {
        let live = greeter().await;
        let n = 10;
        for event_loop in [EventLoop::Epoll, EventLoop::Tokio] {
            let handle = cluster(&[dead(), live], 2);
            let (through, stats) = connect_loop(event_loop, &handle, n).await;
            assert_eq!(through, n, "{event_loop:?}: every connection got through");
            let (total, failed, exceeded) = cluster_counts(&handle);
            // Each connect that hit the dead host first was retried once, on the live one:
            // every one, or all but the first, by where the rotation starts (a retry takes a
            // turn too).
            assert!(
                failed == n || failed == n - 1,
                "{event_loop:?}: {failed} retries"
            );
            assert_eq!((total, exceeded), (n + failed, 0), "{event_loop:?}");
            assert_eq!(stat(&stats, "upstream_cx_connect_attempts_exceeded"), 0);
            assert_eq!(stat(&stats, "upstream_cx_total"), n + failed);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn attempts_end_at_the_maximum_even_when_every_host_is_dead() {
        let n = 4;
        for event_loop in [EventLoop::Epoll, EventLoop::Tokio] {
            // Three attempts over two dead hosts: the third goes to a host tried already.
            let handle = cluster(&[dead(), dead()], 3);
            let (through, stats) = connect_loop(event_loop, &handle, n).await;
            assert_eq!(through, 0, "{event_loop:?}");
            assert_eq!(cluster_counts(&handle), (3 * n, 3 * n, n), "{event_loop:?}");
            assert_eq!(stat(&stats, "upstream_cx_connect_attempts_exceeded"), n);
            assert_eq!(stat(&stats, "downstream_cx_destroy"), n, "{event_loop:?}");
        }
    }

    /// A loopback listener whose accept queue is full (backlog 0, never accepted): the kernel
    /// drops further SYNs, so a connect to it neither succeeds nor fails until its timeout.
    /// The sockets that filled it are returned with it.
    fn stuck() -> (socket2::Socket, Vec<std::net::TcpStream>) {
        use socket2::{Domain, Socket, Type};
        let listener = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        listener
            .bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        listener.listen(0).unwrap();
        let addr = listener.local_addr().unwrap().as_socket().unwrap();
        let mut fill = Vec::new();
        // Bounded: the queue holds one or two connections.
        for _ in 0..8 {
            match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                Ok(s) => fill.push(s),
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return (listener, fill),
                Err(e) => panic!("filling the accept queue: {e}"),
            }
        }
        panic!("the accept queue of a backlog-0 listener did not fill");
    }

    /// A connect that times out is an attempt, as in Envoy: with two, the connection goes on
    /// to the other host, and the timeout is in `upstream_cx_connect_timeout` and
    /// `upstream_cx_connect_fail`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connect_timeout_is_an_attempt() {
        let live = greeter().await;
        let (listener, _fill) = stuck();
        let stuck_addr = listener.local_addr().unwrap().as_socket().unwrap();
        let n = 4;
        for event_loop in [EventLoop::Epoll, EventLoop::Tokio] {
            let handle = cluster(&[stuck_addr, live], 2)
                .with_policy(Some(Duration::from_millis(200)), LbPolicy::RoundRobin);
            let (through, stats) = connect_loop(event_loop, &handle, n).await;
            assert_eq!(through, n, "{event_loop:?}: every connection got through");
            let (total, failed, exceeded) = cluster_counts(&handle);
            // ROUND_ROBIN: every connection meets the stuck host first but, depending on where
            // the rotation starts, the first (a retry takes a turn too).
            assert!(
                failed == n || failed == n - 1,
                "{event_loop:?}: {failed} timeouts"
            );
            assert_eq!((total, exceeded), (n + failed, 0), "{event_loop:?}");
            assert_eq!(stat(&stats, "upstream_cx_connect_timeout"), failed);
        }
    }

    /// The client's bytes read by a connect that failed go to the next host, once.
    #[tokio::test]
    async fn bytes_read_by_a_failed_connect_go_first_on_the_next() {
        let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let live = server.local_addr().unwrap();
        let stats = ProxyStats::default();
        let (client, _app) = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let app = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
            (l.accept().unwrap().0, app)
        };
        let carried = b"hello".to_vec();
        let failed = flow::with_scratch(|s| {
            start_upstream(&client, BackendAddr(dead()), true, carried, s, &stats)
        });
        // Refused by connect() or send() at once (the bytes come back in the error), or on
        // its way (they wait in `unsent`): never sent.
        let unsent = match failed {
            Err(StartFailed { unsent, .. }) => unsent,
            Ok(Started::Upstream {
                unsent,
                sent: 0,
                connecting: true,
                ..
            }) => unsent,
            Ok(_) => panic!("a connect to a closed port went through"),
        };
        assert_eq!(unsent, b"hello");
        let started = flow::with_scratch(|s| {
            start_upstream(&client, BackendAddr(live), true, unsent, s, &stats)
        });
        let Ok(Started::Upstream {
            socket,
            unsent,
            sent,
            ..
        }) = started
        else {
            panic!("no connect to the live host");
        };
        let (mut conn, _) = server.accept().await.unwrap();
        let upstream = TcpStream::from_std(socket).unwrap();
        let mut rest = upstream;
        if !unsent.is_empty() {
            rest.writable().await.unwrap();
            rest.write_all(&unsent).await.unwrap();
        }
        rest.shutdown().await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(TIMEOUT, conn.read_to_end(&mut got))
            .await
            .expect("the host's read ended")
            .unwrap();
        assert_eq!(got, b"hello", "sent {sent}, then {unsent:?}");
    }
}
