//! `SOCK_PEER_V1`: which service a socket that sockops does not follow dialled, for
//! getpeername. A direct-mapped cache: the slot of a socket is its cookie's low bits, and the
//! slot carries the cookie of the socket that wrote it last.
//!
//! A slot can change owner while its old owner reads it (a socket `PEER_SLOTS` cookies newer
//! connects as an old one calls getpeername). The writer stores the cookie before the service,
//! and the reader loads the service before the cookie: a reader that still finds its own cookie
//! loaded the service before the new owner's was stored. That holds where stores and loads keep
//! their program order among themselves (x86-64); elsewhere such a reader could see a mixed
//! address, only for a socket that already lost its slot.

use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};

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
    // SAFETY: the pointer is an element of the array, valid while the program runs; volatile
    // keeps the cookie's store before the service's (see the module's ordering note).
    unsafe {
        write_volatile(addr_of_mut!((*slot).cookie), cookie);
        write_volatile(addr_of_mut!((*slot).key), *key);
    }
}

/// The service the socket of `cookie` dialled, if its slot is still its own.
#[inline(always)]
pub fn lookup(cookie: u64) -> Option<ServiceKey> {
    let slot = slot(cookie)?;
    // SAFETY: as in `record`; the service is loaded before the cookie is checked.
    let (key, owner) =
        unsafe { (read_volatile(addr_of!((*slot).key)), read_volatile(addr_of!((*slot).cookie))) };
    (owner == cookie).then_some(key)
}
