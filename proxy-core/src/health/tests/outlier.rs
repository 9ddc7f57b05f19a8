//! Outlier detection: the four detectors, ejection, backoff, max percent, unejection on the
//! sweep. The expected behaviour is Envoy 1.40's (source/common/upstream/
//! outlier_detection_impl.cc): which results count for which detector, the ejected share
//! counting the host about to be ejected, backoff decaying per sweep once a host has been back
//! for an interval.

use std::{sync::Arc, time::Duration};

use tokio::time::Instant;

use super::support::{addr, secs};
use crate::{
    health::{
        cluster_config::OutlierDetection,
        matrix::ClusterMembership,
        outlier::{FailureVerdict, OutlierDetector, PassiveResult},
        random::{ExtremeRandom, SeededRandom},
    },
    host::Host,
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
            od.tick(Instant::now());
            if !od.is_ejected(addr(1)) {
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

/// Ejects host 1 twice (backoff 2), returning when the second ejection is over.
async fn ejected_twice(od: &mut OutlierDetector) {
    for _ in 0..2 {
        fail_n(od, 1, 5, Instant::now());
        while od.is_ejected(addr(1)) {
            tokio::time::advance(secs(10)).await;
            od.tick(Instant::now());
        }
    }
}

/// How long an ejection of host 1 starting now lasts, in whole sweeps of 10 s.
async fn next_ejection(od: &mut OutlierDetector) -> u64 {
    let ejected_at = Instant::now();
    assert_eq!(fail_n(od, 1, 5, ejected_at), FailureVerdict::Ejected);
    while od.is_ejected(addr(1)) {
        tokio::time::advance(secs(10)).await;
        od.tick(Instant::now());
    }
    Instant::now().duration_since(ejected_at).as_secs()
}

#[tokio::test(start_paused = true)]
async fn backoff_decays_by_one_per_sweep_once_back_for_an_interval() {
    // Back for less than an interval: no decay, so the next ejection is the third (90 s).
    let mut od = detector(10);
    ejected_twice(&mut od).await;
    assert_eq!(next_ejection(&mut od).await, 90);
    // One sweep an interval after coming back: backoff 2 -> 1, next ejection 60 s.
    let mut od = detector(10);
    ejected_twice(&mut od).await;
    tokio::time::advance(secs(10)).await;
    od.tick(Instant::now());
    assert_eq!(next_ejection(&mut od).await, 60);
    // Two such sweeps: backoff 0, back to the base 30 s.
    let mut od = detector(10);
    ejected_twice(&mut od).await;
    for _ in 0..2 {
        tokio::time::advance(secs(10)).await;
        od.tick(Instant::now());
    }
    assert_eq!(next_ejection(&mut od).await, 30);
}

#[tokio::test(start_paused = true)]
async fn max_ejection_percent_counts_the_host_about_to_be_ejected() {
    // 10 % of 10 hosts = 1 host.
    let mut od = detector(10);
    let now = Instant::now();
    assert_eq!(fail_n(&mut od, 1, 5, now), FailureVerdict::Ejected);
    assert_eq!(fail_n(&mut od, 2, 5, now), FailureVerdict::NotEnforced);
    assert!(!od.is_ejected(addr(2)));
    // Host 2's fifth 503 was found by the gateway and the 5xx detectors: two overflows.
    assert_eq!(od.stats().ejections_overflow, 2);
    assert_eq!(od.stats().ejections_active, 1);
    // 1 of 3 hosts is 33 %, over the default 10 %: Envoy 1.40 ejects none...
    let mut od = detector(3);
    assert_eq!(fail_n(&mut od, 1, 5, now), FailureVerdict::NotEnforced);
    assert_eq!(od.stats().ejections_overflow, 2);
    // ...unless one host may always be ejected.
    let cfg = OutlierDetection {
        always_eject_one_host: true,
        ..Default::default()
    };
    let mut od = OutlierDetector::new(cfg, Arc::new(SeededRandom::with_seed(1)));
    od.sync_hosts((1..=3).map(addr));
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

fn record_n(od: &mut OutlierDetector, host: u8, status: u16, n: u32) -> FailureVerdict {
    let now = Instant::now();
    (0..n)
        .map(|_| od.record(addr(host), PassiveResult(status), now))
        .last()
        .unwrap()
}

/// A 503 is a 5xx and a gateway failure: with the defaults both detectors see the fifth, the
/// gateway detector first, which is not enforced (0 %); the 5xx one ejects.
#[tokio::test(start_paused = true)]
async fn gateway_failures_are_detected_and_enforced_only_when_asked() {
    let mut od = detector(10);
    assert_eq!(record_n(&mut od, 1, 503, 5), FailureVerdict::Ejected);
    let s = od.stats();
    assert_eq!(s.ejections_detected_consecutive_gateway_failure, 1);
    assert_eq!(s.ejections_enforced_consecutive_gateway_failure, 0);
    assert_eq!(s.ejections_detected_consecutive_5xx, 1);
    assert_eq!(s.ejections_enforced_consecutive_5xx, 1);
    // Enforced gateway detector, 5xx detector off: 502, 503 and 504 count; a 500 breaks the
    // gateway run (not the 5xx one); anything else breaks both.
    let cfg = OutlierDetection {
        consecutive_5xx: 0,
        enforcing_consecutive_gateway_failure: 100,
        max_ejection_percent: 100,
        ..Default::default()
    };
    let mut od = OutlierDetector::new(cfg, Arc::new(SeededRandom::with_seed(1)));
    od.sync_hosts((1..=2).map(addr));
    let now = Instant::now();
    for status in [502, 504, 503, 502, 500, 502, 503, 504, 404, 502, 503] {
        assert_eq!(
            od.record(addr(1), PassiveResult(status), now),
            FailureVerdict::Counted
        );
    }
    assert_eq!(record_n(&mut od, 1, 504, 3), FailureVerdict::Ejected);
    assert_eq!(od.stats().ejections_enforced_consecutive_gateway_failure, 1);
    assert_eq!(od.stats().ejections_detected_consecutive_5xx, 0);
}

/// Only 5xx results count for consecutive_5xx: a 4xx or a 2xx ends the run.
#[tokio::test(start_paused = true)]
async fn a_non_5xx_status_ends_the_run() {
    let mut od = detector(10);
    assert_eq!(record_n(&mut od, 1, 500, 4), FailureVerdict::Counted);
    assert_eq!(record_n(&mut od, 1, 404, 1), FailureVerdict::Counted);
    assert_eq!(record_n(&mut od, 1, 500, 4), FailureVerdict::Counted);
    assert_eq!(record_n(&mut od, 1, 200, 1), FailureVerdict::Counted);
    assert_eq!(record_n(&mut od, 1, 500, 4), FailureVerdict::Counted);
    assert_eq!(record_n(&mut od, 1, 500, 1), FailureVerdict::Ejected);
}

/// One interval of results: `ok` successes and `bad` 500s for each host, then the sweep.
async fn interval_of(od: &mut OutlierDetector, results: &[(u8, u32, u32)]) -> bool {
    for &(host, ok, bad) in results {
        for _ in 0..ok {
            od.record(addr(host), PassiveResult(200), Instant::now());
        }
        for _ in 0..bad {
            od.record(addr(host), PassiveResult(500), Instant::now());
        }
    }
    tokio::time::advance(secs(10)).await;
    od.tick(Instant::now())
}

/// Envoy's worked example: success rates {50, 100, 100, 100, 100} give mean 90, deviation 20
/// and threshold 90 - 1.9 x 20 = 52, so the first host is an outlier. 1 of 5 hosts is 20 %:
/// over the default 10 % it is counted as an overflow, within 20 % it is ejected.
#[tokio::test(start_paused = true)]
async fn success_rate_ejects_hosts_below_mean_minus_deviations() {
    let detected = [
        (1, 50, 50),
        (2, 100, 0),
        (3, 100, 0),
        (4, 100, 0),
        (5, 100, 0),
    ];
    // Interleaved failures never reach five in a row: only the rate can find host 1.
    let no_runs = OutlierDetection {
        consecutive_5xx: 1000,
        consecutive_gateway_failure: 1000,
        ..Default::default()
    };
    let mut od = OutlierDetector::new(no_runs.clone(), Arc::new(SeededRandom::with_seed(1)));
    od.sync_hosts((1..=5).map(addr));
    assert!(!interval_of(&mut od, &detected).await);
    assert_eq!(od.stats().ejections_detected_success_rate, 1);
    assert_eq!(od.stats().ejections_overflow, 1);
    let cfg = OutlierDetection {
        max_ejection_percent: 20,
        ..no_runs.clone()
    };
    let mut od = OutlierDetector::new(cfg, Arc::new(SeededRandom::with_seed(1)));
    od.sync_hosts((1..=5).map(addr));
    assert!(interval_of(&mut od, &detected).await);
    assert!(od.is_ejected(addr(1)));
    assert_eq!(od.stats().ejections_enforced_success_rate, 1);
    // A host below the request volume (99) does not count, leaving four hosts: too few.
    let cfg = OutlierDetection {
        max_ejection_percent: 100,
        ..no_runs
    };
    let mut od = OutlierDetector::new(cfg, Arc::new(SeededRandom::with_seed(1)));
    od.sync_hosts((1..=5).map(addr));
    let low = [
        (1, 50, 50),
        (2, 100, 0),
        (3, 100, 0),
        (4, 100, 0),
        (5, 99, 0),
    ];
    assert!(!interval_of(&mut od, &low).await);
    assert_eq!(od.stats().ejections_detected_success_rate, 0);
}

/// Failure percentage: a host failing at least 85 % of at least 50 requests, among five such
/// hosts, is detected; enforcement is 0 % unless asked for.
#[tokio::test(start_paused = true)]
async fn failure_percentage_detects_and_enforces_only_when_asked() {
    let results = [(1, 5, 45), (2, 50, 0), (3, 50, 0), (4, 50, 0), (5, 50, 0)];
    let base = OutlierDetection {
        consecutive_5xx: 1000,
        consecutive_gateway_failure: 1000,
        // Keep the success-rate detector out of it (it needs 100 requests per host).
        max_ejection_percent: 100,
        ..Default::default()
    };
    let mut od = OutlierDetector::new(base.clone(), Arc::new(SeededRandom::with_seed(1)));
    od.sync_hosts((1..=5).map(addr));
    assert!(!interval_of(&mut od, &results).await);
    assert_eq!(od.stats().ejections_detected_failure_percentage, 1);
    assert!(!od.is_ejected(addr(1)));
    let cfg = OutlierDetection {
        enforcing_failure_percentage: 100,
        ..base
    };
    let mut od = OutlierDetector::new(cfg, Arc::new(SeededRandom::with_seed(1)));
    od.sync_hosts((1..=5).map(addr));
    assert!(interval_of(&mut od, &results).await);
    assert!(od.is_ejected(addr(1)));
    assert_eq!(od.stats().ejections_enforced_failure_percentage, 1);
    // Results of an earlier interval do not count: the next sweep sees none.
    assert_eq!(od.stats().ejections_detected_failure_percentage, 1);
}

/// `max_ejection_time` unset is the larger of 300 s and `base_ejection_time`, as in Envoy.
#[tokio::test(start_paused = true)]
async fn max_ejection_time_defaults_to_at_least_the_base() {
    let cfg = OutlierDetection {
        base_ejection_time: secs(600),
        ..Default::default()
    };
    assert_eq!(cfg.max_ejection_time(), secs(600));
    let mut od = OutlierDetector::new(cfg, Arc::new(SeededRandom::with_seed(3)));
    od.sync_hosts((1..=10).map(addr));
    assert_eq!(next_ejection(&mut od).await, 600);
    let below = OutlierDetection {
        max_ejection_time_set: Some(secs(10)),
        ..Default::default()
    };
    assert!(
        below
            .validate()
            .unwrap_err()
            .to_string()
            .contains("max_ejection_time cannot be smaller than base_ejection_time")
    );
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
    assert!(!m.outlier_tick(Instant::now()), "still ejected");
    tokio::time::advance(Duration::from_secs(10)).await;
    assert!(m.outlier_tick(Instant::now()), "unejected");
    assert_eq!(m.routing().routable().len(), 2);
    assert_eq!(m.outlier_stats().unwrap().ejections_active, 0);
}

/// Ejection times as large as a config can write them: backoff and sweep saturate instead of
/// overflowing (which panicked the cluster's loop and froze its routing).
#[tokio::test(start_paused = true)]
async fn huge_ejection_times_saturate() {
    let config = OutlierDetection {
        base_ejection_time: Duration::MAX / 2,
        max_ejection_time_set: Some(Duration::MAX),
        ..OutlierDetection::default()
    };
    let mut od = OutlierDetector::new(config, Arc::new(SeededRandom::with_seed(3)));
    od.sync_hosts((1..=10).map(addr));
    let now = Instant::now();
    for _ in 0..3 {
        assert_eq!(fail_n(&mut od, 1, 5, now), FailureVerdict::Ejected);
        assert!(!od.tick(now), "still ejected");
        od.uneject(addr(1), now);
    }
}

/// A passing active check unejects at once by default
/// (`successful_active_health_check_uneject_host`); switched off, the host waits out its
/// ejection.
#[tokio::test(start_paused = true)]
async fn a_passing_health_check_unejects_unless_switched_off() {
    use crate::health::state::HostHealth;
    for uneject in [true, false] {
        let cfg = OutlierDetection {
            consecutive_5xx: 1,
            max_ejection_percent: 100,
            successful_active_health_check_uneject_host: uneject,
            ..Default::default()
        };
        let mut m =
            ClusterMembership::new(true, 0.0, Some(cfg), Arc::new(SeededRandom::with_seed(1)));
        m.update_hosts(vec![Host::new(addr(1)), Host::new(addr(2))]);
        m.set_active_health(addr(1), HostHealth::default());
        m.set_active_health(addr(2), HostHealth::default());
        assert_eq!(
            m.record_connect_failure(addr(2), Instant::now()),
            FailureVerdict::Ejected
        );
        m.set_active_health(addr(2), HostHealth::default());
        assert_eq!(m.routing().routable().len(), if uneject { 2 } else { 1 });
    }
}
