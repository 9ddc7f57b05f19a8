//! One measurement: wait for a quiet machine (or record that it was not), run one client to
//! completion, and account CPU to every process involved: the client from wait4's rusage, the
//! servers, proxies and the daemon from their schedstat deltas.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};

use super::{sys, topo::Net};

/// Other load above this many cores before a measurement makes it invalid.
pub const OTHER_LOAD_LIMIT: f64 = 0.10;
/// The value key of the cores stolen by the hypervisor during a measurement (steal time in
/// /proc/stat), recorded with every client-driven metric.
pub const STEAL: &str = "steal_cores";
/// How many times a measurement stolen over `--steal-limit` is taken again (the default of
/// `--steal-retries`).
pub const STEAL_RETRIES: u32 = 2;
/// The value key of how many times a kept sample's measurement was taken again for steal.
pub const REMEASURED: &str = "steal_remeasured";

/// Whether the hypervisor stole more than `limit` cores during `s` (never without a limit, or
/// for a sample that recorded no steal).
pub fn stolen(s: &Sample, limit: Option<f64>) -> bool {
    matches!((limit, s.values.get(STEAL)), (Some(l), Some(v)) if *v > l)
}

/// Takes a measurement with `take` (one sample, or a pair that stands or falls together) until
/// no sample of it was stolen over `limit`, at most 1 + `retries` times; `show` sees
/// every sample taken. Samples still over the limit after the last try are marked invalid;
/// kept samples record how often they were taken again. The attempts taken again come first
/// in the result, marked `superseded` and invalid, so the raw results keep them.
pub fn steal_checked(
    limit: Option<f64>,
    retries: u32,
    mut take: impl FnMut() -> Vec<Sample>,
    mut show: impl FnMut(&Sample),
) -> Vec<Sample> {
    let mut again = 0;
    let mut dropped = Vec::new();
    loop {
        let mut v = take();
        v.iter().for_each(&mut show);
        let over = v.iter().any(|s| stolen(s, limit));
        if over && again < retries {
            again += 1;
            dropped.extend(v.into_iter().map(|mut s| {
                s.valid = false;
                s.superseded = true;
                s
            }));
            continue;
        }
        for s in &mut v {
            if stolen(s, limit) {
                s.valid = false;
            }
            if again > 0 {
                s.values.insert(REMEASURED.into(), f64::from(again));
            }
        }
        dropped.extend(v);
        return dropped;
    }
}

/// What one client run measures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Metric {
    Bulk { streams: u32 },
    Integrity,
    Rr { size: usize, conns: usize },
    OpenLoop { rate: u32 },
    Cps,
    Idle { conns: usize },
}

impl Metric {
    pub fn key(self) -> String {
        match self {
            Metric::Bulk { streams } => format!("bulk_p{streams}"),
            Metric::Integrity => "integrity".into(),
            Metric::Rr { size, conns } => format!("rr_{size}b_c{conns}"),
            Metric::OpenLoop { rate } => format!("ol_{rate}"),
            Metric::Cps => "cps".into(),
            // The large row is "10k" even where a descriptor limit makes it smaller (the sample
            // records the real count).
            Metric::Idle { conns } => {
                if conns > 1000 {
                    "idle_10k".into()
                } else {
                    format!("idle_{conns}")
                }
            }
        }
    }
}

/// One measured value set, as kept in the raw JSON.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sample {
    pub run: u32,
    /// Which of a run's paired measurements this is (S1 and its paired S0; 0 elsewhere).
    #[serde(default)]
    pub pair: u32,
    pub row: String,
    pub scenario: String,
    pub path: String,
    pub metric: String,
    pub values: BTreeMap<String, f64>,
    /// Cores busy outside the benchmark just before the measurement.
    pub other_load: f64,
    /// Cores busy during the measurement that no process of ours accounts for (kernel threads,
    /// softirq run outside our processes, or other load; steal is not in it); informative.
    pub unaccounted: f64,
    pub valid: bool,
    pub error: Option<String>,
    /// An attempt that `--steal-limit` took again: the raw results keep it apart
    /// (`Results::steal_dropped`), the report leaves it out.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub superseded: bool,
}

/// What a measurement needs to know about its surroundings.
pub struct Ctx<'a> {
    pub worker: &'a Path,
    pub net: &'a Net,
    pub cgroup: Option<PathBuf>,
    /// Process trees of ours that take part (servers, proxy, daemon).
    pub ours: Vec<u32>,
    pub secs: f64,
    pub quiet_wait: Duration,
    /// Where the single-service metrics connect, by backend port.
    pub target: &'a dyn Fn(u16) -> SocketAddr,
    /// Connect-rate target: first address and number of consecutive services.
    pub cps: (SocketAddr, u32),
}

/// Waits up to `quiet_wait` for other load to drop under the limit; returns the last reading.
pub fn wait_quiet(ours: &[u32], quiet_wait: Duration) -> f64 {
    let deadline = Instant::now() + quiet_wait;
    loop {
        let load = sys::other_load(ours, Duration::from_millis(400));
        if load <= OTHER_LOAD_LIMIT || Instant::now() >= deadline {
            return load;
        }
    }
}

/// Worker arguments; the cgroup is joined by the shell wrapper of `Net::client`.
fn worker_args(mode: &str, rest: Vec<String>) -> Vec<String> {
    let mut v = vec!["worker".to_owned(), mode.to_owned()];
    v.extend(rest);
    v
}

/// The client command of a metric (our worker binary, or iperf3).
fn client_cmd(ctx: &Ctx<'_>, m: Metric) -> Command {
    let cg = ctx.cgroup.as_deref();
    let s = |x: &dyn ToString| x.to_string();
    let secs = s(&ctx.secs);
    match m {
        Metric::Bulk { streams } => {
            let t = (ctx.target)(super::topo::IPERF);
            let args = [
                "-c",
                &t.ip().to_string(),
                "-p",
                &t.port().to_string(),
                "-t",
                &s(&ctx.secs.ceil().max(1.0)),
                "-P",
                &s(&streams),
                "-J",
            ]
            .map(str::to_owned);
            // iperf3 joins the cgroup through the shell wrapper.
            ctx.net.client(Path::new("iperf3"), &args, cg)
        }
        Metric::Integrity => {
            let a = worker_args(
                "integrity",
                vec![
                    "--target".into(),
                    s(&(ctx.target)(super::topo::SINK)),
                    "--bytes".into(),
                    (32_u64 << 20).to_string(),
                ],
            );
            ctx.net.client(ctx.worker, &a, cg)
        }
        Metric::Rr { size, conns } => {
            let a = worker_args(
                "rr",
                vec![
                    "--target".into(),
                    s(&(ctx.target)(super::topo::ECHO)),
                    "--size".into(),
                    s(&size),
                    "--conns".into(),
                    s(&conns),
                    "--secs".into(),
                    secs,
                ],
            );
            ctx.net.client(ctx.worker, &a, cg)
        }
        Metric::OpenLoop { rate } => {
            let a = worker_args(
                "open-loop",
                vec![
                    "--target".into(),
                    s(&(ctx.target)(super::topo::ECHO)),
                    "--rate".into(),
                    s(&rate),
                    "--secs".into(),
                    secs,
                ],
            );
            ctx.net.client(ctx.worker, &a, cg)
        }
        Metric::Cps => {
            let a = worker_args(
                "cps",
                vec![
                    "--target".into(),
                    s(&ctx.cps.0),
                    "--count".into(),
                    s(&ctx.cps.1),
                    "--secs".into(),
                    secs,
                ],
            );
            ctx.net.client(ctx.worker, &a, cg)
        }
        Metric::Idle { conns } => {
            let a = worker_args(
                "idle",
                vec![
                    "--target".into(),
                    s(&(ctx.target)(super::topo::ECHO)),
                    "--conns".into(),
                    s(&conns),
                    "--secs".into(),
                    "120".into(),
                ],
            );
            ctx.net.client(ctx.worker, &a, cg)
        }
    }
}

/// Runs one metric; an error is recorded in the sample, not raised.
pub fn measure(ctx: &Ctx<'_>, m: Metric, run: u32, row: &str, scenario: &str) -> Sample {
    let other_load = wait_quiet(&ctx.ours, ctx.quiet_wait);
    let mut sample = Sample {
        run,
        pair: 0,
        row: row.to_owned(),
        scenario: scenario.to_owned(),
        path: ctx.net.path.name().to_owned(),
        metric: m.key(),
        values: BTreeMap::new(),
        other_load,
        unaccounted: 0.0,
        valid: other_load <= OTHER_LOAD_LIMIT,
        error: None,
        superseded: false,
    };
    let result = if let Metric::Idle { conns } = m {
        idle(ctx, conns)
    } else {
        client_run(ctx, m, &mut sample)
    };
    match result {
        Ok(values) => sample.values.extend(values),
        Err(e) => {
            sample.valid = false;
            sample.error = Some(format!("{e:#}"));
        }
    }
    sample
}

fn client_run(
    ctx: &Ctx<'_>,
    m: Metric,
    sample: &mut Sample,
) -> anyhow::Result<BTreeMap<String, f64>> {
    let mark = sys::BusyMark::now();
    let ours0 = sys::cpu_ns(&ctx.ours);
    let child = client_cmd(ctx, m)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the client")?;
    let reaped = sys::reap(
        child,
        &m.key(),
        Duration::from_secs_f64(ctx.secs * 4.0 + 30.0),
    )?;
    let ours_cpu = sys::cpu_ns(&ctx.ours).saturating_sub(ours0) as f64 / 1e9;
    let b = mark.since();
    sample.unaccounted = ((b.busy_s - b.steal_s - ours_cpu - reaped.cpu_s) / b.wall_s).max(0.0);
    if !reaped.success {
        bail!(
            "{} client failed ({}); its output: {:?}",
            m.key(),
            reaped.failure,
            reaped.stdout.trim()
        );
    }
    let out: serde_json::Value = serde_json::from_str(reaped.stdout.trim()).with_context(|| {
        format!(
            "parsing the {} client's output {:?}",
            m.key(),
            reaped.stdout
        )
    })?;
    let mut v = BTreeMap::new();
    let cpu = reaped.cpu_s + ours_cpu;
    v.insert("cpu_client_s".into(), reaped.cpu_s);
    v.insert("cpu_others_s".into(), ours_cpu);
    // Informative: time the machine's CPUs wanted to run and the hypervisor ran others.
    v.insert(STEAL.into(), b.steal_s / b.wall_s);
    match m {
        Metric::Bulk { .. } => {
            let sum = &out["end"]["sum_received"];
            let bytes = sum["bytes"]
                .as_f64()
                .context("iperf3 JSON has no end.sum_received.bytes")?;
            v.insert(
                "gbps".into(),
                sum["bits_per_second"].as_f64().unwrap_or(0.0) / 1e9,
            );
            v.insert("bytes".into(), bytes);
            v.insert("cpu_s_per_gb".into(), cpu / (bytes / 1e9).max(1e-9));
        }
        Metric::Integrity => {
            v.insert(
                "ok".into(),
                if out["ok"].as_bool() == Some(true) {
                    1.0
                } else {
                    0.0
                },
            );
            // EAGAIN returned to a blocking read before its timeout (see the worker).
            v.insert("eagain".into(), out["eagain"].as_f64().unwrap_or(0.0));
        }
        Metric::Rr { .. } => {
            let n = out["transactions"].as_f64().unwrap_or(0.0);
            for k in ["tps", "p50_us", "p99_us"] {
                v.insert(k.into(), out[k].as_f64().unwrap_or(0.0));
            }
            v.insert("cpu_us_per_txn".into(), cpu * 1e6 / n.max(1.0));
        }
        Metric::OpenLoop { .. } => {
            for k in ["p50_us", "p99_us", "p999_us", "lost"] {
                v.insert(k.into(), out[k].as_f64().unwrap_or(0.0));
            }
        }
        Metric::Cps => {
            let n = out["connections"].as_f64().unwrap_or(0.0);
            for k in ["cps", "connect_p50_us", "connect_p99_us", "failures"] {
                v.insert(k.into(), out[k].as_f64().unwrap_or(0.0));
            }
            v.insert("cpu_us_per_conn".into(), cpu * 1e6 / n.max(1.0));
            if n == 0.0 {
                bail!("no connection succeeded: {}", out["first_error"]);
            }
        }
        Metric::Idle { .. } => unreachable!("handled by idle()"),
    }
    Ok(v)
}

/// RSS of the proxy (or daemon: the first of `ours` after the servers) with N idle connections.
fn idle(ctx: &Ctx<'_>, conns: usize) -> anyhow::Result<BTreeMap<String, f64>> {
    use std::io::{BufRead as _, BufReader, Write as _};
    let subject = *ctx.ours.last().context("no process to weigh")?;
    let before = sys::rss_kib(subject) as f64;
    let mut child = client_cmd(ctx, Metric::Idle { conns })
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the idle client")?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("stdout")?).read_line(&mut line)?;
    if !line.starts_with("ready") {
        let _ = child.kill();
        let _ = child.wait();
        bail!(
            "the idle client did not open {conns} connections: {}",
            line.trim()
        );
    }
    std::thread::sleep(Duration::from_millis(300));
    let with = sys::rss_kib(subject) as f64;
    let _ = child.stdin.take().map(|mut s| s.write_all(b"\n"));
    let _ = child.wait();
    let mut v = BTreeMap::new();
    v.insert("conns".into(), conns as f64);
    v.insert("rss_mib".into(), with / 1024.0);
    v.insert("rss_idle_mib".into(), before / 1024.0);
    v.insert("kib_per_conn".into(), (with - before) / conns as f64);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(steal: Option<f64>) -> Sample {
        Sample {
            run: 0,
            pair: 0,
            row: "S0 lo".into(),
            scenario: "S0".into(),
            path: "lo".into(),
            metric: "cps".into(),
            values: steal.map(|v| (STEAL.to_owned(), v)).into_iter().collect(),
            other_load: 0.0,
            unaccounted: 0.0,
            valid: true,
            error: None,
            superseded: false,
        }
    }

    /// Runs `steal_checked` over measurements whose steal comes from `seq`, `per` samples each.
    /// Returns the kept samples and how many were shown; checks that the attempts taken again
    /// come back too, before the kept ones, superseded and invalid.
    fn check(limit: Option<f64>, seq: &[f64], per: usize) -> (Vec<Sample>, usize) {
        let mut it = seq.iter();
        let mut shown = 0;
        let mut all = steal_checked(
            limit,
            STEAL_RETRIES,
            || (0..per).map(|_| sample(it.next().copied())).collect(),
            |_| shown += 1,
        );
        assert_eq!(all.len(), shown, "every attempt is returned");
        let kept = all.split_off(shown - per);
        assert!(all.iter().all(|s| s.superseded && !s.valid));
        assert!(kept.iter().all(|s| !s.superseded));
        let stolen: Vec<f64> = all.iter().map(|s| s.values[STEAL]).collect();
        assert_eq!(stolen, seq[..shown - per], "dropped in the order taken");
        (kept, shown)
    }

    #[test]
    fn without_a_limit_one_measurement_is_kept_whatever_the_steal() {
        let (kept, shown) = check(None, &[0.9], 1);
        assert_eq!(shown, 1);
        assert!(kept[0].valid);
        assert!(!kept[0].values.contains_key(REMEASURED));
    }

    #[test]
    #[expect(
        clippy::float_cmp,
        reason = "the values are copied from the inputs or are whole retry counts, so exact"
    )]
    fn a_stolen_measurement_is_taken_again_until_it_is_under_the_limit() {
        let (kept, shown) = check(Some(0.25), &[0.6, 0.2, 0.9], 1);
        assert_eq!(shown, 2);
        assert!(kept[0].valid);
        assert_eq!(kept[0].values[STEAL], 0.2);
        assert_eq!(kept[0].values[REMEASURED], 1.0);
    }

    #[test]
    #[expect(
        clippy::float_cmp,
        reason = "the values are copied from the inputs or are whole retry counts, so exact"
    )]
    fn a_measurement_stolen_every_time_is_kept_invalid_after_the_last_try() {
        let (kept, shown) = check(Some(0.25), &[0.6, 0.7, 0.8, 0.1], 1);
        assert_eq!(shown, 1 + STEAL_RETRIES as usize);
        assert!(!kept[0].valid);
        assert_eq!(kept[0].values[STEAL], 0.8);
        assert_eq!(kept[0].values[REMEASURED], f64::from(STEAL_RETRIES));
    }

    #[test]
    #[expect(
        clippy::float_cmp,
        reason = "the values are copied from the inputs or are whole retry counts, so exact"
    )]
    fn a_larger_retry_budget_takes_more_tries() {
        let seq = [0.6, 0.7, 0.8, 0.9, 0.1];
        let mut it = seq.iter();
        let mut shown = 0;
        let all = steal_checked(
            Some(0.25),
            4,
            || vec![sample(it.next().copied())],
            |_| shown += 1,
        );
        assert_eq!(shown, 5);
        let kept = all.last().unwrap();
        assert!(kept.valid && !kept.superseded);
        assert_eq!(kept.values[STEAL], 0.1);
        assert_eq!(kept.values[REMEASURED], 4.0);
        assert_eq!(all.iter().filter(|s| s.superseded).count(), 4);
    }

    #[test]
    #[expect(
        clippy::float_cmp,
        reason = "the values are copied from the inputs or are whole retry counts, so exact"
    )]
    fn a_pair_stands_or_falls_together() {
        // One side stolen: both are taken again; the second pair is clean.
        let (kept, shown) = check(Some(0.25), &[0.1, 0.5, 0.2, 0.1], 2);
        assert_eq!(shown, 4);
        assert_eq!(kept.len(), 2);
        assert!(kept.iter().all(|s| s.valid && s.values[REMEASURED] == 1.0));
        // Stolen to the end: only the side over the limit is invalid.
        let (kept, _) = check(Some(0.25), &[0.1, 0.5, 0.1, 0.5, 0.1, 0.5], 2);
        assert!(kept[0].valid);
        assert!(!kept[1].valid);
    }

    #[test]
    fn a_sample_without_steal_is_never_stolen() {
        assert!(!stolen(&sample(None), Some(0.0)));
        assert!(stolen(&sample(Some(0.3)), Some(0.25)));
        assert!(!stolen(&sample(Some(0.25)), Some(0.25)));
    }
}
