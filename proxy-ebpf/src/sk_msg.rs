//! `sk_msg`: socket-to-socket splicing on this host. Attached to the sockhash `SPLICE_V1` (not to
//! the cgroup); runs for every `sendmsg`/`sendfile` on a socket that sockops put there. The
//! message goes straight into the peer socket's receive queue (`BPF_F_INGRESS`), skipping the
//! TCP/IP stack, when the peer is in the sockhash too.
//!
//! Contract: fail-open: a peer that is not in the sockhash (not local, splicing was off when it
//! was established, or it closed) gets the message through TCP as usual, counted
//! `sk_msg_redirect_failed`. The program never drops. Minimum kernel 4.17 (sk_msg), 4.18
//! (sockhash); the attachment is a prog-attach to the map, which lives as long as the pinned
//! map. Reads `SPLICE_V1`; writes `COUNTERS_V2`.

use aya_ebpf::{
    bindings::{BPF_F_INGRESS, sk_action::SK_PASS},
    macros::sk_msg,
    programs::SkMsgContext,
};
use proxy_common::counters;

use crate::{
    maps::{SPLICE_V1, count},
    tuple::{self, Fields},
};

/// The peer socket is not in the sockhash.
struct NotSpliced;

#[sk_msg]
pub fn splice_msg(ctx: SkMsgContext) -> u32 {
    match try_redirect(&ctx) {
        Ok(()) => count(counters::SK_MSG_REDIRECTED),
        Err(NotSpliced) => count(counters::SK_MSG_REDIRECT_FAILED),
    }
    // With a redirect set, SK_PASS delivers to the peer; without one, through TCP.
    SK_PASS
}

fn try_redirect(ctx: &SkMsgContext) -> Result<(), NotSpliced> {
    // SAFETY: the context pointer is valid for the duration of the program.
    let md = unsafe { &*ctx.msg };
    let t = tuple::from_fields(&Fields {
        family: md.family,
        local_ip4: md.local_ip4,
        remote_ip4: md.remote_ip4,
        local_ip6: tuple::words(&raw const md.local_ip6),
        remote_ip6: tuple::words(&raw const md.remote_ip6),
        local_port: md.local_port,
        remote_port: md.remote_port,
    })
    .ok_or(NotSpliced)?;
    let verdict = SPLICE_V1.redirect_msg(ctx, t.reversed(), u64::from(BPF_F_INGRESS));
    if verdict == i64::from(SK_PASS) {
        Ok(())
    } else {
        Err(NotSpliced)
    }
}
