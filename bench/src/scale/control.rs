//! The scale row's control plane and resources: the xDS test server (`tests/xds/xds_server.py`)
//! driven over its control port, and the clusters and listeners it serves.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use crate::{sys, topo::CONN};

/// The test control plane, stopped by PID on drop.
pub struct ControlPlane {
    child: Child,
    pub grpc: u16,
    control: SocketAddr,
}

impl ControlPlane {
    pub fn start() -> anyhow::Result<Self> {
        let root = crate::util::workspace_root();
        let python = std::env::var_os("PROXY_TEST_PYTHON")
            .map_or_else(|| root.join(".venv/bin/python"), PathBuf::from);
        let mut child = Command::new(&python)
            .arg(root.join("tests/xds/xds_server.py"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| {
                format!(
                    "starting the xDS test server with {} (set PROXY_TEST_PYTHON or create .venv: cargo xtask setup)",
                    python.display()
                )
            })?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().context("xds server stdout")?).read_line(&mut line)?;
        let port = |key: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key)?.parse::<u16>().ok())
        };
        let (Some(grpc), Some(control)) = (port("grpc="), port("control=")) else {
            sys::stop(&mut child);
            bail!("the xDS test server did not start (said {line:?}); is its venv complete?");
        };
        Ok(Self {
            child,
            grpc,
            control: SocketAddr::from((Ipv4Addr::LOCALHOST, control)),
        })
    }

    /// Sets the whole set of `kind` (`cluster`, `listener`).
    pub fn push(&self, kind: &str, resources: &[Value]) -> anyhow::Result<()> {
        let body = json!({"type": kind, "version": "1", "resources": resources});
        let status = http_post(self.control, "/push_resources", &body.to_string())?;
        if status != 200 {
            bail!("the xDS test server answered {status} to the {kind} push");
        }
        Ok(())
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        sys::stop(&mut self.child);
    }
}

/// POSTs `body` and returns the status code; the answer may take minutes (a large push).
pub fn http_post(addr: SocketAddr, path: &str, body: &str) -> anyhow::Result<u16> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(300)))?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no HTTP answer from {addr}{path}"))
}

/// Host `h` of the benchmark: distinct loopback addresses from 127.100.0.1 (nothing listens
/// there; no traffic is sent to them).
fn host(h: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(127, 100, 0, 1)) + h)
}

/// The VIP of service `i` (127.78.0.1 on).
pub fn vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(127, 78, 0, 1)) + i)
}

/// `services` STATIC clusters `s<i>` of `per` hosts each, as CDS resources (file form for the
/// file's clusters is the same JSON).
pub fn clusters(services: u32, per: u32, port: u16) -> Vec<Value> {
    (0..services)
        .map(|i| {
            let eps: Vec<Value> = (0..per)
                .map(|k| json!({"endpoint": {"address": {"socket_address": {
                    "address": host(i * per + k).to_string(), "port_value": port}}}}))
                .collect();
            json!({"name": format!("s{i}"), "type": "STATIC", "lb_policy": "RANDOM",
                "load_assignment": {"cluster_name": format!("s{i}"), "endpoints": [{"lb_endpoints": eps}]}})
        })
        .collect()
}

/// `services` tcp_proxy listeners `s<i>` at their VIPs, each to cluster `s<i>`.
pub fn listeners(services: u32) -> Vec<Value> {
    (0..services)
        .map(|i| {
            json!({"name": format!("s{i}"),
                "address": {"socket_address": {"address": vip(i).to_string(), "port_value": CONN}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                    "stat_prefix": format!("s{i}"), "cluster": format!("s{i}")}}]}]})
        })
        .collect()
}
