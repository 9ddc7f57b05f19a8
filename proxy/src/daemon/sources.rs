//! The dynamic sources' overlays as the run loop receives them: one watch channel per source,
//! the newest overlay winning (a burst of pushes is applied once, as its last state).

use std::time::Duration;

use proxy_core::desired::{Feed, Overlay, Source};
use tokio::sync::watch;
use tracing::warn;

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
    /// The first overlay of each source in `expected`, as each comes, until all have or
    /// `bound` passed (the sources that did not answer are applied when they do).
    pub(super) async fn first(
        &mut self,
        expected: &[Source],
        bound: Duration,
    ) -> Vec<(Source, Overlay)> {
        let mut firsts = Vec::new();
        let deadline = tokio::time::Instant::now() + bound;
        let all_in = |firsts: &[(Source, Overlay)]| {
            expected
                .iter()
                .all(|e| firsts.iter().any(|(source, _)| source == e))
        };
        while !all_in(&firsts) {
            let next = tokio::time::timeout_at(deadline, self.changed()).await;
            let Ok((source, overlay)) = next else {
                let missing: Vec<String> = expected
                    .iter()
                    .filter(|s| !firsts.iter().any(|(f, _)| f == *s))
                    .map(ToString::to_string)
                    .collect();
                warn!(missing = %missing.join(", "), "no first answer within {bound:?}; starting without it, applied when it comes");
                break;
            };
            // A source not waited for is applied with the others all the same.
            firsts.retain(|(s, _)| *s != source);
            firsts.push((source, overlay));
        }
        firsts
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    fn named(cluster: &str) -> Overlay {
        let mut one = proxy_core::config::Config::embedded_default().clusters[0].clone();
        cluster.clone_into(&mut one.name);
        Overlay {
            clusters: vec![one].into(),
            ..Overlay::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_start_waits_for_each_expected_source_and_no_longer_than_the_bound() {
        let (feeds, mut sources) = channels();
        feeds.xds.send_replace(named("first"));
        feeds.xds.send_replace(named("second"));
        let firsts = sources.first(&[Source::Xds], Duration::from_secs(15)).await;
        let got: Vec<_> = firsts
            .iter()
            .map(|(s, o)| (*s, o.clusters[0].name.as_str()))
            .collect();
        // The newest state: a burst is applied once, as its last.
        assert_eq!(got, [(Source::Xds, "second")]);

        let started = tokio::time::Instant::now();
        let firsts = sources.first(&[Source::Xds], Duration::from_secs(15)).await;
        assert!(firsts.is_empty(), "nothing new was published");
        assert_eq!(started.elapsed(), Duration::from_secs(15));

        assert!(sources.first(&[], Duration::from_secs(15)).await.is_empty());
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(15),
            "nothing expected: no wait"
        );
    }
}
