//! What the parts of the running daemon share: the data path's slot, the configuration in force,
//! the record of published services, the panic record, and a service's kernel key.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use proxy_common::service::ServiceKey;
use proxy_core::{
    config::{Config, Service},
    upstream::Upstream,
};
use tokio::sync::watch;

use crate::dataplane::Dataplane;

/// The data path, shared by the publishers and the admin interface; `None` after shutdown.
pub type SharedDataplane = Arc<Mutex<Option<Dataplane>>>;

/// The configuration in force and its running clusters, as the admin interface and the passive
/// feed read them; a reload replaces both.
#[derive(Clone)]
pub struct Live {
    pub config: Arc<Config>,
    pub upstreams: BTreeMap<String, Arc<Upstream>>,
}

/// The keys of the services published at least once (under any configuration of this run).
pub(super) type PublishedTx = watch::Sender<BTreeSet<ServiceKey>>;

/// The error `run` returns after a part of the daemon failed: the data path stays pinned.
#[derive(Debug, thiserror::Error)]
#[error("a part of the daemon failed ({0}); the data path stays pinned for the next start")]
pub(super) struct Failed(pub(super) String);

/// Any panic, on any thread or task of the daemon (an engine thread, a cluster's loop, a
/// publisher): a bug, after which part of the daemon no longer runs while the rest would report
/// ready. The panic hook records it; the daemon then takes `/ready` down, logs what panicked
/// and exits non-zero, leaving the kernel's data path pinned with the last published state (as
/// after `kill -9`), which the next start adopts.
#[derive(Clone)]
pub struct Fatal(watch::Receiver<Option<String>>);

impl Fatal {
    /// Installs the process's panic hook (it runs the default one, which prints the panic,
    /// first). `run` does this; call it once per process.
    pub fn install() -> Self {
        let (tx, rx) = watch::channel(None);
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            default(info);
            let thread = std::thread::current();
            let what = format!(
                "thread {} panicked: {info}",
                thread.name().unwrap_or("unnamed")
            );
            tx.send_if_modified(|first| {
                // The first panic is the cause; later ones follow from it.
                first.is_none().then(|| *first = Some(what)).is_some()
            });
        }));
        Self(rx)
    }

    /// What panicked, once something did.
    pub fn cause(&self) -> Option<String> {
        self.0.borrow().clone()
    }

    /// Resolves with what panicked.
    pub(super) async fn wait(mut self) -> String {
        loop {
            if let Some(what) = self.cause() {
                return what;
            }
            if self.0.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}

/// Takes the data path out of the shared slot (publishers and the admin find `None` from now
/// on).
pub(super) fn take(dp: &SharedDataplane) -> Option<Dataplane> {
    dp.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take()
}

/// The stop: the data path stays attached and pinned ([`Dataplane::release`]).
pub(super) fn release(dp: &SharedDataplane) {
    if let Some(dp) = take(dp) {
        dp.release();
    }
}

/// A failed start ([`Dataplane::abandon`]).
pub(super) fn abandon(dp: &SharedDataplane) {
    if let Some(dp) = take(dp) {
        dp.abandon();
    }
}

pub use proxy_core::kernel::service_key;

/// A service's address as `ip:port`, for tables.
pub fn service_addr(svc: &Service) -> SocketAddr {
    SocketAddr::new(svc.address, svc.port)
}
