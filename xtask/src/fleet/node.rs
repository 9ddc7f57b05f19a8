//! One node of the fleet: its daemon (own instance, pin directory, cgroup and admin address,
//! following the node's Consul agent for every service) and its probe process in the node's
//! cgroup and namespace. On drop: the probe is stopped, the daemon stopped by its PID and
//! `proxy uninstall` removes its programs and pins.

use std::{
    fs,
    io::{BufRead as _, BufReader, Write as _},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{ChildStdin, ChildStdout, Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use super::{
    connect_loop::{Counts, Plan},
    consul::HTTP_PORT,
    net::{self, Net},
    probe::Expect,
    sys::Proc,
};

/// Node `i`'s instance name (its pin directory under /sys/fs/bpf).
pub fn instance(i: u32) -> String {
    format!("fleet_{}_{i}", std::process::id())
}

/// The two services every split chain's leg is (on backends 0 and 1).
pub const LEGS: [&str; 2] = ["leg-a", "leg-b"];

/// The daemon config of node `i` (from 1) on the Consul fleet: services `svc-0` ..
/// `svc-{services-1}`, each a Consul catalog cluster read from the node's agent, with panic
/// routing off so that an instance whose check turns critical stops taking connections even
/// when it is the only one; and `splits` services `split-<m>` whose discovery chains (a
/// service-splitter to one of [`LEGS`]) come live from the agent's config entries.
pub fn daemon_config(
    instance: &str,
    cgroup: &Path,
    i: u32,
    (services, splits): (u32, u32),
) -> Value {
    let agent = SocketAddr::from((net::hub_side(i), HTTP_PORT)).to_string();
    let cluster = |name: &str| {
        json!({
            "name": name,
            "cluster_type": {"name": "proxy.clusters.consul",
                "typed_config": {"address": agent, "service": name}},
            "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        })
    };
    let names: Vec<String> = (0..services).map(|j| format!("svc-{j}")).collect();
    let legs = if splits > 0 { &LEGS[..] } else { &[] };
    let clusters: Vec<Value> = names
        .iter()
        .map(String::as_str)
        .chain(legs.iter().copied())
        .map(cluster)
        .collect();
    let mut list: Vec<Value> = (0..services)
        .map(|j| {
            json!({"name": format!("svc-{j}"), "address": net::vip(j).to_string(),
                "port": net::VIP_PORT, "cluster": format!("svc-{j}")})
        })
        .collect();
    list.extend((0..splits).map(|m| {
        json!({"name": format!("split-{m}"), "address": net::vip(services + m).to_string(),
            "port": net::VIP_PORT, "chain": format!("split-{m}")})
    }));
    let mut config = json!({
        "instance": instance,
        "cgroup": cgroup.display().to_string(),
        "admin": {"address": SocketAddr::from(([127, 0, 0, 1], net::ADMIN_PORT)).to_string()},
        "clusters": clusters,
        "services": list,
    });
    if splits > 0 {
        config["consul_config_entries"] = json!({"address": agent});
    }
    config
}

/// A node's daemon and probe.
pub struct Node {
    pub index: u32,
    /// The admin address, on the node's loopback.
    pub admin: SocketAddr,
    /// The node's namespace.
    pub netns: String,
    probe: Option<Probe>,
    looper: Option<Probe>,
    daemon: Option<Proc>,
    proxy: PathBuf,
    config: PathBuf,
}

struct Probe {
    proc: Proc,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Node {
    /// Writes node `i`'s config, checks it with `proxy check`, starts the daemon in the node's
    /// namespace and the probe in its cgroup and namespace. Readiness is the caller's.
    pub fn start(
        proxy: &Path,
        net: &Net,
        dir: &Path,
        (i, config): (u32, &Value),
        poll: Duration,
    ) -> anyhow::Result<Self> {
        let text = serde_json::to_vec_pretty(config)?;
        let config = dir.join(format!("node-{i}.json"));
        fs::write(&config, text)?;
        let mut node = Self {
            index: i,
            admin: SocketAddr::from(([127, 0, 0, 1], net::ADMIN_PORT)),
            netns: net.node(i).to_owned(),
            probe: None,
            looper: None,
            daemon: None,
            proxy: proxy.to_owned(),
            config: config.clone(),
        };
        let check = Command::new(proxy)
            .arg("check")
            .arg("--config")
            .arg(&config)
            .output()?;
        if !check.status.success() {
            bail!(
                "proxy check refused {}: {}",
                config.display(),
                String::from_utf8_lossy(&check.stderr).trim()
            );
        }
        node.spawn_daemon(net, dir)?;
        node.probe = Some(Probe::start(net, i, poll)?);
        Ok(node)
    }

    /// Starts the daemon (again: it adopts its pins, as `proxy run` does on a restart), its
    /// output appended to the node's log.
    fn spawn_daemon(&mut self, net: &Net, dir: &Path) -> anyhow::Result<()> {
        let i = self.index;
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("node-{i}.log")))?;
        let args = [
            "run".to_owned(),
            "--config".to_owned(),
            self.config.display().to_string(),
        ];
        let mut cmd = net::in_netns(net.node(i), &self.proxy, &args);
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        self.daemon = Some(Proc::spawn(
            cmd,
            &format!("the daemon of node {i}"),
            Duration::from_secs(10),
        )?);
        Ok(())
    }

    /// Stops the daemon (SIGTERM, waited for; pins and programs stay) without uninstalling.
    pub fn stop_daemon(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            d.stop();
        }
    }

    /// Starts the daemon again after [`Node::stop_daemon`].
    pub fn restart_daemon(&mut self, net: &Net, dir: &Path) -> anyhow::Result<()> {
        if self.daemon.is_some() {
            bail!("the daemon of node {} is running", self.index);
        }
        self.spawn_daemon(net, dir)
    }

    /// Starts a connect loop in a second probe of the node (waits keep the first).
    pub fn start_loop(&mut self, net: &Net, plan: &Plan) -> anyhow::Result<()> {
        let mut probe = Probe::start(net, self.index, plan.interval)?;
        writeln!(probe.stdin, "{}", plan.line())?;
        let answer = probe.read_line()?;
        if answer != "looping" {
            bail!("the loop probe of node {} said {answer:?}", self.index);
        }
        self.looper = Some(probe);
        Ok(())
    }

    /// Stops the connect loop and returns its counts.
    pub fn stop_loop(&mut self) -> anyhow::Result<Counts> {
        let i = self.index;
        let mut probe = self.looper.take().context("no connect loop")?;
        writeln!(probe.stdin, "stop")
            .with_context(|| format!("the loop probe of node {i} is gone"))?;
        Counts::parse(&probe.read_line()?)
    }

    /// Fails if the daemon exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        self.daemon.as_mut().map_or(Ok(()), Proc::check_alive)
    }

    /// Sends a wait to the probe; `Ok(true)` when it is armed, `Ok(false)` when the condition
    /// already held.
    pub fn arm(
        &mut self,
        addr: SocketAddr,
        expect: &Expect,
        bound: Duration,
    ) -> anyhow::Result<bool> {
        let i = self.index;
        let probe = self.probe.as_mut().context("no probe")?;
        writeln!(
            probe.stdin,
            "wait {addr} {} {}",
            expect.word(),
            bound.as_millis()
        )
        .with_context(|| format!("the probe of node {i} is gone"))?;
        match probe.read_line()?.as_str() {
            "armed" => Ok(true),
            "already" => Ok(false),
            other => bail!("the probe of node {i} said {other:?}"),
        }
    }

    /// The armed wait's end: CLOCK_MONOTONIC of the first matching try, or None on timeout.
    pub fn seen(&mut self) -> anyhow::Result<Option<u64>> {
        let i = self.index;
        let probe = self.probe.as_mut().context("no probe")?;
        let line = probe.read_line()?;
        if line == "timeout" {
            return Ok(None);
        }
        let ns = line.strip_prefix("seen ").and_then(|n| n.parse().ok());
        ns.map(Some)
            .with_context(|| format!("the probe of node {i} said {line:?}"))
    }
}

impl Probe {
    /// `sh` joins the cgroup first (`ip netns exec` would hide the cgroup file system), then
    /// execs nsenter into the namespace, which execs the probe.
    fn start(net: &Net, i: u32, poll: Duration) -> anyhow::Result<Self> {
        let me = std::env::current_exe().context("the xtask binary's path")?;
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!(
                "echo $$ > '{}/cgroup.procs' && exec \"$@\"",
                net.cgroup(i).display()
            ))
            .arg("sh")
            .arg("nsenter")
            .arg(format!("--net=/run/netns/{}", net.node(i)))
            .arg("--")
            .arg(me)
            .arg("fleet-probe")
            .arg(format!("--interval-ms={}", poll.as_millis()));
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
        let mut proc = Proc::spawn(
            cmd,
            &format!("the probe of node {i}"),
            Duration::from_secs(2),
        )?;
        let stdin = proc.child.stdin.take().context("probe stdin")?;
        let stdout = BufReader::new(proc.child.stdout.take().context("probe stdout")?);
        Ok(Self {
            proc,
            stdin,
            stdout,
        })
    }

    fn read_line(&mut self) -> anyhow::Result<String> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("{} exited", self.proc.what);
        }
        Ok(line.trim().to_owned())
    }
}

impl Node {
    /// Stops the probe and sends the daemon SIGTERM; the drop waits for it and uninstalls.
    pub fn terminate(&mut self) {
        drop(self.probe.take());
        drop(self.looper.take());
        if let Some(d) = self.daemon.as_mut() {
            d.terminate();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.terminate();
        let Some(mut daemon) = self.daemon.take() else {
            return;
        };
        daemon.stop();
        let out = Command::new(&self.proxy)
            .arg("uninstall")
            .arg("--config")
            .arg(&self.config)
            .output();
        if !out.as_ref().is_ok_and(|o| o.status.success()) {
            eprintln!(
                "WARNING: proxy uninstall of node {} failed: {out:?}",
                self.index
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_service_follows_the_nodes_own_agent_without_panic_routing() {
        let c = daemon_config("fleet_1_3", Path::new("/cg/node-3"), 3, (2, 1));
        assert_eq!(c["instance"], "fleet_1_3");
        assert_eq!(c["cgroup"], "/cg/node-3");
        assert_eq!(c["admin"]["address"], "127.0.0.1:9901");
        assert_eq!(c["clusters"].as_array().unwrap().len(), 4);
        assert_eq!(c["clusters"][3]["name"], "leg-b");
        assert_eq!(c["consul_config_entries"]["address"], "10.210.3.1:8500");
        let split = &c["services"][2];
        let plain = daemon_config("fleet_1_3", Path::new("/cg/node-3"), 3, (2, 0));
        assert_eq!(plain["clusters"].as_array().unwrap().len(), 2);
        assert!(plain.get("consul_config_entries").is_none());
        assert_eq!(
            (split["name"].as_str(), split["chain"].as_str()),
            (Some("split-0"), Some("split-0"))
        );
        assert_eq!(split["address"], "10.96.0.3");
        let cl = &c["clusters"][1];
        assert_eq!(cl["name"], "svc-1");
        assert_eq!(cl["cluster_type"]["name"], "proxy.clusters.consul");
        assert_eq!(
            cl["cluster_type"]["typed_config"]["address"],
            "10.210.3.1:8500"
        );
        assert_eq!(cl["cluster_type"]["typed_config"]["service"], "svc-1");
        assert_eq!(
            cl["common_lb_config"]["healthy_panic_threshold"]["value"],
            0
        );
        let s = &c["services"][1];
        assert_eq!(
            (s["address"].as_str(), s["port"].as_u64()),
            (Some("10.96.0.2"), Some(8080))
        );
        assert_eq!(s["cluster"], "svc-1");
    }
}
