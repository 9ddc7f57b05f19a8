//! The fleet's Consul 1.8.7: three servers on the hub's loopback, a client agent per node (its
//! HTTP API on the hub's end of the node's veth, where that node's daemon asks), and one client
//! agent for the node that runs the backends, where services register as real deployments do.
//! The API calls are made from inside the hub.

use std::{
    fs,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use serde_json::json;

use super::{
    http::call,
    net::{self, Net},
    node::LEGS,
    sys::{self, Proc},
};
use crate::util::detail;

/// Where an agent registers a service.
pub const REGISTER: &str = "/v1/agent/service/register";
/// Consul's default HTTP port, on every agent's own address.
pub const HTTP_PORT: u16 = 8500;
/// Bound of the cluster's start (leader elected, every agent joined).
const START_TIMEOUT: Duration = Duration::from_secs(90);

/// The running agents, stopped by PID on drop.
pub struct Cluster {
    hub: String,
    /// Servers 0 to 2, the backends agent 3, node `i`'s agent `3 + i`; None while stopped.
    agents: Vec<Option<Proc>>,
    /// How each agent was started, to start it again.
    specs: Vec<Spec>,
    consul: PathBuf,
    dir: PathBuf,
    /// The backends node's agent, where services register.
    pub backends: SocketAddr,
}

impl Cluster {
    /// Starts the servers, the backends agent and one agent per node, and waits (bounded) for
    /// a leader and for every agent to reach it.
    pub fn start(consul: &Path, net: &Net, dir: &Path) -> anyhow::Result<Self> {
        let mut cluster = Self {
            hub: net.hub.clone(),
            agents: Vec::new(),
            specs: Vec::new(),
            consul: consul.to_owned(),
            dir: dir.to_owned(),
            backends: SocketAddr::from((net::BACKENDS_AGENT, HTTP_PORT)),
        };
        for (k, ip) in net::SERVERS.iter().enumerate() {
            let args = vec!["-server".into(), "-bootstrap-expect".into(), "3".into()];
            cluster.spawn(&format!("server-{}", k + 1), *ip, *ip, args)?;
        }
        let b = net::BACKENDS_AGENT;
        cluster.spawn("backends", b, b, Vec::new())?;
        for i in 1..=net.nodes.len() as u32 {
            let (bind, client) = (net::node_agent(i), net::hub_side(i));
            cluster.spawn(&format!("node-{i}"), bind, client, Vec::new())?;
        }
        let started = Instant::now();
        let mut waiting: Vec<SocketAddr> = net::SERVERS
            .iter()
            .map(|ip| SocketAddr::from((*ip, HTTP_PORT)))
            .chain(std::iter::once(cluster.backends))
            .chain(
                (1..=net.nodes.len() as u32)
                    .map(|i| SocketAddr::from((net::hub_side(i), HTTP_PORT))),
            )
            .collect();
        while !waiting.is_empty() {
            sys::check_interrupted()?;
            for agent in cluster.agents.iter_mut().flatten() {
                agent.check_alive()?;
            }
            let hub = cluster.hub.clone();
            let still = net::with_netns(&hub, || {
                waiting
                    .iter()
                    .filter(|a| !knows_leader(**a))
                    .copied()
                    .collect::<Vec<_>>()
            })?;
            waiting = still;
            if started.elapsed() > START_TIMEOUT {
                bail!(
                    "consul: {} agents do not know a leader after {START_TIMEOUT:?} (first: {}; logs in {})",
                    waiting.len(),
                    waiting[0],
                    dir.display()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        detail(format!(
            "consul: 3 servers, {} client agents, leader known to all in {:.1} s",
            net.nodes.len() + 1,
            started.elapsed().as_secs_f64()
        ));
        Ok(cluster)
    }

    fn spawn(
        &mut self,
        name: &str,
        bind: Ipv4Addr,
        client: Ipv4Addr,
        extra: Vec<String>,
    ) -> anyhow::Result<()> {
        let spec = Spec {
            name: name.to_owned(),
            bind,
            client,
            extra,
        };
        let agent = self.start_agent(&spec)?;
        self.agents.push(Some(agent));
        self.specs.push(spec);
        Ok(())
    }

    /// Starts one agent in the hub, its output appended to its log (a restart keeps the data
    /// directory: the agent comes back as itself).
    fn start_agent(&self, spec: &Spec) -> anyhow::Result<Proc> {
        let data = self.dir.join(format!("consul-{}", spec.name));
        fs::create_dir_all(&data)?;
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("consul-{}.log", spec.name)))?;
        let mut args = agent_args(&spec.name, spec.bind, spec.client, &data);
        args.extend(spec.extra.iter().cloned());
        let mut cmd = net::in_netns(&self.hub, &self.consul, &args);
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        Proc::spawn(
            cmd,
            &format!("consul agent {}", spec.name),
            Duration::from_secs(5),
        )
    }

    /// Stops agent `index` (see [`Cluster::agents`]): SIGKILL when `crash`, else SIGTERM
    /// (a client agent then leaves the cluster, as Consul's default on SIGTERM).
    pub fn stop_agent(&mut self, index: usize, crash: bool) -> anyhow::Result<()> {
        let mut agent = self.agents[index]
            .take()
            .context("that agent is not running")?;
        if crash {
            let _ = agent.child.kill();
            let _ = agent.child.wait();
        } else {
            agent.stop();
        }
        Ok(())
    }

    /// Starts agent `index` again, as it was started.
    pub fn restart_agent(&mut self, index: usize) -> anyhow::Result<()> {
        if self.agents[index].is_some() {
            bail!("consul agent {} is running", self.specs[index].name);
        }
        let agent = self.start_agent(&self.specs[index])?;
        self.agents[index] = Some(agent);
        Ok(())
    }

    /// Whether the catalog, read from the leader's own HTTP API (a server that names itself
    /// the leader; none: false), has an instance of `service`.
    pub fn catalog_has(&self, service: &str) -> anyhow::Result<bool> {
        for ip in net::SERVERS {
            let server = SocketAddr::from((ip, HTTP_PORT));
            if self.leader_seen_by(server)? != Some(format!("{ip}:8300")) {
                continue;
            }
            let path = format!("/v1/catalog/service/{service}");
            let answer = net::with_netns(&self.hub, || call(server, "GET", &path, None))?;
            return Ok(answer.is_ok_and(|(status, body)| status == 200 && body.trim() != "[]"));
        }
        Ok(false)
    }

    /// The leader's address (`IP:8300`) as the HTTP API at `addr` says it, or None when that
    /// agent knows none (or does not answer).
    pub fn leader_seen_by(&self, addr: SocketAddr) -> anyhow::Result<Option<String>> {
        let answer = net::with_netns(&self.hub, || call(addr, "GET", "/v1/status/leader", None))?;
        Ok(answer.ok().and_then(|(status, body)| {
            let leader = body.trim().trim_matches('"').to_owned();
            (status == 200 && !leader.is_empty()).then_some(leader)
        }))
    }

    /// The catalog and config entries the run starts from: services `svc-<changes>` ..
    /// `svc-<services-1>` with one instance each (the first `changes` are what registration
    /// adds later); with `splits`, the two legs and `splits` split services, HTTP (Consul's
    /// rule for splitters), each split all to leg-a.
    pub fn populate(
        &self,
        services: u32,
        changes: u32,
        backends: u32,
        splits: u32,
    ) -> anyhow::Result<()> {
        let t = Instant::now();
        let calls: Vec<_> = (changes..services)
            .map(|j| {
                let body = registration(&format!("svc-{j}"), net::backend(j % backends));
                (REGISTER.to_owned(), Some(body))
            })
            .collect();
        self.put_all(&calls, 8)?;
        if splits == 0 {
            detail(format!(
                "registered {} services in {:.1} s",
                calls.len(),
                t.elapsed().as_secs_f64()
            ));
            return Ok(());
        }
        let mut setup: Vec<_> = LEGS
            .iter()
            .zip([net::backend(0), net::backend(1)])
            .map(|(leg, b)| (REGISTER.to_owned(), Some(registration(leg, b))))
            .collect();
        let splits: Vec<String> = (0..splits).map(|m| format!("split-{m}")).collect();
        for name in LEGS
            .iter()
            .copied()
            .chain(splits.iter().map(String::as_str))
        {
            setup.push(("/v1/config".to_owned(), Some(http_defaults(name))));
        }
        self.put_all(&setup, 8)?;
        // After the defaults: Consul checks a splitter against its service's protocol.
        let splitters: Vec<_> = splits
            .iter()
            .map(|name| ("/v1/config".to_owned(), Some(splitter(name, LEGS[0]))))
            .collect();
        self.put_all(&splitters, 8)?;
        detail(format!(
            "registered {} services and wrote {} config entries in {:.1} s",
            calls.len() + 2,
            setup.len() - 2 + splitters.len(),
            t.elapsed().as_secs_f64()
        ));
        Ok(())
    }

    /// PUTs `(path, body)` calls to the backends agent, on `threads` threads in the hub; fails
    /// on the first answer that is not 200.
    pub fn put_all(
        &self,
        calls: &[(String, Option<String>)],
        threads: usize,
    ) -> anyhow::Result<()> {
        let chunk = calls.len().div_ceil(threads.max(1)).max(1);
        let backends = self.backends;
        std::thread::scope(|scope| {
            let handles: Vec<_> = calls
                .chunks(chunk)
                .map(|part| {
                    let hub = self.hub.clone();
                    scope.spawn(move || {
                        net::with_netns(&hub, || {
                            for (path, body) in part {
                                sys::check_interrupted()?;
                                put_ok(backends, path, body.as_deref())?;
                            }
                            anyhow::Ok(())
                        })?
                    })
                })
                .collect();
            for h in handles {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a registration thread panicked"))??;
            }
            anyhow::Ok(())
        })
    }

    /// One PUT to the backends agent; returns CLOCK_MONOTONIC when it was sent (the change's
    /// start).
    pub fn put(&self, path: &str, body: Option<&str>) -> anyhow::Result<u64> {
        let backends = self.backends;
        net::with_netns(&self.hub, || {
            let t0 = sys::monotonic_ns();
            put_ok(backends, path, body).map(|()| t0)
        })?
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // All at once (clients leave the cluster on SIGTERM), then each waited for.
        for agent in self.agents.iter_mut().flatten() {
            agent.terminate();
        }
        for agent in self.agents.iter_mut().flatten() {
            agent.stop();
        }
    }
}

/// How an agent was started.
struct Spec {
    name: String,
    bind: Ipv4Addr,
    client: Ipv4Addr,
    extra: Vec<String>,
}

/// The agent's command line: one address for serf and RPC (`bind`), one for the HTTP API
/// (`client`), default ports, no DNS, gRPC or WAN listener, no update check, joins retried
/// every second (not Consul's 30 s: the servers start at the same moment), room for the
/// blocking queries of a daemon with a thousand clusters, and cumulative counters on
/// `/v1/agent/metrics?format=prometheus` (what `--load` reads; the default in-memory metrics
/// count per ten-second interval).
pub fn agent_args(name: &str, bind: Ipv4Addr, client: Ipv4Addr, data: &Path) -> Vec<String> {
    let mut args: Vec<String> = [
        "agent",
        "-node",
        name,
        "-bind",
        &bind.to_string(),
        "-advertise",
        &bind.to_string(),
        "-client",
        &client.to_string(),
        "-data-dir",
        &data.display().to_string(),
        "-retry-interval",
        "1s",
        "-dns-port",
        "-1",
        "-grpc-port",
        "-1",
        "-serf-wan-port",
        "-1",
        "-log-level",
        "warn",
        "-hcl",
        "disable_update_check = true",
        "-hcl",
        "connect { enabled = true }",
        "-hcl",
        "performance { raft_multiplier = 1 }",
        "-hcl",
        "limits { http_max_conns_per_client = 4096 }",
        "-hcl",
        "telemetry { prometheus_retention_time = \"24h\" disable_hostname = true }",
    ]
    .map(str::to_owned)
    .to_vec();
    for s in net::SERVERS {
        args.extend(["-retry-join".to_owned(), s.to_string()]);
    }
    args
}

/// A service instance on backend `backend`, with a TTL check (passing) the harness turns
/// critical.
pub fn registration(service: &str, backend: Ipv4Addr) -> String {
    json!({
        "ID": service, "Name": service, "Address": backend.to_string(), "Port": net::BACKEND_PORT,
        "Check": {"CheckID": format!("{service}-ttl"), "Name": "ttl", "TTL": "24h", "Status": "passing"},
    })
    .to_string()
}

/// `service-defaults` making `service` HTTP: Consul 1.8.7 refuses a splitter on a TCP service.
pub fn http_defaults(service: &str) -> String {
    json!({"Kind": "service-defaults", "Name": service, "Protocol": "http"}).to_string()
}

/// A `service-splitter` sending all of `service` to `leg` (what `consul config write` sends
/// to `PUT /v1/config`).
pub fn splitter(service: &str, leg: &str) -> String {
    json!({"Kind": "service-splitter", "Name": service, "Splits": [{"Weight": 100, "Service": leg}]})
        .to_string()
}

fn knows_leader(addr: SocketAddr) -> bool {
    call(addr, "GET", "/v1/status/leader", None)
        .is_ok_and(|(status, body)| status == 200 && body.trim().len() > 2)
}

fn put_ok(addr: SocketAddr, path: &str, body: Option<&str>) -> anyhow::Result<()> {
    let (status, text) = call(addr, "PUT", path, body)?;
    if status != 200 {
        bail!("PUT {path} on consul {addr}: {status} {}", text.trim());
    }
    Ok(())
}

/// The consul binary `cargo xtask setup` installs.
pub fn binary() -> anyhow::Result<PathBuf> {
    crate::consul::ensure_consul()?;
    Ok(crate::util::workspace_root().join(crate::consul::INSTALL_PATH))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_joins_the_three_servers_and_serves_http_on_its_client_address() {
        let args = agent_args(
            "node-3",
            net::node_agent(3),
            net::hub_side(3),
            Path::new("/d"),
        );
        let joined: Vec<_> = args
            .windows(2)
            .filter(|w| w[0] == "-retry-join")
            .map(|w| w[1].as_str())
            .collect();
        assert_eq!(joined, ["127.0.0.71", "127.0.0.72", "127.0.0.73"]);
        let at = |flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .map(|p| args[p + 1].as_str())
        };
        assert_eq!(at("-bind"), Some("127.0.0.83"));
        assert_eq!(at("-client"), Some("10.210.3.1"));
        assert_eq!(at("-dns-port"), Some("-1"));
        assert!(
            args.iter().any(|a| a.contains("prometheus_retention_time")),
            "--load reads cumulative counters: {args:?}"
        );
    }

    #[test]
    fn a_registration_carries_a_passing_ttl_check_named_after_the_service() {
        let r: serde_json::Value =
            serde_json::from_str(&registration("svc-7", net::backend(2))).unwrap();
        assert_eq!(r["Address"], "10.220.0.3");
        assert_eq!(r["Port"], 9000);
        assert_eq!(r["Check"]["CheckID"], "svc-7-ttl");
        assert_eq!(r["Check"]["Status"], "passing");
    }

    #[test]
    fn a_split_moves_all_of_a_service_to_one_leg() {
        let s: serde_json::Value = serde_json::from_str(&splitter("split-3", "leg-b")).unwrap();
        assert_eq!(
            (s["Kind"].as_str(), s["Name"].as_str()),
            (Some("service-splitter"), Some("split-3"))
        );
        assert_eq!(s["Splits"], json!([{"Weight": 100, "Service": "leg-b"}]));
        let d: serde_json::Value = serde_json::from_str(&http_defaults("leg-a")).unwrap();
        assert_eq!(d["Protocol"], "http");
    }
}
