//! `sk_skb` stream verdict: kernel splicing of a proxied connection (client socket <-> upstream
//! socket, both the daemon's own). Attached to the sockhash `PAIR_SOCKS_V1`; runs for every
//! chunk of bytes a socket there receives, before userspace could read it, and redirects it to
//! the egress of the peer socket (`bpf_sk_redirect_hash`, flags 0): the bytes leave through the
//! peer's TCP send path without crossing into userspace.
//!
//! The peer is found in a second sockhash, `PAIR_PEER_V1`, under the receiving socket's own
//! 4-tuple. That map has no program attached, so the daemon can put both peers there first and
//! only then arm both sockets in `PAIR_SOCKS_V1`: a socket never runs this program before its
//! peer can be found.
//!
//! Empty buffers (a FIN's) are dropped: a FIN is passed on by the daemon, after the bytes.
//!
//! Contract: fail-closed for the pair: bytes whose peer is not in `PAIR_PEER_V1` (the daemon is
//! tearing the pair down, or the peer closed) are dropped and counted `pair_redirect_failed`;
//! the daemon resets such a connection. Never touches sockets outside the two maps. Minimum
//! kernel 5.10 (a stream verdict without a stream parser); the attachment is a prog-attach to
//! the map, which lives as long as the pinned map. Reads `PAIR_PEER_V1`; writes `COUNTERS_V2`.

use aya_ebpf::{
    bindings::sk_action::{SK_DROP, SK_PASS},
    macros::stream_verdict,
    programs::SkBuffContext,
};
use proxy_common::counters;

use crate::{
    maps::{PAIR_PEER_V1, count},
    tuple::{self, Fields},
};

/// The receiving socket has no peer in `PAIR_PEER_V1`.
struct NoPeer;

#[stream_verdict]
pub fn pair_verdict(ctx: SkBuffContext) -> u32 {
    // From 6.1 the kernel also hands over the empty buffer that carried a FIN (the FIN itself
    // is TCP state, already taken): redirected, it would break the peer's send queue (EPIPE).
    if ctx.len() == 0 {
        return SK_DROP;
    }
    match try_redirect(&ctx) {
        Ok(()) => {
            count(counters::PAIR_REDIRECTED);
            SK_PASS
        }
        Err(NoPeer) => {
            count(counters::PAIR_REDIRECT_FAILED);
            SK_DROP
        }
    }
}

fn try_redirect(ctx: &SkBuffContext) -> Result<(), NoPeer> {
    let skb = ctx.skb.skb;
    // SAFETY: the context pointer is valid for the duration of the program; the fields are
    // read one 4-byte word at a time, as the verifier requires.
    let t = unsafe {
        tuple::from_fields(&Fields {
            family: (*skb).family,
            local_ip4: (*skb).local_ip4,
            remote_ip4: (*skb).remote_ip4,
            local_ip6: tuple::words(&raw const (*skb).local_ip6),
            remote_ip6: tuple::words(&raw const (*skb).remote_ip6),
            local_port: (*skb).local_port,
            remote_port: (*skb).remote_port,
        })
    }
    .ok_or(NoPeer)?;
    // With the redirect set, SK_PASS sends the bytes out of the peer; anything else is a drop.
    let verdict = PAIR_PEER_V1.redirect_skb(ctx, t, 0);
    if verdict == i64::from(SK_PASS) {
        Ok(())
    } else {
        Err(NoPeer)
    }
}
