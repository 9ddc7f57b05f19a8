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
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Unmounts the filesystem at `target`.
pub fn unmount(target: &Path) -> io::Result<()> {
    let target = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    // SAFETY: `target` is a valid NUL-terminated string that outlives the call.
    let rc = unsafe { libc::umount2(target.as_ptr(), 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Lifts the locked-memory limit, which kernels before 5.11 charge BPF maps against.
pub fn raise_memlock_rlimit() -> io::Result<()> {
    let limit = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: `limit` is a valid rlimit that outlives the call.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &raw const limit) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Gives the allocator's free memory back to the system (glibc's `malloc_trim`). A reload
/// parses a whole file and drops a whole configuration; without this the freed pages stay in
/// the allocator's arenas and the process grows from reload to reload.
#[cfg(target_env = "gnu")]
pub fn release_free_memory() {
    // SAFETY: malloc_trim has no preconditions; it only returns free heap pages.
    unsafe { libc::malloc_trim(0) };
}

/// Gives the allocator's free memory back to the system (nothing to do outside glibc).
#[cfg(not(target_env = "gnu"))]
pub fn release_free_memory() {}

/// Moves the calling thread into the network namespace at `path` (e.g. /run/netns/NAME).
/// Call before starting other threads so the whole process works in that namespace.
pub fn enter_netns(path: &Path) -> io::Result<()> {
    use std::os::fd::AsRawFd as _;
    let file = std::fs::File::open(path)?;
    // SAFETY: the fd is valid for the duration of the call; CLONE_NEWNET only changes this
    // thread's network namespace.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `getsockopt(SO_COOKIE)`: the socket's cookie, the key the kernel programs find it by
/// (`bpf_get_socket_cookie`); stable for the socket's life.
pub fn socket_cookie(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<u64> {
    use std::os::fd::AsRawFd as _;
    let mut cookie: u64 = 0;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: `cookie` and `len` are valid for writes and outlive the call.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            (&raw mut cookie).cast(),
            &raw mut len,
        )
    };
    if rc == 0 {
        Ok(cookie)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `setsockopt(SO_RCVLOWAT, 1)`: besides setting the low-water mark, TCP re-runs its
/// data-ready callback for bytes already queued, which is how bytes that arrived before a
/// socket entered a sockmap reach its stream verdict program.
pub fn kick_receive_queue(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    use std::os::fd::AsRawFd as _;
    let one: libc::c_int = 1;
    // SAFETY: `one` is a valid int that outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&raw const one).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `BPF_MAP_UPDATE_BATCH` and `BPF_MAP_DELETE_BATCH` (Linux 5.6+, hash maps): many elements per
/// `bpf(2)` call. aya 0.14 has no binding for them.
pub mod map_batch {
    use std::{
        io,
        mem::size_of,
        os::fd::{AsFd as _, AsRawFd as _},
    };

    use aya::maps::{HashMap, IterableMap as _, MapData};

    /// `enum bpf_cmd` values from include/uapi/linux/bpf.h (stable ABI).
    const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
    const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

    /// The `batch` member of `union bpf_attr` (include/uapi/linux/bpf.h), all of it: the kernel
    /// zero-fills the rest of the union and requires fields past `flags` to be zero.
    #[repr(C)]
    #[derive(Default)]
    struct BatchAttr {
        in_batch: u64,
        out_batch: u64,
        keys: u64,
        values: u64,
        count: u32,
        map_fd: u32,
        elem_flags: u64,
        flags: u64,
    }
    const _: () = assert!(size_of::<BatchAttr>() == 56);

    /// Inserts or replaces `keys[i] -> values[i]` (flags `BPF_ANY`) in `map`, in order. On an
    /// error, an unknown prefix of the elements was applied (the kernel stops at the first
    /// failure).
    pub fn update<K: aya::Pod, V: aya::Pod>(
        map: &mut HashMap<MapData, K, V>,
        keys: &[K],
        values: &[V],
    ) -> io::Result<()> {
        assert_eq!(keys.len(), values.len(), "one value per key");
        let mut attr = BatchAttr {
            keys: keys.as_ptr() as u64,
            values: values.as_ptr() as u64,
            ..BatchAttr::default()
        };
        run(BPF_MAP_UPDATE_BATCH, map, keys.len(), &mut attr)
    }

    /// Deletes `keys` from `map`, in order; the kernel stops at the first key that is not there
    /// (`ENOENT`), so pass only keys known to exist.
    pub fn delete<K: aya::Pod, V: aya::Pod>(
        map: &mut HashMap<MapData, K, V>,
        keys: &[K],
    ) -> io::Result<()> {
        let mut attr = BatchAttr {
            keys: keys.as_ptr() as u64,
            ..BatchAttr::default()
        };
        run(BPF_MAP_DELETE_BATCH, map, keys.len(), &mut attr)
    }

    /// `attr.keys` (and `attr.values`) must point at `len` elements of `K` (and `V`).
    fn run<K: aya::Pod, V: aya::Pod>(
        cmd: libc::c_long,
        map: &mut HashMap<MapData, K, V>,
        len: usize,
        attr: &mut BatchAttr,
    ) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        attr.count = u32::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "batch larger than u32"))?;
        attr.map_fd = map.map().fd().as_fd().as_raw_fd() as u32;
        // SAFETY: `attr` is a valid `bpf_attr.batch` of the size passed. Its keys (and values)
        // point at `len` elements of `K` (`V`), borrowed by our callers for the whole call; aya
        // checked when it opened the map that `K` and `V` have the map's key and value sizes, so
        // the kernel reads exactly those slices. It writes back only `attr.count`, ours mutably.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                std::ptr::from_mut::<BatchAttr>(attr),
                size_of::<BatchAttr>() as libc::c_uint,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

pub mod caps;
pub mod fds;
pub mod iter;
pub mod link;
pub mod seccomp;

/// CLOCK_MONOTONIC now, as a duration since the clock's origin (sd_notify's `MONOTONIC_USEC`).
pub fn monotonic_now() -> std::time::Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill; CLOCK_MONOTONIC always exists.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
    if rc != 0 {
        return std::time::Duration::ZERO;
    }
    std::time::Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

/// The effective user id of the process.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The effective group id of the process.
pub fn effective_gid() -> u32 {
    // SAFETY: getegid has no preconditions and cannot fail.
    unsafe { libc::getegid() }
}

/// `getsockopt(SO_PEERCRED)`: the user id of the process at the other end of a unix socket (as
/// it was when it connected or listened).
pub fn peer_uid(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<u32> {
    use std::os::fd::AsRawFd as _;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes and outlive the call; the kernel writes at
    // most `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != size_of::<libc::ucred>() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "short SO_PEERCRED answer",
        ));
    }
    Ok(cred.uid)
}

/// At most this many descriptors travel in one message of [`send_with_fds`] and
/// [`recv_with_fds`] (the kernel's limit is 253, `SCM_MAX_FD`).
pub const MAX_FDS_PER_MESSAGE: usize = 64;

/// `sendmsg(2)` of one packet (`payload`) with `fds` as `SCM_RIGHTS`, on a connected unix
/// socket; `MSG_NOSIGNAL`, so a peer that went away is an error (EPIPE), not SIGPIPE.
pub fn send_with_fds(
    fd: std::os::fd::BorrowedFd<'_>,
    payload: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    if fds.len() > MAX_FDS_PER_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "too many descriptors for one message",
        ));
    }
    let raw: Vec<libc::c_int> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let data_len = size_of_val(raw.as_slice());
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(data_len as u32) } as usize;
    // u64 elements keep the buffer aligned for `cmsghdr`.
    let mut control = vec![0u64; space.div_ceil(size_of::<u64>())];
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr().cast_mut().cast(),
        iov_len: payload.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    if !raw.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points at `space` bytes, enough for one header and `data_len`
        // bytes of data (CMSG_SPACE), so CMSG_FIRSTHDR is non-null and CMSG_DATA has room for
        // the descriptors; the buffer is aligned for cmsghdr (u64 elements).
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(data_len as u32) as _;
            std::ptr::copy_nonoverlapping(
                raw.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                data_len,
            );
        }
    }
    // SAFETY: `msg` points at `iov` (valid for `payload.len()` bytes, only read) and at
    // `control`, all alive for the call; the descriptors are open (borrowed).
    let sent = unsafe { libc::sendmsg(fd.as_raw_fd(), &raw const msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(sent as usize)
    }
}

/// `recvmsg(2)` of one packet into `buf`, with the descriptors it carries (close-on-exec, at
/// most [`MAX_FDS_PER_MESSAGE`]). A packet longer than `buf`, or with more descriptors or
/// other control data than expected, is an error (`InvalidData`), and any descriptor that came
/// with it is closed. `Ok((0, []))` is the peer's orderly close.
pub fn recv_with_fds(
    fd: std::os::fd::BorrowedFd<'_>,
    buf: &mut [u8],
) -> io::Result<(usize, Vec<std::os::fd::OwnedFd>)> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    let data_max = MAX_FDS_PER_MESSAGE * size_of::<libc::c_int>();
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(data_max as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(size_of::<u64>())];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at `iov` (valid for writes of `buf.len()` bytes) and at `control`
    // (`space` bytes), both alive for the call.
    let n = unsafe { libc::recvmsg(fd.as_raw_fd(), &raw mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    let mut foreign = false;
    // SAFETY: the kernel filled `msg_control` up to `msg_controllen`; CMSG_FIRSTHDR/NXTHDR stay
    // within it, each SCM_RIGHTS header's data holds (cmsg_len - CMSG_LEN(0)) / 4 descriptors,
    // copied out bytewise, each of them newly installed in this process and owned by nobody else.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg);
                for i in 0..bytes / size_of::<libc::c_int>() {
                    let mut raw = [0u8; size_of::<libc::c_int>()];
                    std::ptr::copy_nonoverlapping(
                        data.add(i * raw.len()),
                        raw.as_mut_ptr(),
                        raw.len(),
                    );
                    fds.push(OwnedFd::from_raw_fd(libc::c_int::from_ne_bytes(raw)));
                }
            } else {
                foreign = true;
            }
            cmsg = libc::CMSG_NXTHDR(&raw const msg, cmsg);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 || foreign {
        // `fds` closes what did arrive.
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a truncated message, or unexpected control data",
        ));
    }
    Ok((n as usize, fds))
}

/// Registers a socket with tokio's event loop (readable and writable).
pub fn register_async(
    socket: socket2::Socket,
) -> io::Result<tokio::io::unix::AsyncFd<socket2::Socket>> {
    // SAFETY: the socket owns its descriptor, which stays open and the same until the AsyncFd
    // (its only owner from here) is dropped.
    Ok(unsafe { tokio::io::unix::AsyncFd::register(socket) }?)
}

/// An owner whose descriptor stays open and the same for as long as it lives, so that tokio's
/// event loop may watch it ([`register_readable`]).
///
/// # Safety
///
/// Implement only for a type that owns its descriptor and never closes or replaces it.
pub unsafe trait StableFd: std::os::fd::AsRawFd {}

// SAFETY: aya-log's reader owns its ring buffer's map descriptor for its whole life.
unsafe impl<T> StableFd for aya_log::EbpfLogger<T> {}

/// Registers `owner` (the reader of the kernel's log records) with tokio's event loop for
/// readability.
pub fn register_readable<T: StableFd>(owner: T) -> io::Result<tokio::io::unix::AsyncFd<T>> {
    // SAFETY: `StableFd`: the owner's descriptor stays open and the same until the AsyncFd,
    // its only owner from here, is dropped.
    Ok(unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(owner, tokio::io::Interest::READABLE)
    }?)
}

/// Blocks (`how` = `SIG_BLOCK`) or unblocks (`SIG_UNBLOCK`) `signals` for the calling thread;
/// threads it starts afterwards inherit the mask. A blocked signal stays pending until a thread
/// unblocks it.
fn mask_signals(how: libc::c_int, signals: &[libc::c_int]) -> io::Result<()> {
    // SAFETY: an all-zero sigset_t is a valid value to initialise with sigemptyset.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, exclusively borrowed sigset_t for each call.
    unsafe {
        libc::sigemptyset(&raw mut set);
        for &signal in signals {
            if libc::sigaddset(&raw mut set, signal) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
    }
    // SAFETY: `set` is initialised; the old mask is not asked for (null).
    let rc = unsafe { libc::pthread_sigmask(how, &raw const set, std::ptr::null_mut()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Holds `signals` pending for the calling thread and the threads it starts.
pub fn block_signals(signals: &[libc::c_int]) -> io::Result<()> {
    mask_signals(libc::SIG_BLOCK, signals)
}

/// Lets the calling thread take `signals` again (pending ones are delivered now).
pub fn unblock_signals(signals: &[libc::c_int]) -> io::Result<()> {
    mask_signals(libc::SIG_UNBLOCK, signals)
}
