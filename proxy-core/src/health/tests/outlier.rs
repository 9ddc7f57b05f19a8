//! Outlier detection: ejection, backoff, max percent, unejection on the sweep.

use std::{sync::Arc, time::Duration};

use tokio::time::Instant;

use super::support::{addr, secs};
use crate::{
    discovery::Host,
    health::{
        cluster_config::OutlierDetection,
        matrix::ClusterMembership,
        outlier::{FailureVerdict, OutlierDetector},
        random::{ExtremeRandom, SeededRandom},
    },
};

fn detector(hosts: u8) -> OutlierDetector {
    let mut od = OutlierDetector::new(
        OutlierDetection::default(),
        Arc::new(SeededRandom::with_seed(3)),
    );
    od.sync_hosts((1..=hosts).map(addr));
    od
}

fn fail_n(od: &mut OutlierDetector, host: u8, n: u32, now: Instant) -> FailureVerdict {
    (0..n)
        .map(|_| od.record_connect_failure(addr(host), now))
        .last()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn five_consecutive_failures_eject_and_success_resets() {
    let mut od = detector(10);
    let now = Instant::now();
    assert_eq!(fail_n(&mut od, 1, 4, now), FailureVerdict::Counted);
    od.record_connect_success(addr(1));
    assert_eq!(fail_n(&mut od, 1, 4, now), FailureVerdict::Counted);
    assert!(!od.is_ejected(addr(1)));
    assert_eq!(
        od.record_connect_failure(addr(1), now),
        FailureVerdict::Ejected
    );
    assert!(od.is_ejected(addr(1)));
    let s = od.stats();
    assert_eq!((s.ejections_active, s.ejections_enforced_total), (1, 1));
    assert_eq!(s.ejections_detected_consecutive_5xx, 1);
}

#[tokio::test(start_paused = true)]
async fn ejection_time_backs_off_and_is_capped() {
    let mut od = detector(10);
    let t0 = Instant::now();
    // Sweep every 10 s from t0, like the driver would.
    let mut uneject_after = Vec::new();
    for _ in 0..12 {
        let ejected_at = tokio::time::Instant::now();
        assert_eq!(fail_n(&mut od, 1, 5, ejected_at), FailureVerdict::Ejected);
        loop {
            tokio::time::advance(secs(10)).await;
            if od.tick(Instant::now()).contains(&addr(1)) {
                break;
            }
        }
        uneject_after.push(Instant::now().duration_since(ejected_at).as_secs());
    }
    // 30 s x ejection count, capped at 300 s.
    assert_eq!(
        uneject_after,
        vec![30, 60, 90, 120, 150, 180, 210, 240, 270, 300, 300, 300]
    );
    assert!(Instant::now() > t0);
}

#[tokio::test(start_paused = true)]
async fn backoff_decays_while_the_host_stays_in() {
    let mut od = detector(10);
    for _ in 0..2 {
        fail_n(&mut od, 1, 5, Instant::now());
        while !od.tick(Instant::now()).contains(&addr(1)) {
            tokio::time::advance(secs(10)).await;
        }
    }
    // Backoff is 2. Stay in for 60 s of sweeps: it decays by one per 30 s -> 0.
    for _ in 0..6 {
        tokio::time::advance(secs(10)).await;
        od.tick(Instant::now());
    }
    let ejected_at = Instant::now();
    fail_n(&mut od, 1, 5, ejected_at);
    tokio::time::advance(secs(30)).await;
    assert_eq!(
        od.tick(Instant::now()),
        vec![addr(1)],
        "back to the base 30 s"
    );
    let _ = ejected_at;
}

#[tokio::test(start_paused = true)]
async fn max_ejection_percent_caps_ejections_but_one_is_always_allowed() {
    // 10 % of 10 hosts = 1 host.
    let mut od = detector(10);
    let now = Instant::now();
    assert_eq!(fail_n(&mut od, 1, 5, now), FailureVerdict::Ejected);
    assert_eq!(fail_n(&mut od, 2, 5, now), FailureVerdict::NotEnforced);
    assert!(!od.is_ejected(addr(2)));
    assert_eq!(od.stats().ejections_overflow, 1);
    assert_eq!(od.stats().ejections_active, 1);
    // 10 % of 3 hosts rounds to nothing, but one host may still be ejected.
    let mut od = detector(3);
    assert_eq!(fail_n(&mut od, 1, 5, now), FailureVerdict::Ejected);
    assert_eq!(fail_n(&mut od, 2, 5, now), FailureVerdict::NotEnforced);
    // 50 % of 4 hosts = 2.
    let cfg = OutlierDetection {
        max_ejection_percent: 50,
        ..Default::default()
    };
    let mut od = OutlierDetector::new(cfg, Arc::new(SeededRandom::with_seed(1)));
    od.sync_hosts((1..=4).map(addr));
    assert_eq!(fail_n(&mut od, 1, 5, now), FailureVerdict::Ejected);
    assert_eq!(fail_n(&mut od, 2, 5, now), FailureVerdict::Ejected);
    assert_eq!(fail_n(&mut od, 3, 5, now), FailureVerdict::NotEnforced);
}

#[tokio::test(start_paused = true)]
async fn enforcement_percentage_zero_detects_without_ejecting() {
    let cfg = OutlierDetection {
        enforcing_consecutive_5xx: 0,
        ..Default::default()
    };
    let mut od = OutlierDetector::new(cfg, Arc::new(ExtremeRandom { max: false }));
    od.sync_hosts([addr(1)]);
    assert_eq!(
        fail_n(&mut od, 1, 5, Instant::now()),
        FailureVerdict::NotEnforced
    );
    assert_eq!(od.stats().ejections_detected_consecutive_5xx, 1);
    assert_eq!(od.stats().ejections_enforced_total, 0);
}

#[tokio::test(start_paused = true)]
async fn ejected_hosts_leave_routing_until_the_sweep_returns_them() {
    let cfg = OutlierDetection {
        consecutive_5xx: 2,
        max_ejection_percent: 100,
        ..Default::default()
    };
    let mut m = ClusterMembership::new(false, 0.0, Some(cfg), Arc::new(SeededRandom::with_seed(1)));
    m.update_hosts(vec![Host::new(addr(1)), Host::new(addr(2))]);
    let now = Instant::now();
    m.record_connect_failure(addr(2), now);
    assert_eq!(
        m.record_connect_failure(addr(2), now),
        FailureVerdict::Ejected
    );
    assert_eq!(m.routing().routable().len(), 1);
    let flags: Vec<String> = m.host_statuses().iter().map(|s| s.flags.render()).collect();
    assert_eq!(flags, vec!["healthy", "/failed_outlier_check"]);
    tokio::time::advance(Duration::from_secs(20)).await;
    assert!(m.outlier_tick(Instant::now()).is_empty());
    tokio::time::advance(Duration::from_secs(10)).await;
    assert_eq!(m.outlier_tick(Instant::now()), vec![addr(2)]);
    assert_eq!(m.routing().routable().len(), 2);
    assert_eq!(m.outlier_stats().unwrap().ejections_active, 0);
}

/// Ejection times as large as a config can write them: backoff and sweep saturate instead of
/// overflowing (which panicked the cluster's loop and froze its routing).
#[tokio::test(start_paused = true)]
async fn huge_ejection_times_saturate() {
    let config = OutlierDetection {
        base_ejection_time: Duration::MAX / 2,
        max_ejection_time: Duration::MAX,
        ..OutlierDetection::default()
    };
    let mut od = OutlierDetector::new(config, Arc::new(SeededRandom::with_seed(3)));
    od.sync_hosts((1..=10).map(addr));
    let now = Instant::now();
    for _ in 0..3 {
        assert_eq!(fail_n(&mut od, 1, 5, now), FailureVerdict::Ejected);
        assert!(od.tick(now).is_empty(), "still ejected");
        od.uneject(addr(1), now);
    }
}
