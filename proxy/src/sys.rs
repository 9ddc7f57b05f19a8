//! The daemon's only `unsafe`: thin wrappers over system calls that have no safe binding.

use std::{ffi::CString, io, os::unix::ffi::OsStrExt as _, path::Path};

/// Mounts a BPF filesystem at `target`.
pub fn mount_bpffs(target: &Path) -> io::Result<()> {
    let target = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    let fstype = c"bpf";
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the call; data is NULL,
    // which the bpf filesystem accepts.
    let rc = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Lifts the locked-memory limit, which kernels before 5.11 charge BPF maps against.
pub fn raise_memlock_rlimit() -> io::Result<()> {
    let limit = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: `limit` is a valid rlimit that outlives the call.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Moves the calling thread into the network namespace at `path` (e.g. /run/netns/NAME).
/// Call before starting other threads so the whole process works in that namespace.
pub fn enter_netns(path: &Path) -> io::Result<()> {
    use std::os::fd::AsRawFd as _;
    let file = std::fs::File::open(path)?;
    // SAFETY: the fd is valid for the duration of the call; CLONE_NEWNET only changes this
    // thread's network namespace.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}
