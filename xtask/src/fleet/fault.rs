//! `cargo xtask fleet --fault KIND`: control-plane faults through a running fleet, each a test.
//! Every node runs a connect loop (round robin over services whose hosts stay up) from before
//! the fault until after recovery; the fault is made and recovered from; then one
//! control-plane change must reach every node's kernel within `--bound-s`. The run fails when a
//! loop saw one failed connect, when the change did not converge, or when the fault's own
//! check (re-election, reconnect, versions resumed) did not hold. See docs/fleet.md.

mod actions;

use std::{
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use serde::Serialize;

use super::{
    ControlPlane, Fleet, Options, backend_of,
    connect_loop::{Counts, Plan},
    net,
    node::Node,
    probe::Expect,
    svc, sys,
};
use crate::util::{detail, step};

/// The faults `--fault` makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FaultKind {
    /// xDS: the server stopped, away for a while, started again with the same resources.
    XdsRestart,
    /// Consul: the leader server killed (SIGKILL), re-election, then started again.
    ConsulLeader,
    /// Consul: one follower server cut off from the two others (nft), then joined again.
    ConsulPartition,
    /// Consul: node 1's client agent stopped (it leaves) and started again.
    ConsulAgent,
    /// Either: the last node's daemon stopped and started again during a burst of changes.
    DaemonRestart,
    /// Every fault of the chosen control plane, one after another on one fleet.
    All,
}

/// Services each node's connect loop goes round (after the `changes` that start without an
/// instance), and services the daemon-restart burst moves (after those).
pub const LOOP_SERVICES: u32 = 4;
pub const BURST: u32 = 20;
/// The loops' pace and their bound (longer than any fault with its recovery).
const LOOP_INTERVAL: Duration = Duration::from_millis(20);
const LOOP_BOUND: Duration = Duration::from_secs(900);
/// The daemons' default cap of their retry backoff (Consul's `retry_backoff.max_interval` and
/// the xDS `retry_back_off`): a watch or stream that failed during a fault may sleep up to this
/// long before it asks again, so changes after recovery get `--bound-s` plus this.
pub const RETRY_CAP: Duration = Duration::from_secs(30);
/// Loops run this long before the fault and after the change, as a baseline.
const SETTLE: Duration = Duration::from_secs(1);

impl FaultKind {
    /// The faults this kind runs on `plane`, or why it cannot run there.
    pub fn expand(self, plane: ControlPlane) -> anyhow::Result<Vec<Self>> {
        use FaultKind::{
            All, ConsulAgent, ConsulLeader, ConsulPartition, DaemonRestart, XdsRestart,
        };
        let all = match plane {
            ControlPlane::Consul => vec![ConsulLeader, ConsulPartition, ConsulAgent, DaemonRestart],
            ControlPlane::Xds => vec![XdsRestart, DaemonRestart],
        };
        match self {
            All => Ok(all),
            k if all.contains(&k) => Ok(vec![k]),
            k => bail!(
                "--fault {} needs --control-plane {}",
                k.name(),
                if k == XdsRestart { "xds" } else { "consul" }
            ),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::XdsRestart => "xds-restart",
            Self::ConsulLeader => "consul-leader",
            Self::ConsulPartition => "consul-partition",
            Self::ConsulAgent => "consul-agent",
            Self::DaemonRestart => "daemon-restart",
            Self::All => "all",
        }
    }
}

/// Refuses a fault run the fleet's shape cannot carry.
pub fn validate(opts: &Options, kind: FaultKind) -> anyhow::Result<()> {
    let faults = kind.expand(opts.control_plane)?;
    if opts.changes < faults.len() as u32 {
        bail!(
            "--changes must be at least {} with --fault {}: each fault's closing change adds one \
             of the services that start without an instance",
            faults.len(),
            kind.name()
        );
    }
    let need = opts.changes + LOOP_SERVICES + BURST;
    if opts.services < need {
        bail!(
            "--services must be at least {need} with --fault (--changes, then {LOOP_SERVICES} \
             services the connect loops use, then {BURST} the daemon-restart burst moves)"
        );
    }
    Ok(())
}

/// One fault's outcome.
#[derive(Debug, Default, Serialize)]
pub struct Outcome {
    pub fault: String,
    /// What exactly was done (which server, which node, how long).
    pub what: String,
    /// From the fault to the control plane whole again (a leader known to every server, the
    /// agent answering, every node's stream back, the daemon ready), milliseconds.
    pub recovery_ms: Option<f64>,
    /// xds-restart: each node's first request on the restarted server, milliseconds after it
    /// was ready, and the resource versions that request named (resumed, not started over).
    pub reconnect_ms: Vec<Option<f64>>,
    pub resumed_versions: Vec<usize>,
    /// daemon-restart: per node, checked service by service after the burst (and after the
    /// restarted daemon is ready): the latest time a moved service was first seen at its new
    /// backend, milliseconds after the burst's last change (0 when each already was when
    /// checked; None: one was not within the bound), and how many had to be waited for.
    pub burst_ms: Vec<Option<f64>>,
    pub burst_waited: Vec<u32>,
    /// The change made after recovery: per node, its convergence time (None: not within the
    /// bound).
    pub change_ms: Vec<Option<f64>>,
    /// Consul: when the change was in the leader's catalog (read by the harness, polling every
    /// 10 ms while the nodes' probes wait): Consul's own share of `change_ms`.
    pub catalog_ms: Option<f64>,
    /// Per node, the connect loop's counts.
    pub loops: Vec<Counts>,
    pub duration_s: f64,
}

impl Outcome {
    /// What makes this fault's test fail, each with its node; empty when it passed.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        let f = &self.fault;
        for (n, c) in (1..).zip(&self.loops) {
            if c.failed > 0 {
                let first = c.first_failure.as_deref().unwrap_or("-");
                out.push(format!(
                    "{f}: node {n}: {} of {} connects failed (first: {first})",
                    c.failed, c.attempts
                ));
            }
            if c.bounded {
                out.push(format!(
                    "{f}: node {n}: the connect loop ended at its bound"
                ));
            }
            if c.attempts == 0 {
                out.push(format!("{f}: node {n}: the connect loop made no connect"));
            }
        }
        for (what, times) in [("change", &self.change_ms), ("burst", &self.burst_ms)] {
            for (n, t) in (1..).zip(times) {
                if t.is_none() {
                    out.push(format!("{f}: node {n}: the {what} did not converge"));
                }
            }
        }
        if self.change_ms.is_empty() {
            out.push(format!("{f}: no change was made after recovery"));
        }
        for (n, t) in (1..).zip(&self.reconnect_ms) {
            if t.is_none() {
                out.push(format!("{f}: node {n}: did not reconnect"));
            }
        }
        for (n, v) in (1..).zip(&self.resumed_versions) {
            if *v == 0 {
                out.push(format!("{f}: node {n}: resubscribed without its versions"));
            }
        }
        out
    }

    /// Highest minus lowest reconnect time: the spread of the nodes' backoff.
    pub fn reconnect_spread_ms(&self) -> Option<f64> {
        let t: Vec<f64> = self.reconnect_ms.iter().flatten().copied().collect();
        let max = t.iter().copied().reduce(f64::max)?;
        let min = t.iter().copied().reduce(f64::min)?;
        Some(max - min)
    }
}

/// The run's results file.
#[derive(Serialize)]
struct Results<'a> {
    control_plane: &'a str,
    nodes: u32,
    services: u32,
    bring_up_s: f64,
    faults: &'a [Outcome],
    problems: Vec<String>,
}

/// Runs `kind`'s faults one after another on the ready fleet; writes the results under
/// `out_dir`; fails if any fault's test failed.
pub fn run(
    fleet: &mut Fleet,
    opts: &Options,
    kind: FaultKind,
    (dir, out_dir): (&Path, &Path),
    bring_up_s: f64,
) -> anyhow::Result<()> {
    let faults = kind.expand(opts.control_plane)?;
    let mut outcomes = Vec::new();
    for (f, fault) in (0..).zip(faults) {
        step(format!("fault {}", fault.name()));
        let t = Instant::now();
        let mut outcome = one(fleet, opts, fault, f, dir)?;
        outcome.duration_s = t.elapsed().as_secs_f64();
        print_outcome(&outcome);
        outcomes.push(outcome);
    }
    let problems: Vec<String> = outcomes.iter().flat_map(Outcome::problems).collect();
    let plane = match opts.control_plane {
        ControlPlane::Consul => "consul",
        ControlPlane::Xds => "xds",
    };
    let results = Results {
        control_plane: plane,
        nodes: opts.nodes,
        services: opts.services,
        bring_up_s,
        faults: &outcomes,
        problems: problems.clone(),
    };
    let file = out_dir.join(format!("faults-{plane}-{}.json", super::timestamp()));
    std::fs::write(&file, serde_json::to_vec_pretty(&results)?)?;
    step(format!("fault results in {}", file.display()));
    if !problems.is_empty() {
        bail!("the faults' tests failed:\n  {}", problems.join("\n  "));
    }
    Ok(())
}

/// Loops on, the fault and its recovery, the closing change (service `svc-f`), loops off.
fn one(
    fleet: &mut Fleet,
    opts: &Options,
    fault: FaultKind,
    f: u32,
    dir: &Path,
) -> anyhow::Result<Outcome> {
    let plan = Plan {
        interval: LOOP_INTERVAL,
        bound: LOOP_BOUND,
        targets: (opts.changes..opts.changes + LOOP_SERVICES)
            .map(|j| (vip_addr(j), backend_of(opts, j)))
            .collect(),
    };
    let net = fleet.net.as_ref().context("no network")?;
    for node in &mut fleet.nodes {
        node.start_loop(net, &plan)?;
    }
    std::thread::sleep(SETTLE);
    let mut outcome = match fault {
        FaultKind::XdsRestart => actions::xds_restart(fleet)?,
        FaultKind::ConsulLeader => actions::consul_leader(fleet)?,
        FaultKind::ConsulPartition => actions::consul_partition(fleet)?,
        FaultKind::ConsulAgent => actions::consul_agent(fleet)?,
        FaultKind::DaemonRestart => actions::daemon_restart(fleet, opts, dir)?,
        FaultKind::All => unreachable!("expanded"),
    };
    outcome.fault = fault.name().to_owned();
    (outcome.change_ms, outcome.catalog_ms) = closing_change(fleet, opts, f)?;
    std::thread::sleep(SETTLE);
    for node in &mut fleet.nodes {
        outcome.loops.push(node.stop_loop()?);
    }
    Ok(outcome)
}

/// Service `svc-f` gets its instance (registered, or its endpoint pushed); every node must
/// serve it within the bound.
fn closing_change(
    fleet: &mut Fleet,
    opts: &Options,
    f: u32,
) -> anyhow::Result<(Vec<Option<f64>>, Option<f64>)> {
    let backend = backend_of(opts, f);
    let want = Expect::Up(backend);
    let bound = after_fault_bound(opts);
    arm_all(&mut fleet.nodes, vip_addr(f), &want, bound, true)?;
    let mut catalog_ms = None;
    let t0 = match (&fleet.cluster, fleet.xds.as_mut()) {
        (Some(c), _) => {
            let body = super::consul::registration(&svc(f), backend);
            let t0 = c.put(super::consul::REGISTER, Some(&body))?;
            let deadline = Instant::now() + bound;
            while Instant::now() < deadline {
                if c.catalog_has(&svc(f))? {
                    catalog_ms = Some(ms_since(t0, sys::monotonic_ns()));
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            t0
        }
        (None, Some(x)) => x.push_endpoints(f, Some(backend))?,
        (None, None) => bail!("no control plane"),
    };
    Ok((seen_all(&mut fleet.nodes, t0)?, catalog_ms))
}

/// Arms every node's probe; with `fresh`, a node that already sees `want` is an error (the
/// change has not been made yet).
fn arm_all(
    nodes: &mut [Node],
    addr: SocketAddr,
    want: &Expect,
    bound: Duration,
    fresh: bool,
) -> anyhow::Result<Vec<bool>> {
    let mut armed = Vec::new();
    for node in nodes.iter_mut() {
        sys::check_interrupted()?;
        let a = node.arm(addr, want, bound)?;
        if fresh && !a {
            bail!(
                "node {} saw {addr} {} before the change",
                node.index,
                want.word()
            );
        }
        armed.push(a);
    }
    Ok(armed)
}

/// Each armed node's time since `t0`, in milliseconds (None: not within the bound).
fn seen_all(nodes: &mut [Node], t0: u64) -> anyhow::Result<Vec<Option<f64>>> {
    nodes
        .iter_mut()
        .map(|n| Ok(n.seen()?.map(|t| ms_since(t0, t))))
        .collect()
}

/// How long a change made after a fault may take to reach a node: `--bound-s` plus
/// [`RETRY_CAP`].
fn after_fault_bound(opts: &Options) -> Duration {
    Duration::from_secs(opts.bound_s) + RETRY_CAP
}

fn ms_since(t0: u64, t: u64) -> f64 {
    t.saturating_sub(t0) as f64 / 1e6
}

fn vip_addr(j: u32) -> SocketAddr {
    SocketAddr::from((net::vip(j), net::VIP_PORT))
}

fn print_outcome(o: &Outcome) {
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
    let list = |v: &[Option<f64>]| v.iter().map(|t| ms(*t)).collect::<Vec<_>>().join(" ");
    detail(format!("{}: {}", o.fault, o.what));
    detail(format!(
        "recovery {} ms; change after recovery per node (ms): {}{}",
        ms(o.recovery_ms),
        list(&o.change_ms),
        o.catalog_ms.map_or_else(String::new, |c| format!(
            "; in Consul's catalog after {c:.0} ms"
        ))
    ));
    for (n, c) in (1..).zip(&o.loops) {
        detail(format!(
            "node {n}: {} connects, {} failed{}",
            c.attempts,
            c.failed,
            c.first_failure
                .as_deref()
                .map_or_else(String::new, |f| format!(" (first: {f})"))
        ));
    }
    if !o.reconnect_ms.is_empty() {
        detail(format!(
            "reconnects after the server was back (ms): {}; spread {} ms; versions resumed: {:?}",
            list(&o.reconnect_ms),
            ms(o.reconnect_spread_ms()),
            o.resumed_versions
        ));
    }
    if !o.burst_ms.is_empty() {
        detail(format!(
            "burst: per node, last moved service seen at its new backend (ms after the last \
             change; 0: all already were when checked): {}; services waited for: {:?}",
            list(&o.burst_ms),
            o.burst_waited
        ));
    }
    detail(format!("took {:.1} s", o.duration_s));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_means_every_fault_of_the_control_plane_and_a_mismatch_is_refused() {
        use FaultKind::{
            All, ConsulAgent, ConsulLeader, ConsulPartition, DaemonRestart, XdsRestart,
        };
        assert_eq!(
            All.expand(ControlPlane::Consul).unwrap(),
            [ConsulLeader, ConsulPartition, ConsulAgent, DaemonRestart]
        );
        assert_eq!(
            All.expand(ControlPlane::Xds).unwrap(),
            [XdsRestart, DaemonRestart]
        );
        assert_eq!(
            DaemonRestart.expand(ControlPlane::Xds).unwrap(),
            [DaemonRestart]
        );
        let err = XdsRestart
            .expand(ControlPlane::Consul)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--control-plane xds"), "{err}");
        let err = ConsulLeader
            .expand(ControlPlane::Xds)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--control-plane consul"), "{err}");
    }

    fn passed() -> Outcome {
        Outcome {
            fault: "xds-restart".into(),
            change_ms: vec![Some(40.0), Some(55.0)],
            reconnect_ms: vec![Some(300.0), Some(1200.0)],
            resumed_versions: vec![60, 60],
            loops: vec![
                Counts {
                    attempts: 400,
                    ..Counts::default()
                };
                2
            ],
            ..Outcome::default()
        }
    }

    #[test]
    fn a_clean_fault_passes_and_reports_the_reconnect_spread() {
        let o = passed();
        assert_eq!(o.problems(), Vec::<String>::new());
        assert_eq!(o.reconnect_spread_ms(), Some(900.0));
        assert_eq!(Outcome::default().reconnect_spread_ms(), None);
    }

    #[test]
    fn one_failed_connect_or_one_node_that_did_not_converge_fails_the_fault() {
        let mut o = passed();
        o.loops[1].failed = 1;
        o.loops[1].first_failure = Some("5,10.96.0.11:8080,refused".into());
        let p = o.problems();
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("node 2: 1 of 400 connects failed"), "{p:?}");
        let mut o = passed();
        o.change_ms[0] = None;
        o.burst_ms = vec![Some(10.0), None];
        o.reconnect_ms[0] = None;
        o.resumed_versions[1] = 0;
        o.loops[0].bounded = true;
        let p = o.problems().join("\n");
        for want in [
            "node 1: the change did not converge",
            "node 2: the burst did not converge",
            "node 1: did not reconnect",
            "node 2: resubscribed without its versions",
            "node 1: the connect loop ended at its bound",
        ] {
            assert!(p.contains(want), "{want:?} missing from {p}");
        }
        let mut o = passed();
        o.change_ms.clear();
        assert!(o.problems()[0].contains("no change was made"));
    }

    #[test]
    fn a_fault_run_needs_room_for_its_changes_loops_and_burst() {
        let mut opts =
            crate::fleet::parse(&["--nodes", "3", "--services", "50", "--changes", "10"]).unwrap();
        assert!(validate(&opts, FaultKind::All).is_ok());
        opts.services = 30;
        let err = validate(&opts, FaultKind::All).unwrap_err().to_string();
        assert!(err.contains("at least 34"), "{err}");
        opts.services = 50;
        opts.changes = 3;
        let err = validate(&opts, FaultKind::All).unwrap_err().to_string();
        assert!(err.contains("at least 4"), "{err}");
    }
}
