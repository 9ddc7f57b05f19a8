//! The copy loop: bytes between a client and its upstream, both directions at once.
//!
//! * Half-close: when one side ends its stream (read returns 0), the other side gets
//!   `shutdown(Write)` (a FIN) and the opposite direction goes on until it ends too.
//! * Reset: when a read or write fails (a reset, an abort), both sockets are closed with
//!   `SO_LINGER` 0, so the side that is still alive sees a reset rather than a clean end.
//! * Backpressure: one bounded buffer per direction; nothing more is read until the last read
//!   is written, so a slow reader slows its writer down through TCP flow control.
//! * Forced close (drain deadline, host failure, shutdown): both sockets are reset.

use std::{
    future::Future,
    io,
    os::fd::AsFd,
    sync::atomic::{AtomicU64, Ordering},
    task::{Context, Poll, ready},
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{
        TcpStream,
        tcp::{OwnedReadHalf, OwnedWriteHalf},
    },
};

use crate::sys;

/// First buffer size per direction: request/response traffic mostly fits, and an idle
/// connection costs little (two of these per proxied connection).
pub const INITIAL_BUFFER_SIZE: usize = 8 * 1024;
/// Largest buffer, for bulk transfers: one read drains what the socket holds (as Envoy's 1 MiB
/// per-connection buffer limit), so a bulk stream takes fewer reads and writes than with a
/// smaller one (BENCHMARKS.md has the measurement).
pub const LARGE_BUFFER_SIZE: usize = 1024 * 1024;
/// Completely filled reads in a row after which a direction's buffer grows ([`grown`]): only a
/// sender that keeps the socket full climbs from [`INITIAL_BUFFER_SIZE`] to
/// [`LARGE_BUFFER_SIZE`].
const FULL_READS_TO_GROW: u32 = 4;

/// The next buffer size after [`FULL_READS_TO_GROW`] full reads: four times larger, up to
/// [`LARGE_BUFFER_SIZE`] (8, 32, 128, 512 KiB, 1 MiB).
fn grown(len: usize) -> usize {
    (len * 4).min(LARGE_BUFFER_SIZE)
}

/// Bytes moved, per direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Copied {
    /// Client to upstream.
    pub sent: u64,
    /// Upstream to client.
    pub received: u64,
}

/// How a copy ended when it did not end with both sides closing cleanly.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// A read or write failed on one side (typically a reset); both sides were reset.
    #[error("{side} {op} failed: {source}")]
    Io {
        /// `client` or `upstream`.
        side: &'static str,
        /// `read` or `write`.
        op: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The connection was closed from outside (drain deadline, host failure, shutdown).
    #[error("closed by the proxy: {0}")]
    Closed(&'static str),
}

/// Live byte counters the copy adds to as it goes (the proxy's `upstream_cx_*_bytes_total`).
pub struct Meter<'a> {
    /// Bytes written to the upstream.
    pub tx: &'a AtomicU64,
    /// Bytes read from the upstream.
    pub rx: &'a AtomicU64,
    /// Connections ended by a failed side (`upstream_cx_destroy_with_reset`). Counted before
    /// the other side is reset, so whoever sees the reset also sees it counted.
    pub resets: &'a AtomicU64,
}

/// Copies until both directions are done, a side fails, or `close` resolves with a reason.
/// `unsent` holds bytes already read from the client and not yet written upstream (see
/// [`read_now`]): they go first. Returns the bytes moved either way (`unsent` counted when
/// written), with the error if it did not end cleanly.
pub async fn bidirectional(
    client: TcpStream,
    upstream: TcpStream,
    unsent: Vec<u8>,
    meter: Meter<'_>,
    close: impl Future<Output = &'static str>,
) -> (Copied, Result<(), CopyError>) {
    let (mut client_rd, mut client_wr) = client.into_split();
    let (mut upstream_rd, mut upstream_wr) = upstream.into_split();
    let mut copied = Copied::default();
    let result = {
        let up = one_way(
            &mut client_rd,
            &mut upstream_wr,
            unsent,
            meter.tx,
            &mut copied.sent,
            ("client", "upstream"),
        );
        let down = one_way(
            &mut upstream_rd,
            &mut client_wr,
            Vec::new(),
            meter.rx,
            &mut copied.received,
            ("upstream", "client"),
        );
        tokio::select! {
            r = async { tokio::try_join!(up, down) } => r.map(|_| ()),
            reason = close => Err(CopyError::Closed(reason)),
        }
    };
    // Reunited rather than dropped as halves: a dropped write half would send a FIN first, and
    // the peer would see a clean end before the reset.
    let client = client_rd.reunite(client_wr).ok();
    let upstream = upstream_rd.reunite(upstream_wr).ok();
    match &result {
        Ok(()) => {}
        // The side whose read or write failed is dead already (a reset, an error): only the
        // other one needs SO_LINGER 0 to pass the reset on.
        Err(CopyError::Io { side, .. }) => {
            meter.resets.fetch_add(1, Ordering::Relaxed);
            let alive = if *side == "client" {
                &upstream
            } else {
                &client
            };
            alive.iter().for_each(abort);
        }
        Err(CopyError::Closed(_)) => client.iter().chain(&upstream).for_each(abort),
    }
    (copied, result)
}

/// One direction: write what `buf` holds, then read from `from` and write to `to` until
/// `from` ends; then FIN `to`.
///
/// A direction holds a buffer only while it moves data: a small buffer is let go when there is
/// nothing more to read (to the thread's [`spare`] buffers), and taken again when the socket
/// becomes readable; reads go into its spare capacity, nothing is zeroed. An idle connection so
/// costs its task and sockets, not two buffers (BENCHMARKS.md, memory). Buffers that grew for
/// bulk stay until the connection ends.
async fn one_way(
    from: &mut OwnedReadHalf,
    to: &mut OwnedWriteHalf,
    mut buf: Vec<u8>,
    meter: &AtomicU64,
    total: &mut u64,
    (from_name, to_name): (&'static str, &'static str),
) -> Result<(), CopyError> {
    let mut size = INITIAL_BUFFER_SIZE;
    let mut full_reads = 0u32;
    loop {
        let n = if buf.is_empty() {
            std::future::poll_fn(|cx| poll_fill(from, &mut buf, size, cx))
                .await
                .map_err(|source| CopyError::Io {
                    side: from_name,
                    op: "read",
                    source,
                })?
        } else {
            buf.len()
        };
        if n == 0 {
            // End of stream: pass the FIN on. The peer may be gone already (it reset while we
            // read); that is not this direction's failure.
            let _ = to.shutdown().await;
            return Ok(());
        }
        to.write_all(&buf).await.map_err(|source| CopyError::Io {
            side: to_name,
            op: "write",
            source,
        })?;
        buf.clear();
        *total += n as u64;
        meter.fetch_add(n as u64, Ordering::Relaxed);
        if n < size {
            full_reads = 0;
            // A short read drained the socket: the connection may go idle now, and an idle
            // direction holds no buffer.
            if size == INITIAL_BUFFER_SIZE {
                spare::put(std::mem::take(&mut buf));
            }
        } else {
            full_reads += 1;
            if full_reads >= FULL_READS_TO_GROW && size < LARGE_BUFFER_SIZE {
                size = grown(size);
                buf = Vec::with_capacity(size);
                full_reads = 0;
            }
        }
    }
}

/// One read into `buf`. A direction without a buffer waits for the socket to be readable
/// before it takes one of `size` bytes (not zeroed: reads go into its spare capacity).
fn poll_fill(
    from: &mut OwnedReadHalf,
    buf: &mut Vec<u8>,
    size: usize,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    if buf.capacity() == 0 {
        ready!(from.as_ref().poll_read_ready(cx))?;
        *buf = if size == INITIAL_BUFFER_SIZE {
            spare::take()
        } else {
            Vec::with_capacity(size)
        };
    }
    std::pin::pin!(from.read_buf(buf)).poll(cx)
}

/// Small buffers let go by idle directions, kept per thread for the next readable socket:
/// request/response traffic lets go of and takes a buffer for every message, and this saves
/// it the allocator (bounded: at most [`spare::KEPT`] buffers per thread).
mod spare {
    use std::cell::RefCell;

    use super::INITIAL_BUFFER_SIZE;

    /// Buffers kept per thread (128 KiB).
    pub const KEPT: usize = 16;

    thread_local! {
        static SPARE: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
    }

    /// An empty buffer of [`INITIAL_BUFFER_SIZE`] bytes' capacity.
    pub fn take() -> Vec<u8> {
        SPARE
            .with_borrow_mut(Vec::pop)
            .unwrap_or_else(|| Vec::with_capacity(INITIAL_BUFFER_SIZE))
    }

    /// Buffers kept by this thread now.
    #[cfg(test)]
    pub fn kept() -> usize {
        SPARE.with_borrow(Vec::len)
    }

    /// Keeps `buf` (emptied) for [`take`], or frees it when enough are kept.
    pub fn put(mut buf: Vec<u8>) {
        buf.clear();
        SPARE.with_borrow_mut(|kept| {
            if kept.len() < KEPT && buf.capacity() == INITIAL_BUFFER_SIZE {
                kept.push(buf);
            }
        });
    }
}

/// What the client has sent already, read without waiting for the event loop: a buffer from
/// the thread's spare ones, or an empty one when nothing is there yet or the stream has ended
/// (the copy's first read then finds the end again). An error (a reset) is returned: the
/// kernel reports it once, so the caller must act on it as the copy would.
pub fn read_now(client: &impl AsFd) -> io::Result<Vec<u8>> {
    let mut buf = spare::take();
    match sys::recv_into_spare(client.as_fd(), &mut buf, libc::MSG_DONTWAIT) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
        Err(e) => {
            spare::put(buf);
            return Err(e);
        }
    }
    if buf.is_empty() {
        spare::put(buf);
        return Ok(Vec::new());
    }
    Ok(buf)
}

/// Gives a buffer from [`read_now`] back to the thread's spare ones.
pub fn recycle(buf: Vec<u8>) {
    spare::put(buf);
}

/// Makes the socket's close send a reset (`SO_LINGER` 0).
pub fn abort(stream: &impl AsFd) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(std::time::Duration::ZERO));
}

#[cfg(test)]
mod tests {
    use std::{net::SocketAddr, sync::Arc};

    use tokio::net::TcpListener;

    use super::*;

    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = l.local_addr().unwrap();
        let (a, b) = tokio::join!(TcpStream::connect(addr), l.accept());
        (a.unwrap(), b.unwrap().0)
    }

    /// What a copy returns, with its meter's count of bytes sent upstream.
    type CopyOutcome = ((Copied, Result<(), CopyError>), u64);

    /// app <-> (client_side | copy | upstream_side) <-> server: the outer ends, and the copy
    /// running between them until both sides are done.
    async fn through_copy() -> (TcpStream, TcpStream, tokio::task::JoinHandle<CopyOutcome>) {
        let (app, client_side) = pair().await;
        let (upstream_side, server) = pair().await;
        let copy = tokio::spawn(async move {
            let (tx, rx, resets) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
            let meter = Meter {
                tx: &tx,
                rx: &rx,
                resets: &resets,
            };
            let out = bidirectional(
                client_side,
                upstream_side,
                Vec::new(),
                meter,
                std::future::pending(),
            )
            .await;
            (out, tx.load(Ordering::Relaxed))
        });
        (app, server, copy)
    }

    #[tokio::test]
    async fn half_close_and_counts() {
        let (mut app, mut server, copy) = through_copy().await;
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
        let ((copied, result), tx) = copy.await.unwrap();
        result.unwrap();
        assert_eq!((copied.sent, copied.received, tx), (4, 4, 4));
    }

    #[test]
    fn buffers_grow_in_steps_to_the_limit() {
        let mut sizes = vec![INITIAL_BUFFER_SIZE];
        while *sizes.last().unwrap() < LARGE_BUFFER_SIZE {
            sizes.push(grown(*sizes.last().unwrap()));
        }
        let kib: Vec<_> = sizes.iter().map(|s| s / 1024).collect();
        assert_eq!(kib, [8, 32, 128, 512, 1024]);
        assert_eq!(grown(LARGE_BUFFER_SIZE), LARGE_BUFFER_SIZE);
    }

    #[tokio::test]
    async fn bulk_arrives_intact_through_growing_buffers() {
        let (mut app, mut server, copy) = through_copy().await;
        // 8 MiB of a pattern that shifts with every byte, so a lost or repeated chunk shows.
        let data: Vec<u8> = (0..8u32 << 20).map(|i| (i % 251) as u8).collect();
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            app.write_all(&sent).await.unwrap();
            app.shutdown().await.unwrap();
            app
        });
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.unwrap();
        assert!(
            got == data,
            "{} bytes arrived, not the {} sent",
            got.len(),
            data.len()
        );
        drop(server);
        drop(writer.await.unwrap());
        let ((copied, result), _) = copy.await.unwrap();
        result.unwrap();
        assert_eq!(copied.sent, data.len() as u64);
    }

    #[tokio::test]
    async fn small_messages_between_bursts_arrive_in_order() {
        // Each small message ends in a short read (the buffer is let go) and the next one takes
        // a buffer again; a burst in between grows it. Nothing may be lost or reordered.
        let (mut app, mut server, copy) = through_copy().await;
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
        let ((copied, _), _) = copy.await.unwrap();
        assert_eq!(copied.sent, 3 * (40 + burst.len() as u64));
        assert_eq!(copied.received, 3 * 40);
    }

    #[test]
    fn spare_buffers_are_bounded_and_empty() {
        // A test thread of its own: nothing else uses this thread's spares.
        std::thread::spawn(|| {
            for i in 0..(spare::KEPT as u8 + 4) {
                let mut b = Vec::with_capacity(INITIAL_BUFFER_SIZE);
                b.push(i);
                spare::put(b);
            }
            assert_eq!(spare::kept(), spare::KEPT);
            // A grown buffer is not kept.
            spare::take();
            spare::put(Vec::with_capacity(LARGE_BUFFER_SIZE));
            assert_eq!(spare::kept(), spare::KEPT - 1);
            for _ in 0..spare::KEPT + 2 {
                let b = spare::take();
                assert!(b.is_empty());
                assert_eq!(b.capacity(), INITIAL_BUFFER_SIZE);
            }
            assert_eq!(spare::kept(), 0);
        })
        .join()
        .unwrap();
    }

    #[tokio::test]
    async fn unsent_bytes_go_first_and_are_counted() {
        let (mut app, client_side) = pair().await;
        let (upstream_side, mut server) = pair().await;
        let copy = tokio::spawn(async move {
            let (tx, rx, resets) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
            let meter = Meter {
                tx: &tx,
                rx: &rx,
                resets: &resets,
            };
            let unsent = b"early".to_vec();
            let out = bidirectional(
                client_side,
                upstream_side,
                unsent,
                meter,
                std::future::pending(),
            )
            .await;
            (out, tx.load(Ordering::Relaxed))
        });
        app.write_all(b" and late").await.unwrap();
        app.shutdown().await.unwrap();
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"early and late");
        drop(server);
        let ((copied, result), tx) = copy.await.unwrap();
        result.unwrap();
        assert_eq!((copied.sent, tx), (14, 14));
    }

    #[tokio::test]
    async fn read_now_takes_what_is_there_and_reports_a_reset() {
        let (mut app, client_side) = pair().await;
        assert!(
            read_now(&client_side).unwrap().is_empty(),
            "nothing sent yet"
        );
        app.write_all(b"hello").await.unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let got = loop {
            let got = read_now(&client_side).unwrap();
            if !got.is_empty() || std::time::Instant::now() > deadline {
                break got;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        };
        assert_eq!(got, b"hello");
        app.set_zero_linger().unwrap();
        drop(app);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let err = loop {
            match read_now(&client_side) {
                Err(e) => break e,
                Ok(b) if b.is_empty() && std::time::Instant::now() < deadline => {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                Ok(b) => panic!("no reset reported (got {b:?})"),
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset);
    }

    #[tokio::test]
    async fn forced_close_resets_both() {
        let (mut app, client_side) = pair().await;
        let (upstream_side, mut server) = pair().await;
        let (tx, rx, resets) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
        let meter = Meter {
            tx: &tx,
            rx: &rx,
            resets: &resets,
        };
        let (_, result) = bidirectional(client_side, upstream_side, Vec::new(), meter, async {
            "test"
        })
        .await;
        assert!(matches!(result, Err(CopyError::Closed("test"))));
        assert_eq!(resets.load(Ordering::Relaxed), 0, "a close is not a reset");
        let mut b = [0u8; 1];
        let e = app.read(&mut b).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
        let e = server.read(&mut b).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
    }

    // Two workers: on one, the copy would run to its end before the test read the count.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reset_is_counted_before_the_other_side_sees_it() {
        for app_resets in [true, false] {
            let (app, client_side) = pair().await;
            let (upstream_side, server) = pair().await;
            let resets = Arc::new(AtomicU64::new(0));
            let copy = tokio::spawn({
                let resets = resets.clone();
                async move {
                    let (tx, rx) = (AtomicU64::new(0), AtomicU64::new(0));
                    let meter = Meter {
                        tx: &tx,
                        rx: &rx,
                        resets: &resets,
                    };
                    let close = std::future::pending();
                    bidirectional(client_side, upstream_side, Vec::new(), meter, close).await
                }
            });
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
            assert_eq!(
                resets.load(Ordering::Relaxed),
                1,
                "app resets: {app_resets}"
            );
            let (_, result) = copy.await.unwrap();
            assert!(matches!(result, Err(CopyError::Io { .. })), "{result:?}");
        }
    }
}
