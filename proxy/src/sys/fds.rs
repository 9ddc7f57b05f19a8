//! Descriptors a service manager passed at exec (`LISTEN_FDS`, sd_listen_fds(3)): numbers in
//! the environment, open in the process from the start, owned by nobody yet.

use std::{
    io,
    os::fd::{FromRawFd as _, OwnedFd, RawFd},
};

/// Takes ownership of descriptor `fd`, which the service manager passed to this process: it
/// must be open (`EBADF` otherwise), and it is made close-on-exec. The caller guarantees that
/// nothing else in the process owns `fd` (the manager's descriptors come before any the
/// process opens itself, and each is taken once).
pub fn adopt_passed(fd: RawFd) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(libc::EBADF));
    }
    // SAFETY: F_GETFD only reads the descriptor's flags; an fd that is not open is EBADF.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: F_SETFD on the open descriptor just checked sets its flags only.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is open (checked above) and, by the caller's guarantee, owned by nothing
    // else in this process: the `OwnedFd` is its only owner from here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
