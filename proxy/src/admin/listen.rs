//! The admin listeners: a TCP address, or a unix socket created with mode 0600 (the control
//! socket always is one; a missing directory of it is created with mode 0700, an existing one
//! must be the daemon's user's and writable by nobody else).
//!
//! The socket file is bound, set to 0600, and only then listened on: until `listen(2)` a
//! connect is refused, so there is no moment in which the wider mode that `bind(2)` leaves lets
//! anyone in. A stale socket file (a daemon killed before it could remove its own) is replaced;
//! anything else at the path is left alone and refused, and so is a socket another process
//! still serves.

use std::{
    io,
    os::unix::fs::{DirBuilderExt as _, FileTypeExt as _, MetadataExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
};

use proxy_core::config::AdminAddress;
use tokio::net::{TcpListener, UnixListener};

use crate::socket_file::SocketFile;

/// Mode of the unix socket file: read and write (connect) for its owner only.
const SOCKET_MODE: u32 = 0o600;
/// Mode of a control socket directory the daemon creates.
const DIR_MODE: u32 = 0o700;
/// Pending connections the unix socket queues.
const BACKLOG: i32 = 128;
/// Pending connections the TCP listener queues (the kernel caps it at `net.core.somaxconn`):
/// deep enough that a burst of connects from other users does not overflow it, which would
/// make the kernel drop the next SYN and delay a probe's connect by a second.
const TCP_BACKLOG: i32 = 4096;

/// Why the admin interface could not listen.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// `bind(2)`, `listen(2)` or `chmod(2)` failed.
    #[error("{what} {addr}: {source}")]
    Io {
        /// The step that failed.
        what: &'static str,
        /// The admin address.
        addr: AdminAddress,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Something that is not a socket is at the socket path.
    #[error(
        "{} exists and is not a socket; refusing to replace it (remove it, or choose another admin.address)",
        path.display()
    )]
    NotASocket {
        /// The socket path.
        path: PathBuf,
    },
    /// The control socket's directory could be replaced by another user: the socket in it
    /// could be swapped for theirs.
    #[error(
        "{} is not a directory of this user's that only it can write; refusing to put the admin control socket there (fix its owner and mode, or choose another admin.control_socket)",
        path.display()
    )]
    UnsafeDir {
        /// The directory.
        path: PathBuf,
    },
    /// A live process accepts connections on the socket path.
    #[error(
        "another process serves {} (a second daemon with the same admin.address?)",
        path.display()
    )]
    InUse {
        /// The socket path.
        path: PathBuf,
    },
}

/// A bound admin listener.
pub(super) enum Listener {
    Tcp(TcpListener),
    /// The listener and its file, removed when this is dropped.
    Unix {
        listener: UnixListener,
        _file: SocketFile,
    },
}

/// Binds `addr` (must be called inside a tokio runtime).
pub(super) async fn bind(addr: &AdminAddress) -> Result<Listener, ListenError> {
    let io = |what| {
        let addr = addr.clone();
        move |source| ListenError::Io { what, addr, source }
    };
    match addr {
        AdminAddress::Tcp(tcp) => Ok(Listener::Tcp(bind_tcp(*tcp, io)?)),
        AdminAddress::Unix(path) => {
            remove_stale(path).await?;
            let socket = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)
                .map_err(io("creating a socket for"))?;
            let sockaddr = socket2::SockAddr::unix(path).map_err(io("binding"))?;
            socket.bind(&sockaddr).map_err(io("binding"))?;
            // From here the file exists; a failure below must not leave it behind.
            let file = SocketFile::bound(path, "admin").map_err(io("reading back"))?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(SOCKET_MODE))
                .map_err(io("setting mode 0600 on"))?;
            socket.listen(BACKLOG).map_err(io("listening on"))?;
            socket.set_nonblocking(true).map_err(io("listening on"))?;
            let listener = UnixListener::from_std(std::os::unix::net::UnixListener::from(socket))
                .map_err(io("listening on"))?;
            Ok(Listener::Unix {
                listener,
                _file: file,
            })
        }
    }
}

/// Makes sure the control socket at `path` lands in a directory only this user can change:
/// a missing directory is created (one level, mode 0700).
pub(super) fn prepare_dir(path: &Path) -> Result<(), ListenError> {
    let Some(dir) = path.parent() else {
        return Ok(());
    };
    match std::fs::DirBuilder::new().mode(DIR_MODE).create(dir) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {}
        Err(source) => return Err(stale_io("creating the directory of", path, source)),
    }
    let meta = std::fs::metadata(dir)
        .map_err(|source| stale_io("reading the directory of", path, source))?;
    if !meta.is_dir() || meta.uid() != crate::sys::effective_uid() || meta.mode() & 0o022 != 0 {
        return Err(ListenError::UnsafeDir {
            path: dir.to_owned(),
        });
    }
    Ok(())
}

/// A TCP listener on `tcp` with a [`TCP_BACKLOG`] deep queue; `io` names a failed step.
fn bind_tcp<E>(
    tcp: std::net::SocketAddr,
    io: impl Fn(&'static str) -> E,
) -> Result<TcpListener, ListenError>
where
    E: FnOnce(io::Error) -> ListenError,
{
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(tcp),
        socket2::Type::STREAM,
        None,
    )
    .map_err(io("creating a socket for"))?;
    // As tokio's own bind does: a restarted daemon rebinds despite TIME_WAIT.
    socket.set_reuse_address(true).map_err(io("binding"))?;
    socket.bind(&tcp.into()).map_err(io("binding"))?;
    socket.listen(TCP_BACKLOG).map_err(io("listening on"))?;
    socket.set_nonblocking(true).map_err(io("listening on"))?;
    TcpListener::from_std(std::net::TcpListener::from(socket)).map_err(io("listening on"))
}

/// Removes a socket file that no process serves; refuses anything else at `path`.
async fn remove_stale(path: &Path) -> Result<(), ListenError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(stale_io("reading", path, source)),
    };
    if !meta.file_type().is_socket() {
        return Err(ListenError::NotASocket {
            path: path.to_owned(),
        });
    }
    // Only a refused connect proves that no process listens: a live listener whose queue is
    // full answers EAGAIN, and its socket must not be taken away.
    match tokio::net::UnixStream::connect(path).await {
        Ok(_) => {
            return Err(ListenError::InUse {
                path: path.to_owned(),
            });
        }
        Err(err) if err.kind() == io::ErrorKind::ConnectionRefused => {}
        Err(source) => return Err(stale_io("probing the existing socket", path, source)),
    }
    tracing::info!(path = %path.display(), "replacing a stale admin socket");
    std::fs::remove_file(path).map_err(|source| stale_io("removing the stale socket", path, source))
}

/// Removes the unix socket file at `path` if no process accepts on it (a daemon killed before
/// it could remove its own), so that `proxy uninstall` leaves nothing of the instance behind;
/// whether it did. Only a refused connect proves it stale.
pub fn remove_stale_socket(path: &Path) -> bool {
    let is_socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
    is_socket
        && std::os::unix::net::UnixStream::connect(path)
            .is_err_and(|e| e.kind() == io::ErrorKind::ConnectionRefused)
        && std::fs::remove_file(path).is_ok()
}

fn stale_io(what: &'static str, path: &Path, source: io::Error) -> ListenError {
    ListenError::Io {
        what,
        addr: AdminAddress::Unix(path.to_owned()),
        source,
    }
}
