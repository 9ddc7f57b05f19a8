//! The faults themselves, each with its recovery and its own check: what is stopped, cut or
//! restarted, and how the harness knows the control plane is whole again.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    io::Write as _,
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::{BURST, LOOP_SERVICES, Outcome, after_fault_bound, arm_all, ms_since, vip_addr};
use crate::{
    fleet::{
        Fleet, Options,
        consul::{self, Cluster, HTTP_PORT},
        http, net,
        probe::Expect,
        svc, sys,
    },
    util::detail,
};

/// How long what was stopped stays away (the xDS server, a client agent).
const AWAY: Duration = Duration::from_secs(5);
/// How long a partition lasts.
const CUT: Duration = Duration::from_secs(10);
/// Bound of every wait for the control plane to be whole again.
const RECOVERY_BOUND: Duration = Duration::from_secs(120);
/// The nft table of the partition, in the hub's namespace only.
const PARTITION_TABLE: &str = "proxy_fleet_partition";
/// Consul's server RPC (raft), serf LAN and serf WAN ports.
const SERVER_PORTS: &str = "8300, 8301, 8302";

/// Polls `check` every 50 ms until it holds; the time it took, or None past `bound`.
fn until(
    bound: Duration,
    mut check: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<Option<f64>> {
    let t = Instant::now();
    while t.elapsed() < bound {
        sys::check_interrupted()?;
        if check()? {
            return Ok(Some(t.elapsed().as_secs_f64() * 1e3));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(None)
}

fn server_http(k: usize) -> SocketAddr {
    SocketAddr::from((net::SERVERS[k], HTTP_PORT))
}

/// The servers' index of the leader, as server `asked` says.
fn leader_index(cluster: &Cluster, asked: usize) -> anyhow::Result<Option<usize>> {
    let leader = cluster.leader_seen_by(server_http(asked))?;
    Ok(leader.and_then(|l| {
        let ip: Ipv4Addr = l.split(':').next()?.parse().ok()?;
        net::SERVERS.iter().position(|s| *s == ip)
    }))
}

/// Every server in `servers` names the same leader, and it is one of them.
fn agreed(cluster: &Cluster, servers: &[usize]) -> anyhow::Result<Option<usize>> {
    let mut seen = Vec::new();
    for k in servers {
        seen.push(leader_index(cluster, *k)?);
    }
    Ok(match seen[..] {
        [Some(first), ..] if seen.iter().all(|s| *s == Some(first)) && servers.contains(&first) => {
            Some(first)
        }
        _ => None,
    })
}

/// The leader server killed (SIGKILL: a crash, no leave); the two others elect a new one; the
/// killed one started again (same data) rejoins; recovered when all three agree on a leader.
pub fn consul_leader(fleet: &mut Fleet) -> anyhow::Result<Outcome> {
    let cluster = fleet.cluster.as_mut().context("no consul")?;
    let old = agreed(cluster, &[0, 1, 2])?.context("the servers do not agree on a leader")?;
    let t = Instant::now();
    cluster.stop_agent(old, true)?;
    let others: Vec<usize> = (0..3).filter(|k| *k != old).collect();
    let elected = until(RECOVERY_BOUND, || Ok(agreed(cluster, &others)?.is_some()))?
        .context("no new leader within the bound")?;
    cluster.restart_agent(old)?;
    until(
        RECOVERY_BOUND,
        || Ok(agreed(cluster, &[0, 1, 2])?.is_some()),
    )?
    .context("the restarted server does not agree on the leader within the bound")?;
    let new = agreed(cluster, &[0, 1, 2])?.map_or(0, |k| k + 1);
    Ok(Outcome {
        what: format!(
            "killed the leader server-{} (SIGKILL); server-{new} leads after re-election in \
             {elected:.0} ms; server-{} started again and rejoined",
            old + 1,
            old + 1
        ),
        recovery_ms: Some(t.elapsed().as_secs_f64() * 1e3),
        ..Outcome::default()
    })
}

/// The nft table cutting one server off from the two others; removed on drop.
struct Partition {
    hub: String,
}

impl Partition {
    fn cut(hub: &str, cut: Ipv4Addr, others: &[Ipv4Addr]) -> anyhow::Result<Self> {
        let this = Self {
            hub: hub.to_owned(),
        };
        nft(hub, &partition_rules(cut, others))?;
        Ok(this)
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        let rule = format!("delete table inet {PARTITION_TABLE}\n");
        if let Err(e) = nft(&self.hub, &rule) {
            eprintln!("WARNING: removing nft table {PARTITION_TABLE}: {e:#}");
        }
    }
}

/// The table: packets between `cut` and `others` to or from a server port are dropped, both
/// ways; the agents still reach every server.
pub fn partition_rules(cut: Ipv4Addr, others: &[Ipv4Addr]) -> String {
    let others: Vec<String> = others.iter().map(Ipv4Addr::to_string).collect();
    let others = others.join(", ");
    let mut rules = String::new();
    for (src, dst) in [
        (cut.to_string(), format!("{{ {others} }}")),
        (format!("{{ {others} }}"), cut.to_string()),
    ] {
        for dir in ["dport", "sport"] {
            let _ = writeln!(
                rules,
                "    ip saddr {src} ip daddr {dst} meta l4proto {{ tcp, udp }} th {dir} {{ {SERVER_PORTS} }} drop"
            );
        }
    }
    format!(
        "table inet {PARTITION_TABLE} {{\n  chain input {{\n    type filter hook input priority 0; policy accept;\n{rules}  }}\n}}\n"
    )
}

fn nft(hub: &str, rules: &str) -> anyhow::Result<()> {
    let mut child = net::in_netns(hub, Path::new("nft"), &["-f".to_owned(), "-".to_owned()])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting nft")?;
    child
        .stdin
        .take()
        .context("nft stdin")?
        .write_all(rules.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "nft refused the rules: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A follower cut off from the leader and the other follower for [`CUT`] (the agents still
/// reach it), then joined again; recovered when all three agree on a leader.
pub fn consul_partition(fleet: &mut Fleet) -> anyhow::Result<Outcome> {
    let net = fleet.net.as_ref().context("no network")?;
    let cluster = fleet.cluster.as_mut().context("no consul")?;
    let leader = agreed(cluster, &[0, 1, 2])?.context("the servers do not agree on a leader")?;
    let cut = (0..3).find(|k| *k != leader).context("three servers")?;
    let others: Vec<Ipv4Addr> = (0..3)
        .filter(|k| *k != cut)
        .map(|k| net::SERVERS[k])
        .collect();
    let t = Instant::now();
    let partition = Partition::cut(&net.hub, net::SERVERS[cut], &others)?;
    let lost = until(CUT, || Ok(leader_index(cluster, cut)?.is_none()))?;
    std::thread::sleep(CUT.saturating_sub(t.elapsed()));
    let majority: Vec<usize> = (0..3).filter(|k| *k != cut).collect();
    let kept = agreed(cluster, &majority)?;
    drop(partition);
    let lifted = Instant::now();
    let whole = until(
        RECOVERY_BOUND,
        || Ok(agreed(cluster, &[0, 1, 2])?.is_some()),
    )?
    .context("the servers do not agree on a leader within the bound after the partition")?;
    let ms = |v: Option<f64>| v.map_or_else(|| "never".to_owned(), |v| format!("{v:.0} ms"));
    Ok(Outcome {
        what: format!(
            "cut follower server-{} off from the others for {CUT:?} (leader server-{}); it lost \
             the leader after {}; the majority's leader during the cut: {}; whole again {whole:.0} \
             ms after the cut was lifted",
            cut + 1,
            leader + 1,
            ms(lost),
            kept.map_or_else(|| "none".to_owned(), |k| format!("server-{}", k + 1)),
        ),
        recovery_ms: Some(lifted.duration_since(t).as_secs_f64() * 1e3 + whole),
        ..Outcome::default()
    })
}

/// Node 1's client agent stopped (SIGTERM: it leaves the cluster), away for [`AWAY`], started
/// again; recovered when it knows the leader.
pub fn consul_agent(fleet: &mut Fleet) -> anyhow::Result<Outcome> {
    let cluster = fleet.cluster.as_mut().context("no consul")?;
    let index = 3 + 1;
    let t = Instant::now();
    cluster.stop_agent(index, false)?;
    std::thread::sleep(AWAY);
    cluster.restart_agent(index)?;
    let agent = SocketAddr::from((net::hub_side(1), HTTP_PORT));
    let back = until(RECOVERY_BOUND, || {
        Ok(cluster.leader_seen_by(agent)?.is_some())
    })?
    .context("node 1's agent does not know the leader within the bound")?;
    Ok(Outcome {
        what: format!(
            "stopped node 1's client agent (SIGTERM, it left), started it again after {AWAY:?}; \
             it knew the leader {back:.0} ms later"
        ),
        recovery_ms: Some(t.elapsed().as_secs_f64() * 1e3),
        ..Outcome::default()
    })
}

/// The xDS server stopped, away for [`AWAY`], started again on the same port with the same
/// resources at the same versions; every node's first request on it, and the versions named.
pub fn xds_restart(fleet: &mut Fleet) -> anyhow::Result<Outcome> {
    let nodes = fleet.nodes.len();
    let server = fleet.xds.as_mut().context("no xDS server")?;
    let t = Instant::now();
    server.stop()?;
    std::thread::sleep(AWAY);
    let ready = server.restart()?;
    let mut firsts = BTreeMap::new();
    until(RECOVERY_BOUND, || {
        firsts = first_requests(&server.requests()?);
        Ok(firsts.len() >= nodes)
    })?;
    let reconnect_ms = (1..=nodes)
        .map(|i| {
            firsts
                .get(&format!("node-{i}"))
                .map(|(t, _)| ms_since(ready, *t))
        })
        .collect();
    // Versions named on each node's stream (its initial requests), counted over all requests.
    let resumed_versions = (1..=nodes)
        .map(|i| firsts.get(&format!("node-{i}")).map_or(0, |(_, v)| *v))
        .collect();
    Ok(Outcome {
        what: format!(
            "stopped the xDS server (SIGTERM), started it again after {AWAY:?} with the same resources and versions"
        ),
        recovery_ms: Some(t.elapsed().as_secs_f64() * 1e3),
        reconnect_ms,
        resumed_versions,
        ..Outcome::default()
    })
}

/// Per node id: CLOCK_MONOTONIC (ns) of its first request, and the resource versions its
/// requests named as held (`initial_resource_versions`, summed).
pub fn first_requests(requests: &[serde_json::Value]) -> BTreeMap<String, (u64, usize)> {
    let mut out: BTreeMap<String, (u64, usize)> = BTreeMap::new();
    for r in requests {
        let (Some(node), Some(t)) = (r["node"].as_str(), r["t"].as_f64()) else {
            continue;
        };
        let held = r["initial_resource_versions"]
            .as_object()
            .map_or(0, serde_json::Map::len);
        let e = out.entry(node.to_owned()).or_insert(((t * 1e9) as u64, 0));
        e.1 += held;
    }
    out
}

/// The last node's daemon stopped (SIGTERM) after a quarter of a burst of [`BURST`] moves
/// (each a service's instance to another backend, 100 ms apart) and started again after
/// three quarters; every node must then serve every moved service at its new backend.
pub fn daemon_restart(fleet: &mut Fleet, opts: &Options, dir: &Path) -> anyhow::Result<Outcome> {
    let net = fleet.net.as_ref().context("no network")?;
    let last = fleet.nodes.len() - 1;
    let first = opts.changes + LOOP_SERVICES;
    let moved = |j: u32| net::backend((j + 1) % opts.backends);
    let mut t_last = 0;
    let (mut stopped_at, mut ready_ms) = (None, None);
    for (n, j) in (first..first + BURST).enumerate() {
        sys::check_interrupted()?;
        t_last = match (&fleet.cluster, fleet.xds.as_mut()) {
            (Some(c), _) => c.put(
                consul::REGISTER,
                Some(&consul::registration(&svc(j), moved(j))),
            )?,
            (None, Some(x)) => x.push_endpoints(j, Some(moved(j)))?,
            (None, None) => bail!("no control plane"),
        };
        if n as u32 == BURST / 4 {
            fleet.nodes[last].stop_daemon();
            stopped_at = Some(Instant::now());
        }
        if n as u32 == 3 * BURST / 4 {
            fleet.nodes[last].restart_daemon(net, dir)?;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let node = &mut fleet.nodes[last];
    let admin = node.admin;
    let ns = node.netns.clone();
    if let Some(at) = stopped_at {
        let ready = until(RECOVERY_BOUND, || {
            node.check_alive()?;
            let r = net::with_netns(&ns, || http::call(admin, "GET", "/ready", None))?;
            Ok(r.is_ok_and(|(s, _)| s == 200))
        })?;
        ready_ms = ready.map(|_| at.elapsed().as_secs_f64() * 1e3);
    }
    let bound = after_fault_bound(opts);
    // Per node: the latest time a moved service was first seen at its new backend (0 when
    // every one already was when checked), and how many waited.
    let mut burst_ms: Vec<Option<f64>> = vec![Some(0.0); fleet.nodes.len()];
    let mut waited = vec![0u32; fleet.nodes.len()];
    for j in first..first + BURST {
        let want = Expect::Up(moved(j));
        let armed = arm_all(&mut fleet.nodes, vip_addr(j), &want, bound, false)?;
        for (n, node) in fleet.nodes.iter_mut().enumerate() {
            if !armed[n] {
                continue;
            }
            waited[n] += 1;
            let at = node.seen()?.map(|at| ms_since(t_last, at));
            if let Some(at) = at {
                detail(format!(
                    "node {}: svc-{j} at its new backend {at:.0} ms after the burst",
                    n + 1
                ));
            }
            burst_ms[n] = burst_ms[n].zip(at).map(|(b, at)| b.max(at));
        }
    }
    Ok(Outcome {
        what: format!(
            "moved {BURST} services' instances 100 ms apart; node {}'s daemon stopped (SIGTERM) \
             after move {} and started again after move {} (it adopts its pins)",
            last + 1,
            BURST / 4 + 1,
            3 * BURST / 4 + 1
        ),
        recovery_ms: ready_ms,
        burst_ms,
        burst_waited: waited,
        ..Outcome::default()
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_partition_drops_server_ports_between_the_cut_server_and_the_others_only() {
        let r = partition_rules(net::SERVERS[1], &[net::SERVERS[0], net::SERVERS[2]]);
        assert!(r.starts_with("table inet proxy_fleet_partition {"), "{r}");
        assert_eq!(r.matches(" drop\n").count(), 4, "{r}");
        assert!(r.contains(
            "ip saddr 127.0.0.72 ip daddr { 127.0.0.71, 127.0.0.73 } meta l4proto { tcp, udp } \
             th dport { 8300, 8301, 8302 } drop"
        ));
        assert!(r.contains("ip saddr { 127.0.0.71, 127.0.0.73 } ip daddr 127.0.0.72"));
        assert!(!r.contains("127.0.0.80"), "agents are never cut: {r}");
    }

    #[test]
    fn a_nodes_first_request_and_the_versions_it_resumed() {
        let reqs = [
            json!({"node": "node-2", "t": 10.5, "initial_resource_versions": {"svc-1": "v3"}}),
            json!({"node": "node-1", "t": 10.25, "initial_resource_versions": {}}),
            json!({"node": "node-2", "t": 10.75, "initial_resource_versions": {"c": "v9", "d": "v9"}}),
            json!({"node": "node-1", "t": 11.0}),
            json!({"t": 12.0}),
        ];
        let f = first_requests(&reqs);
        assert_eq!(f.len(), 2);
        assert_eq!(f["node-1"], (10_250_000_000, 0));
        assert_eq!(f["node-2"], (10_500_000_000, 3));
    }
}
