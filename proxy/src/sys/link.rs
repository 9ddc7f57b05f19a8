//! `BPF_LINK_DETACH` (Linux 5.9), which aya 0.14 does not expose: it detaches a link's program
//! at once, whoever else holds the link. Dropping the last reference does not: when that is a
//! bpffs pin, the kernel frees the pin's inode after an RCU grace period and puts the link from
//! a workqueue, so the program can go on running for a while after the unlink returned.

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsFd as _, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

/// bpf(2) commands (linux/bpf.h `enum bpf_cmd`).
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_DETACH: libc::c_long = 34;

/// `union bpf_attr` for `BPF_OBJ_GET`.
#[repr(C)]
struct ObjGet {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// Detaches the program of the link pinned at `pin` now (the pin stays: the caller removes it).
pub fn detach_pinned(pin: &Path) -> io::Result<()> {
    let path = CString::new(pin.as_os_str().as_bytes())
        .map_err(|_| io::Error::other("a pin path with a NUL byte"))?;
    let mut attr = ObjGet {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    // SAFETY: `attr` is a valid `union bpf_attr` prefix; `pathname` points at `path`, a
    // NUL-terminated string alive for the call.
    let rc = unsafe {
        sys_bpf(
            BPF_OBJ_GET,
            std::ptr::from_mut(&mut attr).cast(),
            size_of::<ObjGet>(),
        )
    };
    let fd = i32::try_from(rc).map_err(|_| io::Error::other("BPF_OBJ_GET returned no fd"))?;
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: BPF_OBJ_GET returned a new fd that nothing else owns.
    let link = unsafe { OwnedFd::from_raw_fd(fd) };
    detach(link.as_fd())
}

/// bpf(2) with `attr` of `size` bytes; its return value, negative on failure (errno set).
///
/// # Safety
/// `attr` must point at `size` initialised bytes of a `union bpf_attr` prefix for `cmd`, and
/// every pointer in it at memory alive for the call.
unsafe fn sys_bpf(cmd: libc::c_long, attr: *mut libc::c_void, size: usize) -> libc::c_long {
    // SAFETY: the caller's contract.
    unsafe { libc::syscall(libc::SYS_bpf, cmd, attr, size as libc::c_uint) }
}

/// `union bpf_attr` for `BPF_LINK_DETACH`.
#[repr(C)]
struct LinkDetach {
    link_fd: u32,
}

/// Detaches `link`'s program now. Fails with `EINVAL` or `EOPNOTSUPP` where the kernel or the
/// link type cannot detach (the caller then relies on dropping the link).
pub fn detach(link: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = LinkDetach {
        link_fd: u32::try_from(link.as_raw_fd()).map_err(|_| io::Error::other("negative fd"))?,
    };
    // SAFETY: `attr` is a valid `union bpf_attr` prefix of `size_of::<LinkDetach>()` bytes,
    // alive for the call; it holds no pointer.
    let rc = unsafe {
        sys_bpf(
            BPF_LINK_DETACH,
            std::ptr::from_mut(&mut attr).cast(),
            size_of::<LinkDetach>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
