//! `SOCK_PEER_V1`: which service a socket that sockops does not follow dialled, for
//! getpeername. A direct-mapped cache: the slot of a socket is its cookie's low bits, and the
//! slot carries the cookie of the socket that wrote it last and a check of cookie and service.
//!
//! A slot changes owner only when a socket `PEER_SLOTS` cookies newer connects, and nothing
//! locks it: its old owner may read it meanwhile, and two sockets whose cookies are a multiple
//! of `PEER_SLOTS` apart may write it at once. Either can leave a torn slot (one owner's cookie
//! next to the other's service). The reader takes a slot only when the cookie is its own and
//! the check matches the cookie and the service it read; anything else is fail-open
//! (getpeername shows the backend), and a torn slot passes only by a 32-bit collision.

use core::ptr::{read_volatile, write_volatile};

use proxy_common::{
    service::ServiceKey,
    socket::{PEER_SLOTS, PeerSlot},
};

use crate::maps::SOCK_PEER_V1;

/// The slot of the socket of `cookie`.
#[inline(always)]
fn slot(cookie: u64) -> Option<*mut PeerSlot> {
    SOCK_PEER_V1.get_ptr_mut((cookie & u64::from(PEER_SLOTS - 1)) as u32)
}

/// Records that the socket of `cookie` dialled `key`.
#[inline(always)]
pub fn record(cookie: u64, key: &ServiceKey) {
    let Some(slot) = slot(cookie) else {
        return;
    };
    let value = PeerSlot::new(cookie, *key);
    // SAFETY: the pointer is an element of the array, valid while the program runs. Volatile,
    // so the compiler writes every field (a reader on another CPU may look at any time).
    unsafe { write_volatile(slot, value) };
}

/// The service the socket of `cookie` dialled, if its slot is still its own and whole.
#[inline(always)]
pub fn lookup(cookie: u64) -> Option<ServiceKey> {
    let slot = slot(cookie)?;
    // SAFETY: as in `record`; the fields are copied out before they are checked.
    let seen = unsafe { read_volatile(slot) };
    (seen.cookie == cookie && seen.check == PeerSlot::check_of(cookie, &seen.key))
        .then_some(seen.key)
}
