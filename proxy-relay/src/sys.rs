//! The crate's only `unsafe` code: thin safe wrappers over the socket, epoll and eventfd system
//! calls that neither std, tokio nor socket2 wrap. Each `unsafe` block says why it is sound;
//! the rest of the crate is `#![deny(unsafe_code)]`.

use std::{
    io,
    net::SocketAddr,
    os::fd::{AsFd, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
};

use socket2::SockAddr;
use tokio::io::{Interest, unix::AsyncFd};

/// A system call's `-1` as the thread's `errno`, anything else as a count.
fn check(rc: isize) -> io::Result<usize> {
    usize::try_from(rc).map_err(|_| io::Error::last_os_error())
}

/// `recv(flags)` into `buf`: the bytes read (0 at the end of the stream).
pub fn recv(fd: BorrowedFd<'_>, buf: &mut [u8], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the duration of the call; the
    // kernel writes at most that many.
    check(unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), flags) })
}

/// `recv(MSG_DONTWAIT)`, with `MSG_PEEK` when `peek`: copies what the socket has queued into
/// `buf`, taking it unless peeking (0 at its end; `WouldBlock` when nothing is queued).
pub fn recv_now(fd: BorrowedFd<'_>, buf: &mut [u8], peek: bool) -> io::Result<usize> {
    recv(
        fd,
        buf,
        libc::MSG_DONTWAIT | if peek { libc::MSG_PEEK } else { 0 },
    )
}

/// `send(MSG_NOSIGNAL)`: the bytes of `buf` the socket took (a closed peer is an `EPIPE` error,
/// not a `SIGPIPE`).
pub fn send(fd: BorrowedFd<'_>, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for reads of `buf.len()` bytes for the duration of the call.
    check(unsafe {
        libc::send(
            fd.as_raw_fd(),
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_NOSIGNAL,
        )
    })
}

/// `accept4()` with `SOCK_NONBLOCK | SOCK_CLOEXEC`: the socket is ready for an event loop
/// without another system call, and is not registered with one yet.
pub fn accept_nonblocking(
    listener: &std::net::TcpListener,
) -> io::Result<(std::net::TcpStream, SocketAddr)> {
    // SAFETY: accept4 writes at most `len` bytes of address into the storage `try_init` gives
    // it and returns a new descriptor, which the TcpStream owns from here, or -1.
    let (stream, peer) = unsafe {
        SockAddr::try_init(|storage, len| {
            let fd = libc::accept4(
                listener.as_raw_fd(),
                storage.cast(),
                len,
                libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            );
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(std::net::TcpStream::from_raw_fd(fd))
        })?
    };
    let peer = peer
        .as_socket()
        .ok_or_else(|| io::Error::other("accepted a connection from a non-IP address"))?;
    Ok((stream, peer))
}

/// Registers a listener with tokio's event loop for readability.
pub fn register_readable(
    listener: std::net::TcpListener,
) -> io::Result<AsyncFd<std::net::TcpListener>> {
    // SAFETY: the std listener owns its descriptor, which stays open and the same until the
    // AsyncFd (its only owner from here) is dropped.
    Ok(unsafe { AsyncFd::register_with_interest(listener, Interest::READABLE) }?)
}

/// Waits up to `timeout` until `fd` has something to report (bytes, an end, an error) without
/// taking it: `poll()` leaves a pending error where it is. False when the time ran out.
#[cfg(test)]
pub fn poll_readable(fd: BorrowedFd<'_>, timeout: std::time::Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let millis = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: `pfd` is one valid pollfd that outlives the call, and 1 says so.
    let n = unsafe { libc::poll(&raw mut pfd, 1, millis) };
    check(n as isize).map(|n| n == 1)
}

/// `sched_yield()`: gives the CPU to another runnable task, if any.
pub fn sched_yield() {
    // SAFETY: takes no arguments and only reschedules the calling thread.
    unsafe { libc::sched_yield() };
}

/// An eventfd (non-blocking, close-on-exec): one thread [`notify`](Self::notify)s, the thread
/// that waits on it in an epoll set [`reset`](Self::reset)s it.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    /// A new eventfd with its counter at 0.
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes no pointers and returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Adds 1 to the counter, which makes the eventfd readable. It cannot fail short of the
    /// counter's overflow, which would take 2^64 notifications without a reset.
    pub fn notify(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes the 8 bytes of a live buffer to our own eventfd.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Sets the counter back to 0 (nothing to read when it already is).
    pub fn reset(&self) {
        let mut counter = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer of 8.
        unsafe {
            libc::read(
                self.0.as_raw_fd(),
                counter.as_mut_ptr().cast(),
                counter.len(),
            )
        };
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// An epoll instance (close-on-exec).
#[derive(Debug)]
pub struct Epoll(OwnedFd);

/// One event of [`Epoll::wait`]: `events` (`EPOLLIN`, ...) and the token `u64`.
pub type EpollEvent = libc::epoll_event;

impl Epoll {
    /// A new epoll instance, watching nothing.
    pub fn new() -> io::Result<Self> {
        // SAFETY: epoll_create1 takes no pointers and returns a new descriptor or -1.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `ep` is a fresh descriptor that nothing else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(ep) }))
    }

    /// Watches `fd` for `events`, reported with `token`.
    pub fn add(&self, fd: BorrowedFd<'_>, events: u32, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: both descriptors are open (borrowed for the call); `ev` is a live local the
        // kernel only reads.
        let rc = unsafe {
            libc::epoll_ctl(
                self.0.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                fd.as_raw_fd(),
                &raw mut ev,
            )
        };
        check(rc as isize).map(drop)
    }

    /// Stops watching `fd`; a descriptor that was not watched changes nothing.
    pub fn delete(&self, fd: BorrowedFd<'_>) {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: as in `add`; kernels before 2.6.9 required a non-null event even here.
        unsafe {
            libc::epoll_ctl(
                self.0.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                fd.as_raw_fd(),
                &raw mut ev,
            )
        };
    }

    /// Waits up to `timeout_ms` (-1: without a limit) for events and fills the start of
    /// `events` with them: how many. An interrupted wait is an `Interrupted` error.
    pub fn wait(&self, events: &mut [EpollEvent], timeout_ms: i32) -> io::Result<usize> {
        let max = i32::try_from(events.len()).unwrap_or(i32::MAX);
        // SAFETY: `events` is valid for writes of `max` entries for the duration of the call;
        // the kernel writes at most that many.
        let n =
            unsafe { libc::epoll_wait(self.0.as_raw_fd(), events.as_mut_ptr(), max, timeout_ms) };
        check(n as isize)
    }
}

/// Byte counts of a TCP socket, for proxy-pair splicing: what the kernel moves between two
/// spliced sockets is only visible in their sequence numbers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpBytes {
    /// Data bytes received in sequence (`tcpi_bytes_received`, without the FIN's one).
    pub received: u64,
    /// Bytes received and not yet taken from the receive queue (`SIOCINQ`).
    pub unread: u64,
    /// Bytes written to the socket: acknowledged (`tcpi_bytes_acked`) plus still queued
    /// (`SIOCOUTQ`).
    pub written: u64,
}

/// The start of `struct tcp_info` up to `tcpi_bytes_received` (Linux 4.1+); the kernel copies
/// `min(len, its size)` bytes, so a prefix is enough.
#[repr(C)]
#[derive(Default)]
struct TcpInfoPrefix {
    /// `tcpi_state` (`TCP_ESTABLISHED` = 1, ...).
    state: u8,
    /// ca_state .. delivery_rate_app_limited: seven u8 fields.
    _flags: [u8; 7],
    /// rto .. total_retrans: twenty-four u32 fields.
    _u32s: [u32; 24],
    _pacing_rate: u64,
    _max_pacing_rate: u64,
    bytes_acked: u64,
    bytes_received: u64,
}
const _: () = assert!(size_of::<TcpInfoPrefix>() == 136);

/// `getsockopt(TCP_INFO)`: (bytes acked, bytes received, state). A received FIN takes a
/// sequence number, which `tcpi_bytes_received` counts.
fn tcp_info_bytes(fd: BorrowedFd<'_>) -> io::Result<(u64, u64, u8)> {
    let mut info = TcpInfoPrefix::default();
    let mut len = size_of::<TcpInfoPrefix>() as libc::socklen_t;
    // SAFETY: `info` is a writable buffer of `len` bytes that outlives the call; the kernel
    // writes at most `len` bytes and updates `len`.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if (len as usize) < size_of::<TcpInfoPrefix>() {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "tcp_info without tcpi_bytes_received (kernel before 4.1)",
        ));
    }
    Ok((info.bytes_acked, info.bytes_received, info.state))
}

/// `ioctl(SIOCINQ = FIONREAD | SIOCOUTQ = TIOCOUTQ)`.
fn sock_ioctl(fd: BorrowedFd<'_>, request: libc::Ioctl) -> io::Result<u64> {
    let mut value: libc::c_int = 0;
    // SAFETY: both requests write one int to the pointer, which is valid for the call.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request, &mut value) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(u64::try_from(value).unwrap_or(0))
}

/// Byte counts of a TCP socket. `unread` is exact only while the socket is in no sockmap (from
/// 6.6 a sockmap socket's `SIOCINQ` reports its sockmap queue instead). The counts are read with
/// more than one call: `received` and `unread` are read until `received` is the same before and
/// after, and `written` reads the acknowledged bytes before the queued ones, so it can only be
/// too small, never too large.
pub fn tcp_bytes(fd: BorrowedFd<'_>) -> io::Result<TcpBytes> {
    // The states that come only after a FIN was received, for a socket that did not send one:
    // CLOSE_WAIT (8) and, once it did, LAST_ACK (9).
    let data = |(_, received, state): (u64, u64, u8)| {
        received.saturating_sub(u64::from(matches!(state, 8 | 9)))
    };
    let mut last = tcp_info_bytes(fd)?;
    for _ in 0..8 {
        let unread = sock_ioctl(fd, libc::FIONREAD)?;
        let outq = sock_ioctl(fd, libc::TIOCOUTQ)?;
        let now = tcp_info_bytes(fd)?;
        if now.1 == last.1 {
            return Ok(TcpBytes {
                received: data(now),
                unread,
                written: last.0 + outq,
            });
        }
        last = now;
    }
    Err(io::Error::new(
        io::ErrorKind::WouldBlock,
        "tcp byte counts kept moving",
    ))
}

/// What went into a TCP socket's sending side: see [`tcp_written`].
#[derive(Clone, Copy, Debug)]
pub struct TcpWritten {
    /// Bytes written (acknowledged plus queued, never more than the true count).
    pub total: u64,
    /// Bytes still queued (`SIOCOUTQ`).
    pub queued: u64,
    /// Whether the socket can still send: ESTABLISHED (1) or CLOSE_WAIT (8).
    pub can_send: bool,
}

/// Bytes written to a TCP socket and still queued in it, and whether it can still send.
pub fn tcp_written(fd: BorrowedFd<'_>) -> io::Result<TcpWritten> {
    let (acked, _, state) = tcp_info_bytes(fd)?;
    let outq = sock_ioctl(fd, libc::TIOCOUTQ)?;
    Ok(TcpWritten {
        total: acked + outq,
        queued: outq,
        can_send: matches!(state, 1 | 8),
    })
}

/// Data bytes received in sequence by a TCP socket that received its peer's FIN.
pub fn tcp_received_before_fin(fd: BorrowedFd<'_>) -> io::Result<u64> {
    tcp_info_bytes(fd).map(|(_, received, _)| received.saturating_sub(1))
}
