//! The capability calls behind `crate::privileges`: capset(2) for the calling thread, and the
//! prctl(2) options that shrink the bounding and ambient sets and set `no_new_privs`. Every one
//! acts on the calling thread only; threads started afterwards inherit the result. Also the
//! switch to the steady-state user (setgroups, setresgid, setresuid with `PR_SET_KEEPCAPS`).

use std::io;

/// `_LINUX_CAPABILITY_VERSION_3` (linux/capability.h): 64-bit sets, as two 32-bit words.
const VERSION_3: u32 = 0x2008_0522;

/// `struct __user_cap_header_struct`.
#[repr(C)]
struct Header {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct`: one 32-bit word of each set.
#[repr(C)]
#[derive(Clone, Copy)]
struct Data {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Sets the calling thread's effective and permitted sets to `keep` (bit `n` is capability
/// `n`) and empties its inheritable set. Raising a capability the thread does not have fails
/// with `EPERM`.
pub fn set(keep: u64) -> io::Result<()> {
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let word = |shift: u32| {
        let bits = u32::try_from((keep >> shift) & u64::from(u32::MAX)).unwrap_or_default();
        Data {
            effective: bits,
            permitted: bits,
            inheritable: 0,
        }
    };
    let data = [word(0), word(32)];
    // SAFETY: version 3 of the ABI takes one header and two data structs, both valid and
    // alive for the call; the kernel only writes into the header (the version it wants, on
    // a version mismatch), which is ours mutably.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &raw mut header, data.as_ptr()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Removes capability `cap` from the calling thread's bounding set (needs `CAP_SETPCAP`;
/// `EINVAL` for a number the kernel does not know).
pub fn drop_bounding(cap: u32) -> io::Result<()> {
    prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0)
}

/// Empties the calling thread's ambient set (`EINVAL` before Linux 4.3, which has none).
pub fn clear_ambient() -> io::Result<()> {
    let clear_all = libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong;
    prctl(libc::PR_CAP_AMBIENT, clear_all, 0)
}

/// Sets `no_new_privs`: no `execve` of this thread or its children can gain privileges
/// again (set-user-ID bits and file capabilities are ignored). It cannot be unset.
pub fn set_no_new_privs() -> io::Result<()> {
    prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0)
}

/// Makes the calling thread keep its permitted capabilities when its user ids all leave 0
/// (`PR_SET_KEEPCAPS`; the effective set is emptied all the same), or not.
pub fn set_keep_caps(keep: bool) -> io::Result<()> {
    prctl(libc::PR_SET_KEEPCAPS, libc::c_ulong::from(keep), 0)
}

/// Makes the calling thread user `uid` and group `gid` (real, effective and saved) with no
/// supplementary groups. The group goes first: changing it needs `CAP_SETGID`, which a thread
/// whose user ids left 0 without `PR_SET_KEEPCAPS` no longer has. glibc applies each call to
/// every thread of the process.
pub fn switch_user(uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: a zero-length list is not read (the pointer may be null).
    let rc = unsafe { libc::setgroups(0, std::ptr::null()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: setresgid and setresuid take integers only.
    let rc = unsafe { libc::setresgid(gid, gid, gid) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    let rc = unsafe { libc::setresuid(uid, uid, uid) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The calling thread's (real, effective, saved) user ids, then its group ids.
pub fn ids() -> ([u32; 3], [u32; 3]) {
    let (mut u, mut g) = ([0u32; 3], [0u32; 3]);
    // SAFETY: each pointer is to a distinct, writable u32 that outlives the call; these calls
    // cannot fail with valid pointers.
    unsafe {
        libc::getresuid(&raw mut u[0], &raw mut u[1], &raw mut u[2]);
        libc::getresgid(&raw mut g[0], &raw mut g[1], &raw mut g[2]);
    }
    (u, g)
}

fn prctl(option: libc::c_int, arg2: libc::c_ulong, arg3: libc::c_ulong) -> io::Result<()> {
    let zero: libc::c_ulong = 0;
    // SAFETY: the options used here take integer arguments only (unused ones must be 0);
    // no memory is passed to the kernel.
    let rc = unsafe { libc::prctl(option, arg2, arg3, zero, zero) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
