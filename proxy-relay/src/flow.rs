//! The copy rules of a relayed TCP connection, written once for both drivers (the epoll engine
//! and the tokio path) and free of their event loops: a driver says when a socket may have
//! something to read ([`Flow::readable`], [`Flow::ended`]), calls [`Flow::pump`], and waits for
//! what it answers ([`Wait`]); when the connection ends, [`finish`] applies the end's rule.
//!
//! * Half-close: when one side ends its stream (a read returns 0), the other side gets
//!   `shutdown(Write)` (a FIN) and the opposite direction goes on until it ends too.
//! * Reset as reset: when a read or write fails (a reset, an abort), the side still alive is
//!   closed with `SO_LINGER` 0, so it sees a reset rather than a clean end; counted in
//!   `upstream_cx_destroy_with_reset` before the reset goes out.
//! * Backpressure: nothing more is read in a direction until what it read last is written, so
//!   a slow reader slows its writer down through TCP flow control; what a partial write left is
//!   the only per-connection buffer, and a direction that wrote everything holds none.
//! * Forced close (drain deadline, host failure, shutdown): counted by why, both sockets reset.

use std::{
    cell::RefCell,
    io,
    os::fd::AsFd,
    sync::atomic::{AtomicU64, Ordering},
};

use tracing::debug;

use crate::{conn::ProxyClose, stats::ProxyStats, sys};

/// Bytes read per `recv`, into one buffer per thread. Large, so that one read drains what a bulk
/// sender queued (as Envoy's 1 MiB per-connection buffer limit); a smaller one measurably
/// slowed loopback bulk (BENCHMARKS.md). It is never zeroed again, and no connection owns it.
pub(crate) const SCRATCH: usize = 1024 * 1024;

thread_local! {
    /// The scratch buffer of a thread that is not an engine thread (the tokio workers).
    static SCRATCH_BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's scratch buffer ([`SCRATCH`] bytes, allocated on first use).
/// `f` must not wait: the buffer is lent for the call only.
pub(crate) fn with_scratch<T>(f: impl FnOnce(&mut [u8]) -> T) -> T {
    SCRATCH_BUF.with_borrow_mut(|buf| {
        if buf.is_empty() {
            buf.resize(SCRATCH, 0);
        }
        f(buf)
    })
}

/// Which socket of a relayed connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// The downstream (accepted) socket.
    Client = 0,
    /// The socket to the host.
    Upstream = 1,
}

impl Side {
    /// The other socket.
    pub(crate) fn other(self) -> Self {
        match self {
            Self::Client => Self::Upstream,
            Self::Upstream => Self::Client,
        }
    }

    /// `client` or `upstream`, for logs and errors.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Upstream => "upstream",
        }
    }
}

/// A non-blocking socket as the relay uses it: `WouldBlock` means "not now".
pub(crate) trait RelaySocket: AsFd {
    /// One `recv`.
    fn recv(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// One `send` (no `SIGPIPE`).
    fn send(&self, buf: &[u8]) -> io::Result<usize>;
}

/// The engine's sockets: plain calls, the engine's epoll says when to call again.
impl RelaySocket for std::net::TcpStream {
    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        sys::recv(self.as_fd(), buf, 0)
    }

    fn send(&self, buf: &[u8]) -> io::Result<usize> {
        sys::send(self.as_fd(), buf)
    }
}

/// The tokio path's sockets: through `try_io`, so that a `WouldBlock` clears tokio's readiness
/// and the next wait is a real one. Readiness is cleared only that way: clearing it after a
/// short read without a `recv` could erase an event for bytes that arrived in between (tokio
/// clears whatever it saw last), and the edge would not come again.
impl RelaySocket for tokio::net::TcpStream {
    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.try_io(tokio::io::Interest::READABLE, || {
            sys::recv(self.as_fd(), buf, 0)
        })
    }

    fn send(&self, buf: &[u8]) -> io::Result<usize> {
        self.try_io(tokio::io::Interest::WRITABLE, || {
            sys::send(self.as_fd(), buf)
        })
    }
}

/// What a direction waits for after [`Flow::pump`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Its source to be readable.
    Read,
    /// Its destination to be writable (it holds bytes a write did not take).
    Write,
    /// Nothing: the direction has ended and its end was passed on.
    Done,
}

/// A read or write that failed: the connection ends with a reset.
#[derive(Debug)]
pub(crate) struct Failed {
    /// The socket that failed.
    pub(crate) side: Side,
    /// `read` or `write`.
    pub(crate) op: &'static str,
    /// The error.
    pub(crate) err: io::Error,
}

/// How a relayed connection ended.
#[derive(Debug)]
pub(crate) enum End {
    /// Both directions ended cleanly.
    Done,
    /// A side failed; the other is reset.
    Failed(Failed),
    /// The proxy closed it; both sides are reset.
    Closed(ProxyClose),
}

/// One direction of a relayed connection: client to upstream, or upstream to client.
#[derive(Debug, Default)]
pub(crate) struct Flow {
    /// Read but not yet written (the destination was full).
    pending: Vec<u8>,
    /// The source has ended.
    eof: bool,
    /// The end was passed on (FIN).
    shut: bool,
    /// Bytes written to the destination.
    moved: u64,
    /// The source may have bytes (or its end) to read: set by the driver on a readiness event,
    /// cleared when a read found the source empty.
    pub(crate) readable: bool,
    /// The source announced its end or an error: from here it is read until the kernel says it
    /// is empty, not only until a short read.
    pub(crate) ended: bool,
}

impl Flow {
    /// A direction that starts with `pending` to write (bytes read before the relay started);
    /// its source is read on its first readiness event (a socket that joins an event loop with
    /// bytes queued gets one).
    pub(crate) fn new(pending: Vec<u8>) -> Self {
        Self {
            pending,
            ..Self::default()
        }
    }

    /// Bytes written to the destination so far.
    pub(crate) fn moved(&self) -> u64 {
        self.moved
    }

    /// The direction ended and its end was passed on.
    pub(crate) fn is_done(&self) -> bool {
        self.shut
    }

    /// Moves what can be moved from `src` (the socket of side `from`) to `dst` without waiting:
    /// what a write left first, then reads (into `scratch`) and writes until one of them would
    /// block or the source ended, which is passed on as a FIN. Bytes written are added to
    /// `meter` as they go.
    pub(crate) fn pump(
        &mut self,
        from: Side,
        src: &impl RelaySocket,
        dst: &impl RelaySocket,
        scratch: &mut [u8],
        meter: &AtomicU64,
    ) -> Result<Wait, Failed> {
        let write_failed = |err| Failed {
            side: from.other(),
            op: "write",
            err,
        };
        loop {
            if !self.pending.is_empty() {
                match dst.send(&self.pending) {
                    Ok(n) => {
                        self.count(n, meter);
                        self.pending.drain(..n);
                        if !self.pending.is_empty() {
                            return Ok(Wait::Write);
                        }
                        // A drained buffer is not kept: idle connections hold none.
                        self.pending = Vec::new();
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Wait::Write),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(write_failed(e)),
                }
            }
            if self.eof {
                if !self.shut {
                    self.shut = true;
                    // The peer may be gone already (it reset while we read); that is not this
                    // direction's failure, and the other direction will see it.
                    let _ = socket2::SockRef::from(dst).shutdown(std::net::Shutdown::Write);
                }
                return Ok(Wait::Done);
            }
            if !self.readable {
                return Ok(Wait::Read);
            }
            match src.recv(scratch) {
                Ok(0) => self.eof = true,
                Ok(n) => {
                    let sent = match dst.send(&scratch[..n]) {
                        Ok(sent) => sent,
                        Err(e)
                            if matches!(
                                e.kind(),
                                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                            ) =>
                        {
                            0
                        }
                        Err(e) => return Err(write_failed(e)),
                    };
                    self.count(sent, meter);
                    if sent < n {
                        self.pending.extend_from_slice(&scratch[sent..n]);
                        return Ok(Wait::Write);
                    }
                    if n < scratch.len() && !self.ended {
                        // A short read emptied the socket; new bytes, an end or an error bring
                        // a new readiness event.
                        self.readable = false;
                        return Ok(Wait::Read);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.readable = false;
                    return Ok(Wait::Read);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => {
                    return Err(Failed {
                        side: from,
                        op: "read",
                        err,
                    });
                }
            }
        }
    }

    fn count(&mut self, n: usize, meter: &AtomicU64) {
        self.moved += n as u64;
        meter.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// Both directions of a connection.
#[derive(Debug, Default)]
pub(crate) struct Flows(pub(crate) [Flow; 2]);

impl Flows {
    /// Client to upstream starts with `unsent` (the client's bytes read before the relay
    /// started).
    pub(crate) fn new(unsent: Vec<u8>) -> Self {
        Self([Flow::new(unsent), Flow::new(Vec::new())])
    }

    /// The connect failed and another host gets a turn (`connect_attempts.rs`): the client's bytes not
    /// sent yet come back for the next connect, what the failed socket announced is forgotten,
    /// and what the client announced stays (its events come once).
    pub(crate) fn restart(&mut self) -> Vec<u8> {
        self.0[Side::Upstream as usize] = Flow::default();
        std::mem::take(&mut self.0[Side::Client as usize].pending)
    }

    /// The next connect left `unsent` of the client's bytes to write first.
    pub(crate) fn set_unsent(&mut self, unsent: Vec<u8>) {
        self.0[Side::Client as usize].pending = unsent;
    }

    /// The direction whose source is `side`.
    pub(crate) fn from(&mut self, side: Side) -> &mut Flow {
        &mut self.0[side as usize]
    }

    /// Pumps both directions (see [`Flow::pump`]); returns what each waits for, client to
    /// upstream first, or the failure that ends the connection.
    pub(crate) fn pump<S: RelaySocket>(
        &mut self,
        client: &S,
        upstream: &S,
        scratch: &mut [u8],
        stats: &ProxyStats,
    ) -> Result<[Wait; 2], Failed> {
        let up = self.0[0].pump(
            Side::Client,
            client,
            upstream,
            scratch,
            &stats.upstream_cx_tx_bytes_total,
        )?;
        let down = self.0[1].pump(
            Side::Upstream,
            upstream,
            client,
            scratch,
            &stats.upstream_cx_rx_bytes_total,
        )?;
        Ok([up, down])
    }

    /// Both directions ended and passed their end on.
    pub(crate) fn done(&self) -> bool {
        self.0.iter().all(Flow::is_done)
    }
}

/// Applies the rule of `end` to a connection's sockets (which the caller then closes): a
/// failure is counted and the side still alive reset; a forced close counted by why and both
/// reset; a clean end leaves both to close normally.
pub(crate) fn finish(end: &End, client: &impl AsFd, upstream: &impl AsFd, stats: &ProxyStats) {
    match end {
        End::Done => {}
        End::Failed(Failed { side, op, err }) => {
            // Counted before the surviving side's reset goes out: whoever sees the reset also
            // sees it counted.
            ProxyStats::inc(&stats.upstream_cx_destroy_with_reset);
            debug!(side = side.name(), op, %err, "connection reset");
            match side {
                Side::Client => abort(upstream),
                Side::Upstream => abort(client),
            }
        }
        End::Closed(why) => {
            why.count(stats);
            debug!(why = why.why(), "connection closed by the proxy");
            abort(client);
            abort(upstream);
        }
    }
}

/// Makes the socket's close send a reset (`SO_LINGER` 0).
pub(crate) fn abort(socket: &impl AsFd) {
    let _ = socket2::SockRef::from(socket).set_linger(Some(std::time::Duration::ZERO));
}
