//! One node at scale from a control plane: services and endpoints delivered over xDS (CDS and
//! LDS from the test control plane, `tests/xds/xds_server.py`) until they are in the kernel
//! maps, a reload of a large configuration file, and the daemon's resident memory at rest and
//! across a connect loop.
//!
//! Receipt is the daemon's own debug record `xDS response received` (logged as the response is
//! decoded, before anything is done with it; the later of the Cluster and the Listener
//! response); the maps are read from outside the daemon, from the pinned `SERVICES_V2` and
//! `BACKENDS_V2`, until they hold every service and host.

mod control;

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, bail};
use aya::maps::{HashMap, Map, MapData};
use control::{ControlPlane, clusters, http_post, listeners, vip};
use proxy_common::{
    abi::maps,
    service::{Backend, Service, ServiceKey},
};
use serde_json::{Value, json};

use super::{
    Env, Filter,
    measure::Sample,
    plan,
    report::{Table, cell},
    sys,
    topo::{self, CONN, Daemon, Net},
};

/// How large each measurement is: the plan's sizes, or the smoke run's.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    /// Services (one cluster each) delivered over xDS, and hosts per cluster.
    pub xds: (u32, u32),
    /// The same for the resident-memory measurement at rest.
    pub rss: (u32, u32),
    /// Services of the reloaded file.
    pub reload: u32,
    /// Services of the connect loop, and its seconds.
    pub connect_loop: (u32, f64),
}

impl Sizes {
    pub fn new(smoke: bool) -> Self {
        if smoke {
            Self {
                xds: (20, 2),
                rss: (10, 2),
                reload: 20,
                connect_loop: (20, 1.5),
            }
        } else {
            Self {
                xds: (10_000, 10),
                rss: (1_000, 10),
                reload: 10_000,
                connect_loop: (10_000, 30.0),
            }
        }
    }
}

/// RSS growth (per cent) from the second to the last third of the connect loop that still
/// counts as bounded.
pub const LOOP_GROWTH_LIMIT_PCT: f64 = 5.0;

/// The instance, cgroup and admin address of the benchmark's daemon.
fn base_config() -> anyhow::Result<(Value, String, PathBuf, SocketAddr)> {
    let id = std::process::id();
    let instance = format!("proxy_bench_{id}");
    let cg = super::cgroup2_mount()?.join(format!("proxy-bench-{id}"));
    let admin = topo::free_port()?;
    let config = json!({"instance": instance, "cgroup": cg.display().to_string(),
        "admin": {"address": admin.to_string(), "allow_tcp_mutations": true}});
    Ok((config, instance, cg, admin))
}

/// Starts the daemon on `config` (written as `<label>.json`, log `<label>.log`) with `args`;
/// returns at once (its admin listens only once the first state of its sources is in).
fn launch(
    env: &Env,
    label: &str,
    config: &Value,
    args: &[&str],
) -> anyhow::Result<(Daemon, SocketAddr, PathBuf)> {
    let (instance, cg) = (
        config["instance"].as_str().context("instance")?,
        config["cgroup"].as_str().context("cgroup")?,
    );
    let admin: SocketAddr = config["admin"]["address"]
        .as_str()
        .context("admin")?
        .parse()?;
    let file = env.dir.join(format!("{label}.json"));
    fs::write(&file, serde_json::to_vec(config)?)?;
    let log = env.dir.join(format!("{label}.log"));
    let mut cmd = Command::new(&env.proxy);
    cmd.arg("run").arg("--config").arg(&file).args(args);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log)?);
    let child = cmd.spawn().context("starting the daemon")?;
    let daemon = Daemon {
        proc: topo::Proc { child },
        cgroup: PathBuf::from(cg),
        pins: PathBuf::from("/sys/fs/bpf").join(instance),
        publish_s: 0.0,
        proxy: env.proxy.clone(),
        config: file,
    };
    Ok((daemon, admin, log))
}

/// Waits (at most `limit`) for `GET /ready` to answer 200.
fn wait_ready(admin: SocketAddr, limit: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    while topo::http_status(admin, "/ready") != Some(200) {
        if Instant::now() > deadline {
            bail!("the daemon was not ready within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// A pinned hash map of the instance, opened as any other process can.
fn pinned<K: aya::Pod, V: aya::Pod>(
    pins: &Path,
    name: &str,
) -> anyhow::Result<HashMap<MapData, K, V>> {
    let data = MapData::from_pin(pins.join(name))
        .with_context(|| format!("opening the pinned map {name}"))?;
    Ok(HashMap::try_from(Map::HashMap(data))?)
}

/// Polls the pinned maps until they hold `services` services and `hosts` hosts; returns when
/// the read that saw every service ended (an upper bound of when the maps were complete) and
/// how long that read took (the bound's slack).
///
/// Only the services map is polled: the publisher writes a service's entry after its hosts
/// (the entry is what makes a new host set live), so every service present means every host
/// set is in. The backends are then counted once to check it; reading all of them on every
/// poll (ten times the keys) would make the slack most of what is measured.
fn wait_maps(
    daemon: &mut Daemon,
    services: usize,
    hosts: usize,
) -> anyhow::Result<(SystemTime, f64)> {
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut last = 0;
    while Instant::now() < deadline {
        if let Some(status) = daemon.proc.child.try_wait()? {
            bail!("the daemon exited ({status}) before the maps held every service");
        }
        let t = Instant::now();
        let Ok(map) = pinned::<ServiceKey, Service>(&daemon.pins, maps::SERVICES) else {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        };
        last = map.keys().flatten().count();
        if last >= services {
            let done = (SystemTime::now(), t.elapsed().as_secs_f64() * 1e3);
            let backends: HashMap<MapData, u32, Backend> = pinned(&daemon.pins, maps::BACKENDS)?;
            let b = backends.keys().flatten().count();
            if b < hosts {
                bail!(
                    "every service was in the maps with {b} hosts, not {hosts}: a service entry went in before its hosts"
                );
            }
            return Ok(done);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    bail!("the maps held {last} services after 300 s, not {services}")
}

/// Seconds since the epoch of an RFC 3339 UTC timestamp as tracing's JSON log writes it
/// (`2026-12-07T06:30:10.123456Z`).
fn unix_secs(ts: &str) -> Option<f64> {
    let (date, time) = ts.strip_suffix('Z')?.split_once('T')?;
    let mut date = date.splitn(3, '-').map(str::parse::<i64>);
    let year = date.next()?.ok()?;
    let month = date.next()?.ok()?;
    let day = date.next()?.ok()?;
    let mut time = time.splitn(3, ':');
    let hour = time.next()?.parse::<i64>().ok()?;
    let minute = time.next()?.parse::<i64>().ok()?;
    let second: f64 = time.next()?.parse().ok()?;
    // Days from the civil date (H. Hinnant's algorithm, proleptic Gregorian).
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = era * 146_097 + day_of_era - 719_468;
    Some((days * 86_400 + hour * 3600 + minute * 60) as f64 + second)
}

/// The receipt time of the first Cluster and the first Listener response in the daemon's JSON
/// log; the later of the two.
fn receipt(log: &Path) -> anyhow::Result<f64> {
    let text = fs::read_to_string(log)?;
    let first = |kind: &str| {
        text.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["fields"]["message"] == "xDS response received")
            .filter(|v| {
                v["fields"]["type_url"]
                    .as_str()
                    .is_some_and(|t| t.ends_with(kind))
            })
            .find_map(|v| unix_secs(v["timestamp"].as_str()?))
    };
    match (first(".Cluster"), first(".Listener")) {
        (Some(c), Some(l)) => Ok(c.max(l)),
        _ => bail!(
            "no `xDS response received` records for Cluster and Listener in {}",
            log.display()
        ),
    }
}

/// The daemon's VmRSS in MiB once it is steady: sampled every 500 ms until two readings are
/// within 1 % (at most 20 s).
fn settled_rss_mib(pid: u32) -> f64 {
    let mut last = sys::rss_kib(pid);
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(500));
        let now = sys::rss_kib(pid);
        if now.abs_diff(last) * 100 <= last {
            return now as f64 / 1024.0;
        }
        last = now;
    }
    last as f64 / 1024.0
}

/// `services` clusters of `per` hosts and their listeners over xDS: from the daemon's receipt
/// of them to the kernel maps holding them, and its resident memory afterwards.
pub fn xds(env: &Env, services: u32, per: u32) -> anyhow::Result<BTreeMap<String, f64>> {
    let cp = ControlPlane::start()?;
    cp.push("cluster", &clusters(services, per, CONN))?;
    cp.push("listener", &listeners(services))?;
    let (mut config, ..) = base_config()?;
    config["xds"] = json!({"node": {"id": "proxy-bench", "cluster": "bench"},
        "ads_config": {"api_type": "GRPC", "server_uri": format!("127.0.0.1:{}", cp.grpc)},
        "cds_config": {"ads": {}}, "lds_config": {"ads": {}}});
    let log_filter = "info,proxy_core::discovery::xds::grpc=debug";
    let args = ["--log", log_filter, "--log-format", "json"];
    let label = format!("scale-xds-{services}");
    let (mut daemon, admin, log) = launch(env, &label, &config, &args)?;
    let hosts = (services * per) as usize;
    let (done, poll_ms) = wait_maps(&mut daemon, services as usize, hosts)?;
    let done = done.duration_since(UNIX_EPOCH)?.as_secs_f64();
    let received = receipt(&log)?;
    wait_ready(admin, Duration::from_secs(60))?;
    let rss = settled_rss_mib(daemon.proc.pid());
    Ok(BTreeMap::from([
        ("services".into(), f64::from(services)),
        ("hosts".into(), hosts as f64),
        ("to_maps_ms".into(), (done - received) * 1e3),
        ("poll_ms".into(), poll_ms),
        ("rss_mib".into(), rss),
    ]))
}

/// A configuration file of `services` services, each with its own STATIC cluster of one host
/// on `port`.
fn file_config(services: u32, port: u16) -> anyhow::Result<Value> {
    let (mut config, ..) = base_config()?;
    config["clusters"] = Value::Array(clusters(services, 1, port));
    config["services"] = (0..services)
        .map(|i| json!({"name": format!("s{i}"), "address": vip(i).to_string(), "port": CONN, "cluster": format!("s{i}")}))
        .collect();
    Ok(config)
}

/// A reload of a file of `services` services that moves every host (every service is
/// rewritten), then one of the same file (nothing changes); each timed until `POST /reload`
/// answers, which it does once the change is applied.
pub fn reload(env: &Env, services: u32) -> anyhow::Result<BTreeMap<String, f64>> {
    let config = file_config(services, CONN)?;
    let label = format!("scale-reload-{services}");
    let (daemon, admin, _) = launch(env, &label, &config, &[])?;
    wait_ready(admin, Duration::from_secs(120))?;
    let mut moved = file_config(services, CONN + 1)?;
    moved["instance"] = config["instance"].clone();
    moved["cgroup"] = config["cgroup"].clone();
    moved["admin"] = config["admin"].clone();
    fs::write(&daemon.config, serde_json::to_vec(&moved)?)?;
    let mut times = Vec::new();
    for _ in 0..2 {
        let t = Instant::now();
        let status = http_post(admin, "/reload", "")?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        if status != 200 {
            bail!("POST /reload answered {status} (log: {label}.log)");
        }
    }
    let in_maps = pinned::<ServiceKey, Service>(&daemon.pins, maps::SERVICES)?
        .keys()
        .flatten()
        .count();
    if in_maps != services as usize {
        bail!("after the reload the maps hold {in_maps} services, not {services}");
    }
    Ok(BTreeMap::from([
        ("services".into(), f64::from(services)),
        ("reload_ms".into(), times[0]),
        ("reload_noop_ms".into(), times[1]),
    ]))
}

/// The median of `v` (not empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// RSS growth in per cent from the median of the second third of `samples` to the median of
/// the last third; `None` with fewer than 3 samples.
pub fn growth_pct(samples: &[f64]) -> Option<f64> {
    let third = samples.len() / 3;
    if third == 0 {
        return None;
    }
    let second = median(samples[third..2 * third].to_vec());
    let last = median(samples[samples.len() - third..].to_vec());
    Some((last - second) / second * 100.0)
}

/// The daemon's VmRSS in MiB every 250 ms while `work` runs.
fn rss_during<T>(pid: u32, work: impl FnOnce() -> T) -> (T, Vec<f64>) {
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            let mut rss = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                rss.push(sys::rss_kib(pid) as f64 / 1024.0);
                std::thread::sleep(Duration::from_millis(250));
            }
            rss
        });
        let out = work();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        (out, sampler.join().unwrap_or_default())
    })
}

/// A connect loop from the daemon's cgroup over `services` services for `secs`, sampling the
/// daemon's VmRSS every 250 ms.
pub fn connect_loop(env: &Env, services: u32, secs: f64) -> anyhow::Result<BTreeMap<String, f64>> {
    let net = Net::lo();
    let daemon = Daemon::start(&env.proxy, &env.dir, &net, services, &|_| {})?;
    let pid = daemon.proc.pid();
    let at_rest = settled_rss_mib(pid);
    let target = format!("{}:{CONN}", net.vip_n(0));
    let args = [
        "worker",
        "cps",
        "--target",
        &target,
        "--count",
        &services.to_string(),
    ]
    .into_iter()
    .chain(["--secs", &secs.to_string()])
    .map(str::to_owned)
    .collect::<Vec<_>>();
    let child = net
        .client(&env.worker, &args, Some(&daemon.cgroup))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the connect loop")?;
    let limit = Duration::from_secs_f64(secs + 30.0);
    let (reaped, rss) = rss_during(pid, || sys::reap(child, "connect loop", limit));
    let reaped = reaped?;
    if !reaped.success {
        bail!("the connect loop failed ({})", reaped.failure);
    }
    let out = super::extras::json_values(&reaped.stdout)?;
    let growth = growth_pct(&rss).context("the connect loop ended before 3 RSS samples")?;
    let mut values = BTreeMap::from([
        ("services".into(), f64::from(services)),
        ("rss_rest_mib".into(), at_rest),
        (
            "rss_max_mib".into(),
            rss.iter().copied().fold(0.0, f64::max),
        ),
        ("rss_last_mib".into(), *rss.last().unwrap_or(&0.0)),
        ("growth_pct".into(), growth),
        ("samples".into(), rss.len() as f64),
    ]);
    for key in ["connections", "failures"] {
        let v = out.get(key).copied();
        values.insert(
            key.into(),
            v.with_context(|| format!("the connect loop gave no {key}"))?,
        );
    }
    Ok(values)
}

/// The metric keys of the scale row.
pub const METRICS: [&str; 4] = ["scale_xds", "scale_rss", "scale_reload", "scale_loop"];

/// Per run: the four scale measurements (those `--metric` keeps), each a sample of row `scale`.
pub fn samples(env: &Env, run: u32, smoke: bool, only: Filter<'_>) -> Vec<Sample> {
    let z = Sizes::new(smoke);
    let mut out = Vec::new();
    for metric in METRICS.into_iter().filter(|m| only.wants_metric(m)) {
        let s = plan::extra_sample(run, "scale", metric, || match metric {
            "scale_xds" => xds(env, z.xds.0, z.xds.1),
            "scale_rss" => xds(env, z.rss.0, z.rss.1),
            "scale_reload" => reload(env, z.reload),
            _ => connect_loop(env, z.connect_loop.0, z.connect_loop.1),
        });
        crate::util::detail(plan::summary(&s));
        out.push(s);
    }
    out
}

/// The report's lines: label, metric and value key of the scale row.
const REPORT: [(&str, &str, &str); 19] = [
    (
        "xDS: services (CDS clusters + LDS listeners)",
        "scale_xds",
        "services",
    ),
    ("xDS: hosts", "scale_xds", "hosts"),
    (
        "xDS: receipt to kernel maps (ms)",
        "scale_xds",
        "to_maps_ms",
    ),
    (
        "xDS: the map read that saw them all (ms)",
        "scale_xds",
        "poll_ms",
    ),
    ("xDS: daemon RSS after (MiB)", "scale_xds", "rss_mib"),
    ("RSS row: services", "scale_rss", "services"),
    ("RSS row: hosts", "scale_rss", "hosts"),
    ("RSS row: daemon RSS at rest (MiB)", "scale_rss", "rss_mib"),
    (
        "RSS row: receipt to kernel maps (ms)",
        "scale_rss",
        "to_maps_ms",
    ),
    ("reload: services in the file", "scale_reload", "services"),
    ("reload: every host moved (ms)", "scale_reload", "reload_ms"),
    (
        "reload: the same file again (ms)",
        "scale_reload",
        "reload_noop_ms",
    ),
    ("connect loop: services", "scale_loop", "services"),
    ("connect loop: connections", "scale_loop", "connections"),
    ("connect loop: failed connects", "scale_loop", "failures"),
    (
        "connect loop: RSS at rest before (MiB)",
        "scale_loop",
        "rss_rest_mib",
    ),
    (
        "connect loop: RSS highest (MiB)",
        "scale_loop",
        "rss_max_mib",
    ),
    ("connect loop: RSS last (MiB)", "scale_loop", "rss_last_mib"),
    (
        "connect loop: RSS growth, 2nd to last third (%)",
        "scale_loop",
        "growth_pct",
    ),
];

/// The report's table of the scale row, when it ran.
pub fn report(md: &mut String, t: &Table<'_>) {
    if REPORT
        .iter()
        .all(|(_, m, k)| t.abs("scale", m, k).is_none())
    {
        return;
    }
    let _ = writeln!(md, "\n### One node at scale\n");
    let _ = writeln!(md, "| measure | value |\n|---|---|");
    for (label, metric, key) in REPORT {
        let _ = writeln!(
            md,
            "| {label} | {} |",
            cell(t.abs("scale", metric, key), "")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{growth_pct, unix_secs};

    #[test]
    fn a_log_timestamp_reads_as_seconds_since_the_epoch() {
        assert_eq!(unix_secs("1970-01-01T00:00:00Z"), Some(0.0));
        assert_eq!(unix_secs("2000-03-01T00:00:01.5Z"), Some(951_868_801.5));
        assert_eq!(unix_secs("2026-12-07T06:30:10Z"), Some(1_796_625_010.0));
        for bad in [
            "",
            "2026-12-07 06:30:10Z",
            "2026-12-07T06:30:10",
            "x-1-1T0:0:0Z",
        ] {
            assert_eq!(unix_secs(bad), None, "{bad}");
        }
    }

    #[test]
    fn growth_compares_the_second_third_with_the_last() {
        let flat = [50.0, 60.0, 60.0, 60.0, 60.0, 60.0];
        assert_eq!(growth_pct(&flat), Some(0.0));
        let growing = [10.0, 10.0, 20.0, 20.0, 30.0, 30.0];
        assert_eq!(growth_pct(&growing), Some(50.0));
        assert_eq!(growth_pct(&[1.0, 2.0]), None);
    }
}
