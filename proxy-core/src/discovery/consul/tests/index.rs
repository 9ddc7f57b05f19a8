//! Blocking-query index handling and the request target.

use super::*;
use crate::discovery::consul::{next_index, query_target, watch::MIN_QUERY_INTERVAL};

#[test]
fn next_index_follows_consuls_blocking_query_guidance() {
    // (sent, returned) -> (next, reset)
    assert_eq!(
        next_index(0, 7),
        (7, false),
        "first answer: block on it next"
    );
    assert_eq!(
        next_index(7, 7),
        (7, false),
        "wait ran out: same index again"
    );
    assert_eq!(
        next_index(7, 9),
        (9, false),
        "change: block on the new index"
    );
    assert_eq!(
        next_index(9, 4),
        (0, true),
        "backwards: restart with a non-blocking query"
    );
    assert_eq!(
        next_index(9, 0),
        (0, true),
        "backwards to 0 is a reset as well"
    );
    assert_eq!(
        next_index(0, 0),
        (1, false),
        "0 is never blocked on: it would spin"
    );
}

#[test]
fn target_carries_dc_tag_index_and_wait_but_never_passing() {
    let mut config = ConsulConfig::new("web api");
    assert_eq!(query_target(&config, 0), "/v1/health/service/web%20api");
    config.datacenter = Some("dc 2".to_owned());
    config.tag = Some("v1/blue".to_owned());
    config.wait = Duration::from_millis(1500);
    assert_eq!(
        query_target(&config, 42),
        "/v1/health/service/web%20api?dc=dc%202&tag=v1%2Fblue&index=42&wait=1500ms"
    );
    config.wait = Duration::from_secs(30);
    assert!(query_target(&config, 5).ends_with("&index=5&wait=30s"));
    assert!(!query_target(&config, 5).contains("passing"));
}

#[tokio::test(start_paused = true)]
async fn first_query_does_not_block_then_each_blocks_on_the_returned_index() {
    let a = inst("a", "127.0.0.2", 80);
    let script = Script::new(vec![
        Reply::Ok(7, body(std::slice::from_ref(&a))),
        Reply::Ok(9, body(&[a])),
    ]);
    let mut config = ConsulConfig::new("web");
    config.datacenter = Some("dc1".to_owned());
    let cluster = start(config, &script);
    script.wait_requests(3).await;
    assert_eq!(
        script.targets(),
        [
            "/v1/health/service/web?dc=dc1",
            "/v1/health/service/web?dc=dc1&index=7&wait=30s",
            "/v1/health/service/web?dc=dc1&index=9&wait=30s",
        ]
    );
    let stats = cluster.stats().values();
    assert_eq!((stats.index, stats.index_reset), (9, 0));
}

#[tokio::test(start_paused = true)]
async fn index_going_backwards_restarts_the_watch_from_zero() {
    let a = inst("a", "127.0.0.2", 80);
    let one = || body(std::slice::from_ref(&a));
    let script = Script::new(vec![
        Reply::Ok(10, one()),
        Reply::Ok(4, one()),
        Reply::Ok(5, one()),
    ]);
    let cluster = start(ConsulConfig::new("web"), &script);
    script.wait_requests(4).await;
    assert_eq!(
        script.targets(),
        [
            "/v1/health/service/web",
            "/v1/health/service/web?index=10&wait=30s",
            "/v1/health/service/web",
            "/v1/health/service/web?index=5&wait=30s",
        ]
    );
    let stats = cluster.stats().values();
    assert_eq!((stats.index, stats.index_reset), (5, 1));
    assert_eq!(stats.source.update_success, 3);
}

#[tokio::test(start_paused = true)]
async fn zero_index_is_waited_on_as_one() {
    let script = Script::new(vec![Reply::Ok(0, json!([])), Reply::Ok(0, json!([]))]);
    let cluster = start(ConsulConfig::new("web"), &script);
    script.wait_requests(3).await;
    assert_eq!(
        script.targets()[1..],
        [
            "/v1/health/service/web?index=1&wait=30s",
            "/v1/health/service/web",
        ],
        "0 after 1 went backwards: reset, never a busy loop on index 0"
    );
    assert_eq!(cluster.stats().values().index_reset, 1);
}

#[tokio::test(start_paused = true)]
async fn queries_start_at_least_the_minimum_interval_apart() {
    let replies = (1..=5).map(|i| Reply::Ok(i, json!([]))).collect();
    let script = Script::new(replies);
    let _cluster = start(ConsulConfig::new("web"), &script);
    script.wait_requests(6).await;
    let times = script.times();
    for pair in times.windows(2) {
        assert!(pair[1] - pair[0] >= MIN_QUERY_INTERVAL, "{times:?}");
    }
}
