//! `proxy-bench`, run as `cargo xtask bench`: the benchmark plan (shared reference
//! "benchmarks.md") against the peers.
//!
//! Installs its tools and peers (Debian: HAProxy, nginx + stream module, nft, iperf3, sockperf,
//! wrk, bpftool, a font; Envoy from the project venv), runs every scenario row `--runs` times in
//! a random order per run, on loopback and across a veth pair between two namespaces of ours,
//! and removes everything it set up. Each measurement first checks that the machine is quiet
//! (other load <= 0.1 core) and is marked invalid if not. Raw samples go to
//! `bench-results/<timestamp>/` (git-ignored); the summary tables, the target verdicts and the
//! charts of the latest run go to BENCHMARKS.md and `docs/bench/`.
//!
//! `--smoke` runs five rows with tiny counts once and writes into a scratch directory: it is part
//! of `cargo xtask test` so the harness cannot rot; it fails only if the harness itself fails.
//!
//! The same binary is the benchmark's client and server processes (`proxy-bench worker ...`).

mod chart;
mod extras;
mod health;
mod measure;
mod peers;
mod plan;
mod report;
mod scale;
#[expect(
    unsafe_code,
    reason = "the libc calls of the harness, each with its SAFETY note"
)]
mod sys;
mod targets;
mod topo;
mod util;
mod worker;

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use clap::Parser as _;

use crate::util::{detail, step};

/// Benchmarks against the peers (root): S0-S6 on loopback and veth, HAProxy, nginx, Envoy,
/// nft DNAT; medians of `--runs` runs as ratios to S0; writes BENCHMARKS.md and charts.
/// Run it as `cargo xtask bench`.
#[derive(Debug, clap::Parser)]
#[command(
    name = "proxy-bench",
    bin_name = "cargo xtask bench",
    args_conflicts_with_subcommands = true
)]
pub struct Args {
    /// One run of five rows with tiny counts, into a scratch directory (the test suite's check).
    #[arg(long)]
    pub smoke: bool,
    /// Runs per row (medians need at least 5).
    #[arg(long, default_value_t = 5)]
    pub runs: u32,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    pub secs: f64,
    /// Only rows whose id contains this, or any one of these if comma-separated (e.g. "S1",
    /// "veth", "S0,S3,S4").
    #[arg(long)]
    pub only: Option<String>,
    /// Only metrics whose key contains this, or any one of these if comma-separated (e.g.
    /// "cps", "rr_1b", "bulk,cps"; "ol_1000" also selects ol_10000); rows left without a metric
    /// are skipped.
    #[arg(long)]
    pub metric: Option<String>,
    /// Seconds to wait for a quiet machine before each measurement (then it runs, marked invalid).
    #[arg(long, default_value_t = 5)]
    pub quiet_wait: u64,
    /// Measure a sample again (up to `--steal-retries` more times) when the hypervisor stole
    /// more than this many cores during it (steal time in /proc/stat); a sample still over it is
    /// marked invalid. A paired S1/S0 measurement is repeated as a pair. Without it steal is
    /// only recorded. For virtual machines whose vCPUs are often descheduled (e.g. 0.25).
    #[arg(long, value_name = "CORES", value_parser = cores)]
    pub steal_limit: Option<f64>,
    /// How many more times `--steal-limit` may take one measurement (a larger budget keeps
    /// more cells at five valid runs on a noisy host, at the cost of wall time).
    #[arg(long, value_name = "N", default_value_t = measure::STEAL_RETRIES, requires = "steal_limit")]
    pub steal_retries: u32,
    /// In a KVM guest whose cpuidle driver is haltpoll: poll this many nanoseconds before an
    /// idle vCPU halts to the host, for the run (`guest_halt_poll_ns`, put back afterwards).
    /// At 0 every idle vCPU halts at once and its wake-up waits on the host's scheduler, which
    /// shows as steal and decides rows that sleep per message (1-connection RR, conn/s);
    /// 200000 is the kernel's default. The machine line of the report shows the value in force.
    #[arg(long, value_name = "NS")]
    pub halt_poll_ns: Option<u64>,
    /// Do not rewrite BENCHMARKS.md and docs/bench/ (raw results are still kept).
    #[arg(long)]
    pub no_report: bool,
    /// Use the release binaries already in the target directory instead of building them.
    #[arg(long)]
    pub no_build: bool,
    /// Measure nothing: rewrite BENCHMARKS.md and docs/bench/ from the raw results of an
    /// earlier run (`bench-results/<timestamp>/results.json`, or a copy of it named
    /// `results-<timestamp>.json`), e.g. after a change of the report.
    #[arg(long, value_name = "RESULTS_JSON")]
    pub report_from: Option<PathBuf>,
    /// Measure nothing: draw the charts (docs/bench/*.svg) again from docs/bench/summary.json,
    /// the latest run's medians as the report wrote them; BENCHMARKS.md stays as it is.
    #[arg(long, conflicts_with = "report_from")]
    pub charts_only: bool,
    #[command(subcommand)]
    pub worker: Option<Worker>,
}

/// A number of cores: finite and not negative.
fn cores(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!(
            "{s:?} is not a number of cores (a non-negative number such as 0.25)"
        )),
    }
}

/// Internal: the benchmark's own client and server processes.
#[derive(Debug, clap::Subcommand)]
pub enum Worker {
    #[command(hide = true, subcommand)]
    Worker(worker::Worker),
}

/// What every row needs.
pub struct Env {
    pub worker: PathBuf,
    pub proxy: PathBuf,
    pub envoy: Option<PathBuf>,
    pub dir: PathBuf,
    pub secs: f64,
    pub quiet_wait: Duration,
    /// `--steal-limit`: cores of steal above which a measurement is taken again.
    pub steal_limit: Option<f64>,
    /// `--steal-retries`: how many more times at most.
    pub steal_retries: u32,
    /// `--halt-poll-ns`, if the run set the haltpoll poll time.
    pub halt_poll_ns: Option<u64>,
}

fn main() -> anyhow::Result<()> {
    run(Args::parse())
}

fn run(args: Args) -> anyhow::Result<()> {
    if let Some(Worker::Worker(w)) = args.worker {
        return worker::run(w);
    }
    if args.charts_only {
        chart::redraw(&util::workspace_root())?;
        step("drew docs/bench/*.svg from docs/bench/summary.json");
        return Ok(());
    }
    if let Some(path) = &args.report_from {
        let text =
            fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let results: Results = serde_json::from_str(&text)
            .with_context(|| format!("{} is not the results.json of a run", path.display()))?;
        let stamp = run_stamp(path).with_context(|| {
            format!(
                "{}: name it results-<timestamp>.json or keep it in its run's directory",
                path.display()
            )
        })?;
        report::write(&results, &util::workspace_root(), &stamp)?;
        step(format!(
            "wrote BENCHMARKS.md and docs/bench/ from {}",
            path.display()
        ));
        return Ok(());
    }
    util::require_root("cargo xtask bench")?;
    if args.smoke {
        return smoke();
    }
    install_tools(false)?;
    // Before the build, so a machine without haltpoll fails at once; dropped (put back) when
    // this function returns, whatever way it does.
    let _halt_poll = match args.halt_poll_ns {
        Some(ns) => {
            let guard = sys::HaltPoll::set(ns)?;
            detail(format!(
                "guest_halt_poll_ns {ns} for the run (was {}; put back at the end)",
                guard.before()
            ));
            Some(guard)
        }
        None => None,
    };
    if !args.no_build {
        step("building the daemon, the workers and the publish benchmark (release)");
        util::run(
            util::cargo().args(["build", "--release", "-p", "proxy-bench", "-p", "proxy"]),
            "cargo build --release",
        )?;
        util::run(
            util::cargo().args([
                "build",
                "--release",
                "-p",
                "integration-tests",
                "--bin",
                "bench_publish",
                "--bin",
                "bench_end",
            ]),
            "cargo build --release --bin bench_publish --bin bench_end",
        )?;
    }
    let release = util::target_dir()?.join("release");
    let stamp = timestamp();
    let dir = util::workspace_root().join("bench-results").join(&stamp);
    let env = Env {
        worker: release.join("proxy-bench"),
        proxy: release.join("proxy"),
        envoy: peers::find_envoy(&util::workspace_root()),
        dir,
        secs: args.secs,
        quiet_wait: Duration::from_secs(args.quiet_wait),
        steal_limit: args.steal_limit,
        steal_retries: args.steal_retries,
        halt_poll_ns: args.halt_poll_ns,
    };
    let filter = Filter {
        row: args.only.as_deref(),
        metric: args.metric.as_deref(),
    };
    let rows: Vec<_> = plan::rows(false)
        .into_iter()
        .filter(|r| filter.wants_row(&r.id))
        .collect();
    let results = execute(
        &env,
        rows,
        args.runs,
        &release.join("bench_publish"),
        false,
        filter,
    )?;
    if !args.no_report {
        report::write(&results, &util::workspace_root(), &stamp)?;
        step("wrote BENCHMARKS.md and docs/bench/");
    }
    finish(&results)
}

/// The test suite's check: the smoke rows (both paths), tiny counts, one run; the report goes to
/// the scratch directory. The daemon is `PROXY_BIN` (`cargo xtask test` passes the one it
/// built), else built here.
fn smoke() -> anyhow::Result<()> {
    step("benchmark harness smoke run (cargo xtask bench --smoke)");
    install_tools(true)?;
    let proxy = match std::env::var_os("PROXY_BIN") {
        Some(p) => PathBuf::from(p),
        None => util::build_proxy()?,
    };
    // The publish benchmark next to this binary (cargo test of integration-tests builds it in
    // the same profile); built when missing.
    let exe = std::env::current_exe().context("locating the proxy-bench binary")?;
    let publish = exe.with_file_name("bench_publish");
    if !publish.exists() || !publish.with_file_name("bench_end").exists() {
        util::run(
            util::cargo().args([
                "build",
                "-p",
                "integration-tests",
                "--bin",
                "bench_publish",
                "--bin",
                "bench_end",
            ]),
            "cargo build --bin bench_publish --bin bench_end",
        )?;
    }
    let stamp = format!("smoke-{}", timestamp());
    let dir = std::env::temp_dir().join(format!("proxy-bench-{stamp}"));
    let env = Env {
        worker: exe,
        proxy,
        envoy: None,
        dir: dir.clone(),
        secs: 0.3,
        quiet_wait: Duration::ZERO,
        steal_limit: None,
        steal_retries: 0,
        halt_poll_ns: None,
    };
    let results = execute(&env, plan::rows(true), 1, &publish, true, Filter::default())?;
    report::write(&results, &dir, &stamp)?;
    let errors: Vec<_> = results
        .samples
        .iter()
        .filter_map(|s| {
            s.error
                .as_ref()
                .map(|e| format!("{} {}: {e}", s.row, s.metric))
        })
        .collect();
    let _ = fs::remove_dir_all(&dir);
    if !errors.is_empty() {
        bail!("the benchmark harness failed:\n  {}", errors.join("\n  "));
    }
    let unpaired = plan::missing_pairs(&plan::rows(true), &results.samples, 1);
    if !unpaired.is_empty() {
        bail!("paired measurements missing: {}", unpaired.join(", "));
    }
    step("benchmark harness smoke run passed (numbers are not judged)");
    Ok(())
}

/// Which rows and metrics a run measures (`--only`, `--metric`); `None` is all.
#[derive(Clone, Copy, Default)]
pub struct Filter<'a> {
    pub row: Option<&'a str>,
    pub metric: Option<&'a str>,
}

impl Filter<'_> {
    /// Whether row `id` is measured: no `--only`, or one of its comma-separated parts is in
    /// `id`.
    pub fn wants_row(&self, id: &str) -> bool {
        self.row
            .is_none_or(|parts| parts.split(',').any(|p| id.contains(p)))
    }

    /// Whether metric `key` is measured: no `--metric`, or one of its comma-separated parts is
    /// in `key`.
    pub fn wants_metric(&self, key: &str) -> bool {
        self.metric
            .is_none_or(|keys| keys.split(',').any(|k| key.contains(k)))
    }
}

/// Everything one invocation measured, as kept in `bench-results/<timestamp>/results.json`.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Results {
    pub commit: String,
    pub date: String,
    pub facts_before: sys::Facts,
    pub facts_after: sys::Facts,
    pub runs: u32,
    pub secs: f64,
    pub samples: Vec<measure::Sample>,
    /// Rows that could not run and why (S4/S5/S6 while their pieces are missing).
    pub not_measured: Vec<(String, String)>,
    pub perf_available: bool,
    pub wall_s: f64,
    /// `--steal-limit` of the run, if one was given.
    #[serde(default)]
    pub steal_limit: Option<f64>,
    /// `--steal-retries` of the run (runs before the option had the default).
    #[serde(default = "default_steal_retries")]
    pub steal_retries: u32,
    /// `--halt-poll-ns` of the run, if one was given (the machine facts show the value in
    /// force either way).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub halt_poll_ns: Option<u64>,
    /// The attempts `--steal-limit` took again, as measured (each `superseded`); not in the
    /// report.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steal_dropped: Vec<measure::Sample>,
}

fn default_steal_retries() -> u32 {
    measure::STEAL_RETRIES
}

/// Adds the feature rows (unless `smoke`) that `only` keeps and drops the metrics it does not
/// want; returns the features not measured, with the reason.
fn select_rows(
    env: &Env,
    rows: &mut Vec<plan::Row>,
    smoke: bool,
    only: Filter<'_>,
) -> anyhow::Result<Vec<(String, String)>> {
    let (extra, not_measured) = if smoke {
        (Vec::new(), Vec::new())
    } else {
        plan::features(&env.proxy, &env.dir)
    };
    rows.extend(extra.into_iter().filter(|r| only.wants_row(&r.id)));
    if let Some(key) = only.metric {
        for r in &mut *rows {
            r.metrics.retain(|m| only.wants_metric(&m.key()));
        }
        rows.retain(|r| !r.metrics.is_empty());
        if rows.is_empty()
            && !scale::METRICS
                .iter()
                .chain(plan::EXTRA_METRICS)
                .any(|m| only.wants_metric(m))
        {
            let _ = fs::remove_dir_all(&env.dir);
            bail!("no row measures a metric whose key contains {key:?}");
        }
    }
    Ok(not_measured)
}

/// Raises RLIMIT_NOFILE and sizes the large idle-connection rows (over 1,000) to what it allows,
/// at most 10,000 connections.
fn cap_idle_conns(rows: &mut [plan::Row]) {
    let nofile = sys::raise_nofile(65536);
    // 10,000 idle connections through a proxy need 20,000 descriptors in it, plus its own.
    let idle_max =
        (((nofile.saturating_sub(1000)) / 2).min(10_000) / 1000 * 1000).max(1000) as usize;
    if idle_max < 10_000 {
        detail(format!(
            "the largest idle-connection row uses {idle_max} connections (descriptor limit {nofile})"
        ));
    }
    for r in rows {
        for m in &mut r.metrics {
            if let measure::Metric::Idle { conns } = m
                && *conns > 1000
            {
                *conns = idle_max;
            }
        }
    }
}

fn execute(
    env: &Env,
    mut rows: Vec<plan::Row>,
    runs: u32,
    publish_bin: &Path,
    smoke: bool,
    only: Filter<'_>,
) -> anyhow::Result<Results> {
    fs::create_dir_all(&env.dir)?;
    sys::catch_signals();
    sys::raise_priority();
    let started = Instant::now();
    // Read now, next to the build: the work tree may change while the run goes on.
    let commit = commit();
    let facts_before = sys::facts();
    if facts_before
        .nft_tables
        .iter()
        .any(|t| t.contains(topo::NAT_TABLE))
    {
        bail!(
            "an nft table {} is already there (a previous run?); delete it first",
            topo::NAT_TABLE
        );
    }
    let not_measured = select_rows(env, &mut rows, smoke, only)?;
    cap_idle_conns(&mut rows);
    step(format!(
        "{} rows x {runs} runs, {} s per measurement; results in {}",
        rows.len(),
        env.secs,
        env.dir.display()
    ));
    let lo = topo::Net::lo();
    let lo_backends = lo.start_backends(&env.worker)?;
    let needs_veth = rows.iter().any(|r| r.path == topo::Path2::Veth);
    let pair = if needs_veth {
        Some(topo::VethPair::create()?)
    } else {
        None
    };
    let veth = pair.as_ref().map(topo::Net::veth);
    let veth_backends = match &veth {
        Some(v) => v.start_backends(&env.worker)?,
        None => Vec::new(),
    };
    let mut samples = Vec::new();
    let mut rng =
        worker::Rng::new(started.elapsed().as_nanos() as u64 ^ u64::from(std::process::id()));
    let mut units = plan::units(rows);
    for run in 0..runs {
        step(format!("run {}/{runs}", run + 1));
        // A different order every run.
        rng.shuffle(&mut units);
        for u in &units {
            if sys::interrupted() {
                bail!("interrupted; everything the benchmark started has been stopped and removed");
            }
            let (net, backends) = match u.path() {
                topo::Path2::Lo => (&lo, &lo_backends),
                topo::Path2::Veth => (
                    veth.as_ref().expect("veth rows need the pair"),
                    &veth_backends,
                ),
            };
            let pids: Vec<u32> = backends.iter().map(topo::Proc::pid).collect();
            samples.extend(plan::run_unit(env, net, u, run, &pids, &mut rng));
        }
        if sys::interrupted() {
            bail!("interrupted; everything the benchmark started has been stopped and removed");
        }
        // The health, publish and ending measurements that --only and --metric ask for.
        samples.extend(plan::extras(env, run, publish_bin, smoke, &only));
        if only.wants_row("scale") {
            samples.extend(scale::samples(env, run, smoke, only));
        }
        fs::write(
            env.dir.join("samples.partial.json"),
            serde_json::to_vec(&samples)?,
        )?;
    }
    drop(veth_backends);
    drop(pair);
    drop(lo_backends);
    let (steal_dropped, samples) = samples.into_iter().partition(|s| s.superseded);
    let results = Results {
        commit,
        date: date(),
        facts_before,
        facts_after: sys::facts(),
        runs,
        secs: env.secs,
        samples,
        not_measured,
        perf_available: perf_available(),
        wall_s: started.elapsed().as_secs_f64(),
        steal_limit: env.steal_limit,
        steal_retries: env.steal_retries,
        halt_poll_ns: env.halt_poll_ns,
        steal_dropped,
    };
    save(env, &results)?;
    Ok(results)
}

/// Checks that the run left no nat table behind and writes results.json in place of the
/// partial samples.
fn save(env: &Env, results: &Results) -> anyhow::Result<()> {
    if results
        .facts_after
        .nft_tables
        .iter()
        .any(|t| t.contains(topo::NAT_TABLE))
    {
        bail!(
            "the nft table {} is still there after the run; delete it: nft delete table ip {}",
            topo::NAT_TABLE,
            topo::NAT_TABLE
        );
    }
    fs::write(
        env.dir.join("results.json"),
        serde_json::to_vec_pretty(results)?,
    )?;
    let _ = fs::remove_file(env.dir.join("samples.partial.json"));
    Ok(())
}

fn finish(results: &Results) -> anyhow::Result<()> {
    let invalid = results.samples.iter().filter(|s| !s.valid).count();
    let errors = results.samples.iter().filter(|s| s.error.is_some()).count();
    step(format!(
        "{} samples, {invalid} invalid (other load, steal over `--steal-limit`, or errors), {errors} errors, {:.0} s",
        results.samples.len(),
        results.wall_s
    ));
    if errors > 0 {
        bail!("{errors} measurements failed; see the error lines above and results.json");
    }
    Ok(())
}

/// Debian packages the benchmark uses, by the binary or file that shows each is there.
const TOOLS: &[(&str, &str)] = &[
    ("/usr/bin/iperf3", "iperf3"),
    ("/usr/sbin/nft", "nftables"),
    ("/usr/sbin/iptables", "iptables"),
    ("/usr/sbin/bpftool", "bpftool"),
    ("/usr/sbin/haproxy", "haproxy"),
    ("/usr/sbin/nginx", "nginx-light"),
    (
        "/usr/lib/nginx/modules/ngx_stream_module.so",
        "libnginx-mod-stream",
    ),
    ("/usr/bin/sockperf", "sockperf"),
    ("/usr/bin/wrk", "wrk"),
];

/// Installs what is missing (the smoke run needs only iperf3 and nft); packaged services are
/// kept from starting (nginx and haproxy would take ports).
fn install_tools(smoke: bool) -> anyhow::Result<()> {
    let wanted: Vec<&str> = TOOLS
        .iter()
        .filter(|(_, pkg)| !smoke || matches!(*pkg, "iperf3" | "nftables"))
        .filter(|(file, _)| !Path::new(file).exists())
        .map(|(_, pkg)| *pkg)
        .collect();
    if wanted.is_empty() {
        detail("benchmark tools: all present");
    } else {
        step(format!("installing benchmark tools: {}", wanted.join(" ")));
        let policy = Path::new("/usr/sbin/policy-rc.d");
        let ours = !policy.exists();
        if ours {
            fs::write(policy, "#!/bin/sh\nexit 101\n")?;
            util::run(
                Command::new("chmod").args(["+x", "/usr/sbin/policy-rc.d"]),
                "chmod",
            )?;
        }
        let mut res = util::run(
            Command::new("apt-get")
                .args(["install", "-y", "-q"])
                .args(&wanted)
                .env("DEBIAN_FRONTEND", "noninteractive"),
            "apt-get install",
        );
        if res.is_err() {
            let _ = util::run(
                Command::new("apt-get").args(["update", "-q"]),
                "apt-get update",
            );
            res = util::run(
                Command::new("apt-get")
                    .args(["install", "-y", "-q"])
                    .args(&wanted)
                    .env("DEBIAN_FRONTEND", "noninteractive"),
                "apt-get install",
            );
        }
        if ours {
            let _ = fs::remove_file(policy);
        }
        res.with_context(|| format!("installing {wanted:?}; check access to the Debian mirrors"))?;
    }
    if !smoke && peers::find_envoy(&util::workspace_root()).is_none() {
        step("no Envoy in .venv: running cargo xtask setup");
        util::run(util::cargo().args(["xtask", "setup"]), "cargo xtask setup")?;
    }
    Ok(())
}

/// The cgroup v2 mount point (from /proc/mounts).
pub fn cgroup2_mount() -> anyhow::Result<PathBuf> {
    let mounts = fs::read_to_string("/proc/mounts")?;
    mounts
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
        })
        .context("no cgroup2 mount in /proc/mounts")
}

fn timestamp() -> String {
    sys::sh(Command::new("date").args(["-u", "+%Y%m%dT%H%M%SZ"]), "date")
        .map_or_else(|_| "now".into(), |s| s.trim().to_owned())
}

fn date() -> String {
    sys::sh(
        Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]),
        "date",
    )
    .map(|s| s.trim().to_owned())
    .unwrap_or_default()
}

/// HEAD's short id, with `+dirty` when the work tree differs (read-only git calls).
fn commit() -> String {
    let root = util::workspace_root();
    let head = sys::sh(
        Command::new("git")
            .arg("-C")
            .arg(&root)
            .args(["rev-parse", "--short", "HEAD"]),
        "git rev-parse",
    )
    .map_or_else(|_| "unknown".into(), |s| s.trim().to_owned());
    let dirty = sys::sh(
        Command::new("git").arg("-C").arg(&root).args([
            "status",
            "--porcelain",
            "--untracked-files=no",
        ]),
        "git status",
    )
    .is_ok_and(|s| !s.trim().is_empty());
    if dirty { format!("{head}+dirty") } else { head }
}

/// The run's timestamp from where its results are: a copy named `results-<timestamp>.json`, or
/// `bench-results/<timestamp>/results.json` (the run's directory).
fn run_stamp(path: &std::path::Path) -> Option<String> {
    let name = path.file_name()?.to_str()?;
    if let Some(stamp) = name
        .strip_prefix("results-")
        .and_then(|n| n.strip_suffix(".json"))
        .filter(|s| !s.is_empty())
    {
        return Some(stamp.to_owned());
    }
    path.parent()?
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
}

/// Whether hardware counters work (`perf stat -e instructions true` counts something).
fn perf_available() -> bool {
    Command::new("perf")
        .args(["stat", "-x,", "-e", "instructions", "true"])
        .output()
        .is_ok_and(|o| {
            o.status.success() && !String::from_utf8_lossy(&o.stderr).contains("not supported")
        })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::{cores, run_stamp};

    #[test]
    fn a_steal_limit_is_a_non_negative_number_of_cores() {
        assert_eq!(cores("0.25"), Ok(0.25));
        assert_eq!(cores("0"), Ok(0.0));
        for bad in ["-0.1", "abc", "NaN", "inf", ""] {
            assert!(cores(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn the_run_stamp_comes_from_a_named_copy_or_the_run_directory() {
        let kept = Path::new("/tmp/results-20990101T000000Z.json");
        assert_eq!(run_stamp(kept).as_deref(), Some("20990101T000000Z"));
        let run = Path::new("bench-results/20990101T000000Z/results.json");
        assert_eq!(run_stamp(run).as_deref(), Some("20990101T000000Z"));
        assert_eq!(run_stamp(Path::new("results.json")), None);
    }
}
