//! `sk_skb` stream verdict: kernel splicing of a proxied connection (client socket <-> upstream
//! socket, both the daemon's own). Attached to the sockhash `PAIR_SOCKS_V1`; runs for every
//! chunk of bytes a socket there receives, before userspace could read it, and redirects it to
//! the egress of the peer socket (`bpf_sk_redirect_hash`, flags 0): the bytes leave through the
//! peer's TCP send path without crossing into userspace.
//!
//! The peer is found in a second sockhash, `PAIR_PEER_V2`, under the receiving socket's cookie
//! (stable for the socket's life; its 4-tuple is not: a closing socket's local port reads 0
//! while bytes may still wait for this program). That map has no program attached, so the
//! daemon can put both peers there first and only then arm both sockets in `PAIR_SOCKS_V1`: a
//! socket never runs this program before its peer can be found.
//!
//! Backpressure is a credit: the kernel queues redirected bytes for the peer without any limit
//! of its own, so the program redirects only within the credit the daemon granted in
//! `PAIR_GRANT_V1` (counting in `PAIR_FLOW_V1`). A buffer beyond it, or any buffer while bytes
//! passed earlier are still uncopied, is passed to the receiving socket itself (`SK_PASS`
//! without a redirect): it is charged to that socket's receive buffer, which closes the TCP
//! window when nobody reads, and the daemon, woken by it, copies it to the peer in order once
//! the peer took every redirected byte, then grants more. So the bytes of one direction are
//! always either all in the kernel's queue or behind it, never overtaking each other.
//!
//! Empty buffers (a FIN's) are dropped: a FIN is passed on by the daemon, after the bytes.
//!
//! Contract: fail-closed for the pair: bytes whose peer is not in `PAIR_PEER_V2` (the daemon is
//! tearing the pair down, or the peer closed) are dropped and counted `pair_redirect_failed`;
//! the daemon resets such a connection. A socket without flow or credit entries passes its
//! bytes to itself (counted `pair_redirect_failed` without flow entries). Never touches sockets outside the two sockhashes. Minimum kernel 5.10
//! (a stream verdict without a stream parser; `SK_PASS` charged to the socket's receive
//! buffer); the attachment is a prog-attach to the map, which lives as long as the pinned map.
//! Reads `PAIR_PEER_V2`, `PAIR_GRANT_V1`; writes `PAIR_FLOW_V1`, `COUNTERS_V2`.

use aya_ebpf::{
    EbpfContext as _,
    bindings::sk_action::{SK_DROP, SK_PASS},
    helpers::bpf_get_socket_cookie,
    macros::stream_verdict,
    programs::SkBuffContext,
};
use proxy_common::counters;

use crate::maps::{PAIR_FLOW_V1, PAIR_GRANT_V1, PAIR_PEER_V2, count};

/// What to do with a buffer.
enum Verdict {
    /// Redirected out of the peer.
    Redirected,
    /// Left to the receiving socket, for the daemon to copy.
    Passed,
    /// The receiving socket has no peer in `PAIR_PEER_V2`.
    NoPeer,
}

#[stream_verdict]
pub fn pair_verdict(ctx: SkBuffContext) -> u32 {
    // From 6.1 the kernel also hands over the empty buffer that carried a FIN (the FIN itself
    // is TCP state, already taken): redirected, it would break the peer's send queue (EPIPE).
    if ctx.len() == 0 {
        return SK_DROP;
    }
    match verdict(&ctx) {
        Verdict::Redirected => {
            count(counters::PAIR_REDIRECTED);
            SK_PASS
        }
        Verdict::Passed => {
            count(counters::PAIR_PASSED);
            SK_PASS
        }
        Verdict::NoPeer => {
            count(counters::PAIR_REDIRECT_FAILED);
            SK_DROP
        }
    }
}

fn verdict(ctx: &SkBuffContext) -> Verdict {
    // SAFETY: the helper only reads the context, which is valid.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let len = u64::from(ctx.len());
    let Some(flow) = PAIR_FLOW_V1.get_ptr_mut(&cookie) else {
        // Cannot happen while the daemon holds the pair (it inserts the entry before arming
        // the socket): the bytes go to the socket, counted as a failure.
        count(counters::PAIR_REDIRECT_FAILED);
        return Verdict::Passed;
    };
    // SAFETY: a value of the map, valid while the program runs. One socket's buffers go
    // through this program one at a time (the socket's receive path is serialised), and only
    // this program writes the entry, so the plain read-modify-write below is not racy.
    let flow = unsafe { &mut *flow };
    if !within_credit(cookie, flow.redirected, flow.passed, len) {
        flow.passed += len;
        return Verdict::Passed;
    }
    // With the redirect set, SK_PASS sends the bytes out of the peer; anything else is a drop.
    if PAIR_PEER_V2.redirect_skb(ctx, cookie, 0) != i64::from(SK_PASS) {
        return Verdict::NoPeer;
    }
    flow.redirected += len;
    Verdict::Redirected
}

/// Whether `len` more bytes may be redirected: within the granted credit, and nothing passed
/// earlier is still waiting for the daemon (those bytes come first).
#[inline(always)]
fn within_credit(cookie: u64, redirected: u64, passed: u64, len: u64) -> bool {
    // SAFETY: the value is read before the program returns.
    match unsafe { PAIR_GRANT_V1.get(&cookie) } {
        Some(g) => passed == g.drained && redirected + len <= g.granted,
        None => false,
    }
}
