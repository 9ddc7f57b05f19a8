//! `proxy status`: a readable table of services, clusters, hosts, health and weights, read from
//! a running daemon's admin interface (`/clusters?format=json`).

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::{Context as _, bail};
use serde::Deserialize;

#[derive(Deserialize)]
struct Cluster {
    name: String,
    services: Vec<String>,
    hosts: Vec<Host>,
}

#[derive(Deserialize)]
struct Host {
    address: String,
    health_flags: String,
    weight: u32,
    priority: u32,
    routable: bool,
}

/// Fetches the daemon's clusters and prints them.
pub fn run(admin: SocketAddr, out: &mut impl std::io::Write) -> anyhow::Result<()> {
    let body = get(admin, "/clusters?format=json")?;
    let clusters: Vec<Cluster> = serde_json::from_str(&body).context("parsing /clusters")?;
    writeln!(
        out,
        "{:<28} {:<14} {:<24} {:>4} {:>8} {:<9} HEALTH",
        "SERVICE", "CLUSTER", "HOST", "PRIO", "WEIGHT", "ROUTABLE"
    )?;
    for cluster in &clusters {
        let services = if cluster.services.is_empty() {
            "-".to_owned()
        } else {
            cluster.services.join(", ")
        };
        if cluster.hosts.is_empty() {
            writeln!(out, "{services:<28} {:<14} (no hosts)", cluster.name)?;
        }
        for (i, h) in cluster.hosts.iter().enumerate() {
            let svc = if i == 0 { services.as_str() } else { "" };
            let routable = if h.routable { "yes" } else { "no" };
            writeln!(
                out,
                "{svc:<28} {:<14} {:<24} {:>4} {:>8} {routable:<9} {}",
                cluster.name, h.address, h.priority, h.weight, h.health_flags
            )?;
        }
    }
    Ok(())
}

fn get(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut stream =
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).with_context(|| {
            format!("connecting to the admin interface at {addr} (is the daemon running? --admin)")
        })?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: admin\r\nconnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    if !head.starts_with("HTTP/1.1 200") {
        bail!("GET {path}: {}", head.lines().next().unwrap_or_default());
    }
    Ok(body.to_owned())
}
