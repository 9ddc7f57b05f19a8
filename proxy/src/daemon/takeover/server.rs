//! The running daemon's side of a takeover: its takeover socket, the handshake with a new
//! daemon, and the hand-over itself.

use std::{
    io,
    os::{
        fd::{AsFd as _, OwnedFd},
        unix::fs::{DirBuilderExt as _, FileTypeExt as _, MetadataExt as _, PermissionsExt as _},
    },
    path::{Path, PathBuf},
    time::Duration,
};

use proxy_core::config::Config;
use proxy_relay::{Handover, ProxyHandle};
use socket2::{Domain, SockAddr, Socket, Type};
use tokio::{io::unix::AsyncFd, sync::mpsc, task::JoinHandle};
use tracing::{error, info, warn};

use super::{
    MAX_PACKET, Msg, RUNTIME_DIR, SERVING_TIMEOUT, STEP_TIMEOUT, TakeoverError, VERSION,
    check_peer, decode, encode, socket_path, unexpected,
};
use crate::{daemon::SharedDataplane, socket_file::SocketFile, sys};

/// The running daemon's takeover socket: answers one attempt at a time and yields the one a
/// new daemon committed to. Dropping it closes the socket and removes its file.
pub struct Server {
    task: Option<JoinHandle<()>>,
    committed: mpsc::Receiver<Committed>,
    _file: Option<SocketFile>,
}

/// A takeover the new daemon committed to.
pub struct Committed {
    conn: AsyncFd<Socket>,
}

/// What this daemon offers: its pin directory and its listening sockets.
struct Offer {
    pin_dir: PathBuf,
    sockets: Option<Handover>,
}

impl Server {
    /// Listens on the instance's takeover socket. A failure is logged, and the daemon runs on
    /// without (a `--takeover` start then starts normally and finds the instance busy).
    pub fn start(config: &Config, proxy: Option<&ProxyHandle>) -> Self {
        let (tx, committed) = mpsc::channel(1);
        let offer = Offer {
            pin_dir: Path::new(&config.bpffs).join(&config.instance),
            sockets: proxy.map(ProxyHandle::handover),
        };
        let path = socket_path(Path::new(&config.bpffs), &config.instance);
        match listen(&path) {
            Ok((listener, file)) => Self {
                task: Some(tokio::spawn(serve(listener, path, offer, tx))),
                committed,
                _file: Some(file),
            },
            Err(err) => {
                warn!(%err, "no takeover socket: `proxy run --takeover` cannot take over from this daemon");
                Self {
                    task: None,
                    committed,
                    _file: None,
                }
            }
        }
    }

    /// Resolves when a new daemon committed to a takeover (never without a takeover socket).
    pub async fn committed(&mut self) -> Committed {
        match self.committed.recv().await {
            Some(committed) => committed,
            None => std::future::pending().await,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Hands the instance over to the daemon that committed: stops this one's parts that write
/// the data path, releases it (links and lock; the pins stay), says `released`, keeps
/// accepting until the new daemon serves (bounded), then drains the proxy path without
/// withdrawing the kernel's redirect target (the same sockets listen in the new daemon). The
/// caller has stopped its admin interface and its publishers; `server` goes first, so the new
/// daemon can create its own takeover socket.
pub async fn hand_over(
    committed: Committed,
    server: Server,
    proxy: Option<ProxyHandle>,
    dp: &SharedDataplane,
) -> anyhow::Result<()> {
    drop(server);
    // Taking the data path out of the shared slot waits for a publish in progress; publishers
    // and readers find nothing from now on.
    if let Some(dataplane) = crate::daemon::state::take(dp) {
        dataplane.hand_over();
    }
    let conn = committed.conn;
    if let Err(err) = send(&conn, &Msg::Released, &[]).await {
        error!(%err, "telling the new daemon that the instance is released failed");
    }
    let outcome = tokio::time::timeout(SERVING_TIMEOUT, recv(&conn, "serving")).await;
    let failed = match outcome {
        Ok(Ok((Msg::Serving, _))) => {
            info!("the new daemon serves; draining the proxy path");
            None
        }
        Ok(Ok((other, _))) => Some(unexpected("serving", &other).to_string()),
        Ok(Err(err)) => Some(err.to_string()),
        Err(_) => {
            warn!(
                "the new daemon did not say it serves within {SERVING_TIMEOUT:?}; draining anyway"
            );
            None
        }
    };
    if let Some(why) = &failed {
        error!(%why, "the new daemon failed after the takeover; draining, the data path stays pinned for the next start");
    }
    if let Some(proxy) = proxy {
        let outcome = proxy.shutdown().await;
        info!(?outcome, "proxy path drained after the takeover");
    }
    match failed {
        None => Ok(()),
        Some(why) => Err(anyhow::anyhow!(
            "the daemon that took over failed before it served ({why}); the data path stays pinned for the next start"
        )),
    }
}

/// Answers attempts one at a time until one commits.
async fn serve(
    listener: AsyncFd<Socket>,
    path: PathBuf,
    offer: Offer,
    tx: mpsc::Sender<Committed>,
) {
    loop {
        let accepted = match listener.readable().await {
            Ok(mut ready) => match ready.try_io(|l| l.get_ref().accept()) {
                Ok(accepted) => accepted,
                Err(_would_block) => continue,
            },
            Err(err) => {
                warn!(%err, "waiting on the takeover socket failed; takeover disabled");
                return;
            }
        };
        let conn = match accepted.and_then(|(conn, _)| {
            conn.set_nonblocking(true)?;
            sys::register_async(conn)
        }) {
            Ok(conn) => conn,
            Err(err) => {
                warn!(%err, "accepting on the takeover socket failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        match handshake(&conn, &path, &offer).await {
            Ok(()) => {
                info!("a new daemon committed to take over; handing over");
                let _ = tx.send(Committed { conn }).await;
                return;
            }
            Err(err) => {
                warn!(%err, "a takeover attempt ended without a takeover; this daemon serves on");
            }
        }
    }
}

/// Hello, offer and sockets, then the new daemon's commit (`Ok`) or anything else (`Err`).
async fn handshake(
    conn: &AsyncFd<Socket>,
    path: &Path,
    offer: &Offer,
) -> Result<(), TakeoverError> {
    check_peer(conn.get_ref().as_fd(), path, None)?;
    let step = |expected| async move {
        tokio::time::timeout(STEP_TIMEOUT, recv(conn, expected))
            .await
            .unwrap_or_else(|_| {
                Err(TakeoverError::Io {
                    what: "timed out waiting on",
                    path: path.to_owned(),
                    source: io::ErrorKind::TimedOut.into(),
                })
            })
    };
    match step("hello").await? {
        (Msg::Hello { version: VERSION }, _) => {}
        (other, _) => {
            let reason = format!("this daemon speaks takeover version {VERSION}");
            let _ = send(conn, &Msg::Refuse { reason }, &[]).await;
            return Err(unexpected("hello", &other));
        }
    }
    let sockets = match &offer.sockets {
        Some(handover) => handover.sockets().map_err(|source| TakeoverError::Io {
            what: "duplicating the listening sockets for",
            path: path.to_owned(),
            source,
        })?,
        None => Vec::new(),
    };
    let hello = Msg::Offer {
        version: VERSION,
        pid: std::process::id(),
        pin_dir: offer.pin_dir.clone(),
        listeners: sockets.len() as u32,
    };
    send(conn, &hello, &[]).await?;
    for chunk in sockets.chunks(sys::MAX_FDS_PER_MESSAGE) {
        let fds: Vec<_> = chunk.iter().map(|s| s.as_fd()).collect();
        let msg = Msg::Fds {
            count: fds.len() as u32,
        };
        send(conn, &msg, &fds).await?;
    }
    // This process's duplicates close here; the new daemon holds its own.
    drop(sockets);
    match step("commit").await? {
        (Msg::Commit, _) => Ok(()),
        (other, _) => Err(unexpected("commit", &other)),
    }
}

async fn send(
    conn: &AsyncFd<Socket>,
    msg: &Msg,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> Result<(), TakeoverError> {
    let packet = encode(msg);
    let result = loop {
        let mut ready = match conn.writable().await {
            Ok(ready) => ready,
            Err(err) => break Err(err),
        };
        match ready.try_io(|c| sys::send_with_fds(c.get_ref().as_fd(), &packet, fds)) {
            Ok(sent) => break sent.map(drop),
            Err(_would_block) => {}
        }
    };
    result.map_err(|source| TakeoverError::Io {
        what: "sending on",
        path: PathBuf::from(RUNTIME_DIR),
        source,
    })
}

async fn recv(
    conn: &AsyncFd<Socket>,
    expected: &'static str,
) -> Result<(Msg, Vec<OwnedFd>), TakeoverError> {
    let mut buf = vec![0u8; MAX_PACKET];
    let received = loop {
        let mut ready = match conn.readable().await {
            Ok(ready) => ready,
            Err(err) => break Err(err),
        };
        match ready.try_io(|c| sys::recv_with_fds(c.get_ref().as_fd(), &mut buf)) {
            Ok(received) => break received,
            Err(_would_block) => {}
        }
    };
    let (n, fds) = received.map_err(|source| TakeoverError::Io {
        what: "receiving on",
        path: PathBuf::from(RUNTIME_DIR),
        source,
    })?;
    decode(&buf[..n], fds, expected)
}

/// Binds the takeover socket at `path`: the runtime directory is created 0700 (an existing one
/// must be this user's and writable by nobody else), a stale socket file is replaced (this
/// daemon holds the instance's lock: no other daemon of the instance listens there), the file
/// is made 0600 before `listen(2)`.
fn listen(path: &Path) -> Result<(AsyncFd<Socket>, SocketFile), TakeoverError> {
    let io = |what: &'static str, at: &Path| {
        let path = at.to_owned();
        move |source| TakeoverError::Io { what, path, source }
    };
    let dir = path.parent().unwrap_or(Path::new(RUNTIME_DIR));
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {}
        Err(err) => return Err(io("creating the runtime directory", dir)(err)),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(io("reading", dir))?;
    if !meta.is_dir() || meta.uid() != sys::effective_uid() || meta.mode() & 0o022 != 0 {
        return Err(io("checking the runtime directory", dir)(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "not a directory of this user's that only it can write",
        )));
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            std::fs::remove_file(path).map_err(io("removing the stale", path))?;
        }
        Ok(_) => {
            return Err(io("replacing", path)(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "exists and is not a socket",
            )));
        }
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => return Err(io("reading", path)(err)),
    }
    let socket = Socket::new(Domain::UNIX, Type::SEQPACKET.nonblocking().cloexec(), None)
        .map_err(io("creating a socket for", path))?;
    socket
        .bind(&SockAddr::unix(path).map_err(io("naming", path))?)
        .map_err(io("binding", path))?;
    let file = SocketFile::bound(path, "takeover").map_err(io("reading back", path))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(io("setting mode 0600 on", path))?;
    socket.listen(4).map_err(io("listening on", path))?;
    let listener = sys::register_async(socket).map_err(io("listening on", path))?;
    info!(socket = %path.display(), "takeover socket ready");
    Ok((listener, file))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connected pair: the daemon's end registered with tokio, the other end blocking.
    fn pair() -> (AsyncFd<Socket>, Socket) {
        let (ours, theirs) = Socket::pair(Domain::UNIX, Type::SEQPACKET, None).expect("pair");
        ours.set_nonblocking(true).expect("nonblocking");
        (sys::register_async(ours).expect("register"), theirs)
    }

    fn offer() -> Offer {
        Offer {
            pin_dir: PathBuf::from("/sys/fs/bpf/t"),
            sockets: None,
        }
    }

    fn send_raw(s: &Socket, bytes: &[u8]) {
        sys::send_with_fds(s.as_fd(), bytes, &[]).expect("send");
    }

    fn recv_msg(s: &Socket) -> Msg {
        let mut buf = [0u8; MAX_PACKET];
        let (n, _) = sys::recv_with_fds(s.as_fd(), &mut buf).expect("recv");
        decode(&buf[..n], Vec::new(), "any").expect("a message").0
    }

    #[tokio::test]
    async fn a_full_handshake_ends_in_a_commit() {
        let (ours, theirs) = pair();
        let peer = std::thread::spawn(move || {
            send_raw(&theirs, &encode(&Msg::Hello { version: VERSION }));
            let offer = recv_msg(&theirs);
            send_raw(&theirs, &encode(&Msg::Commit));
            offer
        });
        handshake(&ours, Path::new("t"), &offer())
            .await
            .expect("committed");
        let offered = peer.join().expect("peer");
        assert!(
            matches!(offered, Msg::Offer { listeners: 0, ref pin_dir, .. } if pin_dir == Path::new("/sys/fs/bpf/t")),
            "{offered:?}"
        );
    }

    #[tokio::test]
    async fn garbage_another_version_and_a_refusal_end_the_attempt() {
        for first in [
            b"\x00\x01garbage".to_vec(),
            br#"{"msg":"hello","version":1,"pid":3}"#.to_vec(),
            encode(&Msg::Commit),
        ] {
            let (ours, theirs) = pair();
            send_raw(&theirs, &first);
            let err = handshake(&ours, Path::new("t"), &offer())
                .await
                .expect_err("refused");
            assert!(matches!(err, TakeoverError::Unexpected { .. }), "{err}");
        }
        let (ours, theirs) = pair();
        send_raw(&theirs, &encode(&Msg::Hello { version: 2 }));
        let err = handshake(&ours, Path::new("t"), &offer()).await;
        assert!(err.is_err());
        assert!(
            matches!(recv_msg(&theirs), Msg::Refuse { .. }),
            "the other side learns why"
        );
        let (ours, theirs) = pair();
        let peer = std::thread::spawn(move || {
            send_raw(&theirs, &encode(&Msg::Hello { version: VERSION }));
            let _ = recv_msg(&theirs);
            let reason = "listeners differ".to_owned();
            send_raw(&theirs, &encode(&Msg::Refuse { reason }));
        });
        let err = handshake(&ours, Path::new("t"), &offer()).await;
        peer.join().expect("peer");
        assert!(matches!(err, Err(TakeoverError::Refused { .. })), "{err:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_or_vanished_peer_ends_the_attempt() {
        let (ours, _theirs) = pair();
        let err = handshake(&ours, Path::new("t"), &offer()).await;
        assert!(
            matches!(err, Err(TakeoverError::Io { what, .. }) if what.contains("timed out")),
            "{err:?}"
        );
        let (ours, theirs) = pair();
        drop(theirs);
        let err = handshake(&ours, Path::new("t"), &offer()).await;
        assert!(matches!(err, Err(TakeoverError::Closed { .. })), "{err:?}");
    }
}
