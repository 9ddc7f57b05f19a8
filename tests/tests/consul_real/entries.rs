//! Consul's config entries, watched live from a real Consul 1.8.7: each write, rewrite and
//! delete reaches the published overlay within one watch round trip, and an entry Consul
//! accepts but this daemon cannot use leaves out only the chain that reads it.

use std::time::Instant;

use proxy_chain::{CompileRequest, ConfigEntry, Entries, compile};
use proxy_core::{
    chain::compile_each,
    config::{Config, sources::consul::entries::ConsulEntriesConfig},
    desired::Overlay,
    discovery::consul::entries::{ConsulEntries, EntriesStatValues, spawn_consul_entries},
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
    an_entry_only_consul_accepts_skips_only_its_chain(&consul, &mut overlay, &watch).await;
}

/// Consul 1.8.7 accepts a negative split weight when the sum is 100; this daemon does not. The
/// watch publishes the entry as Consul holds it, and composition leaves out only the chain that
/// reads it, saying why.
async fn an_entry_only_consul_accepts_skips_only_its_chain(
    consul: &Consul,
    overlay: &mut watch::Receiver<Overlay>,
    watch: &ConsulEntries,
) {
    let negative = json!({"Kind": "service-splitter", "Name": "web",
        "Splits": [{"Weight": 200, "ServiceSubset": "v1"}, {"Weight": -100, "ServiceSubset": "v2"}]});
    let want = entry(&negative);
    change(consul, overlay, watch, Ok(&negative), |o| {
        o.config_entries.contains(&want)
    })
    .await;
    let text = "clusters:\n  - name: web\n  - name: api\nservices:\n  \
        - { name: web, address: 127.77.0.1, port: 80, chain: web }\n  \
        - { name: api, address: 127.77.0.2, port: 80, chain: api }\n";
    let config = Config::parse(text, std::path::Path::new("test.yaml")).expect("valid config");
    let out = compile_each(&config, &[], &overlay.borrow().config_entries);
    assert_eq!(
        out.chains.keys().collect::<Vec<_>>(),
        ["api"],
        "{:?}",
        out.failures
    );
    assert_eq!(out.failures.len(), 1, "{:?}", out.failures);
    assert_eq!(out.failures[0].service, "web");
    assert!(
        out.failures[0].reason.contains("negative Weight"),
        "{:?}",
        out.failures
    );
    let stats: BTreeMap<String, u64> = watch.named_stats().into_iter().collect();
    assert_eq!(stats["consul_entries.entries_skipped"], 0, "{stats:?}");
    assert_eq!(stats["consul_entries.update_failure"], 0, "{stats:?}");
}

/// Polls the watch's stats until `wanted` holds (bounded by [`FOLLOW`]): what a query carried
/// shows nowhere else.
async fn wait_stats(
    watch: &ConsulEntries,
    what: &str,
    wanted: impl Fn(&EntriesStatValues) -> bool,
) {
    let deadline = Instant::now() + FOLLOW;
    while !wanted(&watch.stats()) {
        assert!(
            Instant::now() < deadline,
            "{what}: {:?}",
            watch.named_stats()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Waits until the overlay's entries are exactly `want`.
async fn wait_entries(
    overlay: &mut watch::Receiver<Overlay>,
    watch: &ConsulEntries,
    want: &[ConfigEntry],
) {
    let seen = tokio::time::timeout(FOLLOW, overlay.wait_for(|o| o.config_entries == want));
    assert!(
        matches!(seen.await, Ok(Ok(_))),
        "{want:?}: {:?}",
        watch.named_stats()
    );
}

/// With default-deny ACLs: the right token (from a token file) gives the entries; once the file
/// holds a token Consul does not know, the entries stay (nothing drained) and an entry written
/// meanwhile is not applied, counted as denials; the fixed file applies it without a restart.
#[tokio::test]
async fn a_refused_token_keeps_the_entries_until_it_is_fixed() {
    let master = format!("master-{}", integration_tests::kernel::unique("tok"));
    let consul = Consul::start_with_acls("dc1", &master).await;
    let defaults =
        |name: &str| json!({"Kind": "service-defaults", "Name": name, "Protocol": "http"});
    write(&consul, &defaults("web")).await;
    // Made before the watch starts: an ACL change may wake blocking queries.
    let narrow = consul
        .create_token("service \"api\" { policy = \"read\" }")
        .await;
    let dir = integration_tests::kernel::TempDir::new();
    let token_file = dir.0.join("consul.token");
    std::fs::write(&token_file, format!("{master}\n")).expect("write the token");
    let config = ConsulEntriesConfig {
        token_file: Some(token_file.clone()),
        ..entries_config(&consul)
    };
    let (feed, mut overlay) = watch::channel(Overlay::default());
    let watch = spawn_consul_entries(&config, feed).expect("valid config");
    let [web, api, db] = ["web", "api", "db"].map(|name| entry(&defaults(name)));
    wait_entries(&mut overlay, &watch, std::slice::from_ref(&web)).await;
    // Every kind's second, blocking query is out, with the right token.
    wait_stats(&watch, "second queries", |s| s.update_attempt >= 10).await;

    std::fs::write(&token_file, "not-a-known-token\n").expect("rewrite the token");
    // The blocked query answers this write (it carried the right token); the next one does not.
    write(&consul, &defaults("api")).await;
    wait_entries(&mut overlay, &watch, &[api.clone(), web.clone()]).await;
    wait_stats(&watch, "a denial", |s| s.acl_denied > 0).await;
    write(&consul, &defaults("db")).await;
    let denied = watch.stats().acl_denied;
    wait_stats(&watch, "a denial after the write", |s| {
        s.acl_denied > denied
    })
    .await;
    assert_eq!(
        overlay.borrow().config_entries,
        [api.clone(), web.clone()],
        "nothing drained, db not applied"
    );

    std::fs::write(&token_file, format!("{master}\n")).expect("fix the token");
    wait_entries(
        &mut overlay,
        &watch,
        &[api.clone(), db.clone(), web.clone()],
    )
    .await;

    // A token whose policy reads only `api`: Consul's answer then holds api's entry alone. That
    // drops db and web, which it may not read: the answer is refused, nothing drained.
    wait_stats(&watch, "queries out", |s| {
        s.update_attempt >= s.update_success + s.update_failure + 5
    })
    .await;
    std::fs::write(&token_file, format!("{narrow}\n")).expect("the narrow token");
    write(&consul, &defaults("x")).await;
    let x = entry(&defaults("x"));
    let all = [api, db, web, x];
    wait_entries(&mut overlay, &watch, &all).await;
    // The next query carries the narrow token and blocks: a write wakes it.
    let denied = watch.stats().acl_denied;
    write(&consul, &defaults("y")).await;
    wait_stats(&watch, "a denial of the filtered answer", |s| {
        s.acl_denied > denied
    })
    .await;
    assert_eq!(
        overlay.borrow().config_entries,
        all,
        "nothing drained, y not applied"
    );
}
