//! The fleet's xDS control plane: the project's Python server (tests/xds/xds_server.py,
//! grpcio + xds-protos) in the hub, on 0.0.0.0 there, so each node's daemon reaches it at the
//! hub's end of its veth. It serves every node the same clusters (EDS), listeners (tcp_proxy
//! to the cluster of the same name) and endpoints over one delta ADS stream per node; the
//! harness pushes through its control port.

use std::{
    io::{BufRead as _, BufReader},
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Stdio,
    sync::mpsc,
    time::Duration,
};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use super::{
    http::call,
    net::{self, Net},
    sys::{self, Proc},
};

/// The gRPC (ADS) port, in the hub.
pub const GRPC_PORT: u16 = 18000;
/// The control port (pushes), in the hub.
const CONTROL_PORT: u16 = 18001;
/// How long the server may take to listen.
const START_TIMEOUT: Duration = Duration::from_secs(30);
const SETUP_HINT: &str = "python3 -m venv .venv && .venv/bin/pip install -r tests/xds/requirements.txt (at the workspace root), or set PROXY_TEST_PYTHON";

/// The running server, stopped by PID on drop (closing its stdin ends it too).
pub struct XdsServer {
    proc: Option<Proc>,
    hub: String,
    control: SocketAddr,
    version: u64,
    python: PathBuf,
    dir: PathBuf,
    /// What was pushed, the latest call per resource (or per resource type) in push order:
    /// replayed by a restarted server, so it serves the same resources at the same versions.
    state: Vec<(String, String, Value)>,
}

/// The Python with grpcio and xds-protos: `PROXY_TEST_PYTHON`, else the workspace's .venv.
pub fn python() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("PROXY_TEST_PYTHON").map_or_else(
        || crate::util::workspace_root().join(".venv/bin/python"),
        PathBuf::from,
    );
    if !path.exists() {
        bail!("python {} not found; run: {SETUP_HINT}", path.display());
    }
    Ok(path)
}

impl XdsServer {
    pub fn start(python: &Path, net: &Net, dir: &Path) -> anyhow::Result<Self> {
        let mut server = Self {
            proc: None,
            hub: net.hub.clone(),
            control: SocketAddr::from(([127, 0, 0, 1], CONTROL_PORT)),
            version: 0,
            python: python.to_owned(),
            dir: dir.to_owned(),
            state: Vec::new(),
        };
        server.spawn(None)?;
        Ok(server)
    }

    /// Starts the server process, replaying `replay` (a file of control calls) before it
    /// listens; returns CLOCK_MONOTONIC when it said it was ready.
    fn spawn(&mut self, replay: Option<&Path>) -> anyhow::Result<u64> {
        let script = crate::util::workspace_root().join("tests/xds/xds_server.py");
        let mut args: Vec<String> = [
            script.display().to_string().as_str(),
            "--host",
            "0.0.0.0",
            "--grpc-port",
            &GRPC_PORT.to_string(),
            "--control-port",
            &CONTROL_PORT.to_string(),
        ]
        .map(str::to_owned)
        .to_vec();
        if let Some(file) = replay {
            args.extend(["--replay".to_owned(), file.display().to_string()]);
        }
        let mut cmd = net::in_netns(&self.hub, &self.python, &args);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("xds-server.log"))?;
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(log);
        let mut proc = Proc::spawn(cmd, "the xDS server", Duration::from_secs(5))?;
        let stdout = proc.child.stdout.take().context("xds server stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send((line, sys::monotonic_ns()));
        });
        let (line, ready) = rx.recv_timeout(START_TIMEOUT).unwrap_or_default();
        if !line.starts_with("READY") {
            bail!(
                "the xDS server did not start (missing Python packages? run: {SETUP_HINT}); log: {}",
                self.dir.join("xds-server.log").display()
            );
        }
        self.proc = Some(proc);
        Ok(ready)
    }

    /// Stops the server (SIGTERM by its PID, waited for): every stream ends.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        let mut proc = self.proc.take().context("the xDS server is not running")?;
        proc.stop();
        Ok(())
    }

    /// Starts the server again on the same ports with everything pushed so far, at the same
    /// versions; returns CLOCK_MONOTONIC when it was ready.
    pub fn restart(&mut self) -> anyhow::Result<u64> {
        let calls: Vec<Value> = self
            .state
            .iter()
            .map(|(_, path, body)| json!({"path": path, "body": body}))
            .collect();
        let file = self.dir.join("xds-replay.json");
        std::fs::write(&file, serde_json::to_vec(&calls)?)?;
        self.spawn(Some(&file))
    }

    /// Every request the running server received (its `/requests`).
    pub fn requests(&self) -> anyhow::Result<Vec<Value>> {
        let control = self.control;
        let (status, text) =
            net::with_netns(&self.hub, || call(control, "GET", "/requests", None))??;
        if status != 200 {
            bail!("GET /requests on the xDS server: {status}");
        }
        Ok(serde_json::from_str(&text)?)
    }

    fn post(&mut self, path: &str, body: &Value) -> anyhow::Result<u64> {
        self.proc
            .as_mut()
            .context("the xDS server is not running")?
            .check_alive()?;
        let (control, text) = (self.control, body.to_string());
        let (t0, answer) = net::with_netns(&self.hub, || {
            let t0 = sys::monotonic_ns();
            (t0, call(control, "POST", path, Some(&text)))
        })?;
        let (status, text) = answer?;
        if status != 200 {
            bail!("POST {path} on the xDS server: {status} {}", text.trim());
        }
        let name = body.get("cluster").or_else(|| body.get("type"));
        let key = format!("{path} {}", name.map_or_else(String::new, Value::to_string));
        self.state.retain(|(k, _, _)| *k != key);
        self.state.push((key, path.to_owned(), body.clone()));
        Ok(t0)
    }

    fn next_version(&mut self) -> String {
        self.version += 1;
        format!("v{}", self.version)
    }

    /// The whole set of clusters and of listeners for `services` services.
    pub fn push_services(&mut self, services: u32) -> anyhow::Result<()> {
        let clusters: Vec<Value> = (0..services).map(cluster).collect();
        let listeners: Vec<Value> = (0..services).map(listener).collect();
        for (kind, resources) in [("cluster", clusters), ("listener", listeners)] {
            let version = self.next_version();
            let body = json!({"type": kind, "version": version, "resources": resources});
            self.post("/push_resources", &body)?;
        }
        Ok(())
    }

    /// Service `j`'s endpoints: `backend`, or none. Returns CLOCK_MONOTONIC when the push was
    /// sent.
    pub fn push_endpoints(&mut self, j: u32, backend: Option<Ipv4Addr>) -> anyhow::Result<u64> {
        let version = self.next_version();
        let body = json!({"cluster": format!("svc-{j}"), "version": version,
            "endpoints": endpoints(backend)});
        self.post("/push", &body)
    }
}

/// Service `j`'s cluster: EDS over ADS, panic routing off (as the Consul fleet's).
pub fn cluster(j: u32) -> Value {
    json!({
        "name": format!("svc-{j}"), "type": "EDS", "connect_timeout": "5s",
        "eds_cluster_config": {"service_name": format!("svc-{j}"), "eds_config": {"ads": {}}},
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
    })
}

/// Service `j`'s listener: its VIP, a tcp_proxy to its cluster (a kernel-path service).
pub fn listener(j: u32) -> Value {
    json!({
        "name": format!("svc-{j}"),
        "address": {"socket_address": {"address": net::vip(j).to_string(), "port_value": net::VIP_PORT}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            "stat_prefix": format!("svc-{j}"), "cluster": format!("svc-{j}")}}]}],
    })
}

/// The server's endpoint list (see xds_server.py's /push).
pub fn endpoints(backend: Option<Ipv4Addr>) -> Value {
    let list: Vec<Value> = backend
        .iter()
        .map(|b| json!({"address": b.to_string(), "port": net::BACKEND_PORT, "health": "HEALTHY"}))
        .collect();
    Value::Array(list)
}

/// The daemon config of node `i` (from 1) on the xDS fleet: nothing but where the server is;
/// clusters, listeners and endpoints all come over one delta ADS stream.
pub fn daemon_config(instance: &str, cgroup: &Path, i: u32) -> Value {
    json!({
        "instance": instance,
        "cgroup": cgroup.display().to_string(),
        "admin": {"address": SocketAddr::from(([127, 0, 0, 1], net::ADMIN_PORT)).to_string()},
        "xds": {
            "node": {"id": format!("node-{i}"), "cluster": "fleet"},
            "ads_config": {"api_type": "DELTA_GRPC",
                "server_uri": SocketAddr::from((net::hub_side(i), GRPC_PORT)).to_string()},
            "cds_config": {"ads": {}},
            "lds_config": {"ads": {}},
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_is_an_eds_cluster_and_a_tcp_proxy_listener_on_its_vip() {
        let c = cluster(4);
        assert_eq!(
            (c["name"].as_str(), c["type"].as_str()),
            (Some("svc-4"), Some("EDS"))
        );
        assert_eq!(c["eds_cluster_config"]["eds_config"], json!({"ads": {}}));
        assert_eq!(c["common_lb_config"]["healthy_panic_threshold"]["value"], 0);
        let l = listener(4);
        assert_eq!(l["address"]["socket_address"]["address"], "10.96.0.5");
        assert_eq!(l["address"]["socket_address"]["port_value"], 8080);
        assert_eq!(
            l["filter_chains"][0]["filters"][0]["typed_config"]["cluster"],
            "svc-4"
        );
        assert_eq!(endpoints(None), json!([]));
        assert_eq!(endpoints(Some(net::backend(1)))[0]["address"], "10.220.0.2");
    }

    #[test]
    fn a_node_reaches_the_server_at_the_hubs_end_of_its_veth() {
        let c = daemon_config("fleet_1_2", Path::new("/cg/node-2"), 2);
        assert_eq!(c["xds"]["ads_config"]["server_uri"], "10.210.2.1:18000");
        assert_eq!(c["xds"]["ads_config"]["api_type"], "DELTA_GRPC");
        assert_eq!(c["xds"]["node"]["id"], "node-2");
        assert!(c.get("clusters").is_none() && c.get("services").is_none());
    }
}
