//! Proxy-pair splicing from the daemon's side: hand a connected (client, upstream) socket pair
//! of the proxy path to the kernel, which then moves the bytes between them (the stream verdict
//! program `pair_verdict`) without copying them through userspace.
//!
//! [`PairSplicer::splice`] gives each socket its flow counters ([`PAIR_FLOW`]) and a first
//! credit of [`PAIR_CREDIT`] bytes ([`PAIR_GRANT`]), puts each socket into [`PAIR_PEER`] under
//! the other's cookie, then arms both in [`PAIR_SOCKS`] (where the program is
//! attached), then kicks both receive queues so bytes that arrived before the pair was armed
//! go through the program too. The returned [`PairGuard`] reads the flow and grants more
//! credit ([`PairGuard::flow`], [`PairGuard::regrant`]) and takes every entry out again when
//! dropped (the kernel also removes a socket from the sockhashes when it closes). One splicer
//! serves any number of tasks.

use std::{
    net::SocketAddr,
    os::fd::{AsFd, AsRawFd as _, BorrowedFd},
    path::Path,
    sync::{Arc, Mutex},
};

use proxy_common::{
    abi::maps::{PAIR_FLOW, PAIR_GRANT, PAIR_PEER, PAIR_SOCKS},
    socket::{PairFlow, PairGrant, SockTuple},
};
use tracing::{debug, warn};

use super::{
    DataplaneError,
    maps::{KernelMaps, PairMaps},
    publish::backend_of,
};

/// Bytes the kernel may queue for one direction of a spliced pair beyond what the sending
/// socket took: the credit granted at splicing and topped up to after every catch-up. Larger
/// means fewer trips through the daemon on long transfers, smaller less memory per slow peer.
pub const PAIR_CREDIT: u64 = 4 << 20;

/// Hands proxied socket pairs to the kernel. Cheap to clone; usable from many tasks.
#[derive(Clone)]
pub struct PairSplicer {
    maps: Arc<Mutex<PairMaps>>,
}

/// Why a pair could not be spliced; the caller copies in userspace instead.
#[derive(Debug, thiserror::Error)]
pub enum PairError {
    /// A socket's addresses or cookie could not be read (it is not a connected TCP socket).
    #[error("reading the addresses or cookie of a socket to splice: {0}")]
    Addresses(#[source] std::io::Error),
    /// The two ends are of different families (cannot happen for IPv4 vs IPv4-mapped).
    #[error("the client and upstream sockets are of different families")]
    Family,
    /// The kernel refused a map update (not an established TCP socket, map full, ...).
    #[error("map {name}: {source}")]
    Map {
        /// The map.
        name: &'static str,
        /// Why.
        #[source]
        source: aya::maps::MapError,
    },
}

impl PairSplicer {
    pub(super) fn new(maps: PairMaps) -> Self {
        Self {
            maps: Arc::new(Mutex::new(maps)),
        }
    }

    /// Opens the pinned maps of the instance at `pin_dir`. The daemon's loader attaches the
    /// program; a splicer opened on an instance whose attach failed would splice nothing, so
    /// prefer [`Dataplane::pair_splicer`](super::Dataplane::pair_splicer).
    pub fn open_pinned(pin_dir: &Path) -> Result<Self, DataplaneError> {
        KernelMaps::open_pinned(pin_dir)?.pair.map(Self::new)
    }

    /// Splices `client` and `upstream` (both connected TCP sockets of this process): from now
    /// on the kernel sends what one receives out of the other. Bytes already read by userspace
    /// stay read; bytes still queued are sent on. On error nothing is left in the maps.
    pub fn splice(&self, client: &impl AsFd, upstream: &impl AsFd) -> Result<PairGuard, PairError> {
        let (client, upstream) = (client.as_fd(), upstream.as_fd());
        let (c, u) = (own_tuple(client)?, own_tuple(upstream)?);
        if c.family != u.family {
            return Err(PairError::Family);
        }
        let cookie = |fd| crate::sys::socket_cookie(fd).map_err(PairError::Addresses);
        let guard = PairGuard {
            maps: self.maps.clone(),
            client: c,
            upstream: u,
            cookies: [cookie(client)?, cookie(upstream)?],
        };
        let [cc, uc] = guard.cookies;
        {
            let mut maps = self
                .maps
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let err = |name| move |source| PairError::Map { name, source };
            // Peers, counters and credit, then arming: a socket runs the program from the
            // moment it is armed, and all of them must be there by then. (Peers first: a
            // server that answers and closes at once leaves ESTABLISHED quickly, and the
            // kernel takes only ESTABLISHED sockets into a sockhash.) Dropping `guard` on an
            // error takes out whatever went in.
            maps.pair_peer
                .insert(cc, upstream.as_raw_fd(), 0)
                .map_err(err(PAIR_PEER))?;
            maps.pair_peer
                .insert(uc, client.as_raw_fd(), 0)
                .map_err(err(PAIR_PEER))?;
            let first = PairGrant {
                granted: PAIR_CREDIT,
                drained: 0,
            };
            for key in guard.cookies {
                maps.pair_flow
                    .insert(key, PairFlow::default(), 0)
                    .map_err(err(PAIR_FLOW))?;
                maps.pair_grant
                    .insert(key, first, 0)
                    .map_err(err(PAIR_GRANT))?;
            }
            maps.pair_socks
                .insert(c, client.as_raw_fd(), 0)
                .map_err(err(PAIR_SOCKS))?;
            maps.pair_socks
                .insert(u, upstream.as_raw_fd(), 0)
                .map_err(err(PAIR_SOCKS))?;
        }
        // Bytes that arrived before the sockets were armed are still in their receive queues
        // and would wait there for the next segment: run the data-ready callback now. Past this
        // point the pair is spliced (bytes may have moved), so a failure cannot fall back to
        // copying any more; it only delays those bytes.
        for fd in [client, upstream] {
            if let Err(err) = crate::sys::kick_receive_queue(fd) {
                warn!(%err, "kicking the receive queue of a spliced socket failed");
            }
        }
        Ok(guard)
    }

    /// Entries of the two sockhashes now (two per spliced pair that is neither torn down nor
    /// closed).
    pub fn entries(&self) -> (usize, usize) {
        let maps = self
            .maps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (
            maps.pair_socks.keys().flatten().count(),
            maps.pair_peer.keys().flatten().count(),
        )
    }

    /// Entries of the flow and credit maps now (two each per spliced pair not torn down).
    pub fn credit_entries(&self) -> (usize, usize) {
        let maps = self
            .maps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (
            maps.pair_flow.keys().flatten().count(),
            maps.pair_grant.keys().flatten().count(),
        )
    }
}

/// A spliced pair; dropping it takes the sockets out of the maps (drop it before closing them,
/// so that a new connection reusing a 4-tuple is never removed by mistake).
pub struct PairGuard {
    maps: Arc<Mutex<PairMaps>>,
    client: SockTuple,
    upstream: SockTuple,
    /// The client's and the upstream's socket cookies.
    cookies: [u64; 2],
}

/// One socket of a spliced pair (the proxy path's type: it asks by side).
pub use proxy_relay::PairSide;

impl PairGuard {
    fn key(&self, side: PairSide) -> u64 {
        match side {
            PairSide::Client => self.cookies[0],
            PairSide::Upstream => self.cookies[1],
        }
    }

    /// What the program did with the bytes `side` received since splicing.
    pub fn flow(&self, side: PairSide) -> Result<PairFlow, PairError> {
        let maps = self
            .maps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        maps.pair_flow
            .get(&self.key(side), 0)
            .map_err(|source| PairError::Map {
                name: PAIR_FLOW,
                source,
            })
    }

    /// Grants `side` a new credit: the program may redirect until [`PAIR_CREDIT`] bytes more
    /// than `sent` (the redirected bytes that already went into the peer socket) are in the
    /// kernel's queue, once the daemon copied `drained` passed bytes in all.
    pub fn regrant(&self, side: PairSide, sent: u64, drained: u64) -> Result<(), PairError> {
        let grant = PairGrant {
            granted: sent.saturating_add(PAIR_CREDIT),
            drained,
        };
        let mut maps = self
            .maps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        maps.pair_grant
            .insert(self.key(side), grant, 0)
            .map_err(|source| PairError::Map {
                name: PAIR_GRANT,
                source,
            })
    }
}

impl Drop for PairGuard {
    fn drop(&mut self) {
        let mut maps = self
            .maps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Disarm first, then forget the peers and the credit. A socket that already closed is
        // gone from both sockhashes (the kernel removed it): not an error.
        for key in [self.client, self.upstream] {
            if let Err(err) = maps.pair_socks.remove(&key) {
                debug!(%err, "pair socket already gone from the sockhash");
            }
        }
        for key in self.cookies {
            let _ = maps.pair_peer.remove(&key);
            let _ = maps.pair_flow.remove(&key);
            let _ = maps.pair_grant.remove(&key);
        }
    }
}

/// The socket's own view of its connection, keyed like the kernel program keys it (IPv4-mapped
/// IPv6 addresses as IPv4).
fn own_tuple(fd: BorrowedFd<'_>) -> Result<SockTuple, PairError> {
    let sock = socket2::SockRef::from(&fd);
    let addr = |a: std::io::Result<socket2::SockAddr>| {
        a.and_then(|a| {
            a.as_socket().ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "not an IP socket")
            })
        })
        .map_err(PairError::Addresses)
    };
    let canon = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    let local = backend_of(canon(addr(sock.local_addr())?));
    let remote = backend_of(canon(addr(sock.peer_addr())?));
    if local.family != remote.family {
        return Err(PairError::Family);
    }
    Ok(SockTuple {
        local: local.addr,
        remote: remote.addr,
        local_port: local.port,
        remote_port: remote.port,
        family: local.family,
        _pad: [0; 3],
    })
}
