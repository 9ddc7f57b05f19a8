//! Publishing: one task per service that turns the routing of the clusters it reads into its
//! kernel entry whenever one changes, the sweep of what a previous run left once every service
//! was published, and the reaper of retired generations.

use std::{collections::BTreeSet, time::Duration};

use proxy_common::service::ServiceKey;
use proxy_core::{health::Routing, kernel::ServiceTemplate};
use tokio::sync::watch;
use tracing::{error, warn};

use super::{
    ending::Ender,
    state::{PublishedTx, SharedDataplane},
};
use crate::dataplane;

/// How long start-up waits for every service's first publish before it removes what a previous
/// run left behind; a service whose cluster is still resolving is published when it is ready.
pub(super) const FIRST_PUBLISH_WAIT: Duration = Duration::from_secs(10);

/// Waits until every service was published once (bounded), then removes services, tables and
/// backends a previous run left that this configuration does not have (its services are
/// `keys`), and the pins an earlier version of the daemon left (`proxy_common::abi::RETIRED`).
/// Until then, an adopted previous state keeps serving, and a rollback to the earlier version
/// would still find its maps.
pub(super) async fn sweep_after_first_publish(
    keys: &[ServiceKey],
    dp: &SharedDataplane,
    mut published: watch::Receiver<BTreeSet<ServiceKey>>,
) {
    // Checked after every first publish: keys found in are not looked up again. Looking every
    // key up each time is quadratic in services, and ran on the workers the publishers need.
    let mut found = 0;
    let all_in = |set: &BTreeSet<ServiceKey>| {
        while keys.get(found).is_some_and(|k| set.contains(k)) {
            found += 1;
        }
        found == keys.len()
    };
    let waited = tokio::time::timeout(FIRST_PUBLISH_WAIT, published.wait_for(all_in)).await;
    if waited.is_err() {
        warn!("not every service was published within {FIRST_PUBLISH_WAIT:?}; sweeping anyway");
    }
    let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(dp) = guard.as_mut() {
        if let Err(err) = dp.publisher().sweep(keys) {
            warn!(%err, "sweeping state of a previous run failed");
        }
        dp.remove_retired_pins();
    }
}

/// One cluster a service's kernel entry reads.
pub(super) struct ClusterInput {
    pub(super) name: String,
    pub(super) routing: watch::Receiver<Routing>,
}

/// Publishes one service whenever the routing of a cluster it reads changes (the publisher
/// itself skips writes when the kernel already has exactly this).
/// Until `warm` (the service's clusters' `initialized`) all hold, an adopted previous state (or
/// nothing) is better than an empty host set; after `FIRST_PUBLISH_WAIT`, it publishes what
/// there is.
/// A service that ends its hosts' kernel-path sockets (`close_connections_on_host_health_failure`)
/// does so after each publish, and a `drain` after a host's removal ([`Ender`]).
pub(super) async fn publish_loop(
    template: ServiceTemplate,
    mut inputs: Vec<ClusterInput>,
    mut warm: Vec<watch::Receiver<bool>>,
    (dp, published): (SharedDataplane, PublishedTx),
    drain: Duration,
) {
    let all_initialized = async {
        for initialized in &mut warm {
            let _ = initialized.wait_for(|i| *i).await;
        }
    };
    if tokio::time::timeout(FIRST_PUBLISH_WAIT, all_initialized)
        .await
        .is_err()
    {
        warn!(service = %template.name, "clusters not initialized within {FIRST_PUBLISH_WAIT:?}; publishing what they have");
    }
    let mut first = true;
    let mut ender = Ender::new(&template, drain);
    loop {
        let mut routings: Vec<_> = inputs.iter().map(|i| i.routing.borrow().clone()).collect();
        let spec = {
            let clusters: Vec<(&str, &Routing)> = inputs
                .iter()
                .zip(&routings)
                .map(|(i, r)| (i.name.as_str(), r))
                .collect();
            template.spec(&clusters)
        };
        let result = {
            let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match guard.as_mut() {
                Some(dp) => dp.publisher().publish(&spec).map(Some),
                None => return,
            }
        };
        match result {
            Ok(_) => {
                if let Some(ender) = &mut ender {
                    let names = inputs.iter().map(|i| i.name.clone());
                    let routings = std::mem::take(&mut routings);
                    ender.published(&template, &spec, names.zip(routings).collect(), &dp);
                }
                if first {
                    first = false;
                    published.send_modify(|set| {
                        set.insert(spec.key);
                    });
                }
            }
            Err(err) => {
                warn!(service = %spec.name, %err, "publish failed; the previous host set stays live");
            }
        }
        // Not kept while waiting: the routing copies (every host of the service's clusters) and
        // the spec are made again at the next change.
        drop((spec, routings));
        loop {
            let due = async {
                match &ender {
                    Some(ender) => ender.due().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                changed = any_changed(&template.name, &mut inputs) => {
                    if !changed {
                        return;
                    }
                    break;
                }
                () = due => {
                    if let Some(ender) = &mut ender {
                        ender.fire(&template.name, &dp);
                    }
                }
            }
        }
        // Coalesce a burst of changes into one publish: what changed meanwhile is read now.
        for input in &mut inputs {
            input.routing.borrow_and_update();
        }
    }
}

/// Waits on every input's own routing receiver until one changes; false once every input's
/// cluster is gone (at once when there is none).
///
/// A cluster stops only after the publishers that read it (a change that stops a cluster
/// republishes or removes every service reading it first), so a cluster that stops under a
/// running publisher of `service` is a fault: logged as an error, as the service's kernel entry
/// then keeps that cluster's last hosts while the others are followed.
async fn any_changed(service: &str, inputs: &mut [ClusterInput]) -> bool {
    let names: Vec<String> = inputs.iter().map(|input| input.name.clone()).collect();
    let mut waits: Vec<_> = inputs
        .iter_mut()
        .map(|input| Some(Box::pin(input.routing.changed())))
        .collect();
    std::future::poll_fn(|cx| {
        let mut open = false;
        for (slot, cluster) in waits.iter_mut().zip(&names) {
            let Some(wait) = slot else { continue };
            match wait.as_mut().poll(cx) {
                std::task::Poll::Ready(Ok(())) => return std::task::Poll::Ready(true),
                // That cluster stopped; a finished future must not be polled again.
                std::task::Poll::Ready(Err(_)) => {
                    error!(service, cluster, "a cluster stopped under the service's running publisher; the kernel keeps its last hosts for it");
                    *slot = None;
                }
                std::task::Poll::Pending => open = true,
            }
        }
        if open {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(false)
        }
    })
    .await
}

/// Refuses to start (or reload) when a direct-mode service asks for what the kernel's programs
/// cannot do: ROUND_ROBIN where the kernel refused the programs that rotate (before 5.12), or a
/// hash key whose helper the kernel lacks. Said at start, not at the service's first publish.
/// Host ending that the kernel cannot do (before 6.5) is only warned about: the option also
/// configures the proxy path.
pub(super) fn check_kernel_support(
    templates: &[ServiceTemplate],
    dp: &SharedDataplane,
) -> anyhow::Result<()> {
    let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(dp) = guard.as_mut() else {
        return Ok(());
    };
    for t in templates {
        dp.publisher().check_hash_key(&t.name, t.flags)?;
    }
    if let Some(t) = templates.iter().find(|t| t.ends_hosts())
        && let Some(why) = dp.host_ending_unavailable()
    {
        warn!(service = %t.name, why, "close_connections_on_host_health_failure: this kernel cannot end kernel-path sockets; they stay open when their host leaves");
    }
    if dp.round_robin() {
        return Ok(());
    }
    if let Some(t) = templates.iter().find(|t| t.rotates()) {
        return Err(dataplane::DataplaneError::NoRoundRobin {
            service: t.name.clone(),
        }
        .into());
    }
    Ok(())
}

/// Frees retired generations whose grace period passed, once a second. Publishing frees them
/// too, but the generations the last publishes of a burst retired (a reload's, say) would
/// otherwise wait for the next publish.
pub(super) async fn reap(dp: SharedDataplane) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let mut guard = dp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match guard.as_mut() {
            Some(dp) => dp.publisher().reap(false),
            None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn any_changed_wakes_on_any_input_and_ends_with_them() {
        let input = |name: &str| {
            let (tx, routing) = watch::channel(Routing::default());
            let name = name.to_owned();
            (tx, ClusterInput { name, routing })
        };
        assert!(
            !any_changed("s", &mut []).await,
            "no input: nothing to wait for"
        );
        let (a_tx, a) = input("a");
        let (b_tx, b) = input("b");
        let mut inputs = vec![a, b];
        b_tx.send_replace(Routing::default());
        assert!(any_changed("s", &mut inputs).await, "b changed");
        inputs[1].routing.borrow_and_update();
        drop(a_tx);
        b_tx.send_replace(Routing::default());
        assert!(
            any_changed("s", &mut inputs).await,
            "b still runs after a stopped"
        );
        inputs[1].routing.borrow_and_update();
        drop(b_tx);
        assert!(
            !any_changed("s", &mut inputs).await,
            "every cluster stopped"
        );
    }
}
