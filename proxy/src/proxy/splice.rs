//! Kernel splicing of the TCP path (`splice: kernel`): once the upstream is connected, the pair
//! is handed to a [`Splicer`] (the kernel's proxy-pair splicing: `dataplane::PairSplicer`) and
//! the bytes move between the two sockets inside the kernel. Userspace reads nothing; it waits
//! for each socket's end of stream and errors and propagates them:
//!
//! * Half-close: one side's FIN is passed on with `shutdown(Write)` on the other side, but only
//!   once every byte that side received before its FIN went out of the other socket. The kernel
//!   tells nobody when that is, so it is read from sequence numbers: the bytes the receiving
//!   socket got (`tcpi_bytes_received`) against the bytes written to the sending one
//!   (`tcpi_bytes_acked` + `SIOCOUTQ`), both taken relative to the moment of splicing.
//! * Reset: an error on one side (a reset, an abort) resets the other (`SO_LINGER` 0, close).
//! * Forced close (drain deadline, host failure, shutdown): both sides are reset.
//! * Backpressure is the kernel's (see ARCHITECTURE.md, "Proxy-pair splicing").
//!
//! Byte counters (`upstream_cx_*_bytes_total`) count what the copy loop moved; spliced bytes are
//! not in them.

use std::{
    future::Future,
    io,
    os::fd::AsFd as _,
    time::{Duration, Instant},
};

use tokio::{io::Interest, net::TcpStream};

use super::copy::{CopyError, abort};
use crate::sys::{self, TcpBytes};

/// Hands a connected client/upstream pair to something that moves bytes between them without
/// the proxy (the kernel). Shared by every connection task.
pub trait Splicer: Send + Sync {
    /// Splices the pair; bytes move between them until the returned guard is dropped. An error
    /// means nothing was changed: the caller copies in userspace instead.
    fn splice(&self, client: &TcpStream, upstream: &TcpStream) -> Result<SpliceGuard, SpliceError>;
}

/// Why a splicer refused a pair.
pub type SpliceError = Box<dyn std::error::Error + Send + Sync>;

/// A spliced pair: dropping it ends the splicing (always before the sockets close).
pub struct SpliceGuard(#[expect(dead_code, reason = "held for its Drop")] Box<dyn Send>);

impl SpliceGuard {
    /// Wraps whatever undoes the splicing when dropped.
    pub fn new(undo: impl Send + 'static) -> Self {
        Self(Box::new(undo))
    }
}

/// The kernel's proxy-pair splicing.
impl Splicer for crate::dataplane::PairSplicer {
    fn splice(&self, client: &TcpStream, upstream: &TcpStream) -> Result<SpliceGuard, SpliceError> {
        crate::dataplane::PairSplicer::splice(self, client, upstream)
            .map(SpliceGuard::new)
            .map_err(Into::into)
    }
}

/// First wait between two looks at a direction whose FIN is waiting for its bytes to leave.
const FLUSH_POLL_FIRST: Duration = Duration::from_millis(1);
/// The longest such wait (the delay a half-close can get on top of the transfer).
const FLUSH_POLL_MAX: Duration = Duration::from_millis(50);
/// A direction whose bytes stopped moving while nothing is queued in the sending socket for
/// this long lost bytes in the kernel (its peer vanished mid-transfer): the pair is reset.
const FLUSH_STALL: Duration = Duration::from_secs(2);

/// Both sockets' byte counts just before splicing.
pub(super) struct Baseline {
    client: TcpBytes,
    upstream: TcpBytes,
}

/// Reads the byte counts splicing is measured against; call before [`Splicer::splice`].
pub(super) fn baseline(client: &TcpStream, upstream: &TcpStream) -> io::Result<Baseline> {
    Ok(Baseline {
        client: sys::tcp_bytes(client.as_fd())?,
        upstream: sys::tcp_bytes(upstream.as_fd())?,
    })
}

/// One direction of a spliced pair.
struct Direction<'a> {
    from: &'a TcpStream,
    to: &'a TcpStream,
    names: (&'static str, &'static str),
    /// Bytes of `from` that userspace took before splicing (never forwarded by the kernel).
    consumed_before: u64,
    /// Bytes written to `to` before splicing.
    written_before: u64,
    state: State,
}

#[derive(Clone, Copy)]
enum State {
    /// Bytes flow; no FIN yet.
    Open,
    /// `from` ended; waiting until `target` bytes went out of `to`.
    Flushing {
        target: u64,
        written: u64,
        since: Instant,
    },
    /// The FIN was passed on.
    Done,
}

impl<'a> Direction<'a> {
    fn new(
        from: &'a TcpStream,
        to: &'a TcpStream,
        base: (&TcpBytes, &TcpBytes),
        names: (&'static str, &'static str),
    ) -> Self {
        Self {
            from,
            to,
            names,
            consumed_before: base.0.received.saturating_sub(base.0.unread),
            written_before: base.1.written,
            state: State::Open,
        }
    }

    fn io_error(&self, to_side: bool, op: &'static str, source: io::Error) -> CopyError {
        let side = if to_side { self.names.1 } else { self.names.0 };
        CopyError::Io { side, op, source }
    }

    /// `from` reached its end of stream: how many bytes the kernel has to send on.
    fn ended(&mut self) -> Result<(), CopyError> {
        let received = sys::tcp_received_before_fin(self.from.as_fd())
            .map_err(|e| self.io_error(false, "read", e))?;
        let target = received.saturating_sub(self.consumed_before);
        self.state = State::Flushing {
            target,
            written: 0,
            since: Instant::now(),
        };
        self.flush()
    }

    /// Passes the FIN on once every byte went out; fails when bytes stopped moving with nothing
    /// left to send.
    fn flush(&mut self) -> Result<(), CopyError> {
        let State::Flushing {
            target,
            written,
            since,
        } = self.state
        else {
            return Ok(());
        };
        let (now, queued) =
            sys::tcp_written(self.to.as_fd()).map_err(|e| self.io_error(true, "write", e))?;
        let now = now.saturating_sub(self.written_before);
        if now >= target {
            socket2::SockRef::from(self.to)
                .shutdown(std::net::Shutdown::Write)
                .map_err(|e| self.io_error(true, "write", e))?;
            self.state = State::Done;
        } else if now != written || queued > 0 {
            self.state = State::Flushing {
                target,
                written: now,
                since: Instant::now(),
            };
        } else if since.elapsed() > FLUSH_STALL {
            let lost = io::Error::new(
                io::ErrorKind::BrokenPipe,
                "spliced bytes stopped short of the half-close",
            );
            return Err(self.io_error(true, "write", lost));
        }
        Ok(())
    }
}

/// What happened on one socket.
enum Event {
    /// The peer ended its stream.
    Eof,
    /// The socket failed (typically a reset).
    Failed(io::Error),
}

/// Waits for `s`'s end of stream (unless `ended` already) or error.
async fn watch(s: &TcpStream, ended: bool) -> Event {
    let interest = if ended {
        Interest::ERROR
    } else {
        Interest::READABLE | Interest::ERROR
    };
    loop {
        let ready = match s.ready(interest).await {
            Ok(r) => r,
            Err(e) => return Event::Failed(e),
        };
        match s.take_error() {
            Ok(Some(e)) | Err(e) => return Event::Failed(e),
            Ok(None) => {}
        }
        if !ended && ready.is_read_closed() {
            return Event::Eof;
        }
        // A wakeup without news (the kernel's data-ready on a spliced socket): forget it. The
        // closed states are not cleared by this, which is why an ended side waits for errors only.
        let _ = s.try_io(Interest::READABLE, || {
            Err::<(), _>(io::ErrorKind::WouldBlock.into())
        });
        if ready.is_error() {
            let _ = s.try_io(Interest::ERROR, || {
                Err::<(), _>(io::ErrorKind::WouldBlock.into())
            });
        }
    }
}

/// Runs a spliced pair until both directions ended, a side failed or `close` resolves. `guard`
/// is dropped before the sockets close.
pub(super) async fn run(
    client: TcpStream,
    upstream: TcpStream,
    guard: SpliceGuard,
    base: Baseline,
    close: impl Future<Output = &'static str>,
) -> Result<(), CopyError> {
    let result = {
        let mut up = Direction::new(
            &client,
            &upstream,
            (&base.client, &base.upstream),
            ("client", "upstream"),
        );
        let mut down = Direction::new(
            &upstream,
            &client,
            (&base.upstream, &base.client),
            ("upstream", "client"),
        );
        drive(&mut up, &mut down, close).await
    };
    if result.is_err() {
        abort(&client);
        abort(&upstream);
    }
    drop(guard);
    drop((client, upstream));
    result
}

async fn drive(
    up: &mut Direction<'_>,
    down: &mut Direction<'_>,
    close: impl Future<Output = &'static str>,
) -> Result<(), CopyError> {
    tokio::pin!(close);
    let mut poll = FLUSH_POLL_FIRST;
    loop {
        if matches!((&up.state, &down.state), (State::Done, State::Done)) {
            return Ok(());
        }
        let flushing = [&up.state, &down.state]
            .iter()
            .any(|s| matches!(s, State::Flushing { .. }));
        let (up_ended, down_ended) = (
            !matches!(up.state, State::Open),
            !matches!(down.state, State::Open),
        );
        tokio::select! {
            reason = &mut close => return Err(CopyError::Closed(reason)),
            ev = watch(up.from, up_ended) => match ev {
                Event::Eof => up.ended()?,
                Event::Failed(e) => return Err(up.io_error(false, "read", e)),
            },
            ev = watch(down.from, down_ended) => match ev {
                Event::Eof => down.ended()?,
                Event::Failed(e) => return Err(down.io_error(false, "read", e)),
            },
            () = tokio::time::sleep(poll), if flushing => {
                up.flush()?;
                down.flush()?;
                poll = (poll * 2).min(FLUSH_POLL_MAX);
                continue;
            }
        }
        poll = FLUSH_POLL_FIRST;
    }
}
