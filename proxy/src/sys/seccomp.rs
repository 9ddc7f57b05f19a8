//! Installing a seccomp filter (`crate::privileges::seccomp` builds it): prctl(2)
//! `PR_SET_SECCOMP` with `SECCOMP_MODE_FILTER`. It binds the calling thread and every thread it
//! starts afterwards; it cannot be removed.

use std::io;

/// Installs `program` (classic BPF, as `libc::sock_filter` instructions) on the calling
/// thread. Needs `no_new_privs` (or `CAP_SYS_ADMIN`); `EINVAL` for a program the kernel finds
/// invalid, or on a kernel built without seccomp.
pub fn install(program: &[libc::sock_filter]) -> io::Result<()> {
    let len = u16::try_from(program.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "seccomp program too long"))?;
    let prog = libc::sock_fprog {
        len,
        filter: program.as_ptr().cast_mut(),
    };
    let mode = libc::c_ulong::from(libc::SECCOMP_MODE_FILTER);
    let zero: libc::c_ulong = 0;
    // SAFETY: `prog` points at `len` valid instructions, both alive for the call; the kernel
    // copies the program and does not write to it.
    let rc = unsafe { libc::prctl(libc::PR_SET_SECCOMP, mode, &raw const prog, zero, zero) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
