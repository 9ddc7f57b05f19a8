//! What the loading kernel offers beyond the programs' minimum (`proxy_common::abi::features`).
//!
//! The daemon's loader sets [`KERNEL_FEATURES`] before the object is loaded; it lives in the
//! object's read-only data, which aya freezes, so the verifier knows its value and treats the
//! branches of a missing feature as dead: a kernel without a helper never checks the call.

/// The feature bits (`proxy_common::abi::features`). Zero in the object: nothing beyond the
/// minimum until the loader says so. `#[used]` keeps LLVM's constant merging away from it: it
/// would otherwise hand other read-only constants of the same value (a map key of 0) this
/// global's address, and the loader's value would then change them too.
#[unsafe(no_mangle)]
#[used]
static KERNEL_FEATURES: u32 = 0;

/// Whether the kernel has every feature in `bits`.
#[inline(always)]
pub fn has(bits: u32) -> bool {
    // SAFETY: a read of a static; volatile, so the compiler does not fold the object's zero in.
    let features = unsafe { core::ptr::read_volatile(&raw const KERNEL_FEATURES) };
    features & bits == bits
}
