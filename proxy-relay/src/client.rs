//! The accepted client socket as the listener hands it to the TCP path, registered with the
//! event loop only once a task waits on it.

use std::{
    io,
    os::fd::{AsFd, BorrowedFd},
};

use tokio::net::TcpStream;

/// An accepted connection's socket. It joins the event loop only when a task first waits on
/// it: the TCP path reads what the client has sent already and passes it on before that, so a
/// socket whose first bytes were taken that way brings no stale readiness (and no wasted
/// wakeup) with it.
pub(crate) enum Client {
    /// Not registered yet.
    Raw(std::net::TcpStream),
    /// Registered (a PROXY protocol header was read from it).
    Registered(TcpStream),
}

impl Client {
    /// The socket, registered with the event loop.
    pub(crate) fn register(self) -> io::Result<TcpStream> {
        match self {
            Self::Raw(s) => TcpStream::from_std(s),
            Self::Registered(s) => Ok(s),
        }
    }
}

impl AsFd for Client {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Self::Raw(s) => s.as_fd(),
            Self::Registered(s) => s.as_fd(),
        }
    }
}
