//! Takeover (`proxy run --takeover`): a new daemon replaces a running one of the same instance
//! without a refused connect on the proxy path, in the manner of Envoy's hot restart.
//!
//! Every running daemon listens on a unix socket, `/run/proxy/<instance>-<pin hash>.takeover`
//! (mode 0600 in a directory of mode 0700, both the daemon's user's; the peer's uid is checked
//! with `SO_PEERCRED` on both ends: this daemon's, root's, or the directory owner's), named
//! after its pin directory (the place its instance lock is taken), so two daemons of one
//! instance name on two bpffs mounts never share one. The new
//! daemon, before it takes the instance's lock, asks (a daemon of an earlier version listens on
//! `/run/proxy/<instance>.takeover`, which is asked when the first is not there; its offer names
//! its pin directory, which must be the new one's):
//!
//! ```text
//! new                                   old (serving, keeps accepting throughout)
//!  hello {version}            ->
//!                             <-  offer {pin_dir, listeners: n}, then fds {count} packets
//!                                 carrying the n listening sockets (SCM_RIGHTS)
//!  checks: same pin directory, the sockets' addresses are its proxy.listeners
//!  refuse {reason}            ->  (mismatch: the new one exits 1, the old one changes nothing)
//!  commit                     ->  stops its admin interface, publishers and kernel-counter
//!                                 readers; closes its links and its lock (the pins stay)
//!                             <-  released
//!  takes the lock, adopts the pins (a normal start), starts its proxy path on the sockets it
//!  was given (the kernel's redirect target is the same sockets: nothing to change there)
//!  serving                    ->  stops accepting, drains its connections (shutdown_timeout),
//!                                 exits 0
//! ```
//!
//! Until `commit` the old daemon has changed nothing. It keeps accepting until `serving`, so a
//! connect is taken by whichever process accepts first and none is refused; once it stops, the
//! sockets live on in the new process, so no connection queued on them is reset. If the new
//! one fails after `commit`, the old one drains and exits 1, leaving the data path pinned as a
//! SIGTERM does (the next start adopts it).
//!
//! Messages are JSON objects, one per `SOCK_SEQPACKET` packet of at most [`MAX_PACKET`] bytes;
//! every step has a deadline, and anything unexpected ends the attempt (the old daemon serves
//! on and listens for the next).

mod client;
mod server;

use std::{
    io,
    net::SocketAddr,
    os::fd::OwnedFd,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Serialize};

pub use self::{
    client::{Inherited, open_dataplane, request},
    server::{Committed, Server, hand_over},
};
use crate::sys;

/// Where the takeover sockets live.
pub const RUNTIME_DIR: &str = "/run/proxy";
/// The protocol's version; a daemon speaking another one is refused.
const VERSION: u32 = 1;
/// The largest packet either side sends or accepts.
const MAX_PACKET: usize = 4096;
/// At most this many listening sockets are handed over (engine threads x listener addresses).
const MAX_LISTENERS: usize = 4096;
/// How long each step of the handshake may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the old daemon may take to stop its parts and release the instance.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the old daemon keeps accepting while the new one starts (adopting the data path,
/// first discovery results); then it drains anyway.
const SERVING_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the new daemon tries the instance's lock after the old one released it.
const LOCK_RETRY: Duration = Duration::from_secs(2);

/// One message of the handshake.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case", deny_unknown_fields)]
enum Msg {
    /// New to old: the first message.
    Hello { version: u32 },
    /// Old to new: what follows.
    Offer {
        version: u32,
        /// The old daemon's process id, for the logs.
        pid: u32,
        /// Its instance's pin directory.
        pin_dir: PathBuf,
        /// How many listening sockets the `fds` packets carry.
        listeners: u32,
    },
    /// Old to new: a packet carrying `count` listening sockets.
    Fds { count: u32 },
    /// Either way: the attempt ends here, and why.
    Refuse { reason: String },
    /// New to old: go ahead.
    Commit,
    /// Old to new: the instance's lock is free, nothing of the old daemon writes the data path.
    Released,
    /// New to old: the new daemon's proxy path accepts; stop accepting and drain.
    Serving,
}

/// Why a takeover failed.
#[derive(Debug, thiserror::Error)]
pub enum TakeoverError {
    /// A system call on the takeover socket failed.
    #[error("{what} ({}): {source}", path.display())]
    Io {
        /// The step that failed.
        what: &'static str,
        /// The takeover socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The other side is not of this daemon's user.
    #[error(
        "the process at the other end of {} runs as uid {uid}, not as this daemon's: refused",
        path.display()
    )]
    Peer {
        /// The takeover socket.
        path: PathBuf,
        /// The peer's uid.
        uid: u32,
    },
    /// The other side sent something the step does not expect.
    #[error("expected {expected} on the takeover socket, got {got}")]
    Unexpected {
        /// The message the step waits for.
        expected: &'static str,
        /// What came instead.
        got: String,
    },
    /// The other side closed the connection.
    #[error("the other daemon closed the takeover connection while waiting for {expected}")]
    Closed {
        /// The message the step waited for.
        expected: &'static str,
    },
    /// The other side ended the attempt.
    #[error("the other daemon refused the takeover: {reason}")]
    Refused {
        /// Its reason.
        reason: String,
    },
    /// The running daemon's listeners are not the ones this configuration has.
    #[error(
        "the running daemon listens on {running:?} and this configuration on {configured:?} (proxy.listeners): a takeover keeps the listening sockets, so their addresses cannot change; change them with a plain restart instead"
    )]
    Listeners {
        /// The running daemon's listener addresses.
        running: Vec<SocketAddr>,
        /// This configuration's.
        configured: Vec<SocketAddr>,
    },
    /// The running daemon's instance lives elsewhere.
    #[error(
        "the running daemon's pin directory is {} and this configuration's is {} (bpffs): a takeover cannot move the instance",
        running.display(),
        configured.display()
    )]
    PinDir {
        /// The running daemon's pin directory.
        running: PathBuf,
        /// This configuration's.
        configured: PathBuf,
    },
}

impl TakeoverError {
    /// Whether the configuration is why (the listeners or the pin directory differ): the
    /// daemon exits 64 then, as for a configuration that does not validate.
    pub fn is_config(&self) -> bool {
        matches!(self, Self::Listeners { .. } | Self::PinDir { .. })
    }
}

/// The takeover socket of the instance pinned under `bpffs`/`instance`: its name carries a hash
/// of that pin directory, the place of the instance's lock, so that the same instance name on
/// another bpffs has a socket of its own.
pub fn socket_path(bpffs: &Path, instance: &str) -> PathBuf {
    let pin_dir = bpffs.join(instance);
    let hash = fnv1a(pin_dir.as_os_str().as_encoded_bytes());
    Path::new(RUNTIME_DIR).join(format!("{instance}-{hash:016x}.takeover"))
}

/// Where a daemon of an earlier version, which named the socket after the instance alone,
/// listens.
fn legacy_socket_path(instance: &str) -> PathBuf {
    Path::new(RUNTIME_DIR).join(format!("{instance}.takeover"))
}

/// FNV-1a, 64 bits: stable across versions and builds (a socket name must not change with
/// the standard library's hasher).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Removes the takeover socket files of the instance at `bpffs`/`instance` (and one an earlier
/// version left under the instance's name) if no process accepts on them (a daemon killed
/// before it could remove its own), so that `proxy uninstall` leaves nothing of the instance
/// behind; whether it removed one. Only a refused connect proves a socket stale: one a live
/// daemon serves stays.
pub fn remove_stale_socket(bpffs: &Path, instance: &str) -> bool {
    let current = remove_stale(&socket_path(bpffs, instance));
    remove_stale(&legacy_socket_path(instance)) || current
}

fn remove_stale(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt as _;
    let is_socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
    if !is_socket {
        return false;
    }
    let refused = socket2::Socket::new(
        socket2::Domain::UNIX,
        socket2::Type::SEQPACKET.cloexec(),
        None,
    )
    .and_then(|s| s.connect(&socket2::SockAddr::unix(path)?))
    .is_err_and(|e| e.kind() == io::ErrorKind::ConnectionRefused);
    refused && std::fs::remove_file(path).is_ok()
}

/// Accepts the peer at the other end of `path` if it runs as this daemon's uid, root, the
/// owner of the runtime directory, or `user` (the uid this daemon's configuration runs as once
/// attached: a new daemon, still root, takes over from the old one running as that user, even
/// where the service manager handed the runtime directory back to root at this start, as
/// systemd's `RuntimeDirectory=` does).
fn check_peer(
    fd: std::os::fd::BorrowedFd<'_>,
    path: &Path,
    user: Option<u32>,
) -> Result<(), TakeoverError> {
    let uid = sys::peer_uid(fd).map_err(|source| TakeoverError::Io {
        what: "reading the peer's credentials on",
        path: path.to_owned(),
        source,
    })?;
    // Root, or the owner of the runtime directory (a daemon's steady-state user, `user`), on
    // either side: a daemon of one user may take over from a daemon started as root that runs
    // as that user now, and the other way round.
    let dir_owner = path
        .parent()
        .and_then(|d| std::fs::symlink_metadata(d).ok())
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m));
    if uid == sys::effective_uid() || uid == 0 || Some(uid) == dir_owner || Some(uid) == user {
        Ok(())
    } else {
        Err(TakeoverError::Peer {
            path: path.to_owned(),
            uid,
        })
    }
}

fn unexpected(expected: &'static str, got: &Msg) -> TakeoverError {
    match got {
        Msg::Refuse { reason } => TakeoverError::Refused {
            reason: reason.clone(),
        },
        other => TakeoverError::Unexpected {
            expected,
            got: format!("{other:?}"),
        },
    }
}

fn encode(msg: &Msg) -> Vec<u8> {
    // A message of this enum always serialises.
    serde_json::to_vec(msg).unwrap_or_default()
}

/// One packet: a message, or why it is not one (`expected` names the step for the error).
fn decode(
    packet: &[u8],
    fds: Vec<OwnedFd>,
    expected: &'static str,
) -> Result<(Msg, Vec<OwnedFd>), TakeoverError> {
    if packet.is_empty() {
        return Err(TakeoverError::Closed { expected });
    }
    match serde_json::from_slice(packet) {
        Ok(msg) => Ok((msg, fds)),
        Err(err) => Err(TakeoverError::Unexpected {
            expected,
            got: format!("{} bytes that are not a message ({err})", packet.len()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_is_refused() {
        for msg in [
            Msg::Hello { version: 1 },
            Msg::Offer {
                version: 1,
                pid: 7,
                pin_dir: PathBuf::from("/sys/fs/bpf/proxy"),
                listeners: 2,
            },
            Msg::Fds { count: 2 },
            Msg::Refuse {
                reason: "no".to_owned(),
            },
            Msg::Commit,
            Msg::Released,
            Msg::Serving,
        ] {
            let (back, _) = decode(&encode(&msg), Vec::new(), "any").expect("decodes");
            assert_eq!(back, msg);
        }
        for garbage in [
            &b"{"[..],
            b"\xff\xfe",
            br#"{"msg":"hello"}"#,
            br#"{"msg":"hello","version":1,"extra":2}"#,
            br#"{"msg":"launch"}"#,
            b"null",
        ] {
            let err = decode(garbage, Vec::new(), "hello").expect_err("refused");
            assert!(matches!(err, TakeoverError::Unexpected { .. }), "{err}");
        }
        assert!(matches!(
            decode(b"", Vec::new(), "hello"),
            Err(TakeoverError::Closed { .. })
        ));
    }

    #[test]
    fn a_refusal_is_reported_as_such() {
        let err = unexpected(
            "offer",
            &Msg::Refuse {
                reason: "busy".to_owned(),
            },
        );
        assert!(matches!(err, TakeoverError::Refused { .. }), "{err}");
    }

    #[test]
    fn the_socket_is_named_after_the_pin_directory() {
        let a = socket_path(Path::new("/sys/fs/bpf"), "proxy");
        let b = socket_path(Path::new("/run/bpf-b"), "proxy");
        assert_ne!(a, b, "one instance name on two bpffs mounts");
        assert_eq!(a, socket_path(Path::new("/sys/fs/bpf"), "proxy"), "stable");
        // FNV-1a of "/sys/fs/bpf/proxy": the name must not change between versions.
        assert_eq!(
            a,
            Path::new(RUNTIME_DIR).join(format!(
                "proxy-{:016x}.takeover",
                fnv1a(b"/sys/fs/bpf/proxy")
            ))
        );
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        // The longest instance name still fits sun_path (107 bytes).
        let longest = socket_path(Path::new("/sys/fs/bpf"), &"i".repeat(64));
        assert!(longest.as_os_str().len() <= 107, "{}", longest.display());
    }
}
