//! Kernel programs of the proxy.
//!
//! One file per hook family; every map is in [`maps`]. Entry points are thin: each calls a worker
//! that returns `Result` and maps it to a verdict in exactly one place. Outcomes are counted in
//! `COUNTERS_V2`; nothing logs on a path that succeeds. The error paths an operator can act on
//! emit a record ([`log`]) when the daemon loads the programs with a kernel log level.
#![no_std]
#![no_main]
// ROUND_ROBIN's atomic fetch-and-add is one instruction of inline assembly (`select::next_turn`).
#![feature(asm_experimental_arch)]
#![allow(
    unsafe_code,
    reason = "kernel programs: every helper call, map access and context read is unsafe"
)]
#![expect(
    clippy::needless_pass_by_value,
    reason = "aya's program macros hand each entry point its context by value"
)]
#![allow(
    clippy::needless_borrows_for_generic_args,
    reason = "map keys go by reference: the helper reads the caller's stack slot, no copy"
)]

mod active;
mod connect;
mod drop_overload;
mod features;
mod host_cx;
mod limit;
mod listener;
mod log;
mod maps;
mod pair;
mod passive;
mod peer;
mod recvmsg;
mod select;
mod sendmsg;
mod sk_msg;
mod sock_addr;
mod sock_addr_reverse;
mod sock_vip;
mod sockops;
mod translate;
mod tuple;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
