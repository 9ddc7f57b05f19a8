//! The fleet's network and cgroups: a hub namespace holding what is shared (the Consul servers
//! on its loopback, the client agents, the backends, the xDS server), and per node a namespace
//! joined to the hub by a veth pair, plus a cgroup v2 under a parent the harness owns. Nothing
//! routes out of these namespaces; everything is removed on drop.

use std::{
    fs,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

use super::sys;

/// The Consul servers, on the hub's loopback.
pub const SERVERS: [Ipv4Addr; 3] = [
    Ipv4Addr::new(127, 0, 0, 71),
    Ipv4Addr::new(127, 0, 0, 72),
    Ipv4Addr::new(127, 0, 0, 73),
];
/// The client agent of the node that runs the backends (where services register).
pub const BACKENDS_AGENT: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 80);
/// The port every backend listens on.
pub const BACKEND_PORT: u16 = 9000;
/// The port of every service's VIP.
pub const VIP_PORT: u16 = 8080;
/// The admin port of each daemon, on its node's loopback.
pub const ADMIN_PORT: u16 = 9901;
/// Most nodes: node agents take 127.0.0.81 onwards, node links 10.210.<node>.0/24.
pub const MAX_NODES: u32 = 150;
/// Most backends (10.220.0.1 onwards).
pub const MAX_BACKENDS: u32 = 250;

/// Node `i`'s Consul client agent (serf and RPC), on the hub's loopback; nodes count from 1.
pub fn node_agent(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(BACKENDS_AGENT) + i)
}

/// The hub's end of node `i`'s veth (the node agent's HTTP API listens there).
pub fn hub_side(i: u32) -> Ipv4Addr {
    Ipv4Addr::new(10, 210, i as u8, 1)
}

/// The node's end of its veth (its daemon's admin address).
pub fn node_side(i: u32) -> Ipv4Addr {
    Ipv4Addr::new(10, 210, i as u8, 2)
}

/// Backend `b` (from 0), an address on the hub's loopback reached through each node's veth.
pub fn backend(b: u32) -> Ipv4Addr {
    Ipv4Addr::new(10, 220, 0, (b + 1) as u8)
}

/// The VIP of service `j` (from 0) inside every node: 10.96.0.0/16, which has no route there.
pub fn vip(j: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 1)) + j)
}

/// The namespaces and cgroups of one run, removed on drop (after the processes in them, which
/// the caller stops first).
pub struct Net {
    pub hub: String,
    pub nodes: Vec<String>,
    pub cgroup_parent: PathBuf,
    tag: String,
}

impl Net {
    /// Creates the hub, `nodes` nodes and their cgroups. A failure half-way removes what was
    /// made (the drop runs on the partial value).
    pub fn create(nodes: u32, backends: u32) -> anyhow::Result<Self> {
        let tag = format!("pf{}", std::process::id());
        let mut net = Self {
            hub: format!("{tag}-hub"),
            nodes: Vec::new(),
            cgroup_parent: cgroup2_mount()?.join(format!("proxy-fleet-{}", std::process::id())),
            tag,
        };
        ip(&["netns", "add", &net.hub])?;
        ip(&["-n", &net.hub, "link", "set", "lo", "up"])?;
        for b in 0..backends {
            ip(&[
                "-n",
                &net.hub,
                "addr",
                "add",
                &format!("{}/32", backend(b)),
                "dev",
                "lo",
            ])?;
        }
        fs::create_dir(&net.cgroup_parent)
            .with_context(|| format!("creating cgroup {}", net.cgroup_parent.display()))?;
        for i in 1..=nodes {
            net.add_node(i)?;
        }
        Ok(net)
    }

    fn add_node(&mut self, i: u32) -> anyhow::Result<()> {
        let ns = format!("{}-n{i}", self.tag);
        ip(&["netns", "add", &ns])?;
        self.nodes.push(ns.clone());
        let (h, n) = (format!("{}h{i}", self.tag), format!("{}n{i}", self.tag));
        ip(&["link", "add", &h, "type", "veth", "peer", "name", &n])?;
        ip(&["link", "set", &h, "netns", &self.hub])?;
        ip(&["link", "set", &n, "netns", &ns])?;
        ip(&[
            "-n",
            &self.hub,
            "addr",
            "add",
            &format!("{}/24", hub_side(i)),
            "dev",
            &h,
        ])?;
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{}/24", node_side(i)),
            "dev",
            &n,
        ])?;
        ip(&["-n", &self.hub, "link", "set", &h, "up"])?;
        ip(&["-n", &ns, "link", "set", &n, "up"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        let via = hub_side(i).to_string();
        ip(&["-n", &ns, "route", "add", "10.220.0.0/16", "via", &via])?;
        fs::create_dir(self.cgroup(i))
            .with_context(|| format!("creating cgroup {}", self.cgroup(i).display()))?;
        Ok(())
    }

    /// Node `i`'s cgroup (nodes count from 1).
    pub fn cgroup(&self, i: u32) -> PathBuf {
        self.cgroup_parent.join(format!("node-{i}"))
    }

    /// Node `i`'s namespace name.
    pub fn node(&self, i: u32) -> &str {
        &self.nodes[i as usize - 1]
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.nodes.iter().chain(std::iter::once(&self.hub)) {
            let _ = Command::new("ip")
                .args(["netns", "delete", ns])
                .stderr(Stdio::null())
                .status();
        }
        let nodes = (1..=self.nodes.len() as u32).map(|i| self.cgroup(i));
        for cg in nodes.chain(std::iter::once(self.cgroup_parent.clone())) {
            if cg.exists()
                && let Err(e) = fs::remove_dir(&cg)
            {
                eprintln!("WARNING: cannot remove cgroup {}: {e}", cg.display());
            }
        }
    }
}

/// `cmd` run inside namespace `ns` through nsenter, which keeps the host's /sys (so the
/// cgroup and bpf file systems stay visible) and execs without forking: the PID is the
/// program's.
pub fn in_netns(ns: &str, program: &Path, args: &[String]) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{ns}"))
        .arg("--")
        .arg(program)
        .args(args);
    c
}

/// Runs `f` on a thread of its own inside namespace `ns` (setns moves only that thread).
pub fn with_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
    let path = Path::new("/run/netns").join(ns);
    let file = fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                sys::enter_netns(&file)?;
                Ok(f())
            })
            .join()
            .map_err(|_| anyhow::anyhow!("a thread in namespace {ns} panicked"))?
    })
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("starting ip")?;
    if !out.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Where cgroup v2 is mounted (`/sys/fs/cgroup/unified` on hybrid hosts).
pub fn cgroup2_mount() -> anyhow::Result<PathBuf> {
    let mounts = fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    mounts
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
        })
        .context("no cgroup2 mount in /proc/mounts: the daemon needs cgroup v2")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_of_nodes_backends_and_vips_do_not_overlap() {
        assert_eq!(node_agent(1), Ipv4Addr::new(127, 0, 0, 81));
        assert_eq!(node_agent(MAX_NODES), Ipv4Addr::new(127, 0, 0, 230));
        assert_eq!(hub_side(7), Ipv4Addr::new(10, 210, 7, 1));
        assert_eq!(node_side(7), Ipv4Addr::new(10, 210, 7, 2));
        assert_eq!(backend(0), Ipv4Addr::new(10, 220, 0, 1));
        assert_eq!(backend(MAX_BACKENDS - 1), Ipv4Addr::new(10, 220, 0, 250));
        assert_eq!(vip(0), Ipv4Addr::new(10, 96, 0, 1));
        assert_eq!(vip(1000), Ipv4Addr::new(10, 96, 3, 233));
        assert!(!SERVERS.contains(&node_agent(1)) && !SERVERS.contains(&BACKENDS_AGENT));
    }
}
