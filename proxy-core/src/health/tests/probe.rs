//! Probe scheduling and sharing under paused tokio time.

use std::{
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use tokio::time::{Instant, sleep};

use super::support::{Script, ScriptFactory, addr, secs, spec};
use crate::{
    health::{
        cluster::ClusterHealth,
        cluster_config::ClusterHealthConfig,
        manager::HealthCheckManager,
        random::{ExtremeRandom, Random, SeededRandom},
        state::{CheckOutcome, FailureKind},
        stats::HealthCheckStats,
    },
    host::Host,
};

fn manager(script: &Arc<Script>, random: Arc<dyn Random>) -> HealthCheckManager {
    HealthCheckManager::new(Arc::new(ScriptFactory(Arc::clone(script))), random)
}

fn offsets(start: Instant, calls: &[Instant]) -> Vec<Duration> {
    calls.iter().map(|t| t.duration_since(start)).collect()
}

const TCP_CLUSTER: &str = "health_checks: [{timeout: 1s, interval: 5s, unhealthy_threshold: 2, \
                           healthy_threshold: 2, tcp_health_check: {}}]";

/// A cluster with its subscription to the manager's events, as its event loop holds them.
struct Subscribed {
    health: ClusterHealth,
    events: tokio::sync::broadcast::Receiver<crate::health::HealthEvent>,
}

impl Subscribed {
    fn pump_events(&mut self) -> usize {
        self.health.pump_events(&mut self.events)
    }
}

impl std::ops::Deref for Subscribed {
    type Target = ClusterHealth;

    fn deref(&self) -> &ClusterHealth {
        &self.health
    }
}

impl std::ops::DerefMut for Subscribed {
    fn deref_mut(&mut self) -> &mut ClusterHealth {
        &mut self.health
    }
}

fn cluster(name: &str, yaml: &str, mgr: &HealthCheckManager) -> Subscribed {
    let cfg: ClusterHealthConfig = serde_norway::from_str(yaml).unwrap();
    Subscribed {
        events: mgr.subscribe(),
        health: ClusterHealth::new(name, &cfg, mgr, Arc::new(SeededRandom::with_seed(1))).unwrap(),
    }
}

#[tokio::test(start_paused = true)]
async fn no_traffic_interval_until_traffic_then_interval() {
    let script = Arc::new(Script::default());
    let mgr = manager(&script, Arc::new(ExtremeRandom { max: false }));
    let start = Instant::now();
    let stats = Arc::new(HealthCheckStats::default());
    let (_probe, health) = mgr.register("c", addr(1), &Arc::new(spec()), &stats);
    assert!(health.pending);
    sleep(secs(130)).await;
    assert_eq!(
        offsets(start, &script.calls(addr(1))),
        vec![secs(0), secs(60), secs(120)]
    );
    mgr.note_traffic("c");
    sleep(secs(62)).await; // the 180 s check is already scheduled; then every 5 s
    let calls = offsets(start, &script.calls(addr(1)));
    assert_eq!(&calls[3..], &[secs(180), secs(185), secs(190)]);
    assert_eq!(stats.attempt.load(Ordering::Relaxed), 6);
    assert_eq!(stats.success.load(Ordering::Relaxed), 6);
}

#[tokio::test(start_paused = true)]
async fn initial_jitter_delays_only_the_first_check() {
    let script = Arc::new(Script::default());
    let mgr = manager(&script, Arc::new(ExtremeRandom { max: true }));
    mgr.note_traffic("c");
    let mut sp = spec();
    sp.initial_jitter = Duration::from_millis(1000);
    sp.interval_jitter = Duration::from_millis(100);
    let start = Instant::now();
    mgr.register("c", addr(1), &Arc::new(sp), &Arc::default());
    sleep(secs(12)).await;
    let ms = Duration::from_millis;
    assert_eq!(
        offsets(start, &script.calls(addr(1))),
        vec![ms(999), ms(6098), ms(11197)]
    );
}

#[tokio::test(start_paused = true)]
async fn edge_and_unhealthy_intervals_follow_the_transitions() {
    let script = Arc::new(Script::default());
    let mgr = manager(&script, Arc::new(ExtremeRandom { max: false }));
    mgr.note_traffic("c");
    let mut sp = spec();
    sp.unhealthy_threshold = 2;
    sp.unhealthy_interval = secs(7);
    sp.unhealthy_edge_interval = secs(1);
    sp.healthy_edge_interval = secs(2);
    let start = Instant::now();
    mgr.register("c", addr(1), &Arc::new(sp), &Arc::default());
    sleep(Duration::from_millis(1)).await; // t=0 check: healthy, next at 5
    script.set(addr(1), CheckOutcome::Failed(FailureKind::Network));
    // 5: fail (pending) -> +1 edge; 6: fail (changed) -> +7; 13: fail -> +7 = 20.
    sleep(secs(16)).await;
    script.set(addr(1), CheckOutcome::Healthy);
    // 20: ok (pending) -> +2 edge; 22: ok (changed) -> +5 = 27.
    sleep(secs(12)).await;
    let got = offsets(start, &script.calls(addr(1)));
    assert_eq!(got, [0, 5, 6, 13, 20, 22, 27].map(secs).to_vec());
}

#[tokio::test(start_paused = true)]
async fn two_clusters_one_host_share_one_probe() {
    let script = Arc::new(Script::default());
    let mgr = manager(&script, Arc::new(ExtremeRandom { max: false }));
    let mut a = cluster("a", TCP_CLUSTER, &mgr);
    let mut b = cluster("b", TCP_CLUSTER, &mgr);
    a.update_hosts(vec![Host::new(addr(1)), Host::new(addr(2))]);
    b.update_hosts(vec![Host::new(addr(1))]);
    assert_eq!(mgr.probe_count(), 2, "one probe per distinct host");
    assert_eq!(script.builds.load(Ordering::Relaxed), 2);
    sleep(Duration::from_millis(1)).await;
    a.pump_events();
    b.pump_events();
    assert_eq!(
        script.calls(addr(1)).len(),
        1,
        "one check serves both clusters"
    );
    assert_eq!(a.routing().routable().len(), 2);
    assert_eq!(b.routing().routable().len(), 1);
    // Both clusters count the shared check in their own stats.
    let attempts = |c: &ClusterHealth, name: &str| {
        c.stats()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
    };
    assert_eq!(attempts(&a, "cluster.a.health_check.attempt"), Some(2));
    assert_eq!(attempts(&b, "cluster.b.health_check.attempt"), Some(1));
    assert_eq!(attempts(&b, "cluster.b.health_check.healthy"), Some(1));
    // A third cluster joining later gets the known health without waiting for a check.
    let mut c = cluster("c", TCP_CLUSTER, &mgr);
    c.update_hosts(vec![Host::new(addr(1))]);
    assert_eq!(c.routing().routable().len(), 1);
    drop(c);
    drop(a);
    assert_eq!(mgr.probe_count(), 1, "b still uses 127.0.0.1");
    drop(b);
    assert_eq!(mgr.probe_count(), 0);
    let before = script.calls(addr(1)).len();
    sleep(secs(300)).await;
    assert_eq!(
        script.calls(addr(1)).len(),
        before,
        "stopped probes do not check"
    );
}

#[tokio::test(start_paused = true)]
async fn http_probes_differ_when_host_defaults_to_the_cluster_name() {
    let script = Arc::new(Script::default());
    let mgr = manager(&script, Arc::new(ExtremeRandom { max: false }));
    let implicit = "health_checks: [{timeout: 1s, interval: 5s, unhealthy_threshold: 2, \
                    healthy_threshold: 2, http_health_check: {path: /h}}]";
    let explicit = "health_checks: [{timeout: 1s, interval: 5s, unhealthy_threshold: 2, \
                    healthy_threshold: 2, http_health_check: {path: /h, host: shared}}]";
    let mut a = cluster("a", implicit, &mgr);
    let mut b = cluster("b", implicit, &mgr);
    a.update_hosts(vec![Host::new(addr(1))]);
    b.update_hosts(vec![Host::new(addr(1))]);
    assert_eq!(mgr.probe_count(), 2);
    let mut c = cluster("c", explicit, &mgr);
    let mut d = cluster("d", explicit, &mgr);
    c.update_hosts(vec![Host::new(addr(1))]);
    d.update_hosts(vec![Host::new(addr(1))]);
    assert_eq!(mgr.probe_count(), 3);
}

#[tokio::test(start_paused = true)]
async fn failing_host_leaves_routing_after_the_threshold() {
    let script = Arc::new(Script::default());
    let mgr = manager(&script, Arc::new(ExtremeRandom { max: false }));
    mgr.note_traffic("a");
    let mut a = cluster("a", TCP_CLUSTER, &mgr);
    a.update_hosts(vec![Host::new(addr(1)), Host::new(addr(2))]);
    assert!(
        a.routing().routable().is_empty(),
        "pending hosts wait for their first check"
    );
    sleep(Duration::from_millis(1)).await;
    a.pump_events();
    assert_eq!(a.routing().routable().len(), 2);
    script.set(addr(2), CheckOutcome::Failed(FailureKind::Network));
    sleep(secs(5)).await; // one failure: pending
    a.pump_events();
    assert_eq!(a.routing().routable().len(), 2);
    sleep(secs(5)).await; // second failure: unhealthy (threshold 2)
    a.pump_events();
    let routable = a.routing().routable();
    assert_eq!(
        routable.iter().map(|h| h.addr).collect::<Vec<_>>(),
        vec![addr(1)]
    );
    let flags: Vec<String> = a.host_statuses().iter().map(|s| s.flags.render()).collect();
    assert_eq!(
        flags,
        vec!["healthy".to_owned(), "/failed_active_hc".to_owned()]
    );
    script.set(addr(2), CheckOutcome::Failed(FailureKind::Immediate));
    script.set(addr(1), CheckOutcome::Failed(FailureKind::Immediate));
    sleep(secs(5)).await; // immediate: no threshold
    a.pump_events();
    // Both failed: 0 % healthy < 50 % panic threshold -> route to all.
    let routing = a.routing();
    assert!(routing.priorities[0].panic);
    assert_eq!(routing.routable().len(), 2);
}

/// A reload starts a changed cluster's new instance before the old one stops: both register
/// the same probe under the same name. The probe (and the host's health) is kept, and after the
/// old instance goes, checks count in the new instance's stats, not the old one's.
#[tokio::test(start_paused = true)]
async fn a_replaced_cluster_instance_keeps_the_probe_and_counts_in_its_own_stats() {
    let script = Arc::new(Script::default());
    let mgr = manager(&script, Arc::new(ExtremeRandom { max: false }));
    mgr.note_traffic("c");
    let spec = Arc::new(spec());
    let (old, new) = (
        Arc::new(HealthCheckStats::default()),
        Arc::new(HealthCheckStats::default()),
    );
    let (probe, _) = mgr.register("c", addr(1), &spec, &old);
    sleep(secs(6)).await; // checks at 0 and 5
    let (same, health) = mgr.register("c", addr(1), &spec, &new);
    assert_eq!(same, probe, "the probe is shared, not restarted");
    assert!(!health.pending, "its health so far is kept");
    mgr.unregister("c", probe, &old);
    assert_eq!(mgr.probe_count(), 1, "the new instance still uses it");
    sleep(secs(10)).await; // checks at 10 and 15
    assert_eq!(old.attempt.load(Ordering::Relaxed), 2);
    assert_eq!(new.attempt.load(Ordering::Relaxed), 2);
    mgr.unregister("c", probe, &new);
    assert_eq!(mgr.probe_count(), 0, "the last user stopped it");
}

/// `health_check_config`: a host whose checks go to another port is judged by that port (its
/// own is never checked); a host whose checks are disabled routes at once without a probe; a
/// changed target moves the probe.
#[tokio::test(start_paused = true)]
async fn a_hosts_health_check_config_moves_or_disables_its_probe() {
    use crate::host::HealthCheckTarget;
    let script = Arc::new(Script::default());
    let mgr = manager(&script, Arc::new(ExtremeRandom { max: false }));
    mgr.note_traffic("a");
    let mut a = cluster("a", TCP_CLUSTER, &mgr);
    let mut moved = Host::new(addr(1));
    moved.detail_mut().health_check = HealthCheckTarget {
        port: Some(9000),
        ..HealthCheckTarget::default()
    };
    let mut unchecked = Host::new(addr(2));
    unchecked.detail_mut().health_check.disabled = true;
    let check_port = std::net::SocketAddr::new(addr(1).ip(), 9000);
    script.set(check_port, CheckOutcome::Failed(FailureKind::Immediate));
    a.update_hosts(vec![moved.clone(), unchecked]);
    assert_eq!(mgr.probe_count(), 1, "the unchecked host has no probe");
    sleep(Duration::from_millis(1)).await;
    a.pump_events();
    let routable: Vec<_> = a.routing().routable().iter().map(|h| h.addr).collect();
    assert_eq!(routable, vec![addr(2)], "host 1 fails at its check port");
    assert!(
        script.calls(addr(1)).is_empty(),
        "its own port is never checked"
    );
    assert!(!script.calls(check_port).is_empty());

    // Its checks move back to its own port (healthy): the probe follows.
    moved.detail_mut().health_check = HealthCheckTarget::default();
    let mut unchecked = Host::new(addr(2));
    unchecked.detail_mut().health_check.disabled = true;
    a.update_hosts(vec![moved, unchecked]);
    assert_eq!(mgr.probe_count(), 1);
    sleep(Duration::from_millis(1)).await;
    a.pump_events();
    assert_eq!(a.routing().routable().len(), 2);
}
