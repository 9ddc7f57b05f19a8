//! The dynamic sources' overlays as the run loop receives them: one watch channel per source,
//! the newest overlay winning (a burst of pushes is applied once, as its last state).

use proxy_core::desired::{Feed, Overlay, Source};
use tokio::sync::watch;

/// The sending ends, handed to the sources when they start (and again when a reload restarts
/// one). They live as long as the run, so a receiver never sees its channel closed.
#[derive(Clone)]
pub struct Feeds {
    /// LDS, RDS and CDS resources from the xDS server.
    pub xds: Feed,
    /// Consul's config entries.
    pub consul_entries: Feed,
}

/// The receiving ends, owned by the run loop.
pub(super) struct Sources {
    xds: watch::Receiver<Overlay>,
    consul_entries: watch::Receiver<Overlay>,
}

/// A channel per source, with nothing published yet.
pub(super) fn channels() -> (Feeds, Sources) {
    let (xds, xds_rx) = watch::channel(Overlay::default());
    let (consul_entries, consul_rx) = watch::channel(Overlay::default());
    (
        Feeds {
            xds,
            consul_entries,
        },
        Sources {
            xds: xds_rx,
            consul_entries: consul_rx,
        },
    )
}

impl Sources {
    /// The next source whose overlay changed, with its newest overlay. Pending for ever when
    /// no source publishes.
    pub(super) async fn changed(&mut self) -> (Source, Overlay) {
        let source = tokio::select! {
            Ok(()) = self.xds.changed() => Source::Xds,
            Ok(()) = self.consul_entries.changed() => Source::ConsulEntries,
            else => std::future::pending().await,
        };
        let overlay = match source {
            Source::Xds => self.xds.borrow_and_update().clone(),
            _ => self.consul_entries.borrow_and_update().clone(),
        };
        (source, overlay)
    }
}
