//! Measurements outside the scenario rows: health-check CPU for N endpoints (in a network
//! namespace of ours, so one listener on 0.0.0.0 answers every 127.88.x.y address) and the
//! time to publish 10,000 hosts and the cost of ending kernel-path sockets (the `bench_publish`
//! and `bench_end` binaries of the integration-tests crate, which drive `proxy::dataplane`
//! in-process).

use std::{collections::BTreeMap, path::Path, process::Command, time::Duration};

use anyhow::{Context as _, bail};

use super::{Env, sys, topo};

struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.0])
            .status();
    }
}

pub fn json_values(stdout: &str) -> anyhow::Result<BTreeMap<String, f64>> {
    let v: serde_json::Value =
        serde_json::from_str(stdout.trim()).with_context(|| format!("parsing {stdout:?}"))?;
    Ok(v.as_object()
        .context("expected a JSON object")?
        .iter()
        .filter_map(|(k, v)| {
            Some((
                k.clone(),
                v.as_f64()
                    .or_else(|| v.as_bool().map(|b| f64::from(u8::from(b))))?,
            ))
        })
        .collect())
}

pub fn health(env: &Env, endpoints: u32, udp: bool) -> anyhow::Result<BTreeMap<String, f64>> {
    let ns = Netns(format!("pbh-{}", std::process::id()));
    sys::sh(
        Command::new("ip").args(["netns", "add", &ns.0]),
        "ip netns add",
    )?;
    sys::sh(
        Command::new("ip").args(["-n", &ns.0, "link", "set", "lo", "up"]),
        "ip link set lo up",
    )?;
    let port = 18001_u16;
    let serve_args = [
        "worker",
        "serve",
        "--echo",
        "127.0.0.1:18000",
        "--conn",
        "0.0.0.0:18001",
        "--sink",
        "127.0.0.1:18002",
    ]
    .map(str::to_owned);
    let udp_args = [
        "worker",
        "udp-echo",
        "--base",
        "127.88.0.1",
        "--count",
        &endpoints.to_string(),
        "--port",
        "18001",
    ]
    .map(str::to_owned);
    let (args, what): (&[String], &str) = if udp {
        (&udp_args, "health UDP echo")
    } else {
        (&serve_args, "health listener")
    };
    let server = topo::start(
        topo::Net::in_ns(Some(&ns.0), &env.worker, args),
        what,
        None,
        None,
    )?;
    let secs = if env.secs < 1.0 {
        1.0
    } else {
        (env.secs * 2.0).max(5.0)
    };
    let mut args: Vec<String> = [
        "worker",
        "health",
        "--endpoints",
        &endpoints.to_string(),
        "--port",
        &port.to_string(),
        "--interval-ms",
        "1000",
        "--secs",
        &secs.to_string(),
    ]
    .map(str::to_owned)
    .into();
    if udp {
        args.push("--udp".to_owned());
    }
    let before = sys::cpu_ns(&[server.pid()]);
    let child = topo::Net::in_ns(Some(&ns.0), &env.worker, &args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("starting the health worker")?;
    let reaped = sys::reap(child, "health worker", Duration::from_secs_f64(secs + 60.0))?;
    let listener_cpu = sys::cpu_ns(&[server.pid()]).saturating_sub(before) as f64 / 1e9;
    drop(server);
    if !reaped.success {
        bail!("the health worker failed ({})", reaped.failure);
    }
    let mut v = json_values(&reaped.stdout)?;
    v.insert("listener_cpu_s".into(), listener_cpu);
    Ok(v)
}

pub fn publish(bin: &Path, hosts: u32) -> anyhow::Result<BTreeMap<String, f64>> {
    if !bin.exists() {
        bail!(
            "{} is missing (cargo build -p integration-tests --bin bench_publish)",
            bin.display()
        );
    }
    let cg = super::cgroup2_mount()?.join(format!("proxy-bench-publish-{}", std::process::id()));
    let out = sys::sh(
        Command::new(bin)
            .arg("--hosts")
            .arg(hosts.to_string())
            .arg("--cgroup")
            .arg(&cg),
        "bench_publish",
    )?;
    json_values(out.lines().last().unwrap_or(""))
}

/// The exit status of `bench_end` when the kernel cannot end sockets (`bpf_sock_destroy`,
/// Linux 6.5+): the row reads `unavailable` and the reason is printed, as the daemon runs on.
const END_UNAVAILABLE: i32 = 3;

/// Ends `sockets` kernel-path connections of one host with the reaper (`bench_end`, next to
/// `bench_publish`).
pub fn ending(publish_bin: &Path, sockets: u32) -> anyhow::Result<BTreeMap<String, f64>> {
    let bin = publish_bin.with_file_name("bench_end");
    if !bin.exists() {
        bail!(
            "{} is missing (cargo build -p integration-tests --bin bench_end)",
            bin.display()
        );
    }
    let out = Command::new(&bin)
        .arg("--sockets")
        .arg(sockets.to_string())
        .stdin(std::process::Stdio::null())
        .output()
        .context("starting bench_end")?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(END_UNAVAILABLE) {
        crate::util::detail(format!("ending not measured: {}", stderr.trim()));
        return Ok([("unavailable".to_owned(), 1.0)].into());
    }
    if !out.status.success() {
        bail!("bench_end failed ({}): {}", out.status, stderr.trim());
    }
    json_values(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .unwrap_or(""),
    )
}
