//! Kernel splicing of the TCP path (`splice: kernel`): once the upstream is connected, the pair
//! is handed to a [`Splicer`] (the kernel's proxy-pair splicing: `dataplane::PairSplicer`) and
//! the bytes move between the two sockets inside the kernel. Userspace reads nothing while the
//! peers keep up; it waits for each socket's end of stream and errors and propagates them:
//!
//! * Backpressure: the kernel redirects one direction's bytes only within a credit (see
//!   `pair_verdict`). Beyond it, or while bytes passed earlier are still uncopied, it passes
//!   them to the receiving socket, which wakes this task: once every redirected byte went into
//!   the sending socket, the passed bytes are copied after them (waiting on the sending socket
//!   like the copy loop does), then the credit is topped up. A stopped reader therefore stops
//!   the writer, through the receiving socket's full buffer and TCP window, with at most the
//!   credit queued in the kernel.
//! * Half-close: one side's FIN is passed on with `shutdown(Write)` on the other side, but only
//!   once every byte that side received before its FIN went out of the other socket. The kernel
//!   tells nobody when that is, so it is read from sequence numbers: the bytes the receiving
//!   socket got (`tcpi_bytes_received`) against the bytes written to the sending one
//!   (`tcpi_bytes_acked` + `SIOCOUTQ`), both taken relative to the moment of splicing.
//! * Reset: an error on one side (a reset, an abort) resets the other (`SO_LINGER` 0, close).
//! * Forced close (drain deadline, host failure, shutdown): both sides are reset.
//!
//! Byte counters (`upstream_cx_*_bytes_total`) count what userspace moved (the copy loop, and
//! the bytes a spliced pair's kernel passed back); bytes the kernel redirected are not in them.

use std::{
    future::Future,
    io,
    os::fd::AsFd as _,
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use proxy_common::socket::PairFlow;
use tokio::{io::Interest, net::TcpStream};

use crate::{
    conn::ProxyClose,
    flow::{self, End, Failed, Side, abort},
    stats::ProxyStats,
    sys::{self, TcpBytes},
};

/// How a spliced pair's run ended when it did not end with both sides closing cleanly.
#[derive(Debug)]
enum CopyError {
    /// A read or write failed on one side (or bytes were lost in the kernel).
    Io {
        /// `client` or `upstream`.
        side: &'static str,
        /// `read` or `write`.
        op: &'static str,
        /// The error.
        source: io::Error,
    },
    /// The proxy closed the pair (drain deadline, host failure, shutdown).
    Closed(ProxyClose),
}

/// One socket of a spliced pair: its received bytes are one direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PairSide {
    /// The accepted client socket (bytes from the client, to the upstream).
    Client,
    /// The upstream socket (bytes from the upstream, to the client).
    Upstream,
}

/// Hands a connected client/upstream pair to something that moves bytes between them without
/// the proxy (the kernel). Shared by every connection task. The daemon implements it for its
/// `dataplane::PairSplicer`.
pub trait Splicer: Send + Sync {
    /// Splices the pair; bytes move between them until the returned guard is dropped. An error
    /// means nothing was changed: the caller copies in userspace instead.
    fn splice(&self, client: &TcpStream, upstream: &TcpStream) -> Result<SpliceGuard, SpliceError>;
}

/// Why a splicer refused a pair.
pub type SpliceError = Box<dyn std::error::Error + Send + Sync>;

/// A spliced pair: dropping it ends the splicing (always before the sockets close). While it
/// lives, the proxy reads the kernel's flow counters and tops up its credit through it.
pub struct SpliceGuard(Box<dyn SpliceControl>);

impl SpliceGuard {
    /// Wraps the control of a spliced pair; dropping it undoes the splicing.
    pub fn new(control: impl SpliceControl + 'static) -> Self {
        Self(Box::new(control))
    }
}

/// What the proxy needs from a spliced pair while it runs (see the module docs).
pub trait SpliceControl: Send + Sync {
    /// What the kernel did with the bytes `side` received since splicing.
    fn flow(&self, side: PairSide) -> io::Result<PairFlow>;
    /// A new credit for `side`'s bytes, counted from `sent` (its redirected bytes that already
    /// went into the other socket); the kernel redirects only once `drained` (the passed bytes
    /// copied in all) caught up with what it passed.
    fn regrant(&self, side: PairSide, sent: u64, drained: u64) -> io::Result<()>;
}

/// First wait between two looks at bytes leaving the sending socket (before a half-close, or
/// before passed bytes may follow the redirected ones).
const POLL_FIRST: Duration = Duration::from_micros(200);
/// The longest such wait (the delay a half-close can get on top of the transfer).
const POLL_MAX: Duration = Duration::from_millis(50);
/// A direction whose bytes stopped moving, with nothing queued in a sending socket that can no
/// longer send, for this long lost bytes in the kernel (its peer vanished mid-transfer): the
/// pair is reset. (When the kernel drops redirected bytes it also reports an error on the
/// socket, which ends the pair at the next look.)
const FLUSH_STALL: Duration = Duration::from_secs(2);
/// The longest bytes may stay out of sight while both sockets are healthy: they sit in the
/// kernel's socket work queue, whose worker a loaded host can hold back for seconds. Beyond
/// this, the pair is reset all the same, so no connection waits forever.
const STALL_LIMIT: Duration = Duration::from_secs(30);
/// The most passed bytes read at once.
const COPY_CHUNK: u64 = 64 << 10;
/// The credit is topped up once this many redirected bytes went into the other socket since
/// the last grant (a fraction of `dataplane::PAIR_CREDIT`, so a peer that keeps up never runs
/// out of it).
const REFRESH_AFTER: u64 = 1 << 20;
/// How often an active direction looks at its flow to top up the credit; doubled up to
/// `TICK_MAX` while nothing moves.
const TICK_FIRST: Duration = Duration::from_millis(1);
const TICK_MAX: Duration = Duration::from_secs(1);

/// Both sockets' byte counts just before splicing.
pub(crate) struct Baseline {
    client: TcpBytes,
    upstream: TcpBytes,
}

/// Reads the byte counts splicing is measured against; call before [`Splicer::splice`].
pub(crate) fn baseline(client: &TcpStream, upstream: &TcpStream) -> io::Result<Baseline> {
    Ok(Baseline {
        client: sys::tcp_bytes(client.as_fd())?,
        upstream: sys::tcp_bytes(upstream.as_fd())?,
    })
}

/// One direction of a spliced pair.
struct Direction<'a> {
    from: &'a TcpStream,
    to: &'a TcpStream,
    /// Which socket `from` is, for the kernel's flow counters.
    side: PairSide,
    names: (&'static str, &'static str),
    /// Bytes of `from` that userspace took before splicing (never forwarded by the kernel).
    consumed_before: u64,
    /// Bytes written to `to` before splicing.
    written_before: u64,
    /// Bytes the kernel passed that this direction copied to `to` since splicing.
    copied: u64,
    /// The stats counter of bytes this direction moves through userspace.
    meter: &'a AtomicU64,
    /// Redirected bytes that had gone into `to` at the last grant (the credit runs from there).
    granted_at: u64,
}

impl<'a> Direction<'a> {
    fn new(
        from: &'a TcpStream,
        to: &'a TcpStream,
        side: PairSide,
        base: (&TcpBytes, &TcpBytes),
        names: (&'static str, &'static str),
        meter: &'a AtomicU64,
    ) -> Self {
        Self {
            from,
            to,
            side,
            names,
            consumed_before: base.0.received.saturating_sub(base.0.unread),
            written_before: base.1.written,
            copied: 0,
            meter,
            granted_at: 0,
        }
    }

    fn io_error(&self, to_side: bool, op: &'static str, source: io::Error) -> CopyError {
        let side = if to_side { self.names.1 } else { self.names.0 };
        CopyError::Io { side, op, source }
    }

    /// Bytes that stopped short of `to`: lost in the kernel (its peer vanished mid-transfer).
    fn lost(&self, what: &'static str) -> CopyError {
        self.io_error(
            true,
            "write",
            io::Error::new(io::ErrorKind::BrokenPipe, what),
        )
    }

    /// Bytes that went into `to` since splicing (redirected by the kernel or copied here), and
    /// bytes still queued in it.
    /// Fails with the error the kernel reported on `to`, if any (redirected bytes it dropped).
    fn written_now(&self) -> Result<(u64, sys::TcpWritten), CopyError> {
        if let Some(e) = self
            .to
            .take_error()
            .map_err(|e| self.io_error(true, "write", e))?
        {
            return Err(self.io_error(true, "write", e));
        }
        let w = sys::tcp_written(self.to.as_fd()).map_err(|e| self.io_error(true, "write", e))?;
        Ok((w.total.saturating_sub(self.written_before), w))
    }

    /// Waits until `target` bytes went into `to` since splicing; fails when they stopped
    /// moving with nothing left queued in `to`.
    async fn written(&self, target: u64, lost: &'static str) -> Result<(), CopyError> {
        let mut wait = Progress::new();
        loop {
            let (now, w) = self.written_now()?;
            if now >= target {
                return Ok(());
            }
            wait.step(now, &w).await.map_err(|()| self.lost(lost))?;
        }
    }

    /// The kernel's counters of this direction, when it passed bytes not copied yet.
    fn passed(&self, ctl: &dyn SpliceControl) -> io::Result<Option<PairFlow>> {
        let flow = ctl.flow(self.side)?;
        Ok((flow.passed > self.copied).then_some(flow))
    }

    /// Tops the credit up when enough redirected bytes went into `to` since the last grant.
    /// Harmless while passed bytes wait: the grant keeps `drained` at what was copied, so the
    /// kernel goes on passing until they are.
    fn refresh(&mut self, ctl: &dyn SpliceControl, flow: &PairFlow) -> Result<(), CopyError> {
        if flow.redirected < self.granted_at + REFRESH_AFTER {
            return Ok(());
        }
        let written =
            sys::tcp_written(self.to.as_fd()).map_err(|e| self.io_error(true, "write", e))?;
        let sent = written
            .total
            .saturating_sub(self.written_before)
            .saturating_sub(self.copied);
        if sent < self.granted_at + REFRESH_AFTER {
            return Ok(());
        }
        ctl.regrant(self.side, sent, self.copied)
            .map_err(|e| self.io_error(false, "read", e))?;
        self.granted_at = sent;
        Ok(())
    }

    /// Copies the bytes the kernel passed to `from`, after every byte it redirected, then lets
    /// it redirect again.
    ///
    /// The last bytes of each round are peeked, written, granted and only then consumed:
    /// consuming them reopens `from`'s TCP window, and a sender that slips bytes in before the
    /// grant keeps the kernel passing (correct, but another round through userspace).
    async fn catch_up(
        &mut self,
        ctl: &dyn SpliceControl,
        mut flow: PairFlow,
        buf: &mut Vec<u8>,
    ) -> Result<(), CopyError> {
        loop {
            // The kernel redirects nothing while passed bytes wait, so `redirected` is final
            // until the grant below.
            self.written(
                flow.redirected + self.copied,
                "spliced bytes stopped short of the bytes passed after them",
            )
            .await?;
            let pending = flow.passed - self.copied;
            let last = pending.min(COPY_CHUNK);
            // Whatever does not fit one peek is copied plainly first.
            let mut plain = pending - last;
            while plain > 0 {
                let want = plain.min(COPY_CHUNK) as usize;
                buf.resize(want, 0);
                let n = owed(self.from, &mut buf[..want], false)
                    .await
                    .map_err(|e| self.io_error(false, "read", e))?;
                self.copy_out(buf, n).await?;
                plain -= n as u64;
            }
            let last = last as usize;
            buf.resize(last, 0);
            owed(self.from, &mut buf[..last], true)
                .await
                .map_err(|e| self.io_error(false, "read", e))?;
            self.copy_out(buf, last).await?;
            ctl.regrant(self.side, flow.redirected, self.copied)
                .map_err(|e| self.io_error(false, "read", e))?;
            self.granted_at = flow.redirected;
            let mut left = last;
            while left > 0 {
                left -= owed(self.from, &mut buf[..left], false)
                    .await
                    .map_err(|e| self.io_error(false, "read", e))?;
            }
            // A buffer passed between the last look and the grant keeps `passed` ahead of
            // `drained`: the kernel goes on passing, and the next round copies it.
            match self
                .passed(ctl)
                .map_err(|e| self.io_error(false, "read", e))?
            {
                Some(more) => flow = more,
                None => return Ok(()),
            }
        }
    }

    /// Writes the `n` bytes read into `buf` to `to`.
    async fn copy_out(&mut self, buf: &[u8], n: usize) -> Result<(), CopyError> {
        write_all(self.to, &buf[..n])
            .await
            .map_err(|e| self.io_error(true, "write", e))?;
        self.copied += n as u64;
        self.meter.fetch_add(n as u64, Ordering::Relaxed);
        Ok(())
    }

    /// `from` reached its end of stream: passes the FIN on once every byte it received went
    /// out of `to`. Its last bytes can still be going through the kernel (a segment's FIN is
    /// taken before its data reaches the program): passed ones are copied as they come.
    async fn pass_fin(
        &mut self,
        ctl: &dyn SpliceControl,
        buf: &mut Vec<u8>,
    ) -> Result<(), CopyError> {
        let received = sys::tcp_received_before_fin(self.from.as_fd())
            .map_err(|e| self.io_error(false, "read", e))?;
        let target = received.saturating_sub(self.consumed_before);
        let mut wait = Progress::new();
        loop {
            if let Some(flow) = self
                .passed(ctl)
                .map_err(|e| self.io_error(false, "read", e))?
            {
                self.catch_up(ctl, flow, buf).await?;
            }
            let (now, w) = self.written_now()?;
            if now >= target {
                return socket2::SockRef::from(self.to)
                    .shutdown(std::net::Shutdown::Write)
                    .map_err(|e| self.io_error(true, "write", e));
            }
            wait.step(now, &w)
                .await
                .map_err(|()| self.lost("spliced bytes stopped short of the half-close"))?;
        }
    }
}

/// Waiting for bytes to leave through a socket, polled (the kernel signals nothing): from
/// `POLL_FIRST` up to `POLL_MAX` between looks.
struct Progress {
    poll: Duration,
    last: Option<u64>,
    since: Instant,
}

impl Progress {
    fn new() -> Self {
        Self {
            poll: POLL_FIRST,
            last: None,
            since: Instant::now(),
        }
    }

    /// One look found `written` bytes out (and `w` of the sending socket): waits for the next
    /// look, or fails (`Err`) when nothing moved with nothing queued for `FLUSH_STALL` while
    /// the socket can no longer send, or for `STALL_LIMIT` in any case (the bytes were lost in
    /// the kernel).
    async fn step(&mut self, written: u64, w: &sys::TcpWritten) -> Result<(), ()> {
        if self.last != Some(written) || w.queued > 0 {
            self.last = Some(written);
            self.since = Instant::now();
        } else {
            let stalled = self.since.elapsed();
            if stalled > STALL_LIMIT || (!w.can_send && stalled > FLUSH_STALL) {
                return Err(());
            }
        }
        tokio::time::sleep(self.poll).await;
        self.poll = (self.poll * 2).min(POLL_MAX);
        Ok(())
    }
}

fn ended_early() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the stream ended before the bytes the kernel passed",
    )
}

/// Reads (or, with `peek`, peeks all of `buf.len()`) bytes the kernel passed to `s`: `passed`
/// says they are owed, but they can still be on their way into the socket's queue (through the
/// psock's work queue), and meanwhile a read sees nothing, or the end of the stream once the
/// peer's FIN came (5.10). So this polls, from 20 us up to 1 ms (`POLL_MAX` once they are
/// `FLUSH_STALL` late), rather than trusting either, and gives up after `STALL_LIMIT`; an error
/// on `s` ends the wait at once (`recv` reports it).
async fn owed(s: &TcpStream, buf: &mut [u8], peek: bool) -> io::Result<usize> {
    let started = Instant::now();
    let mut poll = Duration::from_micros(20);
    loop {
        match sys::recv_now(s.as_fd(), buf, peek) {
            Ok(n) if n == buf.len() || (n > 0 && !peek) => return Ok(n),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        let late = started.elapsed();
        if late > STALL_LIMIT {
            return Err(ended_early());
        }
        tokio::time::sleep(poll).await;
        let most = if late > FLUSH_STALL {
            POLL_MAX
        } else {
            Duration::from_millis(1)
        };
        poll = (poll * 2).min(most);
    }
}

/// Writes all of `buf` to `s`, waiting while its send buffer is full.
async fn write_all(s: &TcpStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        s.writable().await?;
        match s.try_write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One direction until its FIN was passed on: wakes on `from`'s data-ready (the kernel passed
/// bytes, or a wakeup without news), its end of stream or its error, and on a timer that tops
/// up the credit while bytes move.
async fn run_direction(mut d: Direction<'_>, ctl: &dyn SpliceControl) -> Result<(), CopyError> {
    let mut buf = Vec::new();
    let mut tick = TICK_FIRST;
    let mut last = PairFlow::default();
    loop {
        let ready = tokio::select! {
            ready = d.from.ready(Interest::READABLE | Interest::ERROR) => {
                ready.map_err(|e| d.io_error(false, "read", e))?
            }
            () = tokio::time::sleep(tick) => {
                let flow = ctl.flow(d.side).map_err(|e| d.io_error(false, "read", e))?;
                tick = if flow == last { (tick * 2).min(TICK_MAX) } else { TICK_FIRST };
                last = flow;
                d.refresh(ctl, &flow)?;
                continue;
            }
        };
        match d.from.take_error() {
            Ok(Some(e)) | Err(e) => return Err(d.io_error(false, "read", e)),
            Ok(None) => {}
        }
        if ready.is_read_closed() {
            return d.pass_fin(ctl, &mut buf).await;
        }
        // Whether the kernel passed bytes is read inside `try_io`: a wakeup without news is
        // forgotten, and one that comes after the look is kept.
        let mut seen = None;
        let passed = d.from.try_io(Interest::READABLE, || {
            let flow = ctl.flow(d.side)?;
            seen = Some(flow);
            if flow.passed > d.copied {
                Ok(flow)
            } else {
                Err(io::ErrorKind::WouldBlock.into())
            }
        });
        match passed {
            Ok(flow) => d.catch_up(ctl, flow, &mut buf).await?,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                // The kernel's data-ready after bytes it redirected: bytes move.
                if let Some(flow) = seen {
                    d.refresh(ctl, &flow)?;
                    tick = TICK_FIRST;
                }
            }
            Err(e) => return Err(d.io_error(false, "read", e)),
        }
        if ready.is_error() {
            let _ = d.from.try_io(Interest::ERROR, || {
                Err::<(), _>(io::ErrorKind::WouldBlock.into())
            });
        }
    }
}

/// Waits for an error on `s`, a side whose end of stream was already passed on.
async fn failed(s: &TcpStream) -> io::Error {
    loop {
        if let Err(e) = s.ready(Interest::ERROR).await {
            return e;
        }
        match s.take_error() {
            Ok(Some(e)) | Err(e) => return e,
            Ok(None) => {}
        }
        let _ = s.try_io(Interest::ERROR, || {
            Err::<(), _>(io::ErrorKind::WouldBlock.into())
        });
    }
}

/// Runs a spliced pair until both directions ended, a side failed or `close` resolves, and
/// ends it by the relay's rules (`flow::finish`); on a failure both sides are reset, since a
/// direction whose bytes were lost in the kernel leaves neither side whole. `guard` is dropped
/// before the sockets close.
pub(crate) async fn run(
    client: TcpStream,
    upstream: TcpStream,
    guard: SpliceGuard,
    base: Baseline,
    stats: &ProxyStats,
    close: impl Future<Output = ProxyClose>,
) -> End {
    let result = {
        let up = Direction::new(
            &client,
            &upstream,
            PairSide::Client,
            (&base.client, &base.upstream),
            ("client", "upstream"),
            &stats.upstream_cx_tx_bytes_total,
        );
        let down = Direction::new(
            &upstream,
            &client,
            PairSide::Upstream,
            (&base.upstream, &base.client),
            ("upstream", "client"),
            &stats.upstream_cx_rx_bytes_total,
        );
        drive(up, down, &*guard.0, close).await
    };
    let end = match result {
        Ok(()) => End::Done,
        Err(CopyError::Io { side, op, source }) => {
            let side = if side == "client" {
                Side::Client
            } else {
                Side::Upstream
            };
            End::Failed(Failed {
                side,
                op,
                err: source,
            })
        }
        Err(CopyError::Closed(why)) => End::Closed(why),
    };
    flow::finish(&end, &client, &upstream, stats);
    if let End::Failed(_) = end {
        abort(&client);
        abort(&upstream);
    }
    drop(guard);
    drop((client, upstream));
    end
}

async fn drive(
    up: Direction<'_>,
    down: Direction<'_>,
    ctl: &dyn SpliceControl,
    close: impl Future<Output = ProxyClose>,
) -> Result<(), CopyError> {
    let (client, upstream) = (up.from, down.from);
    let up = run_direction(up, ctl);
    let down = run_direction(down, ctl);
    tokio::pin!(up, down, close);
    let (mut up_done, mut down_done) = (false, false);
    while !(up_done && down_done) {
        tokio::select! {
            reason = &mut close => return Err(CopyError::Closed(reason)),
            r = &mut up, if !up_done => {
                r?;
                up_done = true;
            }
            r = &mut down, if !down_done => {
                r?;
                down_done = true;
            }
            // A side that ended its stream can still be reset.
            e = failed(client), if up_done => {
                return Err(CopyError::Io { side: "client", op: "read", source: e });
            }
            e = failed(upstream), if down_done => {
                return Err(CopyError::Io { side: "upstream", op: "read", source: e });
            }
        }
    }
    Ok(())
}
