//! The scenario rows (S0-S6 on loopback and veth, at 1 / 1,000 / 10,000 services), which
//! metrics each measures, and running one row: set up its state (daemon, nft table, proxy
//! peer), measure, tear it down.

use std::{
    collections::BTreeMap,
    net::{SocketAddr, SocketAddrV4},
};

use super::{
    Env,
    measure::{self, Ctx, Metric, Sample},
    peers::{self, Peer},
    topo::{self, CONN, Daemon, NatTable, Net, Path2},
    worker,
};

/// Port offset of the servers S6 starts inside the cgroup.
const LOCAL_OFFSET: u16 = 300;

#[derive(Clone, Debug)]
pub enum Kind {
    /// S0: straight to the backend.
    Direct,
    /// S1: the daemon publishes `services` connect-rate VIPs; `non_vip` dials the backend
    /// directly from inside the cgroup.
    Kernel { services: u32, non_vip: bool },
    /// S4/S5/S6: the daemon with a feature switched on in its config (`proxy check` must accept
    /// it first, see `features`); `direct` dials the backend (S6: local pairs spliced).
    Feature {
        tweak: fn(&mut serde_json::Value),
        direct: bool,
    },
    /// S2: nft DNAT with `rules` connect-rate services.
    Dnat { rules: u32 },
    /// S2b: a nat table that matches nothing.
    NatIdle,
    /// S3: nft REDIRECT to a userspace proxy.
    Redirect(Peer),
    /// S3 ours: nft REDIRECT to the daemon's proxy listeners (`iptables_redirect`: the original
    /// destination from SO_ORIGINAL_DST); the client is outside the cgroup.
    RedirectOurs { tweak: fn(&mut serde_json::Value) },
}

#[derive(Clone, Debug)]
pub struct Row {
    pub id: String,
    pub scenario: &'static str,
    pub path: Path2,
    pub kind: Kind,
    pub metrics: Vec<Metric>,
}

fn full(smoke: bool) -> Vec<Metric> {
    if smoke {
        return vec![
            Metric::Bulk { streams: 1 },
            Metric::Integrity,
            Metric::Rr { size: 1, conns: 1 },
            Metric::OpenLoop { rate: 1000 },
            Metric::Cps,
        ];
    }
    vec![
        Metric::Bulk { streams: 1 },
        Metric::Bulk { streams: 4 },
        Metric::Integrity,
        Metric::Rr { size: 1, conns: 1 },
        Metric::Rr { size: 1, conns: 16 },
        Metric::Rr {
            size: 1024,
            conns: 1,
        },
        Metric::Rr {
            size: 1024,
            conns: 16,
        },
        Metric::OpenLoop { rate: 1000 },
        Metric::OpenLoop { rate: 10000 },
        Metric::Cps,
    ]
}

fn short() -> Vec<Metric> {
    vec![Metric::Rr { size: 1, conns: 1 }, Metric::Cps]
}

/// An S1 row: the daemon with `services` connect-rate VIPs; `non_vip` dials the backend.
fn kernel(path: Path2, variant: &str, services: u32, non_vip: bool, metrics: Vec<Metric>) -> Row {
    row(
        "S1",
        path,
        variant,
        Kind::Kernel { services, non_vip },
        metrics,
    )
}

fn row(
    scenario: &'static str,
    path: Path2,
    variant: &str,
    kind: Kind,
    metrics: Vec<Metric>,
) -> Row {
    Row {
        id: format!("{scenario} {} {variant}", path.name())
            .trim()
            .to_owned(),
        scenario,
        path,
        kind,
        metrics,
    }
}

/// Every row of a full run, or the smoke run's four.
pub fn rows(smoke: bool) -> Vec<Row> {
    use Path2::{Lo, Veth};
    if smoke {
        return vec![
            row("S0", Lo, "", Kind::Direct, full(true)),
            kernel(
                Lo,
                "svc=1",
                1,
                false,
                vec![
                    Metric::Rr { size: 1, conns: 1 },
                    Metric::Cps,
                    Metric::Idle { conns: 100 },
                ],
            ),
            // The veth path's own machinery: the daemon in the client's namespace, its paired
            // baseline, and a proxy fed by an nft REDIRECT there; with S4, a side-by-side unit.
            kernel(Veth, "svc=1", 1, false, vec![Metric::Cps]),
            row(
                "S3",
                Veth,
                "ours",
                Kind::RedirectOurs {
                    tweak: proxy_redirect,
                },
                vec![Metric::Cps],
            ),
            row(
                "S4",
                Veth,
                "ours",
                Kind::Feature {
                    tweak: proxy_mode,
                    direct: false,
                },
                vec![Metric::Cps, Metric::Rr { size: 1, conns: 1 }],
            ),
        ];
    }
    let mut idle_full = full(false);
    idle_full.extend([Metric::Idle { conns: 1000 }, Metric::Idle { conns: 10000 }]);
    let veth_set = veth();
    let nat_idle = vec![
        Metric::Bulk { streams: 1 },
        Metric::Rr { size: 1, conns: 1 },
        Metric::Cps,
    ];
    let mut rows = vec![
        row("S0", Lo, "", Kind::Direct, full(false)),
        row("S0", Veth, "", Kind::Direct, veth_set.clone()),
        kernel(Lo, "svc=1", 1, false, idle_full.clone()),
        kernel(Lo, "svc=1000", 1000, false, short()),
        kernel(Lo, "svc=10000", 10000, false, short()),
        kernel(Lo, "non-VIP", 1000, true, short()),
        kernel(Veth, "svc=1", 1, false, veth_set.clone()),
        row("S2", Lo, "rules=1", Kind::Dnat { rules: 1 }, full(false)),
        row("S2", Lo, "rules=1000", Kind::Dnat { rules: 1000 }, short()),
        row(
            "S2",
            Lo,
            "rules=10000",
            Kind::Dnat { rules: 10000 },
            short(),
        ),
        row("S2", Veth, "rules=1", Kind::Dnat { rules: 1 }, veth_set),
        row("S2b", Lo, "", Kind::NatIdle, nat_idle.clone()),
        row("S2b", Veth, "", Kind::NatIdle, nat_idle),
    ];
    for p in Peer::ALL {
        rows.push(row(
            "S3",
            Lo,
            p.name(),
            Kind::Redirect(p),
            idle_full.clone(),
        ));
        rows.push(row("S3", Veth, p.name(), Kind::Redirect(p), veth()));
    }
    rows
}

/// The metrics of the veth rows: bulk, the integrity check (mandatory where S5 splices), RR and
/// connections; what the S1 and proxy targets judge on that path.
fn veth() -> Vec<Metric> {
    vec![
        Metric::Bulk { streams: 1 },
        Metric::Bulk { streams: 4 },
        Metric::Integrity,
        Metric::Rr { size: 1, conns: 1 },
        Metric::Rr {
            size: 1024,
            conns: 16,
        },
        Metric::Cps,
    ]
}

/// What a run shuffles and runs as one: a row, or the rows that the targets compare with each
/// other, run side by side.
pub enum Unit {
    Row(Row),
    SideBySide(Vec<Row>),
}

impl Unit {
    pub fn path(&self) -> Path2 {
        match self {
            Unit::Row(r) => r.path,
            Unit::SideBySide(rows) => rows[0].path,
        }
    }
}

/// The proxy rows (S3's four proxies, S4, S5) are judged against each other, and the machine
/// drifts by more than their differences over the minutes between two rows of a shuffled run
/// (so does the S0 row they would be divided by). So the proxy rows of one path run as one
/// unit, metric by metric: each metric is measured for every row of the unit in a random order
/// before the next metric, and the targets compare the rows run by run.
fn side_by_side(r: &Row) -> bool {
    matches!(r.scenario, "S3" | "S4" | "S5")
}

/// `rows` as units: every row on its own except the proxy rows, one unit per path.
pub fn units(rows: Vec<Row>) -> Vec<Unit> {
    let mut out = Vec::new();
    let mut groups: Vec<Vec<Row>> = Vec::new();
    for r in rows {
        if !side_by_side(&r) {
            out.push(Unit::Row(r));
        } else if let Some(g) = groups.iter_mut().find(|g| g[0].path == r.path) {
            g.push(r);
        } else {
            groups.push(vec![r]);
        }
    }
    out.extend(groups.into_iter().map(Unit::SideBySide));
    out
}

/// Runs a unit in `run`: a row's metrics, or side by side, each metric of a unit's rows for
/// every row that measures it (in a random order), each with the row's own set-up and teardown.
pub fn run_unit(
    env: &Env,
    net: &Net,
    u: &Unit,
    run: u32,
    backends: &[u32],
    rng: &mut worker::Rng,
) -> Vec<Sample> {
    let rows = match u {
        Unit::Row(r) => return run_row(env, net, r, run, backends, rng),
        Unit::SideBySide(rows) => rows,
    };
    let mut metrics: Vec<Metric> = Vec::new();
    for m in rows.iter().flat_map(|r| &r.metrics) {
        if !metrics.contains(m) {
            metrics.push(*m);
        }
    }
    let mut out = Vec::new();
    for m in metrics {
        let mut measuring: Vec<&Row> = rows.iter().filter(|r| r.metrics.contains(&m)).collect();
        rng.shuffle(&mut measuring);
        for r in measuring {
            if super::sys::interrupted() {
                return out;
            }
            let one = Row {
                metrics: vec![m],
                ..r.clone()
            };
            out.extend(run_row(env, net, &one, run, backends, rng));
        }
    }
    out
}

/// Runs one row's metrics in `run`; set-up failures become error samples.
pub fn run_row(
    env: &Env,
    net: &Net,
    r: &Row,
    run: u32,
    backends: &[u32],
    rng: &mut worker::Rng,
) -> Vec<Sample> {
    match run_row_inner(env, net, r, run, backends, rng) {
        Ok(s) => s,
        Err(e) => vec![Sample {
            run,
            pair: 0,
            row: r.id.clone(),
            scenario: r.scenario.to_owned(),
            path: r.path.name().to_owned(),
            metric: "setup".into(),
            values: BTreeMap::default(),
            other_load: 0.0,
            unaccounted: 0.0,
            valid: false,
            error: Some(format!("{e:#}")),
            superseded: false,
        }],
    }
}

fn run_row_inner(
    env: &Env,
    net: &Net,
    r: &Row,
    run: u32,
    backends: &[u32],
    rng: &mut worker::Rng,
) -> anyhow::Result<Vec<Sample>> {
    let mut ours = backends.to_vec();
    // Dropped in reverse order: the proxy (ours or a peer) stops before its nat table goes.
    // Packets after the table is deleted are no longer tracked, so connections the proxy
    // closed later stayed in conntrack half-closed, with their REDIRECT binding, for minutes;
    // a later NAT row's connect that reused such a client port was sent to the dead
    // listener and refused (seen as S2 errors right after an S3 row).
    let (mut _table, mut daemon, mut _peer) = (None, None, None);
    let mut cgroup = None;
    let direct = |p: u16| net.backend(p);
    // S6's servers run inside the cgroup, on the backend ports + LOCAL_OFFSET.
    let local = |p: u16| net.backend(p + LOCAL_OFFSET);
    let mut _local_backends = Vec::new();
    let vip = |p: u16| SocketAddr::V4(SocketAddrV4::new(net.vip, p));
    let via_vip = vip;
    let mut target: &dyn Fn(u16) -> SocketAddr = &via_vip;
    let mut cps = (vip(CONN), 1);
    let dir = env.dir.as_path();
    match &r.kind {
        Kind::Direct => {
            target = &direct;
            cps = (net.backend(CONN), 1);
        }
        Kind::Kernel { services, non_vip } => {
            let d = Daemon::start(&env.proxy, dir, net, *services, &|_| {})?;
            ours.push(d.proc.pid());
            cgroup = Some(d.cgroup.clone());
            if *non_vip {
                target = &direct;
                cps = (net.backend(CONN), 1);
            } else {
                cps = (
                    SocketAddr::V4(SocketAddrV4::new(net.vip_n(0), CONN)),
                    *services,
                );
            }
            daemon = Some(d);
        }
        Kind::Feature {
            tweak,
            direct: dial_direct,
        } => {
            let d = Daemon::start(&env.proxy, dir, net, 0, tweak)?;
            ours.push(d.proc.pid());
            cgroup = Some(d.cgroup.clone());
            if *dial_direct {
                // Both ends in the cgroup, so sockops sees (and splices) both sockets.
                _local_backends =
                    net.start_backends_at(&env.worker, LOCAL_OFFSET, Some(&d.cgroup))?;
                target = &local;
                cps = (local(CONN), 1);
            }
            daemon = Some(d);
        }
        Kind::Dnat { rules } => {
            _table = Some(nat_table(net, &topo::dnat_rules(net, *rules))?);
            cps = (
                SocketAddr::V4(SocketAddrV4::new(net.vip_n(0), CONN)),
                *rules,
            );
        }
        Kind::NatIdle => {
            _table = Some(nat_table(
                net,
                "  ip daddr 127.77.255.254 tcp dport 1 dnat to 127.0.0.1:1\n",
            )?);
            target = &direct;
            cps = (net.backend(CONN), 1);
        }
        Kind::RedirectOurs { tweak } => {
            let d = Daemon::start(&env.proxy, dir, net, 0, tweak)?;
            ours.push(d.proc.pid());
            daemon = Some(d);
            _table = Some(nat_table(net, &peers::redirect_rules(net))?);
        }
        Kind::Redirect(peer) => {
            let p = peers::start(*peer, dir, net, env.envoy.as_deref())?;
            ours.push(p.pid());
            _peer = Some(p);
            _table = Some(nat_table(net, &peers::redirect_rules(net))?);
        }
    }
    // S1's paired baseline: the same client straight to the backend from outside the cgroup,
    // where none of the daemon's programs runs, with the daemon up and counted as ours.
    let baseline = Ctx {
        worker: env.worker.as_path(),
        net,
        cgroup: None,
        ours: ours.clone(),
        secs: env.secs,
        quiet_wait: env.quiet_wait,
        target: &direct,
        cps: (net.backend(CONN), 1),
    };
    let ctx = Ctx {
        worker: env.worker.as_path(),
        net,
        cgroup,
        ours,
        secs: env.secs,
        quiet_wait: env.quiet_wait,
        target,
        cps,
    };
    let ready_s = daemon.as_ref().map(|d: &Daemon| d.publish_s);
    Ok(measure_metrics(env, r, run, &ctx, &baseline, ready_s, rng))
}

/// Loads `rules` as the benchmark's nat table in the client's namespace of `net`.
fn nat_table(net: &Net, rules: &str) -> anyhow::Result<NatTable> {
    NatTable::load(net.client_ns.as_deref(), rules)
}

/// Measures each metric of row `r` in `ctx`, with the paired S0 measurements in `baseline`
/// that [`pairs_of`] asks for, each taken again while stolen (`--steal-limit`).
fn measure_metrics(
    env: &Env,
    r: &Row,
    run: u32,
    ctx: &Ctx<'_>,
    baseline: &Ctx<'_>,
    ready_s: Option<f64>,
    rng: &mut worker::Rng,
) -> Vec<Sample> {
    let paired_id = paired_baseline(&r.id);
    let mut out = Vec::new();
    for m in &r.metrics {
        let pairs = pairs_of(r, *m);
        let measure_row = |pair: u32| {
            let mut s = measure::measure(ctx, *m, run, &r.id, r.scenario);
            s.pair = pair;
            if let Some(t) = ready_s {
                s.values.insert("daemon_ready_s".into(), t);
            }
            s
        };
        let measure_baseline = |pair: u32| {
            let mut s = measure::measure(baseline, *m, run, &paired_id, "S0");
            s.pair = pair;
            s
        };
        let show = |s: &Sample| {
            crate::util::detail(summary(s));
            if measure::stolen(s, env.steal_limit) {
                crate::util::detail(format!(
                    "steal over the limit of {:.2} cores (`--steal-limit`)",
                    env.steal_limit.unwrap_or_default()
                ));
            }
        };
        if pairs == 0 {
            out.extend(measure::steal_checked(
                env.steal_limit,
                env.steal_retries,
                || vec![measure_row(0)],
                show,
            ));
            continue;
        }
        for pair in 0..pairs {
            // The order within a pair is random, so neither side always runs warm.
            let baseline_first = rng.next() & 1 == 0;
            let take_pair = || {
                let mut v = Vec::with_capacity(2);
                if baseline_first {
                    v.push(measure_baseline(pair));
                }
                v.push(measure_row(pair));
                if !baseline_first {
                    v.push(measure_baseline(pair));
                }
                v
            };
            out.extend(measure::steal_checked(
                env.steal_limit,
                env.steal_retries,
                take_pair,
                show,
            ));
        }
    }
    out
}

/// Paired S0 measurements of metric `m` of row `r` per run: [`PAIRS`] for a kernel-path (S1)
/// metric judged as a ratio to S0 (not the integrity check, not idle memory), else none.
fn pairs_of(r: &Row, m: Metric) -> u32 {
    let judged = !matches!(m, Metric::Integrity | Metric::Idle { .. });
    if matches!(r.kind, Kind::Kernel { .. }) && judged {
        PAIRS
    } else {
        0
    }
}

/// The paired measurements that `samples` of `runs` runs of `rows` lack, each side of a pair
/// named (the smoke run's check that pairing works).
pub fn missing_pairs(rows: &[Row], samples: &[Sample], runs: u32) -> Vec<String> {
    let mut missing = Vec::new();
    for r in rows {
        for m in &r.metrics {
            let metric = m.key();
            for run in 0..runs {
                for pair in 0..pairs_of(r, *m) {
                    for row in [r.id.clone(), paired_baseline(&r.id)] {
                        let found = samples.iter().any(|s| {
                            s.row == row && s.metric == metric && s.run == run && s.pair == pair
                        });
                        if !found {
                            missing.push(format!("{row} {metric} run {run} pair {pair}"));
                        }
                    }
                }
            }
        }
    }
    missing
}

/// Paired measurements per S1 metric and run. Back to back, an S1 measurement and its S0 can
/// still differ by far more than the S1 targets allow when a burst of a shared host's load hits
/// one of them (either side); the run's ratio is the median of its pairs, so one such burst
/// does not decide it.
pub const PAIRS: u32 = 3;

/// How the row id of a paired baseline ends.
pub const PAIRED_SUFFIX: &str = " (paired S0)";

/// Row id of the S0 measurements paired with `row`'s (see `Table::vs_s0`).
pub fn paired_baseline(row: &str) -> String {
    format!("{row}{PAIRED_SUFFIX}")
}

pub fn summary(s: &Sample) -> String {
    let main = [
        "gbps",
        "tps",
        "cps",
        "p50_us",
        "ok",
        "rss_mib",
        "cpu_cores",
        "services_x1_ms",
        "sockets_per_s",
        "unavailable",
    ]
    .iter()
    .find_map(|k| s.values.get(*k).map(|v| format!("{k}={v:.3}")))
    .unwrap_or_default();
    let flag = if s.valid { "" } else { " INVALID" };
    let err = s
        .error
        .as_deref()
        .map(|e| format!(" error: {e}"))
        .unwrap_or_default();
    let run = if s.row.ends_with(PAIRED_SUFFIX) || s.scenario == "S1" {
        format!("{}.{}", s.run, s.pair)
    } else {
        s.run.to_string()
    };
    let steal = s
        .values
        .get(measure::STEAL)
        .map(|v| format!(", steal {v:.2}"))
        .unwrap_or_default();
    format!(
        "run {run:<3} {:<30} {:<12} {main} (other load {:.2} cores{steal}){flag}{err}",
        s.row, s.metric, s.other_load
    )
}

fn proxy_mode(c: &mut serde_json::Value) {
    if let Some(svcs) = c["services"].as_array_mut() {
        for s in svcs {
            s["mode"] = "proxy".into();
        }
    }
}

/// S3 ours: every service in proxy mode, listening where the REDIRECT rules send each port (as
/// the peers do), taking the original destination from SO_ORIGINAL_DST.
fn proxy_redirect(c: &mut serde_json::Value) {
    proxy_mode(c);
    let listeners: Vec<String> = topo::PORTS
        .iter()
        .map(|p| format!("127.0.0.1:{}", p + peers::PROXY_OFFSET))
        .collect();
    c["proxy"] = serde_json::json!({"listeners": listeners, "iptables_redirect": true});
}

fn splice(c: &mut serde_json::Value) {
    c["splice"] = true.into();
}

/// S5: S4 with the proxied client/upstream pair handed to the kernel (`proxy.splice: kernel`).
fn proxy_mode_spliced(c: &mut serde_json::Value) {
    proxy_mode(c);
    c["proxy"] = serde_json::json!({"splice": "kernel"});
}

/// S4/S5/S6 rows whose pieces the daemon has (its `proxy check` accepts the configuration),
/// and for the others what is missing.
pub fn features(
    proxy: &std::path::Path,
    dir: &std::path::Path,
) -> (Vec<Row>, Vec<(String, String)>) {
    type Candidate = (
        &'static str,
        &'static str,
        fn(&mut serde_json::Value),
        bool,
        &'static str,
    );
    let lo = topo::Net::lo();
    let candidates: [Candidate; 3] = [
        (
            "S4",
            "ours",
            proxy_mode,
            false,
            "services with `mode: proxy` (connect4 redirect to the daemon's own proxy listener)",
        ),
        (
            "S5",
            "ours",
            proxy_mode_spliced,
            false,
            "`mode: proxy` with `proxy.splice: kernel` (the client/upstream pair spliced by an sk_skb verdict)",
        ),
        (
            "S6",
            "",
            splice,
            true,
            "`splice: true` (sockops + sk_msg splicing of local socket pairs, no proxy)",
        ),
    ];
    let (mut rows, mut missing) = (Vec::new(), Vec::new());
    match topo::check_config(proxy, dir, &lo, proxy_redirect) {
        Ok(()) => {
            let mut m = full(false);
            m.extend([Metric::Idle { conns: 1000 }, Metric::Idle { conns: 10000 }]);
            let kind = Kind::RedirectOurs {
                tweak: proxy_redirect,
            };
            rows.push(row("S3", Path2::Lo, "ours", kind.clone(), m));
            rows.push(row("S3", Path2::Veth, "ours", kind, veth()));
        }
        Err(e) => missing.push((
            "S3 lo ours".to_owned(),
            format!("the daemon does not accept a REDIRECT-fed proxy listener: {e}"),
        )),
    }
    for (scenario, variant, tweak, direct, what) in candidates {
        match topo::check_config(proxy, dir, &lo, tweak) {
            Ok(()) => {
                let mut m = full(false);
                m.extend([Metric::Idle { conns: 1000 }, Metric::Idle { conns: 10000 }]);
                let kind = Kind::Feature { tweak, direct };
                rows.push(row(scenario, Path2::Lo, variant, kind.clone(), m));
                // S6 splices pairs of local sockets; across the veth its two ends would be in
                // different namespaces, which is not the local pair it is about.
                if !direct {
                    rows.push(row(scenario, Path2::Veth, variant, kind, veth()));
                }
            }
            Err(e) => missing.push((
                format!("{scenario} lo {variant}").trim().to_owned(),
                format!("the daemon does not accept {what}: {e}"),
            )),
        }
    }
    (rows, missing)
}

/// One measurement of [`extras`]: its values by key.
type Measure<'a> = dyn Fn() -> anyhow::Result<std::collections::BTreeMap<String, f64>> + 'a;

/// The metrics of [`extras`].
pub const EXTRA_METRICS: &[&str] = &[
    "health_10k",
    "health_udp_10k",
    "publish_10k",
    "publish_100k",
    "end_5k",
];

/// Per run, outside the scenario rows, those that `only` asks for: health-check CPU for
/// 10,000 endpoints at 1 s (TCP checks, then UDP checks), the time to publish 10,000 hosts, and
/// ending 5,000 kernel-path sockets of a host.
pub fn extras(
    env: &Env,
    run: u32,
    publish_bin: &std::path::Path,
    smoke: bool,
    only: &crate::Filter<'_>,
) -> Vec<Sample> {
    let endpoints = if smoke { 100 } else { 10_000 };
    let measurements: [(&str, &str, Box<Measure<'_>>); 5] = [
        (
            "health",
            "health_10k",
            Box::new(|| super::extras::health(env, endpoints, false)),
        ),
        (
            "health",
            "health_udp_10k",
            Box::new(|| super::extras::health(env, endpoints, true)),
        ),
        (
            "publish",
            "publish_10k",
            Box::new(|| super::extras::publish(publish_bin, if smoke { 100 } else { 10_000 })),
        ),
        (
            "publish",
            "publish_100k",
            Box::new(|| super::extras::publish(publish_bin, if smoke { 1_000 } else { 100_000 })),
        ),
        (
            "ending",
            "end_5k",
            Box::new(|| super::extras::ending(publish_bin, if smoke { 100 } else { 5_000 })),
        ),
    ];
    let mut out = Vec::new();
    for (row, metric, measure) in measurements {
        if only.wants_row(row) && only.wants_metric(metric) {
            let s = extra_sample(run, row, metric, measure);
            crate::util::detail(summary(&s));
            out.push(s);
        }
    }
    out
}

pub fn extra_sample(
    run: u32,
    row: &str,
    metric: &str,
    f: impl FnOnce() -> anyhow::Result<std::collections::BTreeMap<String, f64>>,
) -> Sample {
    let other_load = measure::wait_quiet(&[], std::time::Duration::from_secs(2));
    let mut s = Sample {
        run,
        pair: 0,
        row: row.to_owned(),
        scenario: row.to_owned(),
        path: "lo".into(),
        metric: metric.to_owned(),
        values: BTreeMap::default(),
        other_load,
        unaccounted: 0.0,
        valid: other_load <= measure::OTHER_LOAD_LIMIT,
        error: None,
        superseded: false,
    };
    match f() {
        Ok(v) => s.values = v,
        Err(e) => {
            s.valid = false;
            s.error = Some(format!("{e:#}"));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(row: &str, metric: String, pair: u32) -> Sample {
        Sample {
            run: 0,
            pair,
            row: row.to_owned(),
            scenario: row.split_whitespace().next().unwrap_or("").to_owned(),
            path: "lo".into(),
            metric,
            values: BTreeMap::default(),
            other_load: 0.0,
            unaccounted: 0.0,
            valid: true,
            error: None,
            superseded: false,
        }
    }

    #[test]
    fn proxy_rows_of_a_path_run_as_one_unit() {
        let units = units(rows(false));
        let groups: Vec<Vec<String>> = units
            .iter()
            .filter_map(|u| match u {
                Unit::SideBySide(rows) => Some(rows.iter().map(|r| r.id.clone()).collect()),
                Unit::Row(_) => None,
            })
            .collect();
        assert_eq!(
            groups,
            [
                ["S3 lo haproxy", "S3 lo nginx", "S3 lo envoy"],
                ["S3 veth haproxy", "S3 veth nginx", "S3 veth envoy"],
            ]
        );
        for u in &units {
            if let Unit::Row(r) = u {
                assert!(!side_by_side(r), "{} runs on its own", r.id);
            }
        }
    }

    #[test]
    fn the_smoke_check_names_a_missing_side_of_a_pair() {
        let rows = rows(true);
        let mut samples = Vec::new();
        for r in &rows {
            for m in &r.metrics {
                for pair in 0..pairs_of(r, *m) {
                    samples.push(sample(&r.id, m.key(), pair));
                    samples.push(sample(&paired_baseline(&r.id), m.key(), pair));
                }
            }
        }
        // Only S1 is paired: on loopback RR and connections (its idle memory is not judged
        // as a ratio), on veth connections; S0 and S3 have no pairs.
        assert_eq!(samples.len() as u32, 2 * (2 + 1) * PAIRS);
        assert!(missing_pairs(&rows, &samples, 1).is_empty());
        let last = samples.pop().expect("samples");
        assert_eq!(
            missing_pairs(&rows, &samples, 1),
            [format!(
                "{} {} run 0 pair {}",
                last.row,
                last.metric,
                PAIRS - 1
            )]
        );
    }
}
