//! systemd's service notification protocol (sd_notify(3)), for `Type=notify` units: `READY=1`
//! once every service is published (when `/ready` turns 200), `STATUS=` lines a person reads in
//! `systemctl status`, `RELOADING=1`/`READY=1` around a reload, `STOPPING=1` on the way out, and
//! `WATCHDOG=1` from the daemon's main loop at half of `WatchdogSec=` so that a wedged loop gets
//! the daemon restarted.
//!
//! The socket is connected once, at the start, while the daemon is still root: after the drop
//! to the steady-state user and the seccomp filter, a send on the connected socket is all it
//! takes. Without `NOTIFY_SOCKET` every call does nothing. A send that fails is logged once and
//! otherwise ignored: a notification is advice to the service manager, never a reason to stop.
//!
//! The manager's file-descriptor store (`crate::fd_store`) goes through here too: the proxy
//! listener's sockets passed back at the start ([`Notifier::take_passed`]) and stored again
//! once the proxy listens ([`Notifier::store_listeners`]).

use std::{
    net::TcpListener,
    os::{
        fd::AsFd as _,
        unix::net::{SocketAddr, UnixDatagram},
    },
    sync::{
        Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use thiserror::Error;
use tracing::{debug, warn};

/// Where notifications go, and how often the watchdog wants to hear from the daemon.
#[derive(Debug, Default)]
pub struct Notifier {
    socket: Option<UnixDatagram>,
    watchdog: Option<Duration>,
    warned: AtomicBool,
    /// How many descriptors the manager's store keeps (`FDSTORE`); `None`: it offers none.
    store_max: Option<usize>,
    /// The proxy listener's sockets the manager passed back at the start, until taken.
    passed: Mutex<Vec<TcpListener>>,
    /// Whether the proxy listener's sockets are in the manager's store now.
    stored: AtomicBool,
}

/// Why `NOTIFY_SOCKET` or `WATCHDOG_USEC` cannot be used.
#[derive(Debug, Error)]
pub enum NotifyError {
    /// `NOTIFY_SOCKET` is neither an absolute path nor an abstract name (`@name`).
    #[error("NOTIFY_SOCKET {0:?} is neither an absolute path nor an abstract socket name (@name)")]
    Address(String),
    /// The socket could not be created or connected.
    #[error("connecting to the service manager's NOTIFY_SOCKET {path:?}: {source}")]
    Connect {
        /// The variable's value.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `WATCHDOG_USEC` is not a positive number of microseconds.
    #[error("WATCHDOG_USEC {0:?} is not a positive number of microseconds")]
    Watchdog(String),
}

impl Notifier {
    /// The notifier the environment asks for: `NOTIFY_SOCKET` (unset: none), and
    /// `WATCHDOG_USEC` when `WATCHDOG_PID` is unset or names this process.
    pub fn from_env() -> Result<Self, NotifyError> {
        let var = |name| std::env::var(name).ok().filter(|v| !v.is_empty());
        let Some(path) = var("NOTIFY_SOCKET") else {
            return Ok(Self::default());
        };
        let addr = address(&path)?;
        let socket = UnixDatagram::unbound()
            .and_then(|s| s.connect_addr(&addr).map(|()| s))
            .map_err(|source| NotifyError::Connect {
                path: path.clone(),
                source,
            })?;
        let for_us = var("WATCHDOG_PID").is_none_or(|pid| pid == std::process::id().to_string());
        let watchdog = match var("WATCHDOG_USEC").filter(|_| for_us) {
            None => None,
            Some(usec) => Some(watchdog(&usec)?),
        };
        // A store the daemon cannot size is not used; the notifications still go.
        let store_max = var("FDSTORE").and_then(|max| {
            let parsed = max.parse::<usize>().ok();
            if parsed.is_none() {
                warn!(
                    FDSTORE = max,
                    "FDSTORE is not a number of descriptors: the proxy listener is not stored"
                );
            }
            parsed
        });
        Ok(Self {
            socket: Some(socket),
            watchdog,
            store_max: store_max.filter(|max| *max > 0),
            ..Self::default()
        })
    }

    /// This notifier, holding `passed` (the proxy listener's sockets the manager passed back,
    /// [`crate::fd_store::take_passed`]) until the proxy path takes them.
    #[must_use]
    pub fn with_passed(self, passed: Vec<TcpListener>) -> Self {
        Self {
            passed: Mutex::new(passed),
            ..self
        }
    }

    /// The proxy listener's sockets the manager passed back (taken once; empty without).
    pub fn take_passed(&self) -> Vec<TcpListener> {
        std::mem::take(&mut *self.passed.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Puts the proxy listener's `sockets` in the manager's file-descriptor store, in place of
    /// what it held under that name (all of it, when `sockets` is empty), when it offers one
    /// that is large enough. Whether they are there now: then the listener outlives this
    /// daemon, and its stop leaves the kernel redirecting to it ([`Notifier::keeps_listeners`]).
    pub fn store_listeners(&self, sockets: &[TcpListener]) -> bool {
        let (Some(socket), Some(max)) = (&self.socket, self.store_max) else {
            return false;
        };
        let name = crate::fd_store::LISTENER_FDNAME;
        self.send(&format!("FDSTOREREMOVE=1\nFDNAME={name}"));
        self.stored.store(false, Ordering::Relaxed);
        if sockets.is_empty() {
            return false;
        }
        if sockets.len() > max {
            warn!(
                sockets = sockets.len(),
                max,
                "the service manager's file-descriptor store (FileDescriptorStoreMax=) is too small for the proxy listener's sockets; a restart refuses HTTP-routed proxy-mode connects meanwhile"
            );
            return false;
        }
        let message = format!("FDSTORE=1\nFDNAME={name}");
        for chunk in sockets.chunks(crate::sys::MAX_FDS_PER_MESSAGE) {
            let fds: Vec<_> = chunk.iter().map(|s| s.as_fd()).collect();
            if let Err(err) = crate::sys::send_with_fds(socket.as_fd(), message.as_bytes(), &fds) {
                warn!(%err, "storing the proxy listener with the service manager failed; a restart refuses HTTP-routed proxy-mode connects meanwhile");
                self.send(&format!("FDSTOREREMOVE=1\nFDNAME={name}"));
                return false;
            }
        }
        debug!(
            sockets = sockets.len(),
            "proxy listener stored with the service manager"
        );
        self.stored.store(true, Ordering::Relaxed);
        true
    }

    /// Whether the manager keeps the proxy listener's sockets open beyond this daemon.
    pub fn keeps_listeners(&self) -> bool {
        self.stored.load(Ordering::Relaxed)
    }

    /// How often to send `WATCHDOG=1`: half of the manager's interval (sd_watchdog_enabled(3)'s
    /// advice), if it asked for one.
    pub fn watchdog_period(&self) -> Option<Duration> {
        self.watchdog.map(|interval| interval / 2)
    }

    /// Every service is published: the manager may start what comes `After=` this unit.
    pub fn ready(&self, status: &str) {
        self.send(&format!("READY=1\nSTATUS={status}"));
    }

    /// A line for `systemctl status`.
    pub fn status(&self, status: &str) {
        self.send(&format!("STATUS={status}"));
    }

    /// A reload starts; [`Notifier::ready`] ends it.
    pub fn reloading(&self) {
        let monotonic = monotonic_usec();
        self.send(&format!(
            "RELOADING=1\nMONOTONIC_USEC={monotonic}\nSTATUS=reloading the configuration"
        ));
    }

    /// The daemon is on its way out.
    pub fn stopping(&self, status: &str) {
        self.send(&format!("STOPPING=1\nSTATUS={status}"));
    }

    /// The main loop is alive.
    pub fn watchdog(&self) {
        if self.watchdog.is_some() {
            self.send("WATCHDOG=1");
        }
    }

    fn send(&self, message: &str) {
        let Some(socket) = &self.socket else {
            return;
        };
        match socket.send(message.as_bytes()) {
            Ok(_) => debug!(message, "service manager notified"),
            Err(err) if !self.warned.swap(true, Ordering::Relaxed) => {
                warn!(%err, "cannot notify the service manager (NOTIFY_SOCKET); further failures are not logged");
            }
            Err(_) => {}
        }
    }
}

/// `NOTIFY_SOCKET`'s address: an absolute path, or `@name` for an abstract socket.
fn address(path: &str) -> Result<SocketAddr, NotifyError> {
    use std::os::linux::net::SocketAddrExt as _;
    let invalid = || NotifyError::Address(path.to_owned());
    if let Some(name) = path.strip_prefix('@') {
        SocketAddr::from_abstract_name(name.as_bytes()).map_err(|_| invalid())
    } else if path.starts_with('/') {
        SocketAddr::from_pathname(path).map_err(|_| invalid())
    } else {
        Err(invalid())
    }
}

fn watchdog(usec: &str) -> Result<Duration, NotifyError> {
    match usec.parse::<u64>() {
        Ok(usec) if usec > 0 => Ok(Duration::from_micros(usec)),
        _ => Err(NotifyError::Watchdog(usec.to_owned())),
    }
}

/// CLOCK_MONOTONIC in microseconds, as `RELOADING=1` wants it beside.
fn monotonic_usec() -> u128 {
    crate::sys::monotonic_now().as_micros()
}

/// `WATCHDOG=1` at half of the manager's `WatchdogSec=`, sent by the daemon's main loop itself:
/// while it waits for a change and while it applies one. A loop (or its thread) that wedges stops the
/// pings, and the manager restarts the daemon.
pub struct Watchdog<'a> {
    notifier: &'a Notifier,
    interval: Option<tokio::time::Interval>,
}

impl<'a> Watchdog<'a> {
    pub fn new(notifier: &'a Notifier) -> Self {
        let interval = notifier.watchdog_period().map(|period| {
            let mut interval = tokio::time::interval(period);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            interval
        });
        Self { notifier, interval }
    }

    /// Whom it notifies.
    pub fn notifier(&self) -> &'a Notifier {
        self.notifier
    }

    /// Waits for the next ping and sends it; never, without a watchdog.
    pub async fn tick(&mut self) {
        match &mut self.interval {
            Some(interval) => {
                interval.tick().await;
                self.notifier.watchdog();
            }
            None => std::future::pending().await,
        }
    }

    /// Runs `work` to its end, pinging meanwhile.
    pub async fn during<F: std::future::Future>(&mut self, work: F) -> F::Output {
        tokio::pin!(work);
        loop {
            tokio::select! {
                output = &mut work => return output,
                () = self.tick() => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::linux::net::SocketAddrExt as _;

    use super::{Notifier, NotifyError, address, watchdog};

    #[test]
    fn the_address_is_a_path_or_an_abstract_name() {
        assert_eq!(
            address("/run/systemd/notify")
                .expect("a path")
                .as_pathname()
                .and_then(|p| p.to_str()),
            Some("/run/systemd/notify")
        );
        assert_eq!(
            address("@sd-notify-42")
                .expect("abstract")
                .as_abstract_name(),
            Some(&b"sd-notify-42"[..])
        );
        for bad in ["relative/notify", "", "notify"] {
            let err = address(bad).expect_err(bad);
            assert!(matches!(err, NotifyError::Address(_)), "{bad}: {err}");
            assert!(
                err.to_string().contains("neither an absolute path"),
                "{err}"
            );
        }
    }

    #[test]
    fn the_watchdog_interval_is_positive_microseconds_and_pinged_at_half() {
        assert_eq!(
            watchdog("30000000").expect("30 s"),
            std::time::Duration::from_secs(30)
        );
        for bad in ["0", "-1", "30s", ""] {
            assert!(
                matches!(watchdog(bad), Err(NotifyError::Watchdog(_))),
                "{bad}"
            );
        }
        let notifier = Notifier {
            watchdog: Some(std::time::Duration::from_secs(30)),
            ..Notifier::default()
        };
        assert_eq!(
            notifier.watchdog_period(),
            Some(std::time::Duration::from_secs(15))
        );
    }

    #[test]
    fn messages_reach_the_socket_as_the_protocol_spells_them() {
        let dir = std::env::temp_dir().join(format!("proxy-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let path = dir.join("notify");
        let manager = std::os::unix::net::UnixDatagram::bind(&path).expect("binds");
        let socket = std::os::unix::net::UnixDatagram::unbound().expect("socket");
        socket.connect(&path).expect("connects");
        let notifier = Notifier {
            socket: Some(socket),
            watchdog: Some(std::time::Duration::from_secs(2)),
            ..Notifier::default()
        };
        notifier.status("publishing 3 services");
        notifier.ready("serving 3 services");
        notifier.watchdog();
        notifier.stopping("stopping: draining the proxy path");
        let mut got = Vec::new();
        let mut buf = [0u8; 512];
        for _ in 0..4 {
            let n = manager.recv(&mut buf).expect("a message");
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        assert_eq!(
            got,
            [
                "STATUS=publishing 3 services",
                "READY=1\nSTATUS=serving 3 services",
                "WATCHDOG=1",
                "STOPPING=1\nSTATUS=stopping: draining the proxy path",
            ]
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_listener_goes_into_the_store_only_when_it_fits() {
        use std::os::fd::AsFd as _;
        let dir = std::env::temp_dir().join(format!("proxy-fdstore-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let path = dir.join("notify");
        let manager = std::os::unix::net::UnixDatagram::bind(&path).expect("binds");
        manager
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .expect("timeout");
        let socket = std::os::unix::net::UnixDatagram::unbound().expect("socket");
        socket.connect(&path).expect("connects");
        let listeners: Vec<_> = (0..2)
            .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind"))
            .collect();
        let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let notifier = Notifier {
            socket: Some(socket),
            store_max: Some(2),
            ..Notifier::default()
        };
        let receive = || {
            let mut buf = [0u8; 512];
            let (n, fds) = crate::sys::recv_with_fds(manager.as_fd(), &mut buf).expect("a message");
            (String::from_utf8_lossy(&buf[..n]).into_owned(), fds)
        };
        assert!(notifier.store_listeners(&listeners));
        assert!(notifier.keeps_listeners());
        let (removed, none) = receive();
        assert_eq!(removed, "FDSTOREREMOVE=1\nFDNAME=proxy-listener");
        assert!(none.is_empty());
        let (stored, fds) = receive();
        assert_eq!(stored, "FDSTORE=1\nFDNAME=proxy-listener");
        let got: Vec<_> = fds
            .into_iter()
            .map(|fd| std::net::TcpListener::from(fd).local_addr().unwrap())
            .collect();
        assert_eq!(got, addrs);
        // Three sockets in a store of two: none is stored, and the store is emptied.
        let three: Vec<_> = listeners
            .iter()
            .chain(&listeners[..1])
            .map(|l| l.try_clone().unwrap())
            .collect();
        assert!(!notifier.store_listeners(&three));
        assert!(!notifier.keeps_listeners());
        assert_eq!(receive().0, "FDSTOREREMOVE=1\nFDNAME=proxy-listener");
        // No store offered (no FDSTORE): nothing is sent.
        let without = Notifier {
            store_max: None,
            ..notifier
        };
        assert!(!without.store_listeners(&listeners));
        manager.set_nonblocking(true).expect("nonblocking");
        assert!(manager.recv(&mut [0u8; 64]).is_err(), "nothing sent");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn without_a_socket_nothing_is_sent_and_nothing_fails() {
        let notifier = Notifier::default();
        notifier.ready("serving");
        notifier.watchdog();
        assert_eq!(notifier.watchdog_period(), None);
    }
}
