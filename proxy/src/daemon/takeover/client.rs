//! The new daemon's side of a takeover: synchronous, on the main thread, before the runtime
//! starts and before the instance's lock is taken.

use std::{
    io,
    net::SocketAddr,
    os::fd::{AsFd as _, OwnedFd},
    path::{Path, PathBuf},
    time::Duration,
};

use proxy_core::config::Config;
use socket2::{Domain, SockAddr, Socket, Type};
use tracing::{info, warn};

use super::{
    LOCK_RETRY, MAX_LISTENERS, MAX_PACKET, Msg, RELEASE_TIMEOUT, STEP_TIMEOUT, TakeoverError,
    VERSION, check_peer, decode, encode, legacy_socket_path, socket_path, unexpected,
};
use crate::{
    dataplane::{Dataplane, DataplaneError, DataplaneOptions},
    sys,
};

/// What the new daemon took over: the old one's listening sockets, and the connection on
/// which it says when it serves. Dropping it without [`Inherited::serving`] tells the old
/// daemon that this one failed.
pub struct Inherited {
    listeners: Vec<std::net::TcpListener>,
    conn: Socket,
    path: PathBuf,
}

impl Inherited {
    /// The listening sockets (taken once).
    pub fn take_listeners(&mut self) -> Vec<std::net::TcpListener> {
        std::mem::take(&mut self.listeners)
    }

    /// Tells the old daemon that this one accepts on the sockets now: it stops accepting and
    /// drains.
    pub fn serving(self) {
        match send_blocking(&self.conn, &self.path, &Msg::Serving, &[]) {
            Ok(()) => {
                info!("takeover complete: the previous daemon drains its connections and exits");
            }
            Err(err) => {
                warn!(%err, "telling the previous daemon that this one serves failed; it drains anyway");
            }
        }
    }
}

/// With `takeover`, asks the daemon running `config`'s instance to hand over (see the module
/// documentation): `Ok(None)` when none runs (the start is a normal one), an error when the
/// takeover was refused (nothing changed) or failed.
pub fn request(config: &Config, takeover: bool) -> Result<Option<Inherited>, TakeoverError> {
    if !takeover {
        return Ok(None);
    }
    let current = socket_path(Path::new(&config.bpffs), &config.instance);
    // A daemon of an earlier version listens under the instance's name alone; its offer names
    // its pin directory, which `receive_offer` checks against this configuration's.
    let Some((conn, path)) = connect_any(&[current.clone(), legacy_socket_path(&config.instance)])?
    else {
        info!(socket = %current.display(), "--takeover: no daemon of this instance to take over from; starting normally");
        return Ok(None);
    };
    let io = |what| {
        let path = path.clone();
        move |source| TakeoverError::Io { what, path, source }
    };
    check_peer(
        conn.as_fd(),
        &path,
        crate::privileges::configured_uid(config),
    )?;
    conn.set_write_timeout(Some(STEP_TIMEOUT))
        .map_err(io("setting a timeout on"))?;
    conn.set_read_timeout(Some(STEP_TIMEOUT))
        .map_err(io("setting a timeout on"))?;
    send_blocking(&conn, &path, &Msg::Hello { version: VERSION }, &[])?;
    let (pid, listeners) = receive_offer(&conn, &path, config)?;
    info!(pid, listeners = ?addresses(&listeners), "the running daemon offers its listeners; taking over");
    send_blocking(&conn, &path, &Msg::Commit, &[])?;
    conn.set_read_timeout(Some(RELEASE_TIMEOUT))
        .map_err(io("setting a timeout on"))?;
    match recv_blocking(&conn, &path, "released")? {
        (Msg::Released, _) => {}
        (other, _) => return Err(unexpected("released", &other)),
    }
    Ok(Some(Inherited {
        listeners,
        conn,
        path,
    }))
}

/// A connection to the first of `paths` a daemon accepts on, with its path; `None` when none
/// does (missing, or a stale file).
fn connect_any(paths: &[PathBuf]) -> Result<Option<(Socket, PathBuf)>, TakeoverError> {
    for path in paths {
        let io = |what| {
            let path = path.clone();
            move |source| TakeoverError::Io { what, path, source }
        };
        let conn = Socket::new(Domain::UNIX, Type::SEQPACKET.cloexec(), None)
            .map_err(io("creating a socket for"))?;
        let addr = SockAddr::unix(path).map_err(io("naming"))?;
        match conn.connect(&addr) {
            Ok(()) => return Ok(Some((conn, path.clone()))),
            Err(err)
                if matches!(
                    err.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                ) => {}
            Err(err) => return Err(io("connecting to")(err)),
        }
    }
    Ok(None)
}

/// Reads the offer and its sockets and checks them against `config`; a mismatch is answered
/// with `refuse` (the old daemon serves on) and returned.
fn receive_offer(
    conn: &Socket,
    path: &Path,
    config: &Config,
) -> Result<(u32, Vec<std::net::TcpListener>), TakeoverError> {
    let (pid, pin_dir, count) = match recv_blocking(conn, path, "offer")? {
        (
            Msg::Offer {
                version: VERSION,
                pid,
                pin_dir,
                listeners,
            },
            _,
        ) if listeners as usize <= MAX_LISTENERS => (pid, pin_dir, listeners as usize),
        (other, _) => return Err(unexpected("offer", &other)),
    };
    let mut fds: Vec<OwnedFd> = Vec::new();
    while fds.len() < count {
        match recv_blocking(conn, path, "fds")? {
            (Msg::Fds { count: n }, got) if n as usize == got.len() && !got.is_empty() => {
                fds.extend(got);
            }
            (other, _) => return Err(unexpected("fds", &other)),
        }
    }
    if fds.len() != count {
        return Err(TakeoverError::Unexpected {
            expected: "fds",
            got: format!("{} sockets for an offer of {count}", fds.len()),
        });
    }
    let listeners: Vec<std::net::TcpListener> = fds.into_iter().map(Into::into).collect();
    let configured_pins = Path::new(&config.bpffs).join(&config.instance);
    let checked = if pin_dir == configured_pins {
        check_listeners(&configured_listeners(config), &addresses(&listeners))
    } else {
        Err(TakeoverError::PinDir {
            running: pin_dir,
            configured: configured_pins,
        })
    };
    if let Err(err) = checked {
        let refuse = Msg::Refuse {
            reason: err.to_string(),
        };
        if let Err(send) = send_blocking(conn, path, &refuse, &[]) {
            warn!(%send, "telling the running daemon why the takeover is refused failed");
        }
        return Err(err);
    }
    Ok((pid, listeners))
}

/// The proxy listener addresses `config` binds (none without a proxy path).
fn configured_listeners(config: &Config) -> Vec<SocketAddr> {
    if config.declares_proxy() {
        config.effective_proxy().listeners
    } else {
        Vec::new()
    }
}

/// The distinct bound addresses of `sockets`, sorted (an unreadable one counts as `0.0.0.0:0`,
/// which no configuration matches).
fn addresses(sockets: &[std::net::TcpListener]) -> Vec<SocketAddr> {
    let mut addrs: Vec<SocketAddr> = sockets
        .iter()
        .map(|s| {
            s.local_addr()
                .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)))
        })
        .collect();
    addrs.sort_unstable();
    addrs.dedup();
    addrs
}

/// Whether the running daemon's listener addresses (`running`, distinct) are exactly the
/// configured ones (a configured port 0 takes any port of its address).
fn check_listeners(configured: &[SocketAddr], running: &[SocketAddr]) -> Result<(), TakeoverError> {
    let mut left: Vec<SocketAddr> = running.to_vec();
    let mut matched = true;
    for want in configured {
        match left
            .iter()
            .position(|a| a == want || (want.port() == 0 && a.ip() == want.ip()))
        {
            Some(i) => {
                left.swap_remove(i);
            }
            None => matched = false,
        }
    }
    if matched && left.is_empty() {
        Ok(())
    } else {
        Err(TakeoverError::Listeners {
            running: running.to_vec(),
            configured: configured.to_vec(),
        })
    }
}

/// Opens the data path after a takeover: the old daemon closed its lock before it said
/// `released`, so a busy instance here is only a moment's race; it is tried for
/// [`LOCK_RETRY`].
pub fn open_dataplane(
    opts: &DataplaneOptions,
    inherited: bool,
) -> Result<Dataplane, DataplaneError> {
    let deadline = std::time::Instant::now() + LOCK_RETRY;
    loop {
        match Dataplane::open(opts) {
            Err(DataplaneError::InstanceBusy { .. })
                if inherited && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            result => return result,
        }
    }
}

fn send_blocking(
    conn: &Socket,
    path: &Path,
    msg: &Msg,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> Result<(), TakeoverError> {
    sys::send_with_fds(conn.as_fd(), &encode(msg), fds)
        .map(drop)
        .map_err(|source| TakeoverError::Io {
            what: "sending on",
            path: path.to_owned(),
            source,
        })
}

fn recv_blocking(
    conn: &Socket,
    path: &Path,
    expected: &'static str,
) -> Result<(Msg, Vec<OwnedFd>), TakeoverError> {
    let mut buf = [0u8; MAX_PACKET];
    let (n, fds) =
        sys::recv_with_fds(conn.as_fd(), &mut buf).map_err(|source| TakeoverError::Io {
            what: if source.kind() == io::ErrorKind::WouldBlock {
                "timed out waiting on"
            } else {
                "receiving on"
            },
            path: path.to_owned(),
            source,
        })?;
    decode(&buf[..n], fds, expected)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(list: &[&str]) -> Vec<SocketAddr> {
        list.iter().map(|a| a.parse().unwrap()).collect()
    }

    #[test]
    fn listeners_must_be_the_configured_ones() {
        let both = addrs(&["127.0.0.1:15001", "[::1]:15001"]);
        assert!(check_listeners(&both, &addrs(&["[::1]:15001", "127.0.0.1:15001"])).is_ok());
        assert!(
            check_listeners(&[], &[]).is_ok(),
            "direct-only on both sides"
        );
        let port0 = addrs(&["127.0.0.1:0"]);
        assert!(check_listeners(&port0, &addrs(&["127.0.0.1:40000"])).is_ok());
        for running in [
            addrs(&["127.0.0.1:15002"]),
            addrs(&["127.0.0.1:15001"]),
            addrs(&["127.0.0.1:15001", "[::1]:15001", "127.0.0.2:15001"]),
            Vec::new(),
        ] {
            let err = check_listeners(&both, &running).expect_err("a mismatch");
            assert!(err.to_string().contains("plain restart"), "{err}");
        }
        assert!(check_listeners(&[], &addrs(&["127.0.0.1:15001"])).is_err());
    }
}
