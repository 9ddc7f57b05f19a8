//! `policy.endpoint_stale_after` on paused time: the lease every accepted assignment restarts,
//! the hosts removed when it runs out, and Envoy's two counters.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use envoy_types::pb::{
    envoy::config::endpoint::v3::{ClusterLoadAssignment, cluster_load_assignment::Policy},
    google::protobuf,
};
use tokio::sync::watch;

use super::fixtures::{cla, ports, sotw};
use crate::discovery::{
    SourceUpdate,
    xds::{
        ClusterStats,
        state::{EdsState, Sink, watch_leases},
    },
};

/// One cluster reading resource `web`, its state driven by the lease task as the client runs it.
struct Leased {
    state: Arc<Mutex<EdsState>>,
    rx: watch::Receiver<SourceUpdate>,
    stats: Arc<ClusterStats>,
    task: tokio::task::JoinHandle<()>,
}

impl Leased {
    fn start() -> Self {
        let (tx, rx) = watch::channel(SourceUpdate::default());
        let stats = Arc::new(ClusterStats::default());
        let sink = Sink {
            cluster: "web".into(),
            tx,
            stats: Arc::clone(&stats),
        };
        let state = Arc::new(Mutex::new(EdsState::new(vec![("web".into(), sink)])));
        let leases = state.lock().unwrap().leases();
        let task = tokio::spawn(watch_leases(Arc::clone(&state), leases));
        Self {
            state,
            rx,
            stats,
            task,
        }
    }

    fn apply(&self, version: &str, assignment: ClusterLoadAssignment) {
        self.state
            .lock()
            .unwrap()
            .apply_sotw(&sotw(version, version, &[assignment]))
            .expect("accepted");
    }

    fn ports(&self) -> Vec<u16> {
        ports(&self.rx.borrow())
    }

    /// (assignment_timeout_received, assignment_stale).
    fn counters(&self) -> (u64, u64) {
        let v = self.stats.values();
        (v.assignment_timeout_received, v.assignment_stale)
    }
}

impl Drop for Leased {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn leased(ports: &[u32], lease: Option<Duration>) -> ClusterLoadAssignment {
    let mut assignment = cla("web", ports);
    assignment.policy = lease.map(|lease| Policy {
        endpoint_stale_after: Some(protobuf::Duration {
            seconds: i64::try_from(lease.as_secs()).unwrap(),
            nanos: i32::try_from(lease.subsec_nanos()).unwrap(),
        }),
        ..Default::default()
    });
    assignment
}

/// Lets the lease task run at the current (paused) time.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn hosts_are_removed_when_the_lease_runs_out_and_come_back_with_the_next_assignment() {
    let web = Leased::start();
    web.apply("1", leased(&[80, 81], Some(Duration::from_secs(5))));
    settle().await;
    assert_eq!(web.ports(), [80, 81]);
    assert_eq!(web.counters(), (1, 0));
    tokio::time::sleep(Duration::from_millis(4999)).await;
    settle().await;
    assert_eq!(web.ports(), [80, 81], "still within the lease");
    tokio::time::sleep(Duration::from_millis(1)).await;
    settle().await;
    assert_eq!(web.ports(), Vec::<u16>::new(), "the lease ran out");
    let update = web.rx.borrow().clone();
    assert_eq!(
        update.removed.len(),
        2,
        "both hosts removed as discovery drops them"
    );
    assert_eq!(web.counters(), (1, 1));
    assert_eq!(web.stats.values().source.membership_total, 0);
    // Nothing more while nothing comes.
    tokio::time::sleep(Duration::from_secs(60)).await;
    settle().await;
    assert_eq!(web.counters(), (1, 1));
    web.apply("2", leased(&[82], Some(Duration::from_secs(5))));
    settle().await;
    assert_eq!(web.ports(), [82]);
    assert_eq!(web.counters(), (2, 1));
}

#[tokio::test(start_paused = true)]
async fn every_assignment_restarts_the_lease_and_one_without_it_ends_it() {
    let web = Leased::start();
    web.apply("1", leased(&[80], Some(Duration::from_secs(5))));
    tokio::time::sleep(Duration::from_secs(4)).await;
    // The same hosts again, before the lease runs out: a new lease of 5 s from now.
    web.apply("2", leased(&[80], Some(Duration::from_secs(5))));
    tokio::time::sleep(Duration::from_secs(4)).await;
    settle().await;
    assert_eq!(
        web.ports(),
        [80],
        "8 s after the first, 4 s into the second lease"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    settle().await;
    assert_eq!(web.ports(), Vec::<u16>::new());
    assert_eq!(web.counters(), (2, 1));
    // Without the field, no lease: the hosts stay for good.
    web.apply("3", leased(&[81], Some(Duration::from_secs(1))));
    web.apply("4", leased(&[81], None));
    tokio::time::sleep(Duration::from_secs(3600)).await;
    settle().await;
    assert_eq!(web.ports(), [81]);
    assert_eq!(web.counters(), (3, 1));
}
