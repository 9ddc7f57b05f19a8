//! The config entry watch on scripted answers, one script per kind: nothing published before
//! every kind answered, the union after, the catalog's index and backoff rules, unusable
//! entries skipped (their last usable version kept), and ACL denials that keep the entries.

use std::collections::BTreeMap;

use proxy_chain::{ConfigEntry, EntryKind};

use super::*;
use crate::{
    config::sources::consul::{RetryBackoff, entries::ConsulEntriesConfig},
    desired::Overlay,
    discovery::consul::{
        entries::{ConsulEntries, KINDS, decode, entries_target, spawn_with},
        watch::MIN_QUERY_INTERVAL,
    },
};

/// Routes each query to its kind's script, and `/v1/acl/token/self` to its own.
#[derive(Clone)]
struct ByKind {
    kinds: BTreeMap<&'static str, Script>,
    acl: Script,
}

impl CatalogFetch for ByKind {
    fn post<'a>(
        &'a self,
        target: &'a str,
        token: Option<&'a ConsulToken>,
        body: Vec<u8>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<HttpResponse, HttpError>> {
        self.acl.post(target, token, body, timeout)
    }

    fn get<'a>(
        &'a self,
        target: &'a str,
        token: Option<&'a ConsulToken>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<HttpResponse, HttpError>> {
        if target == TOKEN_SELF {
            return self.acl.get(target, token, timeout);
        }
        let path = target.split('?').next().unwrap_or_default();
        let kind = path.trim_start_matches("/v1/config/");
        match self.kinds.get(kind) {
            Some(script) => script.get(target, token, timeout),
            None => panic!("query for an unknown kind: {target}"),
        }
    }
}

impl ByKind {
    fn kind(&self, kind: EntryKind) -> &Script {
        &self.kinds[kind.as_str()]
    }
}

/// Starts the watch: each kind answers `replies` if given, else one empty list; `token` is
/// sent when set; `/v1/acl/token/self` answers per `acls`.
fn start(
    mut replies: BTreeMap<EntryKind, Vec<Reply>>,
    acls: Acls,
    config: &ConsulEntriesConfig,
) -> (ConsulEntries, watch::Receiver<Overlay>, ByKind) {
    let kinds = KINDS
        .iter()
        .map(|k| {
            let script = replies
                .remove(k)
                .unwrap_or_else(|| vec![Reply::Ok(1, json!([]))]);
            (k.as_str(), Script::new(script))
        })
        .collect();
    let fetch = ByKind {
        kinds,
        acl: Script::new(Vec::new()),
    };
    fetch.acl.set_acls(acls);
    let connection = config.connection();
    let access = crate::config::sources::consul::access::resolve(&connection, &|_| None)
        .expect("valid config");
    let (feed, overlay) = watch::channel(Overlay::default());
    let entries = spawn_with(
        &connection,
        &access.token,
        &(Arc::new(fetch.clone()) as Arc<dyn CatalogFetch>),
        &mut fastrand::Rng::with_seed(7),
        feed,
    );
    (entries, overlay, fetch)
}

fn splitter(name: &str, v1: u32, modify_index: u64) -> Value {
    json!({"Kind": "service-splitter", "Name": name, "CreateIndex": 3,
        "ModifyIndex": modify_index,
        "Splits": [{"Weight": v1, "ServiceSubset": "v1"},
                   {"Weight": 100 - v1, "ServiceSubset": "v2"}]})
}

fn resolver(name: &str, timeout: &str) -> Value {
    json!({"Kind": "service-resolver", "Name": name, "ConnectTimeout": timeout,
        "Subsets": {"v1": {"Filter": "Service.Meta.version == v1"},
                    "v2": {"Filter": "Service.Meta.version == v2"}}})
}

fn entry(value: &Value) -> ConfigEntry {
    let mut value = value.clone();
    if let Some(object) = value.as_object_mut() {
        object.remove("CreateIndex");
        object.remove("ModifyIndex");
    }
    let mut entry: ConfigEntry = serde_json::from_value(value).expect("an entry");
    entry.normalize();
    entry
}

async fn wait_overlay(
    overlay: &mut watch::Receiver<Overlay>,
    wanted: impl FnMut(&Overlay) -> bool,
) -> Overlay {
    let matched = match tokio::time::timeout(WAIT, overlay.wait_for(wanted)).await {
        Ok(Ok(o)) => Some(o.clone()),
        _ => None,
    };
    matched.unwrap_or_else(|| panic!("overlay never matched; last: {:?}", overlay.borrow()))
}

#[tokio::test(start_paused = true)]
async fn nothing_is_published_until_every_kind_has_answered() {
    let replies = BTreeMap::from([
        (
            EntryKind::ServiceSplitter,
            vec![Reply::Ok(5, json!([splitter("web", 90, 5)]))],
        ),
        // No answer: a blocking query that never returns.
        (EntryKind::ServiceResolver, Vec::new()),
    ]);
    let (entries, overlay, fetch) = start(replies, Acls::Disabled, &ConsulEntriesConfig::default());
    for kind in KINDS {
        fetch.kind(kind).wait_requests(1).await;
    }
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(overlay.borrow().is_empty(), "{:?}", overlay.borrow());
    assert!(!overlay.has_changed().unwrap_or(true), "nothing was sent");
    let initialized = tokio::time::timeout(Duration::from_secs(1), entries.initialized()).await;
    assert!(
        initialized.is_err(),
        "not initialized while a kind has not answered"
    );
    assert_eq!(entries.stats().entries_change, 0);
}

#[tokio::test(start_paused = true)]
async fn the_union_is_published_and_each_kind_follows_the_index_rules() {
    let s90 = splitter("web", 90, 5);
    let s50 = splitter("web", 50, 9);
    let replies = BTreeMap::from([
        (
            EntryKind::ServiceSplitter,
            vec![
                Reply::Ok(5, json!([s90])),
                // The wait ran out: same index, same content.
                Reply::Ok(5, json!([splitter("web", 90, 5)])),
                // The index went backwards (a snapshot restore): start again from 0.
                Reply::Ok(3, json!([s50])),
                Reply::Ok(9, json!([s50])),
            ],
        ),
        (
            EntryKind::ServiceResolver,
            vec![Reply::Ok(7, json!([resolver("web", "5s")]))],
        ),
    ]);
    let (entries, mut overlay, fetch) =
        start(replies, Acls::Disabled, &ConsulEntriesConfig::default());
    entries.initialized().await;
    let last = wait_overlay(&mut overlay, |o| o.config_entries.contains(&entry(&s50))).await;
    assert_eq!(
        last.config_entries,
        [entry(&s50), entry(&resolver("web", "5s"))],
        "kinds in publishing order: splitters before resolvers"
    );
    fetch
        .kind(EntryKind::ServiceSplitter)
        .wait_requests(5)
        .await;
    let splitter = "/v1/config/service-splitter";
    assert_eq!(
        fetch.kind(EntryKind::ServiceSplitter).targets(),
        [
            splitter.to_owned(),
            format!("{splitter}?index=5&wait=30s"),
            format!("{splitter}?index=5&wait=30s"),
            splitter.to_owned(),
            format!("{splitter}?index=9&wait=30s"),
        ]
    );
    let times = fetch.kind(EntryKind::ServiceSplitter).times();
    assert!(
        times.windows(2).all(|p| p[1] - p[0] >= MIN_QUERY_INTERVAL),
        "{times:?}"
    );
    let stats = entries.stats();
    assert_eq!(stats.index_reset, 1);
    assert_eq!(stats.entries_total, 2);
    assert_eq!(
        stats.entries_change, 2,
        "the first union, then the 50/50 split"
    );
    assert!(stats.update_no_rebuild >= 2, "{stats:?}");
    let named: BTreeMap<String, u64> = entries.named_stats().into_iter().collect();
    assert_eq!(named["consul_entries.index_reset"], 1);
}

#[tokio::test(start_paused = true)]
async fn an_undecodable_entry_is_skipped_and_its_last_decoded_version_stays() {
    let mut bad = resolver("web", "1s");
    bad["Bogus"] = json!(true);
    let replies = BTreeMap::from([(
        EntryKind::ServiceResolver,
        vec![
            Reply::Ok(5, json!([resolver("web", "5s"), resolver("api", "5s")])),
            Reply::Ok(
                6,
                json!([
                    bad,
                    resolver("api", "2s"),
                    splitter("db", 50, 6),
                    42,
                    resolver("new", "not a duration"),
                    // Decodes, but breaks a rule (Consul's own, here): published as it is,
                    // for composition to leave out the chains that read it.
                    {"Kind": "service-resolver", "Name": "odd", "Redirect": {}}
                ]),
            ),
        ],
    )]);
    let (entries, mut overlay, _fetch) =
        start(replies, Acls::Disabled, &ConsulEntriesConfig::default());
    let last = wait_overlay(&mut overlay, |o| {
        o.config_entries.contains(&entry(&resolver("api", "2s")))
    })
    .await;
    assert_eq!(
        last.config_entries,
        [
            entry(&resolver("api", "2s")),
            entry(&json!({"Kind": "service-resolver", "Name": "odd", "Redirect": {}})),
            entry(&resolver("web", "5s"))
        ],
        "web keeps its last decoded version; db (not a resolver) and new are left out"
    );
    let skipped: Vec<(String, bool)> = entries
        .skipped()
        .into_iter()
        .map(|s| (s.name, s.reason.is_empty()))
        .collect();
    assert_eq!(
        skipped,
        [
            ("web".to_owned(), false),
            ("db".to_owned(), false),
            ("#3".to_owned(), false),
            ("new".to_owned(), false),
        ]
    );
    let reasons: Vec<String> = entries.skipped().into_iter().map(|s| s.reason).collect();
    assert!(reasons[0].contains("Bogus"), "{reasons:?}");
    assert!(
        reasons[1].contains("Kind is not service-resolver"),
        "{reasons:?}"
    );
    assert_eq!(entries.stats().entries_skipped, 4);
}

#[tokio::test(start_paused = true)]
async fn acl_denials_keep_the_entries_and_the_index() {
    let s90 = splitter("web", 90, 5);
    let replies = BTreeMap::from([(
        EntryKind::ServiceSplitter,
        vec![
            Reply::Ok(5, json!([s90])),
            // What Consul 1.8.7 answers when its ACLs hide every entry from the token.
            Reply::Ok(6, json!([])),
            Reply::Status(403, "ACL not found"),
            Reply::Ok(7, json!([splitter("web", 10, 7)])),
        ],
    )]);
    let config = ConsulEntriesConfig {
        token: ConsulToken::new("stale"),
        ..ConsulEntriesConfig::default()
    };
    let (entries, mut overlay, fetch) = start(replies, Acls::Known(vec!["good"]), &config);
    let script = fetch.kind(EntryKind::ServiceSplitter);
    script.wait_requests(3).await;
    assert_eq!(
        overlay.borrow().config_entries,
        [entry(&s90)],
        "the denials drained nothing"
    );
    let last = wait_overlay(&mut overlay, |o| o.config_entries != [entry(&s90)]).await;
    assert_eq!(last.config_entries, [entry(&splitter("web", 10, 7))]);
    let targets = script.targets();
    assert_eq!(
        targets[2], targets[1],
        "a denied answer's index is not used"
    );
    assert_eq!(targets[3], targets[1]);
    assert!(
        fetch
            .acl
            .acl_checks()
            .iter()
            .all(|t| t.as_deref() == Some("stale"))
    );
    let stats = entries.stats();
    // The four other kinds' first (empty) answers are denied too.
    assert_eq!(stats.acl_denied, 4 + 2, "{stats:?}");
    assert!(
        script
            .sent()
            .iter()
            .all(|(_, token)| token.as_deref() == Some("stale")),
        "the token is sent with every query"
    );
}

#[tokio::test(start_paused = true)]
async fn a_failure_keeps_the_entries_and_is_retried_after_a_backoff() {
    let s90 = splitter("web", 90, 5);
    let replies = BTreeMap::from([(
        EntryKind::ServiceSplitter,
        vec![
            Reply::Ok(5, json!([s90])),
            Reply::Status(500, "rpc error: No cluster leader"),
            Reply::Fail,
            Reply::Raw(HttpResponse {
                status: 200,
                headers: vec![("x-consul-index".to_owned(), "6".to_owned())],
                body: b"{\"not\": \"a list\"}".to_vec(),
            }),
            Reply::Ok(6, json!([splitter("web", 20, 6)])),
        ],
    )]);
    let config = ConsulEntriesConfig {
        retry_backoff: RetryBackoff {
            base_interval: Duration::from_secs(1),
            max_interval: Duration::from_secs(30),
        },
        ..ConsulEntriesConfig::default()
    };
    let (entries, mut overlay, fetch) = start(replies, Acls::Disabled, &config);
    let script = fetch.kind(EntryKind::ServiceSplitter);
    script.wait_requests(4).await;
    assert_eq!(
        overlay.borrow().config_entries,
        [entry(&s90)],
        "failures changed nothing"
    );
    let last = wait_overlay(&mut overlay, |o| o.config_entries != [entry(&s90)]).await;
    assert_eq!(last.config_entries, [entry(&splitter("web", 20, 6))]);
    let times = script.times();
    let gaps: Vec<Duration> = times.windows(2).map(|p| p[1] - p[0]).collect();
    // After failure n the delay is below min(1 s * 2^(n-1), 30 s).
    for (gap, bound) in gaps[1..].iter().zip([1, 2, 4]) {
        assert!(*gap < Duration::from_secs(bound), "gaps {gaps:?}");
    }
    let stats = entries.stats();
    assert_eq!(stats.update_failure, 3, "{stats:?}");
    assert_eq!(stats.acl_denied, 0);
}

#[test]
fn target_names_the_kind_datacenter_index_and_wait() {
    let mut config = ConsulEntriesConfig::default().connection();
    assert_eq!(
        entries_target(&config, EntryKind::ServiceRouter, 0),
        "/v1/config/service-router"
    );
    config.datacenter = Some("dc 2".to_owned());
    config.wait = Duration::from_millis(1500);
    assert_eq!(
        entries_target(&config, EntryKind::ProxyDefaults, 42),
        "/v1/config/proxy-defaults?dc=dc%202&index=42&wait=1500ms"
    );
}

#[test]
fn an_answer_is_a_bounded_list_and_raft_indexes_do_not_count_as_changes() {
    let (none, skipped) = decode::decode(EntryKind::ServiceSplitter, b"null").expect("null");
    assert!(none.is_empty() && skipped.is_empty());
    let list = decode::decode(EntryKind::ServiceSplitter, b"{}").expect_err("an object");
    assert!(list.contains("not a JSON list"), "{list}");
    let long = json!(vec![json!(1); decode::MAX_ENTRIES_PER_KIND + 1]).to_string();
    let long = decode::decode(EntryKind::ServiceSplitter, long.as_bytes()).expect_err("too long");
    assert!(long.contains("10001 entries"), "{long}");
    let body = |index: u64| json!([splitter("web", 90, index)]).to_string();
    let (a, _) = decode::decode(EntryKind::ServiceSplitter, body(5).as_bytes()).expect("a");
    let (b, _) = decode::decode(EntryKind::ServiceSplitter, body(9).as_bytes()).expect("b");
    assert_eq!(a, b);
}

#[test]
fn the_block_is_checked_at_load_and_errors_name_its_position() {
    use crate::config::{Config, ConfigError};
    let parse = |text: &str| Config::parse(text, std::path::Path::new("test.yaml"));
    let config = parse("consul_config_entries:\n  address: 127.0.0.1:8501\n  datacenter: dc2\n")
        .expect("valid");
    let block = config.consul_config_entries.expect("the block");
    assert_eq!(block.address.as_deref(), Some("127.0.0.1:8501"));
    assert_eq!(
        block.wait,
        Duration::from_secs(30),
        "the catalog's default wait"
    );
    let located = |text: &str| match parse(text) {
        Err(err @ ConfigError::Invalid { .. }) => {
            let at = err.position().expect("a position");
            (
                err.field().unwrap_or_default().to_owned(),
                at.line,
                err.to_string(),
            )
        }
        other => panic!("expected an Invalid error, got {other:?}"),
    };
    let (field, line, message) = located("datacenter: dc1\nconsul_config_entries:\n  wait: 900s\n");
    assert_eq!((field.as_str(), line), ("consul_config_entries", 2));
    assert!(message.contains("at most 10 minutes"), "{message}");
    let (_, line, message) = located("consul_config_entries:\n  token: a\n  token_file: /t\n");
    assert_eq!(line, 1);
    assert!(message.contains("both set"), "{message}");
    let unknown = parse("consul_config_entries:\n  service: web\n").expect_err("unknown field");
    assert!(
        unknown.to_string().contains("unknown field `service`"),
        "{unknown}"
    );
}

#[tokio::test(start_paused = true)]
async fn an_empty_first_union_is_sent_for_the_start_to_wait_on() {
    let (entries, mut overlay, _fetch) = start(
        BTreeMap::new(),
        Acls::Disabled,
        &ConsulEntriesConfig::default(),
    );
    let sent = tokio::time::timeout(WAIT, overlay.changed()).await;
    assert!(
        matches!(sent, Ok(Ok(()))),
        "the empty first union was not sent"
    );
    assert!(overlay.borrow_and_update().is_empty());
    entries.initialized().await;
    assert_eq!(entries.stats().entries_change, 1);
}

#[test]
fn the_token_never_shows_in_the_config_dump() {
    let text = "consul_config_entries:\n  token: s3cr3t-entries-token\n";
    let config =
        crate::config::Config::parse(text, std::path::Path::new("test.yaml")).expect("valid");
    let dump = serde_json::to_string(&config).expect("serializes");
    assert!(!dump.contains("s3cr3t"), "{dump}");
    assert!(dump.contains("\"token\":\"<redacted>\""), "{dump}");
    let debug = format!("{:?}", config.consul_config_entries);
    assert!(!debug.contains("s3cr3t"), "{debug}");
}

#[tokio::test(start_paused = true)]
async fn an_empty_answer_to_a_token_that_may_not_read_a_held_entry_keeps_it() {
    let r = resolver("web", "5s");
    let replies = BTreeMap::from([(
        EntryKind::ServiceResolver,
        vec![Reply::Ok(5, json!([r])), Reply::Ok(6, json!([]))],
    )]);
    let config = ConsulEntriesConfig {
        token: ConsulToken::new("scoped"),
        ..ConsulEntriesConfig::default()
    };
    let (entries, overlay, fetch) = start(replies, Acls::KnownWithoutRead(vec!["scoped"]), &config);
    fetch
        .kind(EntryKind::ServiceResolver)
        .wait_requests(3)
        .await;
    assert_eq!(
        overlay.borrow().config_entries,
        [entry(&r)],
        "the entry was not drained"
    );
    // Only the answer that would drain an entry asks whether its service may be read.
    let asked = fetch.acl.authorizations();
    assert_eq!(asked.len(), 1, "{asked:?}");
    assert!(asked[0].2.contains("\"Segment\":\"web\""), "{asked:?}");
    assert_eq!(asked[0].1.as_deref(), Some("scoped"));
    let stats = entries.stats();
    assert_eq!(
        (stats.acl_denied, stats.update_failure),
        (1, 1),
        "{stats:?}"
    );
}

/// Consul hides the entries of services a token may not read even from a non-empty answer:
/// an answer that drops a held entry is trusted only when the token may read its service.
#[tokio::test(start_paused = true)]
async fn an_answer_that_drops_an_entry_is_trusted_only_if_its_service_may_be_read() {
    let (web, api) = (resolver("web", "5s"), resolver("api", "5s"));
    for (acls, want) in [
        (
            Acls::KnownWithoutRead(vec!["t"]),
            vec![entry(&api), entry(&web)],
        ),
        (Acls::Known(vec!["t"]), vec![entry(&api)]),
    ] {
        let replies = BTreeMap::from([(
            EntryKind::ServiceResolver,
            vec![Reply::Ok(5, json!([web, api])), Reply::Ok(6, json!([api]))],
        )]);
        let config = ConsulEntriesConfig {
            token: ConsulToken::new("t"),
            ..ConsulEntriesConfig::default()
        };
        let (entries, overlay, fetch) = start(replies, acls.clone(), &config);
        fetch
            .kind(EntryKind::ServiceResolver)
            .wait_requests(3)
            .await;
        assert_eq!(overlay.borrow().config_entries, want, "{acls:?}");
        let asked = fetch.acl.authorizations();
        assert_eq!(asked.len(), 1, "{asked:?}");
        assert!(asked[0].2.contains("\"Segment\":\"web\""), "{asked:?}");
        let denied = u64::from(matches!(acls, Acls::KnownWithoutRead(_)));
        assert_eq!(entries.stats().acl_denied, denied, "{acls:?}");
    }
}
