//! The tokio driver of the copy rules (`flow.rs`): one task moves both directions of a
//! connection, pumping them as the engine does and waiting on each socket's tokio readiness for
//! what its directions need (the engine waits on its epoll for the same).

use std::{future::Future, io, pin::pin};

use tokio::{
    io::{Interest, Ready},
    net::TcpStream,
};

use crate::{
    conn::ProxyClose,
    flow::{self, End, Failed, Flows, Side, Wait},
    stats::ProxyStats,
};

/// Bytes moved, per direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Copied {
    /// Client to upstream.
    pub(crate) sent: u64,
    /// Upstream to client.
    pub(crate) received: u64,
}

/// Relays until both directions are done, a side fails, or `close` resolves with a reason;
/// then applies the end's rule ([`flow::finish`]: counted, sockets reset as it says), and
/// returns the bytes moved either way (`unsent`, the client's bytes read before, go first and
/// count when written) and the end. The caller closes the sockets.
pub(crate) async fn relay(
    client: &TcpStream,
    upstream: &TcpStream,
    unsent: Vec<u8>,
    stats: &ProxyStats,
    close: impl Future<Output = ProxyClose>,
) -> (Copied, End) {
    let mut flows = Flows::new(unsent);
    let mut close = pin!(close);
    let end = loop {
        let waits = match flow::with_scratch(|s| flows.pump(client, upstream, s, stats)) {
            Ok(waits) => waits,
            Err(failed) => break End::Failed(failed),
        };
        if flows.done() {
            break End::Done;
        }
        // Each socket is waited on for its own direction's read and the other's write.
        let client_wants = interest(waits[0] == Wait::Read, waits[1] == Wait::Write);
        let upstream_wants = interest(waits[1] == Wait::Read, waits[0] == Wait::Write);
        let (side, ready) = tokio::select! {
            ready = ready(client, client_wants) => (Side::Client, ready),
            ready = ready(upstream, upstream_wants) => (Side::Upstream, ready),
            why = &mut close => break End::Closed(why),
        };
        match ready {
            Ok(ready) => readiness(&mut flows, side, ready),
            Err(err) => {
                break End::Failed(Failed {
                    side,
                    op: "poll",
                    err,
                });
            }
        }
    };
    let copied = Copied {
        sent: flows.0[0].moved(),
        received: flows.0[1].moved(),
    };
    flow::finish(&end, client, upstream, stats);
    (copied, end)
}

/// What to wait for on a socket: readable for the direction it feeds, writable for the one
/// that writes to it; `None`: nothing.
fn interest(read: bool, write: bool) -> Option<Interest> {
    match (read, write) {
        (true, true) => Some(Interest::READABLE | Interest::WRITABLE),
        (true, false) => Some(Interest::READABLE),
        (false, true) => Some(Interest::WRITABLE),
        (false, false) => None,
    }
}

async fn ready(socket: &TcpStream, interest: Option<Interest>) -> io::Result<Ready> {
    match interest {
        Some(interest) => socket.ready(interest).await,
        None => std::future::pending().await,
    }
}

/// A readiness event on `side`'s socket, as the engine reads an epoll event: readable (or an
/// end, or an error) makes the direction it feeds readable; an end or an error means read
/// until empty. A writable socket needs nothing: the next pump writes what waits.
fn readiness(flows: &mut Flows, side: Side, ready: Ready) {
    let flow = flows.from(side);
    if ready.is_readable() || ready.is_read_closed() || ready.is_error() {
        flow.readable = true;
    }
    if ready.is_read_closed() || ready.is_error() {
        flow.ended = true;
    }
}

#[cfg(test)]
mod tests {
    use std::{
        net::SocketAddr,
        sync::{Arc, atomic::Ordering},
    };

    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpListener,
    };

    use super::*;

    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = l.local_addr().unwrap();
        let (a, b) = tokio::join!(TcpStream::connect(addr), l.accept());
        (a.unwrap(), b.unwrap().0)
    }

    type Relayed = tokio::task::JoinHandle<(Copied, End)>;

    /// app <-> (client_side | relay | upstream_side) <-> server: the outer ends, the relay's
    /// stats, and the relay running between them with `unsent` to go first, until `close`.
    async fn through_relay(
        unsent: &[u8],
        close: impl Future<Output = ProxyClose> + Send + 'static,
    ) -> (TcpStream, TcpStream, Arc<ProxyStats>, Relayed) {
        let (app, client_side) = pair().await;
        let (upstream_side, server) = pair().await;
        let stats = Arc::new(ProxyStats::default());
        let relay_stats = stats.clone();
        let unsent = unsent.to_vec();
        let relayed = tokio::spawn(async move {
            relay(&client_side, &upstream_side, unsent, &relay_stats, close).await
        });
        (app, server, stats, relayed)
    }

    #[tokio::test]
    async fn half_close_and_counts() {
        let (mut app, mut server, stats, relayed) =
            through_relay(b"", std::future::pending()).await;
        app.write_all(b"ping").await.unwrap();
        app.shutdown().await.unwrap();
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"ping");
        server.write_all(b"pong").await.unwrap();
        drop(server);
        let mut back = Vec::new();
        app.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, b"pong");
        let (copied, end) = relayed.await.unwrap();
        assert!(matches!(end, End::Done), "{end:?}");
        let tx = stats.upstream_cx_tx_bytes_total.load(Ordering::Relaxed);
        assert_eq!((copied.sent, copied.received, tx), (4, 4, 4));
    }

    #[tokio::test]
    async fn small_messages_between_bursts_arrive_in_order() {
        // Each small message ends in a short read, after which readiness is given back; a
        // burst in between fills the socket. Nothing may be lost or reordered.
        let (mut app, mut server, _, relayed) = through_relay(b"", std::future::pending()).await;
        let burst: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 253) as u8).collect();
        for round in 0..3u8 {
            for i in 0..20u8 {
                app.write_all(&[round, i]).await.unwrap();
                let mut got = [0u8; 2];
                server.read_exact(&mut got).await.unwrap();
                assert_eq!(got, [round, i]);
                server.write_all(&[i, round]).await.unwrap();
                app.read_exact(&mut got).await.unwrap();
                assert_eq!(got, [i, round]);
            }
            let (w, r) = tokio::join!(app.write_all(&burst), async {
                let mut got = vec![0u8; burst.len()];
                server.read_exact(&mut got).await.map(|_| got)
            });
            w.unwrap();
            assert!(r.unwrap() == burst, "burst {round} arrived altered");
        }
        drop(app);
        drop(server);
        let (copied, _) = relayed.await.unwrap();
        assert_eq!(copied.sent, 3 * (40 + burst.len() as u64));
        assert_eq!(copied.received, 3 * 40);
    }

    #[tokio::test]
    async fn unsent_bytes_go_first_and_are_counted() {
        let (mut app, mut server, stats, relayed) =
            through_relay(b"early", std::future::pending()).await;
        app.write_all(b" and late").await.unwrap();
        app.shutdown().await.unwrap();
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"early and late");
        drop(server);
        let (copied, _) = relayed.await.unwrap();
        let tx = stats.upstream_cx_tx_bytes_total.load(Ordering::Relaxed);
        assert_eq!((copied.sent, tx), (14, 14));
    }

    #[tokio::test]
    async fn forced_close_resets_both_and_counts_why() {
        let (mut app, mut server, stats, relayed) =
            through_relay(b"", async { ProxyClose::Drained }).await;
        let (_, end) = relayed.await.unwrap();
        assert!(matches!(end, End::Closed(ProxyClose::Drained)), "{end:?}");
        let resets = stats.upstream_cx_destroy_with_reset.load(Ordering::Relaxed);
        assert_eq!(resets, 0, "a close is not a reset");
        assert_eq!(stats.upstream_cx_drain_close.load(Ordering::Relaxed), 1);
        let mut b = [0u8; 1];
        let e = app.read(&mut b).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
        let e = server.read(&mut b).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
    }

    // Two workers: on one, the relay would run to its end before the test read the count.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reset_is_counted_before_the_other_side_sees_it() {
        for app_resets in [true, false] {
            let (app, server, stats, relayed) = through_relay(b"", std::future::pending()).await;
            let (resetter, mut other) = if app_resets {
                (app, server)
            } else {
                (server, app)
            };
            resetter.set_zero_linger().unwrap();
            drop(resetter);
            let mut b = [0u8; 1];
            let e = other.read(&mut b).await.unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
            // No wait: the count came first.
            let resets = stats.upstream_cx_destroy_with_reset.load(Ordering::Relaxed);
            assert_eq!(resets, 1, "app resets: {app_resets}");
            let (_, end) = relayed.await.unwrap();
            assert!(matches!(end, End::Failed(_)), "{end:?}");
        }
    }
}
