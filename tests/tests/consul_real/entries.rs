//! Consul's config entries, watched live from a real Consul 1.8.7: each write, rewrite and
//! delete reaches the published overlay within one watch round trip, and an entry Consul
//! accepts but this daemon cannot use is skipped while the others apply.

use std::time::Instant;

use proxy_chain::{CompileRequest, ConfigEntry, Entries, compile};
use proxy_core::{
    desired::Overlay,
    discovery::consul::entries::{ConsulEntries, ConsulEntriesConfig, spawn_consul_entries},
};
use tokio::sync::watch;

use super::*;

/// Bound of one watch round trip, from a write's return to the overlay that holds it. When the
/// write returns, Consul has committed it and woken the kind's blocking query; the loop adds at
/// most `MIN_QUERY_INTERVAL` (50 ms) before that query, then one loopback HTTP exchange and the
/// decoding of a few entries. 1 s is that with room for a loaded test host, and 30 times less
/// than `wait` (30 s): a watch that missed the wake-up and waited for the next poll fails it.
const ROUND_TRIP: Duration = Duration::from_secs(1);

fn entries_config(consul: &Consul) -> ConsulEntriesConfig {
    let mut config = ConsulEntriesConfig {
        address: Some(consul.http_addr().to_string()),
        datacenter: Some(consul.datacenter().to_owned()),
        ..ConsulEntriesConfig::default()
    };
    config.retry_backoff.base_interval = Duration::from_millis(100);
    config.retry_backoff.max_interval = Duration::from_millis(500);
    config
}

/// An entry as the watch publishes it.
fn entry(value: &Value) -> ConfigEntry {
    let mut entry: ConfigEntry = serde_json::from_value(value.clone()).expect("an entry");
    entry.normalize();
    entry
}

/// Writes `value` (or deletes `kind`/`name` when `value` is `None`), then waits until the
/// overlay satisfies `wanted`; returns the time from the write's return to that overlay.
async fn change(
    consul: &Consul,
    overlay: &mut watch::Receiver<Overlay>,
    watch: &ConsulEntries,
    value: Result<&Value, (&str, &str)>,
    wanted: impl FnMut(&Overlay) -> bool,
) -> Duration {
    match value {
        Ok(value) => write(consul, value).await,
        Err((kind, name)) => consul.delete_config(kind, name).await,
    }
    let written = Instant::now();
    let seen = matches!(
        tokio::time::timeout(FOLLOW, overlay.wait_for(wanted)).await,
        Ok(Ok(_))
    );
    let took = written.elapsed();
    assert!(
        seen,
        "{value:?}: the overlay never followed within {FOLLOW:?}\nlast: {:?}\nstats: {:?}\n\
         consul log: {}",
        overlay.borrow().config_entries,
        watch.named_stats(),
        consul.log()
    );
    took
}

#[tokio::test]
async fn config_entry_writes_reach_the_overlay_within_one_watch_round_trip() {
    let consul = Consul::start("dc1").await;
    let (feed, mut overlay) = watch::channel(Overlay::default());
    let watch = spawn_consul_entries(&entries_config(&consul), feed).expect("valid config");
    let started = tokio::time::timeout(FOLLOW, watch.initialized()).await;
    assert!(
        started.is_ok(),
        "never initialized: {:?}",
        watch.named_stats()
    );
    let defaults = json!({"Kind": "service-defaults", "Name": "web", "Protocol": "http"});
    let resolver = json!({"Kind": "service-resolver", "Name": "web",
        "Subsets": {"v1": {"Filter": "Service.Meta.version == v1"},
                    "v2": {"Filter": "Service.Meta.version == v2"}}});
    let split = |v1: f64| {
        json!({"Kind": "service-splitter", "Name": "web",
        "Splits": [{"Weight": v1, "ServiceSubset": "v1"},
                   {"Weight": 100.0 - v1, "ServiceSubset": "v2"}]})
    };
    let mut took = Vec::new();
    for value in [&defaults, &resolver, &split(90.0), &split(50.0)] {
        let want = entry(value);
        took.push(
            change(&consul, &mut overlay, &watch, Ok(value), |o| {
                o.config_entries.contains(&want)
            })
            .await,
        );
    }
    let published = overlay.borrow().config_entries.clone();
    assert_eq!(
        published,
        [entry(&defaults), entry(&split(50.0)), entry(&resolver)]
    );
    let chain = compile(
        &CompileRequest::new("web", "dc1", "consul"),
        &Entries::from_entries(published).expect("valid"),
    )
    .expect("compiles");
    let legs = chain.legs().expect("legs");
    assert_eq!(
        legs.iter().map(|l| l.weight).collect::<Vec<_>>(),
        [50.0, 50.0]
    );

    let gone = |o: &Overlay| o.config_entries.len() == 2;
    took.push(
        change(
            &consul,
            &mut overlay,
            &watch,
            Err(("service-splitter", "web")),
            gone,
        )
        .await,
    );
    assert!(
        took.iter().all(|t| *t < ROUND_TRIP),
        "write to overlay: {took:?}"
    );
    eprintln!("write to overlay: {took:?}");
    unusable_entry_is_skipped(&consul, &mut overlay, &watch).await;
}

/// Consul 1.8.7 accepts a negative split weight when the sum is 100; the watch skips it, says
/// why, and keeps everything else. A usable splitter written after it shows that the answer
/// holding both was applied.
async fn unusable_entry_is_skipped(
    consul: &Consul,
    overlay: &mut watch::Receiver<Overlay>,
    watch: &ConsulEntries,
) {
    // Consul takes a splitter only for an HTTP service.
    let http = json!({"Kind": "service-defaults", "Name": "api", "Protocol": "http"});
    let want = entry(&http);
    change(consul, overlay, watch, Ok(&http), |o| {
        o.config_entries.contains(&want)
    })
    .await;
    let mut want = overlay.borrow().config_entries.clone();
    let negative = json!({"Kind": "service-splitter", "Name": "web",
        "Splits": [{"Weight": 200, "ServiceSubset": "v1"}, {"Weight": -100, "ServiceSubset": "v2"}]});
    write(consul, &negative).await;
    let api = json!({"Kind": "service-splitter", "Name": "api", "Splits": [{"Weight": 100}]});
    want.insert(2, entry(&api));
    change(consul, overlay, watch, Ok(&api), |o| {
        o.config_entries == want
    })
    .await;
    let skipped = watch.skipped();
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert_eq!(skipped[0].name, "web");
    assert!(skipped[0].reason.contains("negative Weight"), "{skipped:?}");
    let stats: BTreeMap<String, u64> = watch.named_stats().into_iter().collect();
    assert_eq!(stats["consul_entries.entries_skipped"], 1, "{stats:?}");
    assert_eq!(stats["consul_entries.update_failure"], 0, "{stats:?}");
}
