//! Health-check cost: `proxy_core::health::HealthCheckManager` running TCP connect checks (or
//! UDP payload checks: `PING` out, `PING` back) against N local endpoints at a fixed interval,
//! and the CPU that costs this process.
//!
//! Run in a network namespace of the benchmark: every endpoint is a distinct address
//! 127.88.x.y on that namespace's loopback, all answered by one listener on 0.0.0.0:PORT (TCP),
//! or by one UDP socket per address at PORT (a checker connected to an address takes replies
//! from that address only).

use std::{
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use anyhow::Context as _;
use proxy_core::health::{HealthCheck, HealthCheckManager, HealthCheckStats};
use serde_json::json;

/// Our own CPU so far (all threads, live ones from schedstat).
fn self_cpu_ns() -> u64 {
    super::sys::schedstat_ns(std::process::id())
}

pub fn run(
    udp: bool,
    endpoints: u32,
    port: u16,
    interval_ms: u64,
    secs: f64,
) -> anyhow::Result<()> {
    let checker = if udp {
        (
            "udp_health_check",
            json!({"send": {"text": "50494E47"}, "receive": [{"text": "50494E47"}]}),
        )
    } else {
        ("tcp_health_check", json!({}))
    };
    let mut check = json!({
        "timeout": "1s",
        "interval": format!("{interval_ms}ms"),
        "no_traffic_interval": format!("{interval_ms}ms"),
        "initial_jitter": format!("{interval_ms}ms"),
        "unhealthy_threshold": 3,
        "healthy_threshold": 1,
    });
    check[checker.0] = checker.1;
    let check: HealthCheck = serde_json::from_value(check).context("building the health check")?;
    let spec = Arc::new(
        check
            .validate("bench")
            .context("validating the health check")?,
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let manager = HealthCheckManager::default();
        let stats = Arc::new(HealthCheckStats::default());
        let base = u32::from(Ipv4Addr::new(127, 88, 0, 1));
        let mut probes = Vec::with_capacity(endpoints as usize);
        for i in 0..endpoints {
            let addr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(base + i), port));
            probes.push(manager.register("bench", addr, &spec, &stats).0);
        }
        // Let the initial jitter spread the first round, then measure steady state.
        tokio::time::sleep(Duration::from_millis(interval_ms * 2)).await;
        let (a0, s0, cpu0) = (stats.attempt.load(Ordering::Relaxed), stats.success.load(Ordering::Relaxed), self_cpu_ns());
        let started = std::time::Instant::now();
        tokio::time::sleep(Duration::from_secs_f64(secs)).await;
        let wall = started.elapsed().as_secs_f64();
        let cpu = (self_cpu_ns() - cpu0) as f64 / 1e9;
        let attempts = stats.attempt.load(Ordering::Relaxed) - a0;
        let successes = stats.success.load(Ordering::Relaxed) - s0;
        for p in probes {
            manager.unregister("bench", p, &stats);
        }
        println!(
            "{}",
            json!({"udp": udp, "endpoints": endpoints, "interval_ms": interval_ms, "checks_per_s": attempts as f64 / wall,
                   "success_ratio": if attempts > 0 { successes as f64 / attempts as f64 } else { 0.0 },
                   "cpu_cores": cpu / wall, "cpu_us_per_check": if attempts > 0 { cpu * 1e6 / attempts as f64 } else { 0.0 }})
        );
        anyhow::Ok(())
    })
}
