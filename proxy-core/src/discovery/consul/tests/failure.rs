//! Failures keep hosts, back off with jitter, and count as Envoy counts them.

use super::*;
use crate::{config::sources::consul::RetryBackoff, discovery::consul::watch::MIN_QUERY_INTERVAL};

fn two() -> Value {
    body(&[inst("a", "127.0.0.2", 80), inst("b", "127.0.0.3", 80)])
}

#[tokio::test(start_paused = true)]
async fn a_failure_keeps_the_hosts_and_is_retried_after_a_backoff() {
    let script = Script::new(vec![
        Reply::Ok(5, two()),
        Reply::Status(500, "rpc error: No cluster leader"),
        Reply::Fail,
        Reply::Ok(6, body(&[inst("a", "127.0.0.2", 80)])),
    ]);
    let cluster = start(ConsulConfig::new("web"), &script);
    let first = wait_state(&cluster, |u| u.initialized).await;
    script.wait_requests(3).await;
    assert_eq!(cluster.current(), first, "a failure changes nothing");
    assert_eq!(addrs(&first), ["127.0.0.2:80", "127.0.0.3:80"]);
    let last = wait_state(&cluster, |u| u.hosts.len() == 1).await;
    assert_eq!(last.version, first.version + 1);
    let targets = script.targets();
    assert_eq!(targets[1], "/v1/health/service/web?index=5&wait=30s");
    assert_eq!(targets[2], targets[1], "retries keep the index");
    assert_eq!(targets[3], targets[1]);
    let times = script.times();
    assert!(
        times[2] - times[1] < Duration::from_secs(1),
        "first retry below base_interval"
    );
    assert!(
        times[3] - times[2] < Duration::from_secs(2),
        "second retry below 2 x base"
    );
    let stats = cluster.stats().values();
    assert_eq!(
        (
            stats.source.update_attempt,
            stats.source.update_success,
            stats.source.update_failure
        ),
        (4, 2, 2)
    );
    assert_eq!(stats.source.membership_change, 2);
    assert_eq!(stats.source.membership_total, 1);
}

#[tokio::test(start_paused = true)]
async fn backoff_bound_doubles_up_to_the_cap_and_resets_after_a_success() {
    let replies = vec![
        Reply::Fail,
        Reply::Fail,
        Reply::Fail,
        Reply::Fail,
        Reply::Fail,
        Reply::Ok(3, json!([])),
        Reply::Fail,
    ];
    let script = Script::new(replies);
    let mut config = ConsulConfig::new("web");
    config.retry_backoff = RetryBackoff {
        base_interval: Duration::from_secs(10),
        max_interval: Duration::from_secs(40),
    };
    let _cluster = start(config, &script);
    script.wait_requests(8).await;
    let times = script.times();
    let gaps: Vec<Duration> = times.windows(2).map(|p| p[1] - p[0]).collect();
    // Delay after failure n is uniform in [0, min(10 s * 2^(n-1), 40 s)).
    let bounds = [10, 20, 40, 40, 40].map(Duration::from_secs);
    for (gap, bound) in gaps.iter().zip(bounds) {
        assert!(*gap < bound.max(MIN_QUERY_INTERVAL * 2), "gaps {gaps:?}");
    }
    assert!(
        gaps[..5].iter().sum::<Duration>() > Duration::from_secs(20),
        "gaps {gaps:?}"
    );
    assert!(
        gaps[5] <= MIN_QUERY_INTERVAL,
        "a success is followed by the next query at once"
    );
    assert!(
        gaps[6] < Duration::from_secs(10),
        "the bound restarts from base: {gaps:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_first_failure_initializes_the_cluster_without_hosts() {
    let script = Script::new(vec![Reply::Fail, Reply::Ok(2, two())]);
    let cluster = start(ConsulConfig::new("web"), &script);
    let update = wait_state(&cluster, |u| u.initialized).await;
    assert_eq!((update.version, update.hosts.len()), (1, 0));
    let update = wait_state(&cluster, |u| u.hosts.len() == 2).await;
    assert_eq!(update.version, 2);
}

#[tokio::test(start_paused = true)]
async fn bad_answers_are_failures() {
    let raw = |headers: &[(&str, &str)], body: &str| {
        Reply::Raw(HttpResponse {
            status: 200,
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect(),
            body: body.as_bytes().to_vec(),
        })
    };
    let script = Script::new(vec![
        Reply::Ok(4, two()),
        Reply::Status(500, "No path to datacenter"),
        raw(&[], "[]"),
        raw(&[("x-consul-index", "abc")], "[]"),
        raw(&[("x-consul-index", "9")], "<html>"),
        raw(&[("x-consul-index", "9")], "{\"Node\": 1}"),
    ]);
    let cluster = start(ConsulConfig::new("web"), &script);
    script.wait_requests(7).await;
    let stats = cluster.stats().values();
    assert_eq!(
        (stats.source.update_success, stats.source.update_failure),
        (1, 5)
    );
    assert_eq!(
        cluster.current().hosts.len(),
        2,
        "hosts kept through every failure"
    );
    assert_eq!(stats.index, 4, "a failed answer's index is not used");
}

#[tokio::test(start_paused = true)]
async fn an_unchanged_answer_publishes_nothing_and_counts_no_rebuild() {
    let script = Script::new(vec![
        Reply::Ok(5, two()),
        Reply::Ok(6, two()),
        Reply::Ok(7, json!(null)),
    ]);
    let cluster = start(ConsulConfig::new("web"), &script);
    script.wait_requests(4).await;
    let update = wait_state(&cluster, |u| u.hosts.is_empty() && u.version == 2).await;
    assert!(update.initialized);
    let stats = cluster.stats().values();
    assert_eq!(
        (
            stats.source.update_no_rebuild,
            stats.source.membership_change
        ),
        (1, 2)
    );
    assert_eq!(
        stats.source.membership_total, 0,
        "a deregistered service leaves no hosts"
    );
}

#[tokio::test(start_paused = true)]
async fn stats_have_envoy_names() {
    let script = Script::new(vec![Reply::Ok(5, two())]);
    let cluster = start(ConsulConfig::new("web"), &script);
    wait_state(&cluster, |u| u.initialized).await;
    script.wait_requests(2).await;
    let stats: std::collections::BTreeMap<String, u64> =
        cluster.named_stats().into_iter().collect();
    for (name, value) in [
        ("cluster.web.update_attempt", 2),
        ("cluster.web.update_success", 1),
        ("cluster.web.update_failure", 0),
        ("cluster.web.update_no_rebuild", 0),
        ("cluster.web.membership_total", 2),
        ("cluster.web.consul.index", 5),
    ] {
        assert_eq!(stats.get(name), Some(&value), "{name} in {stats:?}");
    }
    assert_eq!(cluster.cluster_name(), "web");
    assert!(cluster.drain_on_change());
}

/// An entry Consul accepts but no host can be made of (a port of -1 or 70000) is skipped with a
/// log line and the `instances_skipped` gauge; the answer's other entries, and every later
/// answer, are used. Before, such an entry made every answer fail to parse and froze the hosts.
#[tokio::test(start_paused = true)]
async fn one_bad_entry_is_skipped_and_never_freezes_the_rest() {
    let with_bad = |port: i64, good: &[Inst]| {
        let mut value = body(good);
        let mut bad = body(&[inst("bad", "127.0.0.9", 80)])[0].clone();
        bad["Service"]["Port"] = serde_json::json!(port);
        value.as_array_mut().unwrap().push(bad);
        value
    };
    let script = Script::new(vec![
        Reply::Ok(4, with_bad(-1, &[inst("a", "127.0.0.2", 80)])),
        Reply::Ok(
            5,
            with_bad(
                70000,
                &[inst("a", "127.0.0.2", 80), inst("b", "127.0.0.3", 80)],
            ),
        ),
    ]);
    let cluster = start(ConsulConfig::new("web"), &script);
    let first = wait_state(&cluster, |u| u.initialized).await;
    assert_eq!(addrs(&first), ["127.0.0.2:80"]);
    let later = wait_state(&cluster, |u| u.hosts.len() == 2).await;
    assert_eq!(addrs(&later), ["127.0.0.2:80", "127.0.0.3:80"]);
    let stats = cluster.stats().values();
    assert_eq!(
        stats.source.update_failure, 0,
        "a bad entry is not a failed answer"
    );
    assert_eq!(stats.instances_skipped, 1);
}

/// The time from cluster `a`'s first success to cluster `b`'s next query, where `b` failed eight
/// times first (its backoff bound at the 30 s cap) and `a` starts then, fails once and recovers;
/// both on one agent or each on its own.
async fn b_retry_after_a_recovers(shared: bool) -> Duration {
    let agent = super::super::recovery::alone();
    let mut replies_b = vec![Reply::Ok(5, two())];
    replies_b.extend((0..8).map(|_| Reply::Fail));
    replies_b.push(Reply::Ok(6, two()));
    let mut script_b = Script::new(replies_b);
    let mut script_a = Script::new(vec![Reply::Fail, Reply::Ok(6, two())]);
    if shared {
        script_b = script_b.on_agent(&agent);
        script_a = script_a.on_agent(&agent);
    }
    let _b = start(ConsulConfig::new("web"), &script_b);
    script_b.wait_requests(9).await;
    let _a = start(ConsulConfig::new("web"), &script_a);
    script_a.wait_requests(2).await;
    let recovered = script_a.times()[1];
    script_b.wait_requests(10).await;
    script_b.times()[9] - recovered
}

/// After the agent is back (one watch on it succeeds after failing), a watch waiting out a long
/// backoff retries within `base_interval` (1 s), not after the rest of its delay.
#[tokio::test(start_paused = true)]
async fn a_watch_retries_within_base_once_another_on_its_agent_recovers() {
    let shared = b_retry_after_a_recovers(true).await;
    assert!(shared < Duration::from_secs(1), "{shared:?}");
    // The same seeds, each watch on its own agent: b waits out its own delay.
    let alone = b_retry_after_a_recovers(false).await;
    assert!(alone > Duration::from_secs(1), "{alone:?}");
}
