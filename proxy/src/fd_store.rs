//! The service manager's file-descriptor store for the proxy listener (systemd's
//! `FileDescriptorStoreMax=`): the listening sockets outlive the daemon, so a restart (SIGTERM
//! and a new start, or `kill -9` and a new start) refuses no proxy-mode connect, HTTP-routed
//! ones included. While no daemon accepts, the kernel still finds the stored socket listening
//! and redirects to it; connects wait in its accept queue for the next daemon.
//!
//! The daemon stores its listeners with `FDSTORE=1` and `FDNAME=`[`LISTENER_FDNAME`] over
//! `NOTIFY_SOCKET` ([`crate::notify::Notifier::store_listeners`]) when the manager offers a
//! store (`FDSTORE`, set by systemd 254 and later to `FileDescriptorStoreMax=`), and on the next
//! start takes them back from `LISTEN_FDS`/`LISTEN_PID`/`LISTEN_FDNAMES` (descriptors from 3,
//! sd_listen_fds(3)) instead of binding new ones. Everything passed is checked: a descriptor
//! under this name that is not a listening TCP socket stops the start with an error; one under
//! another name is closed with a warning; addresses no longer configured are closed and leave
//! the store. Without these variables nothing changes.

use std::{
    io,
    net::TcpListener,
    os::fd::{AsRawFd as _, RawFd},
};

use socket2::{Domain, Protocol, Socket, Type};
use thiserror::Error;
use tracing::{info, warn};

use crate::sys;

/// The name the proxy listener's sockets are stored under (`FDNAME=`, `LISTEN_FDNAMES`).
pub const LISTENER_FDNAME: &str = "proxy-listener";
/// The first passed descriptor (`SD_LISTEN_FDS_START`).
const FIRST_FD: RawFd = 3;
/// At most this many passed descriptors are taken (engine threads x listener addresses, with
/// room to spare); more is refused as a malformed `LISTEN_FDS`.
const MAX_PASSED: usize = 4096;

/// Why the descriptors the service manager passed cannot be used.
#[derive(Debug, Error)]
pub enum FdStoreError {
    /// `LISTEN_PID` is not a process id.
    #[error("LISTEN_PID {0:?} is not a process id")]
    Pid(String),
    /// `LISTEN_FDS` is not a count of descriptors.
    #[error("LISTEN_FDS {0:?} is not a number of passed descriptors (0 to {MAX_PASSED})")]
    Count(String),
    /// `LISTEN_FDNAMES` does not name each passed descriptor once.
    #[error("LISTEN_FDNAMES names {names} descriptors, but LISTEN_FDS passes {fds}")]
    Names {
        /// Names given.
        names: usize,
        /// Descriptors passed.
        fds: usize,
    },
    /// A passed descriptor is not open.
    #[error("descriptor {fd} passed by the service manager (LISTEN_FDS): {source}")]
    Closed {
        /// Its number.
        fd: RawFd,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A descriptor stored under [`LISTENER_FDNAME`] is not a listening TCP socket.
    #[error(
        "descriptor {fd} passed by the service manager as {LISTENER_FDNAME:?} is not a listening TCP socket ({what}); if the unit's store holds something else, empty it with `systemctl clean --what=fdstore UNIT`"
    )]
    NotListener {
        /// Its number.
        fd: RawFd,
        /// What it is instead.
        what: String,
    },
}

/// The passed descriptors `LISTEN_PID`, `LISTEN_FDS` and `LISTEN_FDNAMES` describe for the
/// process `me`, with their names: none when `LISTEN_PID` is unset or names another process
/// (the variables were meant for a parent), as sd_listen_fds(3) reads them.
pub fn described(
    listen_pid: Option<&str>,
    listen_fds: Option<&str>,
    fd_names: Option<&str>,
    me: u32,
) -> Result<Vec<(RawFd, String)>, FdStoreError> {
    let Some(pid) = listen_pid else {
        return Ok(Vec::new());
    };
    match pid.parse::<u32>() {
        Ok(pid) if pid > 0 && pid != me => return Ok(Vec::new()),
        Ok(pid) if pid > 0 => {}
        _ => return Err(FdStoreError::Pid(pid.to_owned())),
    }
    let n = match listen_fds.map(str::parse::<usize>) {
        None => return Ok(Vec::new()),
        Some(Ok(n)) if n <= MAX_PASSED => n,
        Some(_) => return Err(FdStoreError::Count(listen_fds.unwrap_or("").to_owned())),
    };
    let names: Vec<String> = match fd_names {
        // Unnamed descriptors are "unknown" (sd_listen_fds_with_names(3)).
        None => vec!["unknown".to_owned(); n],
        Some(names) if n == 0 && names.is_empty() => Vec::new(),
        Some(names) => names.split(':').map(str::to_owned).collect(),
    };
    if names.len() != n {
        return Err(FdStoreError::Names {
            names: names.len(),
            fds: n,
        });
    }
    // `n` is at most MAX_PASSED, so the numbers fit.
    Ok((FIRST_FD..).zip(names).collect())
}

/// Takes the proxy listener's sockets the service manager passed to this process (see the
/// module documentation). To be called once, early: the descriptors become this process's.
pub fn take_passed() -> Result<Vec<TcpListener>, FdStoreError> {
    let var = |name| std::env::var(name).ok();
    let passed = described(
        var("LISTEN_PID").as_deref(),
        var("LISTEN_FDS").as_deref(),
        var("LISTEN_FDNAMES").as_deref(),
        std::process::id(),
    )?;
    let mut listeners = Vec::new();
    for (fd, name) in passed {
        let owned =
            sys::fds::adopt_passed(fd).map_err(|source| FdStoreError::Closed { fd, source })?;
        if name != LISTENER_FDNAME {
            warn!(
                fd,
                name,
                "closing a descriptor the service manager passed under a name this daemon does not use"
            );
            continue;
        }
        listeners.push(listener(Socket::from(owned))?);
    }
    if !listeners.is_empty() {
        info!(
            sockets = listeners.len(),
            "the service manager passed the proxy listener's sockets back"
        );
    }
    Ok(listeners)
}

/// `socket` as a listening TCP socket (IPv4 or IPv6), or why not.
fn listener(socket: Socket) -> Result<TcpListener, FdStoreError> {
    let fd = socket.as_raw_fd();
    let not = |what: String| FdStoreError::NotListener { fd, what };
    let domain = socket
        .domain()
        .map_err(|err| not(format!("not a socket: {err}")))?;
    if domain != Domain::IPV4 && domain != Domain::IPV6 {
        return Err(not(format!("a socket of domain {domain:?}")));
    }
    let kind = socket.r#type().map_err(|err| not(err.to_string()))?;
    let protocol = socket.protocol().map_err(|err| not(err.to_string()))?;
    if kind != Type::STREAM || protocol != Some(Protocol::TCP) {
        let protocol = protocol.map_or_else(|| "none".to_owned(), |p| format!("{p:?}"));
        return Err(not(format!(
            "a socket of type {kind:?}, protocol {protocol}"
        )));
    }
    if !socket.is_listener().map_err(|err| not(err.to_string()))? {
        return Err(not("a TCP socket that does not listen".to_owned()));
    }
    socket
        .set_nonblocking(true)
        .map_err(|err| not(err.to_string()))?;
    Ok(socket.into())
}

#[cfg(test)]
mod tests {
    use std::os::fd::OwnedFd;

    use super::{FdStoreError, LISTENER_FDNAME, Socket, described, listener};

    #[test]
    fn the_variables_describe_descriptors_from_3_for_this_process_only() {
        let me = 4242;
        assert_eq!(
            described(Some("4242"), Some("2"), Some("proxy-listener:other"), me).unwrap(),
            [(3, LISTENER_FDNAME.to_owned()), (4, "other".to_owned())]
        );
        // Unnamed descriptors are "unknown".
        assert_eq!(
            described(Some("4242"), Some("1"), None, me).unwrap(),
            [(3, "unknown".to_owned())]
        );
        // Meant for another process, or not there at all: nothing passed.
        for (pid, fds) in [
            (Some("17"), Some("2")),
            (None, Some("2")),
            (Some("4242"), None),
        ] {
            assert!(
                described(pid, fds, None, me).unwrap().is_empty(),
                "{pid:?} {fds:?}"
            );
        }
        assert!(
            described(Some("4242"), Some("0"), Some(""), me)
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn malformed_variables_are_refused_with_what_is_wrong() {
        let me = 4242;
        for pid in ["0", "-1", "pid", ""] {
            let err = described(Some(pid), Some("1"), None, me).unwrap_err();
            assert!(matches!(err, FdStoreError::Pid(_)), "{pid}: {err}");
        }
        for count in ["-1", "two", "", "4097", "99999999999999999999"] {
            let err = described(Some("4242"), Some(count), None, me).unwrap_err();
            assert!(matches!(err, FdStoreError::Count(_)), "{count}: {err}");
            assert!(err.to_string().contains("LISTEN_FDS"), "{err}");
        }
        let err = described(Some("4242"), Some("2"), Some("proxy-listener"), me).unwrap_err();
        assert_eq!(
            err.to_string(),
            "LISTEN_FDNAMES names 1 descriptors, but LISTEN_FDS passes 2"
        );
    }

    #[test]
    fn only_a_listening_tcp_socket_is_taken() {
        let bound = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = bound.local_addr().unwrap();
        let taken = listener(Socket::from(OwnedFd::from(bound))).expect("a listener");
        assert_eq!(taken.local_addr().unwrap(), addr);

        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let unbound = Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        let unix = std::os::unix::net::UnixListener::bind(
            std::env::temp_dir().join(format!("proxy-fdstore-{}", std::process::id())),
        )
        .unwrap();
        let file = std::fs::File::open("/dev/null").unwrap();
        let cases: [(OwnedFd, &str); 4] = [
            (
                udp.into(),
                "a socket of type SOCK_DGRAM, protocol IPPROTO_UDP",
            ),
            (unbound.into(), "a TCP socket that does not listen"),
            (unix.into(), "a socket of domain"),
            (file.into(), "not a socket"),
        ];
        for (fd, what) in cases {
            let err = listener(Socket::from(fd)).unwrap_err();
            let text = err.to_string();
            assert!(matches!(err, FdStoreError::NotListener { .. }), "{text}");
            assert!(text.contains(what), "{what}: {text}");
            assert!(text.contains("systemctl clean --what=fdstore"), "{text}");
        }
        let _ = std::fs::remove_file(
            std::env::temp_dir().join(format!("proxy-fdstore-{}", std::process::id())),
        );
    }
}
