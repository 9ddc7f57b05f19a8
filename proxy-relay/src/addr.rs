//! The addresses of a proxied connection as newtypes, so a client address is never passed where
//! a backend is meant: the client's end ([`ClientAddr`]), where it was going ([`OrigDstAddr`]) and
//! the host the proxy connects to ([`BackendAddr`]).

use std::{fmt, net::SocketAddr};

/// The client end of a proxied connection, as the listener's `accept()` saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClientAddr(pub SocketAddr);

/// The address the client dialled before it was redirected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OrigDstAddr(pub SocketAddr);

/// The host the proxy connects to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendAddr(pub SocketAddr);

macro_rules! display {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    )*};
}
display!(ClientAddr, OrigDstAddr, BackendAddr);

/// `a` with an IPv4-mapped IPv6 address written as IPv4, so both spellings find one entry.
pub(crate) fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}
