//! `--load`: the load the fleet puts on Consul, counted on Consul's side. Every agent and server
//! exposes cumulative counters (`/v1/agent/metrics?format=prometheus`, the agents run with a
//! Prometheus retention for it); the harness reads them before and after two windows, an idle
//! one after bring-up and the one the measured changes take, and reports the difference per
//! node (the HTTP requests its daemon made to its own agent, and the RPCs that agent made to the
//! servers) and per server (RPCs handled, blocking queries among them).
//!
//! Each node's requests are held to a bound derived from how the daemon follows Consul (one
//! blocking query per watch, re-sent when it returns: at the latest after `wait`, at once after
//! a change) so that a regression to polling, a hot loop or a storm of queries fails the run.
//! See docs/fleet.md.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use serde::Serialize;

mod design;

pub use self::design::{Changes, Design};
use super::{Fleet, Options, consul::HTTP_PORT, http, net, sys};
use crate::util::{detail, step};

/// The daemon's requests, by the agent's HTTP timer of each endpoint it calls (a summary's
/// `_count`: requests that finished).
const HEALTH: &str = "consul_http_GET_v1_health_service___count";
const CONFIG: &str = "consul_http_GET_v1_config___count";
const TOKEN_SELF: &str = "consul_http_GET_v1_acl_token_self_count";
const AUTHORIZE: &str = "consul_http_POST_v1_internal_acl_authorize_count";
/// RPCs an agent made to the servers (every kind, its own anti-entropy and coordinates too).
const CLIENT_RPC: &str = "consul_client_rpc";
/// RPCs a server handled (forwarded ones included), and blocking queries among them.
const RPC_REQUEST: &str = "consul_rpc_request";
const RPC_QUERY: &str = "consul_rpc_query";

/// The unlabelled samples of a Prometheus text exposition, by name. Comments, labelled samples
/// (quantiles) and lines that do not parse are left out.
pub fn parse(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(name), Some(value)) = (words.next(), words.next()) else {
            continue;
        };
        if name.contains('{') {
            continue;
        }
        if let Ok(v) = value.parse::<f64>()
            && v.is_finite()
        {
            out.insert(name.to_owned(), v);
        }
    }
    out
}

/// How much counter `name` grew from `before` to `after` (absent is 0; a counter never shrinks,
/// a smaller value reads as 0).
fn grew(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>, name: &str) -> u64 {
    let at = |m: &BTreeMap<String, f64>| m.get(name).copied().unwrap_or(0.0);
    (at(after) - at(before)).max(0.0).round() as u64
}

/// Every agent's and server's counters at one moment.
pub struct Scrape {
    at: Instant,
    nodes: Vec<BTreeMap<String, f64>>,
    servers: Vec<BTreeMap<String, f64>>,
}

/// Reads every node agent's and server's metrics, from the hub.
pub fn scrape(fleet: &Fleet) -> anyhow::Result<Scrape> {
    let hub = &fleet.net.as_ref().context("no network")?.hub;
    let nodes = fleet.nodes.len() as u32;
    let read = |addr: SocketAddr| -> anyhow::Result<BTreeMap<String, f64>> {
        let path = "/v1/agent/metrics?format=prometheus";
        let (status, body) = http::call(addr, "GET", path, None)?;
        anyhow::ensure!(status == 200, "GET {path} on consul {addr}: {status}");
        Ok(parse(&body))
    };
    net::with_netns(hub, || {
        let at = Instant::now();
        let nodes = (1..=nodes)
            .map(|i| read(SocketAddr::from((net::hub_side(i), HTTP_PORT))))
            .collect::<anyhow::Result<_>>()?;
        let servers = net::SERVERS
            .iter()
            .map(|ip| read(SocketAddr::from((*ip, HTTP_PORT))))
            .collect::<anyhow::Result<_>>()?;
        anyhow::Ok(Scrape { at, nodes, servers })
    })?
}

/// One node in one window.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NodeLoad {
    pub node: u32,
    /// `GET /v1/health/service/<name>`.
    pub health: u64,
    /// `GET /v1/config/<kind>`.
    pub config: u64,
    /// ACL checks of empty answers (`/v1/acl/token/self`, `/v1/internal/acl/authorize`).
    pub acl: u64,
    /// All of the above.
    pub requests: u64,
    pub requests_per_s: f64,
    /// RPCs the node's agent made to the servers.
    pub agent_rpc: u64,
    pub agent_rpc_per_s: f64,
}

/// One server in one window.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ServerLoad {
    pub server: String,
    pub rpc_request: u64,
    pub rpc_request_per_s: f64,
    pub rpc_query: u64,
    pub rpc_query_per_s: f64,
}

/// Counters before and after, one map per agent or server.
type Pair<'a> = (&'a [BTreeMap<String, f64>], &'a [BTreeMap<String, f64>]);

/// One window.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Window {
    pub name: String,
    pub seconds: f64,
    pub changes: Changes,
    /// The most requests one node may make in it.
    pub bound_requests: u64,
    /// Lowest, mean and highest requests per second over the nodes.
    pub node_requests_per_s: [f64; 3],
    pub nodes: Vec<NodeLoad>,
    pub servers: Vec<ServerLoad>,
}

impl Window {
    /// The window from `a` to `b` with `changes` in it.
    pub fn new(name: &str, a: &Scrape, b: &Scrape, changes: Changes, design: &Design) -> Self {
        let seconds = b.at.duration_since(a.at).as_secs_f64();
        let counts = (
            (&a.nodes[..], &b.nodes[..]),
            (&a.servers[..], &b.servers[..]),
        );
        Self::of_counts((name, seconds), counts, changes, design)
    }

    /// The window `(name, seconds)` long between two sets of counts `((nodes before, after),
    /// (servers before, after))`.
    fn of_counts(
        (name, seconds): (&str, f64),
        ((n0, n1), (s0, s1)): (Pair<'_>, Pair<'_>),
        changes: Changes,
        design: &Design,
    ) -> Self {
        let rate = |n: u64| n as f64 / seconds.max(f64::MIN_POSITIVE);
        let nodes: Vec<NodeLoad> = (1..)
            .zip(n0.iter().zip(n1))
            .map(|(node, (a, b))| {
                let (health, config) = (grew(a, b, HEALTH), grew(a, b, CONFIG));
                let acl = grew(a, b, TOKEN_SELF) + grew(a, b, AUTHORIZE);
                let requests = health + config + acl;
                let agent_rpc = grew(a, b, CLIENT_RPC);
                NodeLoad {
                    node,
                    health,
                    config,
                    acl,
                    requests,
                    requests_per_s: rate(requests),
                    agent_rpc,
                    agent_rpc_per_s: rate(agent_rpc),
                }
            })
            .collect();
        let servers = net::SERVERS
            .iter()
            .zip(s0.iter().zip(s1))
            .map(|(ip, (a, b))| {
                let (rpc_request, rpc_query) = (grew(a, b, RPC_REQUEST), grew(a, b, RPC_QUERY));
                ServerLoad {
                    server: ip.to_string(),
                    rpc_request,
                    rpc_request_per_s: rate(rpc_request),
                    rpc_query,
                    rpc_query_per_s: rate(rpc_query),
                }
            })
            .collect();
        let per_s: Vec<f64> = nodes.iter().map(|n| n.requests_per_s).collect();
        let mean = per_s.iter().sum::<f64>() / per_s.len().max(1) as f64;
        Self {
            name: name.to_owned(),
            seconds,
            changes,
            bound_requests: design.bound(seconds, changes),
            node_requests_per_s: [
                per_s.iter().copied().reduce(f64::min).unwrap_or(0.0),
                mean,
                per_s.iter().copied().reduce(f64::max).unwrap_or(0.0),
            ],
            nodes,
            servers,
        }
    }

    /// The nodes above the bound, each as a sentence.
    pub fn exceeded(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter(|n| n.requests > self.bound_requests)
            .map(|n| {
                format!(
                    "{}: node {} made {} requests to its agent in {:.1} s ({} health, {} config, \
                     {} acl), above the bound of {}",
                    self.name,
                    n.node,
                    n.requests,
                    self.seconds,
                    n.health,
                    n.config,
                    n.acl,
                    self.bound_requests
                )
            })
            .collect()
    }
}

/// Both windows, the design they are held to, and the nodes that broke the bound.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Load {
    pub design: Design,
    pub idle: Window,
    pub change: Window,
    /// The most requests one node made per change beyond what its idle rate would have made
    /// in the change window (None without changes): under change the rate follows how fast
    /// the harness changes things, this does not.
    pub above_idle_per_change: Option<f64>,
    pub exceeded: Vec<String>,
}

/// See [`Load::above_idle_per_change`].
fn above_idle(idle: &Window, change: &Window) -> Option<f64> {
    let changes = change.changes.total();
    let extra = idle.nodes.iter().zip(&change.nodes).map(|(i, c)| {
        (c.requests as f64 - i.requests_per_s * change.seconds).max(0.0) / changes as f64
    });
    (changes > 0).then(|| extra.reduce(f64::max).unwrap_or(0.0))
}

/// With `--load`: the idle window, `--load-idle-s` long, right after bring-up. None without.
pub fn idle(fleet: &Fleet, opts: &Options) -> anyhow::Result<Option<Window>> {
    if !opts.load {
        return Ok(None);
    }
    step(format!(
        "measuring the idle load for {} s",
        opts.load_idle_s
    ));
    let a = scrape(fleet)?;
    let end = a.at + Duration::from_secs(opts.load_idle_s);
    while Instant::now() < end {
        sys::check_interrupted()?;
        std::thread::sleep(Duration::from_millis(200));
    }
    let (b, design) = (scrape(fleet)?, Design::of(opts));
    let w = Window::new("idle", &a, &b, Changes::default(), &design);
    log(&w);
    Ok(Some(w))
}

/// With `--load`: the counters before the changes.
pub fn begin(fleet: &Fleet, opts: &Options) -> anyhow::Result<Option<Scrape>> {
    opts.load.then(|| scrape(fleet)).transpose()
}

/// The change window from `before` (None without `--load`), and the whole load report.
pub fn end(
    fleet: &Fleet,
    opts: &Options,
    idle: Option<Window>,
    before: Option<Scrape>,
) -> anyhow::Result<Option<Load>> {
    let (Some(idle), Some(before)) = (idle, before) else {
        return Ok(None);
    };
    let k = u64::from(opts.changes);
    // Registrations and checks turning critical; deregistrations; split moves.
    let changes = Changes {
        catalog: 2 * k,
        deregistrations: k,
        config: if opts.splits() > 0 { k } else { 0 },
    };
    let design = Design::of(opts);
    let change = Window::new("change", &before, &scrape(fleet)?, changes, &design);
    log(&change);
    let exceeded = [idle.exceeded(), change.exceeded()].concat();
    let above_idle_per_change = above_idle(&idle, &change);
    let load = Load {
        design,
        idle,
        change,
        above_idle_per_change,
        exceeded,
    };
    Ok(Some(load))
}

fn log(w: &Window) {
    let [lo, mean, hi] = w.node_requests_per_s;
    detail(format!(
        "{} load over {:.1} s: {lo:.1} / {mean:.1} / {hi:.1} requests/s per node (min/mean/max), \
         bound {} requests per node",
        w.name, w.seconds, w.bound_requests
    ));
}

/// The printed table: per window, the nodes' rates and the servers'.
pub fn table(load: &Load) -> String {
    let mut out = format!(
        "{:<7} {:>7} {:>8}  {:>24}  {:>12}  {:>10}  {:>12}  server rpc/s (blocking queries/s)\n",
        "window",
        "seconds",
        "changes",
        "node req/s min/mean/max",
        "node max req",
        "bound req",
        "+req/change"
    );
    for (w, extra) in [
        (&load.idle, None),
        (&load.change, load.above_idle_per_change),
    ] {
        let [lo, mean, hi] = w.node_requests_per_s;
        let servers: Vec<String> = w
            .servers
            .iter()
            .map(|s| format!("{:.1} ({:.1})", s.rpc_request_per_s, s.rpc_query_per_s))
            .collect();
        let _ = writeln!(
            out,
            "{:<7} {:>7.1} {:>8}  {:>24}  {:>12}  {:>10}  {:>12}  {}",
            w.name,
            w.seconds,
            w.changes.total(),
            format!("{lo:.1} / {mean:.1} / {hi:.1}"),
            w.nodes.iter().map(|n| n.requests).max().unwrap_or(0),
            w.bound_requests,
            extra.map_or_else(|| "-".to_owned(), |r: f64| format!("{r:.1}")),
            servers.join(", ")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{
        design::tests::{DESIGN, NONE},
        *,
    };

    const AGENT: &str = "\
# HELP consul_client_rpc consul_client_rpc
# TYPE consul_client_rpc counter
consul_client_rpc 9
consul_http_GET_v1_health_service__{quantile=\"0.5\"} 0.30
consul_http_GET_v1_health_service___sum 1.69
consul_http_GET_v1_health_service___count 2
consul_http_GET_v1_acl_token_self_count 1 1700000000000
consul_rpc_query NaN
broken
";

    #[test]
    fn the_unlabelled_samples_are_read_and_the_rest_left_out() {
        let m = parse(AGENT);
        assert_eq!(m.get(CLIENT_RPC), Some(&9.0));
        assert_eq!(m.get(HEALTH), Some(&2.0));
        assert_eq!(m.get(TOKEN_SELF), Some(&1.0), "a timestamp after the value");
        assert_eq!(
            m.get("consul_http_GET_v1_health_service___sum"),
            Some(&1.69)
        );
        assert!(!m.keys().any(|k| k.contains('{')));
        assert!(!m.contains_key(RPC_QUERY), "NaN is no count");
        assert!(!m.contains_key("broken"));
    }

    fn counts(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
    }

    /// A 10-second window over two nodes and the three servers.
    fn window(
        nodes: [&[BTreeMap<String, f64>]; 2],
        servers: [&[BTreeMap<String, f64>]; 2],
        changes: Changes,
    ) -> Window {
        Window::of_counts(
            ("w", 10.0),
            ((nodes[0], nodes[1]), (servers[0], servers[1])),
            changes,
            &DESIGN,
        )
    }

    #[test]
    fn a_window_is_the_growth_of_each_counter_per_node_and_server() {
        let n0 = [counts(&[(HEALTH, 10.0), (CLIENT_RPC, 5.0)]), counts(&[])];
        let n1 = [
            counts(&[
                (HEALTH, 40.0),
                (TOKEN_SELF, 4.0),
                (CONFIG, 6.0),
                (CLIENT_RPC, 25.0),
            ]),
            counts(&[(HEALTH, 20.0), (AUTHORIZE, 1.0)]),
        ];
        let s0 = [
            counts(&[(RPC_REQUEST, 100.0), (RPC_QUERY, 50.0)]),
            counts(&[]),
            counts(&[]),
        ];
        let s1 = [
            counts(&[(RPC_REQUEST, 300.0), (RPC_QUERY, 90.0)]),
            counts(&[]),
            counts(&[]),
        ];
        let w = window([&n0, &n1], [&s0, &s1], NONE);
        let first = NodeLoad {
            node: 1,
            health: 30,
            config: 6,
            acl: 4,
            requests: 40,
            requests_per_s: 4.0,
            agent_rpc: 20,
            agent_rpc_per_s: 2.0,
        };
        assert_eq!(w.nodes[0], first);
        assert_eq!((w.nodes[1].requests, w.nodes[1].acl), (21, 1));
        let centi = w.node_requests_per_s.map(|r| (r * 100.0).round() as u64);
        assert_eq!(centi, [210, 305, 400], "min, mean, max");
        let leader = &w.servers[0];
        assert_eq!(leader.server, "127.0.0.71");
        assert_eq!((leader.rpc_request_per_s, leader.rpc_query), (20.0, 40));
        assert_eq!(w.servers[2].rpc_request, 0);
        // A counter that went down (an agent restarted) counts nothing, not a negative.
        assert_eq!(window([&n1, &n0], [&s1, &s0], NONE).nodes[0].requests, 0);
    }

    #[test]
    fn a_node_above_the_bound_is_named_and_polling_is_caught() {
        let n0 = [counts(&[]), counts(&[])];
        // A daemon that polled every 50 ms instead of blocking: 100 watches x 20 per second.
        let n1 = [counts(&[(HEALTH, 120.0)]), counts(&[(HEALTH, 20_000.0)])];
        let s = [counts(&[]), counts(&[]), counts(&[])];
        let idle = window([&n0, &n1], [&s, &s], NONE);
        let exceeded = idle.exceeded();
        assert_eq!(exceeded.len(), 1, "{exceeded:?}");
        assert!(
            exceeded[0].starts_with("w: node 2 made 20000 requests"),
            "{exceeded:?}"
        );
        assert!(exceeded[0].contains("bound of 120"), "{exceeded:?}");
        // Node 1 made 12 requests/s idle, then 300 more than that in 10 s with 40 changes;
        // node 2 kept its rate.
        let n2 = [counts(&[(HEALTH, 420.0)]), counts(&[(HEALTH, 20_000.0)])];
        let changes = Changes {
            catalog: 20,
            deregistrations: 10,
            config: 10,
        };
        let change = window([&n0, &n2], [&s, &s], changes);
        assert_eq!(above_idle(&idle, &change), Some(7.5));
        assert_eq!(above_idle(&idle, &idle), None, "no changes");
        let load = Load {
            design: DESIGN,
            idle,
            change,
            above_idle_per_change: Some(7.5),
            exceeded,
        };
        let table = table(&load);
        let header = table.lines().next().unwrap();
        assert!(
            header.contains("+req/change") && table.contains(" 7.5 "),
            "{table}"
        );
        assert_eq!(table.lines().count(), 3, "{table}");
    }
}
