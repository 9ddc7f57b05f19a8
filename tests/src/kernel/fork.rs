//! Running a closure in a child process inside a test cgroup and namespace.

use std::{io::Read as _, path::Path, time::Duration};

use super::Netns;

/// Serialises fork() with the pipe set-up around it, so a child never inherits the write end of
/// another child's result pipe (which would keep that pipe open after its writer exits).
static FORK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Closes every descriptor the child inherited from the test process but stdin, stdout, stderr
/// and `keep` (its result pipe, and what its closure was given). The parent's other threads hold sockets at the moment of the
/// fork, a banner server's just-accepted connection among them; a copy kept here for the
/// child's whole life would make the server's close send no FIN, and that connection's client
/// would wait for an end that never comes (a lost connect in `load`, one in a million).
///
/// # Safety
/// Only for a child right after `fork`, before it uses any descriptor but `keep`.
unsafe fn close_inherited(keep: &[libc::c_int]) {
    let mut kept: Vec<libc::c_uint> = keep
        .iter()
        .filter_map(|&fd| libc::c_uint::try_from(fd).ok())
        .filter(|&fd| fd > 2)
        .collect();
    kept.sort_unstable();
    let mut from: libc::c_uint = 3;
    for fd in kept.into_iter().chain([libc::c_uint::MAX]) {
        // close_range(2), Linux 5.9; a failure leaves the copies open, as before.
        // SAFETY: closes descriptors of this process only; none is used afterwards.
        if fd > from {
            unsafe { libc::syscall(libc::SYS_close_range, from, fd - 1, 0) };
        }
        from = fd.saturating_add(1);
    }
}

/// A closure run in a forked child process that joined a cgroup and a network namespace: the way
/// to make sockets that the cgroup's programs see without moving the test process itself. The
/// closure returns a result string (e.g. JSON); a panic in it becomes `"PANIC: ..."`. The child
/// is killed and reaped on drop if still running.
pub struct InCgroup {
    pid: libc::pid_t,
    out: Option<std::fs::File>,
}

impl InCgroup {
    /// Forks; the child joins `cgroup` (unless `None`) and `netns`, runs `f` and exits. The
    /// child holds no descriptor of the parent's but its standard ones: `f` makes its own.
    pub fn spawn(cgroup: Option<&Path>, netns: &Netns, f: impl FnOnce() -> String) -> Self {
        Self::spawn_keeping(cgroup, netns, -1, f)
    }

    /// Like [`InCgroup::spawn`], but the child keeps descriptor `keep` of the parent's (one
    /// that `f` uses, e.g. its end of a socket pair).
    pub fn spawn_keeping(
        cgroup: Option<&Path>,
        netns: &Netns,
        keep: std::os::fd::RawFd,
        f: impl FnOnce() -> String,
    ) -> Self {
        use std::os::fd::{AsRawFd as _, FromRawFd as _};
        let procs = cgroup.map(|cg| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(cg.join("cgroup.procs"))
                .unwrap_or_else(|e| panic!("opening {}/cgroup.procs: {e}", cg.display()))
        });
        let ns = std::fs::File::open(netns.path()).expect("opening the namespace");
        let guard = FORK
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut fds = [0; 2];
        // SAFETY: fds is a valid array of two ints.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe");
        // SAFETY: the child only joins the cgroup and namespace, runs `f` (no locks of the
        // parent's other threads are taken by it: it uses sockets and the allocator, which glibc
        // keeps fork-safe) and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: closing our copy of the read end; writing "0" to cgroup.procs moves this
            // process; setns takes a valid namespace fd.
            unsafe {
                libc::close(fds[0]);
                if let Some(p) = &procs
                    && libc::write(p.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1
                {
                    libc::_exit(90);
                }
                if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    libc::_exit(91);
                }
                close_inherited(&[fds[1], keep]);
            }
            let result =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
                    let msg = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                        .unwrap_or_default();
                    format!("PANIC: {msg}")
                });
            // SAFETY: fds[1] is our write end; _exit skips the parent's atexit handlers.
            unsafe {
                let mut bytes = result.as_bytes();
                while !bytes.is_empty() {
                    let n = libc::write(fds[1], bytes.as_ptr().cast(), bytes.len());
                    if n <= 0 {
                        break;
                    }
                    bytes = &bytes[n as usize..];
                }
                libc::_exit(0);
            }
        }
        // SAFETY: closing the parent's copy of the write end; the read end is ours to own.
        let out = unsafe {
            libc::close(fds[1]);
            std::fs::File::from_raw_fd(fds[0])
        };
        drop(guard);
        Self {
            pid,
            out: Some(out),
        }
    }

    /// Waits (at most `timeout`) for the child's result; panics on a timeout or a panic.
    pub fn wait(self, timeout: Duration) -> String {
        self.result(timeout)
            .unwrap_or_else(|text| panic!("child failed: {text}"))
    }

    /// Waits (at most `timeout`) for the child's result; `Err` with its panic's text when it
    /// panicked. Panics on a timeout.
    pub fn result(mut self, timeout: Duration) -> Result<String, String> {
        let mut out = self.out.take().expect("not waited yet");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = out.read_to_string(&mut text);
            let _ = tx.send(text);
        });
        let text = rx
            .recv_timeout(timeout)
            .unwrap_or_else(|_| panic!("child {} gave no result in {timeout:?}", self.pid));
        self.reap();
        if text.starts_with("PANIC") {
            Err(text)
        } else {
            Ok(text)
        }
    }

    fn reap(&mut self) {
        if self.pid > 0 {
            let mut status = 0;
            // SAFETY: our own child; kill is harmless if it already exited (not yet reaped).
            unsafe {
                libc::kill(self.pid, libc::SIGKILL);
                libc::waitpid(self.pid, &raw mut status, 0);
            }
            self.pid = 0;
        }
    }
}

impl Drop for InCgroup {
    fn drop(&mut self) {
        self.reap();
    }
}
