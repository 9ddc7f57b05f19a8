//! `cargo xtask fleet`: many nodes on this machine, each a network namespace with its own
//! cgroup, daemon and probe, following one control plane; measures how long a control-plane
//! change takes to reach every node's kernel (observed by connects from inside each node,
//! never from the daemon's log), then tears everything down. See docs/fleet.md.

mod chart;
mod connect_loop;
mod consul;
mod fault;
mod http;
mod load;
mod measure;
mod net;
mod node;
mod probe;
mod report;
#[allow(
    unsafe_code,
    reason = "setns(2), clock_gettime(2), signals, kill(2), setrlimit(2)"
)]
mod sys;
mod xds;

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

pub use self::probe::serve as probe_main;
use self::{consul::Cluster, net::Net, node::Node, probe::Backends, xds::XdsServer};
use crate::util::{self, detail, step};

/// The control plane the fleet follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ControlPlane {
    /// A three-server Consul 1.8.7 cluster, a client agent per node.
    Consul,
    /// One xDS server (ADS): listeners, clusters and endpoints.
    Xds,
}

/// `cargo xtask fleet` options.
#[derive(Clone, Debug, clap::Args)]
pub struct Options {
    /// Nodes (network namespace, cgroup, daemon, probe each).
    #[arg(long, default_value_t = 10)]
    pub nodes: u32,
    /// Services every node follows.
    #[arg(long, default_value_t = 1000)]
    pub services: u32,
    /// Changes measured per kind (Consul: registration, deregistration, check turning
    /// critical, split moved by a config write; xDS: endpoint added, endpoint removed).
    #[arg(long, default_value_t = 100)]
    pub changes: u32,
    /// The control plane.
    #[arg(long, value_enum, default_value = "consul")]
    pub control_plane: ControlPlane,
    /// Consul: leave out the split moved by a config write (`changes` services whose
    /// discovery chains come live from Consul's config entries, measured by default); the
    /// daemons then read no config entries.
    #[arg(long)]
    pub no_split: bool,
    /// Backend servers the services' instances are spread over.
    #[arg(long, default_value_t = 16)]
    pub backends: u32,
    /// How often a probe connects while it waits, in milliseconds (the resolution).
    #[arg(long, default_value_t = 5)]
    pub poll_ms: u64,
    /// Longest wait for one change at one node, in seconds.
    #[arg(long, default_value_t = 30)]
    pub bound_s: u64,
    /// The daemon binary (default: a debug build of this workspace).
    #[arg(long)]
    pub proxy: Option<PathBuf>,
    /// Measure nothing: draw the results files given after the options (target/fleet/*.json)
    /// as one SVG chart at this path.
    #[arg(long, value_name = "OUT.svg")]
    pub chart: Option<PathBuf>,
    /// Consul: also count the requests each node's daemon makes to its agent and the RPCs the
    /// agents and servers handle, idle and under change, from Consul's own metrics; fail when a
    /// node makes more than the daemon's design allows.
    #[arg(long)]
    pub load: bool,
    /// With `--load`: seconds of the idle window after bring-up.
    #[arg(long, default_value_t = 60)]
    pub load_idle_s: u64,
    /// Measure nothing: make this control-plane fault (or `all` of the control plane's) with
    /// connect loops on every node; fails if one connect failed or the change made after
    /// recovery did not converge (see docs/fleet.md).
    #[arg(long, value_enum, value_name = "KIND")]
    pub fault: Option<fault::FaultKind>,
    /// The results files `--chart` draws.
    #[arg(requires = "chart", value_name = "RESULTS.json")]
    pub results: Vec<PathBuf>,
}

impl Options {
    /// The split services (Consul without `--no-split`): `changes` of them, or none.
    pub fn splits(&self) -> u32 {
        if !self.no_split && self.control_plane == ControlPlane::Consul {
            self.changes
        } else {
            0
        }
    }

    /// Refuses what the run cannot do, with the reason.
    pub fn validate(&self) -> anyhow::Result<()> {
        if !(1..=net::MAX_NODES).contains(&self.nodes) {
            bail!(
                "--nodes must be 1 to {}, got {}",
                net::MAX_NODES,
                self.nodes
            );
        }
        // Two at least: the split legs are on backends 0 and 1.
        if !(2..=net::MAX_BACKENDS).contains(&self.backends) {
            bail!(
                "--backends must be 2 to {}, got {}",
                net::MAX_BACKENDS,
                self.backends
            );
        }
        if self.changes == 0 {
            bail!("--changes must be at least 1");
        }
        if self.services < 2 * self.changes || self.services > 40_000 {
            bail!(
                "--services must be at least twice --changes (the first {c} are registered and \
                 deregistered, the next {c} have a check turned critical) and at most 40000, got {}",
                self.services,
                c = self.changes
            );
        }
        if self.poll_ms == 0 || self.poll_ms > 1000 || self.bound_s == 0 || self.bound_s > 600 {
            bail!("--poll-ms must be 1 to 1000 and --bound-s 1 to 600");
        }
        if self.load && self.control_plane != ControlPlane::Consul {
            bail!("--load counts requests to Consul: it needs --control-plane consul");
        }
        if self.load_idle_s == 0 || self.load_idle_s > 600 {
            bail!("--load-idle-s must be 1 to 600, got {}", self.load_idle_s);
        }
        if self.load && self.fault.is_some() {
            bail!("--load measures a run of changes and --fault makes a fault: choose one");
        }
        if let Some(kind) = self.fault {
            fault::validate(self, kind)?;
        }
        Ok(())
    }
}

/// Everything the run started, torn down in field order: nodes (probes, daemons, uninstall),
/// Consul or the xDS server, backends, namespaces and cgroups, the work directory.
#[derive(Default)]
struct Fleet {
    nodes: Vec<Node>,
    cluster: Option<Cluster>,
    xds: Option<XdsServer>,
    backends: Option<Backends>,
    net: Option<Net>,
    workdir: Option<WorkDir>,
}

/// The agents' data and the logs; removed on drop, the logs kept under target/fleet/logs when
/// the run failed.
struct WorkDir {
    path: PathBuf,
    keep_logs: Option<PathBuf>,
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if let Some(dest) = &self.keep_logs {
            let _ = fs::create_dir_all(dest);
            for e in fs::read_dir(&self.path).into_iter().flatten().flatten() {
                if e.path()
                    .extension()
                    .is_some_and(|x| x == "log" || x == "json")
                {
                    let _ = fs::copy(e.path(), dest.join(e.file_name()));
                }
            }
            eprintln!("the logs of the failed run are in {}", dest.display());
        }
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// `cargo xtask fleet`.
pub fn run(opts: &Options) -> anyhow::Result<()> {
    if let Some(out) = &opts.chart {
        return chart::write(out, &opts.results);
    }
    opts.validate()?;
    util::require_root("cargo xtask fleet")?;
    let proxy = match &opts.proxy {
        Some(p) => p.clone(),
        None => util::build_proxy()?,
    };
    let out_dir = util::target_dir()?.join("fleet");
    fs::create_dir_all(&out_dir)?;
    sys::catch_signals();
    detail(format!("open files allowed: {}", sys::raise_nofile()));
    let pid = std::process::id();
    let mut fleet = Fleet::default();
    let path = std::env::temp_dir().join(format!("proxy-fleet-{pid}"));
    fs::create_dir_all(&path)?;
    fleet.workdir = Some(WorkDir {
        path: path.clone(),
        keep_logs: None,
    });
    let outcome = bring_up_and_measure(&mut fleet, opts, &proxy, (&path, &out_dir));
    if outcome.is_err()
        && let Some(w) = fleet.workdir.as_mut()
    {
        w.keep_logs = Some(out_dir.join(format!("logs-{pid}")));
    }
    step("tearing the fleet down");
    let t = Instant::now();
    for node in &mut fleet.nodes {
        node.terminate();
    }
    drop(fleet);
    let teardown_s = t.elapsed().as_secs_f64();
    detail(format!("torn down in {teardown_s:.1} s"));
    let left = leftovers(pid);
    if !left.is_empty() {
        eprintln!("WARNING: left behind: {}", left.join(", "));
    }
    let Some(mut report) = outcome? else {
        if !left.is_empty() {
            bail!("the teardown left things behind (see above)");
        }
        return Ok(());
    };
    report.teardown_s = teardown_s;
    let file = out_dir.join(format!(
        "fleet-{}-{}.json",
        report.inner.control_plane,
        timestamp()
    ));
    fs::write(&file, serde_json::to_vec_pretty(&report)?)?;
    println!("{}", report::table(&report.inner));
    if let Some(load) = &report.load {
        println!("{}", load::table(load));
    }
    step(format!("results in {}", file.display()));
    if !left.is_empty() {
        bail!("the teardown left things behind (see above)");
    }
    if let Some(load) = report.load.as_ref().filter(|l| !l.exceeded.is_empty()) {
        bail!(
            "the fleet's load on consul is above the bound:\n{}",
            load.exceeded.join("\n")
        );
    }
    Ok(())
}

/// The report with the teardown time, known only after it.
#[derive(serde::Serialize)]
struct Written {
    #[serde(flatten)]
    inner: report::Report,
    teardown_s: f64,
    /// With `--load`: the requests and RPCs counted by Consul.
    #[serde(skip_serializing_if = "Option::is_none")]
    load: Option<load::Load>,
}

/// The measurement's report, or None after a fault run (which writes its own results).
fn bring_up_and_measure(
    fleet: &mut Fleet,
    opts: &Options,
    proxy: &Path,
    (dir, out_dir): (&Path, &Path),
) -> anyhow::Result<Option<Written>> {
    let up = Instant::now();
    let plane = match opts.control_plane {
        ControlPlane::Consul => "consul",
        ControlPlane::Xds => "xds",
    };
    step(format!(
        "bringing up {} nodes, {} services, {plane}",
        opts.nodes, opts.services
    ));
    let net = fleet.net.insert(Net::create(opts.nodes, opts.backends)?);
    fleet.backends = Some(Backends::start(net, opts.backends)?);
    let mut configs = Vec::new();
    match opts.control_plane {
        ControlPlane::Consul => {
            let cluster = fleet
                .cluster
                .insert(Cluster::start(&consul::binary()?, net, dir)?);
            cluster.populate(opts.services, opts.changes, opts.backends, opts.splits())?;
            for i in 1..=opts.nodes {
                let counts = (opts.services, opts.splits());
                configs.push(node::daemon_config(
                    &node::instance(i),
                    &net.cgroup(i),
                    i,
                    counts,
                ));
            }
        }
        ControlPlane::Xds => {
            let server = fleet
                .xds
                .insert(XdsServer::start(&xds::python()?, net, dir)?);
            let t = Instant::now();
            // Services 0..changes start with no endpoint: the pushes measured add one.
            for j in 0..opts.services {
                sys::check_interrupted()?;
                let backend = (j >= opts.changes).then(|| backend_of(opts, j));
                server.push_endpoints(j, backend)?;
            }
            server.push_services(opts.services)?;
            detail(format!(
                "pushed {} clusters, listeners and endpoints in {:.1} s",
                opts.services,
                t.elapsed().as_secs_f64()
            ));
            for i in 1..=opts.nodes {
                configs.push(xds::daemon_config(&node::instance(i), &net.cgroup(i), i));
            }
        }
    }
    let poll = Duration::from_millis(opts.poll_ms);
    for (i, config) in (1..).zip(&configs) {
        sys::check_interrupted()?;
        fleet
            .nodes
            .push(Node::start(proxy, net, dir, (i, config), poll)?);
    }
    measure::wait_ready(&mut fleet.nodes, opts)?;
    let bring_up_s = up.elapsed().as_secs_f64();
    detail(format!("bring-up took {bring_up_s:.1} s"));
    if let Some(kind) = opts.fault {
        fault::run(fleet, opts, kind, (dir, out_dir), bring_up_s)?;
        return Ok(None);
    }
    let idle = load::idle(fleet, opts)?;
    let counted = load::begin(fleet, opts)?;
    let measuring = Instant::now();
    let load_before = report::load_average();
    let kinds = match opts.control_plane {
        ControlPlane::Consul => measure::consul(fleet, opts)?,
        ControlPlane::Xds => measure::xds(fleet, opts)?,
    };
    let load = load::end(fleet, opts, idle, counted)?;
    Ok(Some(Written {
        inner: report::Report {
            control_plane: plane.to_owned(),
            nodes: opts.nodes,
            services: opts.services,
            backends: opts.backends,
            changes_per_kind: opts.changes,
            poll_interval_ms: opts.poll_ms,
            bring_up_s,
            measure_s: measuring.elapsed().as_secs_f64(),
            load_before,
            load_after: report::load_average(),
            kinds,
        },
        teardown_s: 0.0,
        load,
    }))
}

pub(crate) fn svc(j: u32) -> String {
    format!("svc-{j}")
}

/// The `m`-th split service (Consul fleet).
pub(crate) fn split(m: u32) -> String {
    format!("split-{m}")
}

/// The backend of service `j`'s instance.
pub(crate) fn backend_of(opts: &Options, j: u32) -> std::net::Ipv4Addr {
    net::backend(j % opts.backends)
}

/// What of run `pid` is still there: namespaces, cgroups, pins, the daemons' files in /run.
fn leftovers(pid: u32) -> Vec<String> {
    let mut left = Vec::new();
    let ns_prefix = format!("pf{pid}-");
    for e in fs::read_dir("/run/netns").into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(&ns_prefix) {
            left.push(format!("netns {name}"));
        }
    }
    if let Ok(cg) = net::cgroup2_mount() {
        let parent = cg.join(format!("proxy-fleet-{pid}"));
        if parent.exists() {
            left.push(format!("cgroup {}", parent.display()));
        }
    }
    // Pins, and the daemons' lock, takeover and admin sockets.
    let prefix = format!("fleet_{pid}_");
    for dir in ["/sys/fs/bpf", "/run/proxy"] {
        for e in fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(&prefix) {
                left.push(format!("{dir}/{name}"));
            }
        }
    }
    left
}

fn timestamp() -> String {
    util::output(Command::new("date").args(["-u", "+%Y%m%dT%H%M%SZ"]), "date")
        .map_or_else(|_| "now".into(), |s| s.trim().to_owned())
}

/// The options as `cargo xtask fleet ARGS` would read them, checked.
#[derive(clap::Parser)]
struct Cli {
    #[command(flatten)]
    opts: Options,
}

pub(crate) fn parse(args: &[&str]) -> anyhow::Result<Options> {
    use clap::Parser as _;
    let cli = Cli::try_parse_from(std::iter::once("fleet").chain(args.iter().copied()))?;
    cli.opts.validate()?;
    Ok(cli.opts)
}

/// The suite's fault runs (`cargo xtask test`): every fault of each control plane, each a test,
/// on a fleet small enough for the suite's time (3 nodes, 40 services), with `proxy`.
pub fn suite_faults(proxy: &Path) -> anyhow::Result<()> {
    let proxy = proxy.to_str().context("the daemon's path is not UTF-8")?;
    for plane in ["consul", "xds"] {
        step(format!(
            "control-plane faults on a fleet of 3 nodes ({plane})"
        ));
        let args = [
            "--nodes",
            "3",
            "--services",
            "40",
            "--changes",
            "10",
            "--control-plane",
            plane,
            "--fault",
            "all",
            "--proxy",
            proxy,
        ];
        run(&parse(&args)?).with_context(|| format!("the {plane} fault runs failed"))?;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_issues_ten_nodes_thousand_services_hundred_changes() {
        let o = parse(&[]).unwrap();
        assert_eq!((o.nodes, o.services, o.changes), (10, 1000, 100));
        assert_eq!(o.control_plane, ControlPlane::Consul);
        assert_eq!((o.poll_ms, o.backends), (5, 16));
        assert_eq!(o.splits(), 100);
        assert_eq!(parse(&["--no-split"]).unwrap().splits(), 0);
        let xds = parse(&["--control-plane", "xds"]).unwrap();
        assert_eq!(xds.splits(), 0, "xDS has no Consul splitter");
    }

    #[test]
    fn impossible_runs_are_refused_with_the_reason() {
        for (args, why) in [
            (&["--nodes", "0"][..], "--nodes"),
            (&["--nodes", "151"], "--nodes"),
            (&["--services", "150", "--changes", "100"], "twice"),
            (&["--changes", "0"], "--changes"),
            (&["--backends", "1"], "--backends"),
            (&["--poll-ms", "0"], "--poll-ms"),
            (&["--load", "--control-plane", "xds"], "--load"),
            (&["--load", "--load-idle-s", "0"], "--load-idle-s"),
        ] {
            let err = parse(args).unwrap_err().to_string();
            assert!(err.contains(why), "{args:?}: {err}");
        }
        assert!(parse(&["--control-plane", "etcd"]).is_err());
        assert!(parse(&["--nodes", "-3"]).is_err());
        let o = parse(&["--nodes", "3", "--services", "20", "--changes", "10"]).unwrap();
        assert_eq!((o.nodes, o.services, o.changes), (3, 20, 10));
    }
}
