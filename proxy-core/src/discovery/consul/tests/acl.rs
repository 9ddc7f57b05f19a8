//! ACL tokens: the header sent, a token file re-read before every query, and empty or refused
//! answers that never drain a service while Consul's ACLs deny the token.

use std::path::{Path, PathBuf};

use super::*;
use crate::config::sources::consul::access::ConsulToken;

fn two() -> Value {
    body(&[inst("a", "127.0.0.2", 80), inst("b", "127.0.0.3", 80)])
}

/// A token file in a fresh directory of this test, holding `text`.
fn token_file(test: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("proxy-consul-acl-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("token");
    std::fs::write(&path, text).expect("write token");
    path
}

fn write(path: &Path, text: &'static str) -> Box<dyn FnOnce() + Send> {
    let path = path.to_owned();
    Box::new(move || std::fs::write(&path, text).expect("rewrite token"))
}

fn then(hook: Box<dyn FnOnce() + Send>, reply: Reply) -> Reply {
    Reply::Then(hook, Box::new(reply))
}

fn tokens(script: &Script) -> Vec<Option<String>> {
    script.sent().into_iter().map(|(_, token)| token).collect()
}

#[tokio::test(start_paused = true)]
async fn without_a_token_an_empty_answer_keeps_the_hosts() {
    let script = Script::new(vec![
        Reply::Ok(5, two()),
        Reply::Ok(6, json!([])),
        Reply::Ok(7, json!([])),
    ]);
    script.set_acls(Acls::Known(vec!["good"]));
    let cluster = start(ConsulConfig::new("web"), &script);
    script.wait_requests(4).await;
    assert_eq!(addrs(&cluster.current()), ["127.0.0.2:80", "127.0.0.3:80"]);
    assert_eq!(
        script.acl_checks(),
        [None, None],
        "each empty answer is checked"
    );
    let targets = script.targets();
    assert_eq!(
        targets[2], targets[1],
        "a denied answer's index is not used"
    );
    let stats = cluster.stats().values();
    assert_eq!((stats.acl_denied, stats.source.update_failure), (2, 2));
    assert_eq!((stats.source.update_success, stats.index), (1, 5));
    let named: std::collections::BTreeMap<String, u64> =
        cluster.named_stats().into_iter().collect();
    assert_eq!(named.get("cluster.web.consul.acl_denied"), Some(&2));
}

#[tokio::test(start_paused = true)]
async fn with_acls_disabled_an_empty_answer_drains() {
    let script = Script::new(vec![Reply::Ok(5, two()), Reply::Ok(6, json!([]))]);
    let cluster = start(ConsulConfig::new("web"), &script);
    let drained = wait_state(&cluster, |u| {
        u.initialized && u.hosts.is_empty() && u.version == 2
    });
    drained.await;
    assert_eq!(script.acl_checks(), [None]);
    assert_eq!(cluster.stats().values().acl_denied, 0);
}

#[tokio::test(start_paused = true)]
async fn a_known_token_makes_an_empty_answer_trusted() {
    let script = Script::new(vec![Reply::Ok(5, two()), Reply::Ok(6, json!([]))]);
    script.set_acls(Acls::Known(vec!["good"]));
    let mut config = ConsulConfig::new("web");
    config.token = ConsulToken::new("good");
    let cluster = start(config, &script);
    wait_state(&cluster, |u| u.version == 2 && u.hosts.is_empty()).await;
    assert_eq!(script.acl_checks(), [Some("good".to_owned())]);
    assert!(tokens(&script).iter().all(|t| t.as_deref() == Some("good")));
}

/// A token Consul knows whose policy does not reach the service: Consul 1.8.7 answers the
/// health endpoint with an empty list, and only its permission check tells.
#[tokio::test(start_paused = true)]
async fn a_known_token_that_may_not_read_the_service_keeps_the_hosts() {
    let script = Script::new(vec![
        Reply::Ok(5, two()),
        Reply::Ok(6, json!([])),
        Reply::Ok(7, json!([])),
    ]);
    script.set_acls(Acls::KnownWithoutRead(vec!["narrow"]));
    let mut config = ConsulConfig::new("web");
    config.token = ConsulToken::new("narrow");
    config.datacenter = Some("dc 2".to_owned());
    let cluster = start(config, &script);
    script.wait_requests(4).await;
    assert_eq!(cluster.current().hosts.len(), 2, "never drained");
    let stats = cluster.stats().values();
    assert_eq!((stats.acl_denied, stats.source.update_success), (2, 1));
    let asked = script.authorizations();
    assert_eq!(asked.len(), 2, "each empty answer is checked");
    let (target, token, body) = &asked[0];
    assert_eq!(target, "/v1/internal/acl/authorize?dc=dc%202");
    assert_eq!(token.as_deref(), Some("narrow"));
    let body: Value = serde_json::from_str(body).expect("json");
    assert_eq!(
        body,
        json!([{"Resource": "service", "Segment": "web", "Access": "read"},
               {"Resource": "node", "Segment": "", "Access": "read"}])
    );
    let err = crate::discovery::consul::AclDenial::NoServiceRead {
        origin: crate::config::sources::consul::access::TokenOrigin::Config,
        service: "web".to_owned(),
    }
    .to_string();
    assert!(err.contains("may not read service \"web\""), "{err}");
}

/// A token that may read the service but not nodes: Consul's health answer leaves out every
/// instance on a node it may not read, so its empty answer keeps the hosts too.
#[tokio::test(start_paused = true)]
async fn a_token_without_node_read_keeps_the_hosts() {
    let script = Script::new(vec![Reply::Ok(5, two()), Reply::Ok(6, json!([]))]);
    script.set_acls(Acls::KnownWithoutNodeRead(vec!["nodeless"]));
    let mut config = ConsulConfig::new("web");
    config.token = ConsulToken::new("nodeless");
    let cluster = start(config, &script);
    script.wait_requests(3).await;
    assert_eq!(cluster.current().hosts.len(), 2, "never drained");
    assert_eq!(cluster.stats().values().acl_denied, 1);
    let err = crate::discovery::consul::AclDenial::NoNodeRead {
        origin: crate::config::sources::consul::access::TokenOrigin::Config,
        service: "web".to_owned(),
    }
    .to_string();
    assert!(err.contains("but not all nodes"), "{err}");
}

#[tokio::test(start_paused = true)]
async fn a_refused_token_or_a_failed_check_keeps_the_hosts() {
    let script = Script::new(vec![
        Reply::Ok(5, two()),
        Reply::Status(403, "ACL not found"),
        Reply::Status(403, "Permission denied"),
        Reply::Ok(6, json!([])),
    ]);
    script.set_acls(Acls::Status(500));
    let mut config = ConsulConfig::new("web");
    config.token = ConsulToken::new("wrong");
    let cluster = start(config, &script);
    script.wait_requests(5).await;
    assert_eq!(cluster.current().hosts.len(), 2, "never drained");
    let stats = cluster.stats().values();
    assert_eq!(
        stats.acl_denied, 2,
        "the two 403s; the failed check is a plain failure"
    );
    assert_eq!(stats.source.update_failure, 3);
}

/// The token file is read before every query: a token rotated in the file is sent from the
/// next query on, without a restart, and a fixed token recovers the watch.
#[tokio::test(start_paused = true)]
async fn a_rotated_token_file_applies_from_the_next_query() {
    let path = token_file("rotate", "good\n");
    let script = Script::new(vec![
        then(write(&path, "  wrong  "), Reply::Ok(5, two())),
        Reply::Ok(6, json!([])),
        then(write(&path, "good"), Reply::Status(403, "ACL not found")),
        Reply::Ok(7, body(&[inst("a", "127.0.0.2", 80)])),
    ]);
    script.set_acls(Acls::Known(vec!["good"]));
    let mut config = ConsulConfig::new("web");
    config.token_file = Some(path.clone());
    let cluster = start(config, &script);
    let recovered = wait_state(&cluster, |u| u.hosts.len() == 1).await;
    assert_eq!(
        recovered.version, 2,
        "two host sets published: never drained between"
    );
    let tokens = tokens(&script);
    let sent: Vec<Option<&str>> = tokens.iter().map(Option::as_deref).collect();
    assert_eq!(
        sent[..4],
        [Some("good"), Some("wrong"), Some("wrong"), Some("good")]
    );
    let stats = cluster.stats().values();
    assert_eq!((stats.acl_denied, stats.source.update_success), (2, 2));
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}

#[tokio::test(start_paused = true)]
async fn a_missing_token_file_is_a_failure_that_sends_nothing() {
    let path = token_file("missing", "good");
    let script = Script::new(vec![Reply::Ok(5, two())]);
    let mut config = ConsulConfig::new("web");
    config.token_file = Some(path.with_file_name("absent"));
    let cluster = start(config, &script);
    let update = wait_state(&cluster, |u| u.initialized).await;
    assert!(update.hosts.is_empty());
    assert!(script.targets().is_empty(), "no query without the token");
    assert!(cluster.stats().values().source.update_failure >= 1);
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}
