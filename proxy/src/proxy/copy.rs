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
    sync::atomic::{AtomicU64, Ordering},
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{
        TcpStream,
        tcp::{OwnedReadHalf, OwnedWriteHalf},
    },
};

/// First buffer size per direction: request/response traffic mostly fits, and an idle
/// connection costs little (two of these per proxied connection).
pub const INITIAL_BUFFER_SIZE: usize = 8 * 1024;
/// Buffer size for bulk transfers: a read can drain a whole loopback segment (64 KiB MSS), so a
/// large transfer takes a quarter of the syscalls it would with 16 KiB.
pub const LARGE_BUFFER_SIZE: usize = 64 * 1024;
/// Completely filled reads in a row after which a direction counts as bulk and its buffer grows
/// from [`INITIAL_BUFFER_SIZE`] to [`LARGE_BUFFER_SIZE`].
const FULL_READS_TO_GROW: u32 = 4;

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
}

/// Copies until both directions are done, a side fails, or `close` resolves with a reason.
/// Returns the bytes moved either way, with the error if it did not end cleanly.
pub async fn bidirectional(
    client: TcpStream,
    upstream: TcpStream,
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
            meter.tx,
            &mut copied.sent,
            ("client", "upstream"),
        );
        let down = one_way(
            &mut upstream_rd,
            &mut client_wr,
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
    if result.is_err() {
        client.iter().chain(&upstream).for_each(abort);
    }
    (copied, result)
}

/// One direction: read from `from`, write to `to`, until `from` ends; then FIN `to`.
async fn one_way(
    from: &mut OwnedReadHalf,
    to: &mut OwnedWriteHalf,
    meter: &AtomicU64,
    total: &mut u64,
    (from_name, to_name): (&'static str, &'static str),
) -> Result<(), CopyError> {
    let mut buf = vec![0u8; INITIAL_BUFFER_SIZE];
    let mut full_reads = 0u32;
    loop {
        let n = from.read(&mut buf).await.map_err(|source| CopyError::Io {
            side: from_name,
            op: "read",
            source,
        })?;
        if n == 0 {
            // End of stream: pass the FIN on. The peer may be gone already (it reset while we
            // read); that is not this direction's failure.
            let _ = to.shutdown().await;
            return Ok(());
        }
        to.write_all(&buf[..n])
            .await
            .map_err(|source| CopyError::Io {
                side: to_name,
                op: "write",
                source,
            })?;
        *total += n as u64;
        meter.fetch_add(n as u64, Ordering::Relaxed);
        full_reads = if n == buf.len() { full_reads + 1 } else { 0 };
        if full_reads >= FULL_READS_TO_GROW && buf.len() < LARGE_BUFFER_SIZE {
            buf.resize(LARGE_BUFFER_SIZE, 0);
        }
    }
}

/// Makes the socket's close send a reset (`SO_LINGER` 0).
pub fn abort(stream: &TcpStream) {
    let _ = stream.set_zero_linger();
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use tokio::net::TcpListener;

    use super::*;

    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = l.local_addr().unwrap();
        let (a, b) = tokio::join!(TcpStream::connect(addr), l.accept());
        (a.unwrap(), b.unwrap().0)
    }

    #[tokio::test]
    async fn half_close_and_counts() {
        // app <-> (client_side | proxy | upstream_side) <-> server
        let (mut app, client_side) = pair().await;
        let (upstream_side, mut server) = pair().await;
        let (tx, rx) = (AtomicU64::new(0), AtomicU64::new(0));
        let copy = tokio::spawn(async move {
            let meter = Meter { tx: &tx, rx: &rx };
            let out =
                bidirectional(client_side, upstream_side, meter, std::future::pending()).await;
            (out, tx.load(Ordering::Relaxed))
        });
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

    #[tokio::test]
    async fn forced_close_resets_both() {
        let (mut app, client_side) = pair().await;
        let (upstream_side, mut server) = pair().await;
        let (tx, rx) = (AtomicU64::new(0), AtomicU64::new(0));
        let meter = Meter { tx: &tx, rx: &rx };
        let (_, result) = bidirectional(client_side, upstream_side, meter, async { "test" }).await;
        assert!(matches!(result, Err(CopyError::Closed("test"))));
        let mut b = [0u8; 1];
        let e = app.read(&mut b).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
        let e = server.read(&mut b).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
    }
}
