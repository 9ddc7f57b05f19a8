//! The run loop: configuration in, data path attached and published, admin served, clean stop.

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use anyhow::Context as _;
use proxy_common::service::{PROTO_TCP, PROTO_UDP, SERVICE_F_MAGLEV};
use proxy_core::config::{Config, LbPolicy, Protocol};
use tokio::signal::unix::{SignalKind, signal};
use tracing::info;

use crate::{
    admin,
    dataplane::{self, Dataplane, DataplaneOptions, ServiceSpec},
};

/// Runs the daemon until SIGINT or SIGTERM, then detaches and removes everything it created.
pub fn run(config: Config) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(run_async(config))
}

async fn run_async(config: Config) -> anyhow::Result<()> {
    let opts = DataplaneOptions {
        cgroup: dataplane::resolve_cgroup(&config.cgroup)?,
        bpffs: PathBuf::from(&config.bpffs),
        instance: config.instance.clone(),
    };
    let mut dp = Dataplane::open(&opts).context("attaching the data path")?;
    if let Err(err) = publish_all(&mut dp, &config) {
        dp.shutdown();
        return Err(err);
    }
    let dp = Arc::new(Mutex::new(Some(dp)));
    let state = admin::State::new(config.clone(), dp.clone());
    let admin_addr: SocketAddr = config.admin.address;
    let server = match admin::serve(admin_addr, state).await {
        Ok(server) => server,
        Err(err) => {
            shutdown(&dp);
            return Err(err).context(format!("admin listener on {admin_addr}"));
        }
    };
    info!(admin = %admin_addr, services = config.services.len(), "ready");
    wait_for_signal().await;
    server.abort();
    shutdown(&dp);
    Ok(())
}

fn shutdown(dp: &Mutex<Option<Dataplane>>) {
    let taken = dp.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(dp) = taken {
        dp.shutdown();
    }
}

async fn wait_for_signal() {
    let (Ok(mut int), Ok(mut term)) =
        (signal(SignalKind::interrupt()), signal(SignalKind::terminate()))
    else {
        // Without signal handlers the process dies on the default action; nothing to wait for.
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = int.recv() => info!("SIGINT: shutting down"),
        _ = term.recv() => info!("SIGTERM: shutting down"),
    }
}

/// Publishes every configured service, then removes what a previous run left and is no longer
/// configured.
fn publish_all(dp: &mut Dataplane, config: &Config) -> anyhow::Result<()> {
    let specs = service_specs(config);
    let publisher = dp.publisher();
    for spec in &specs {
        publisher.publish(spec)?;
    }
    let keys: Vec<_> = specs.iter().map(|s| s.key).collect();
    publisher.sweep(&keys)?;
    Ok(())
}

/// The kernel's view of every configured service: routable hosts by priority.
pub fn service_specs(config: &Config) -> Vec<ServiceSpec> {
    config
        .services
        .iter()
        .filter_map(|svc| {
            let cluster = config.cluster(&svc.cluster)?;
            let mut priorities: Vec<Vec<(SocketAddr, u32)>> = Vec::new();
            for host in cluster.static_hosts() {
                let p = host.priority as usize;
                if priorities.len() <= p {
                    priorities.resize(p + 1, Vec::new());
                }
                priorities[p].push((host.addr, host.weight));
            }
            let proto = match svc.protocol {
                Protocol::Tcp => PROTO_TCP,
                Protocol::Udp => PROTO_UDP,
            };
            let flags = match cluster.lb_policy {
                LbPolicy::Maglev => SERVICE_F_MAGLEV,
                _ => 0,
            };
            Some(ServiceSpec {
                name: svc.name.clone(),
                key: dataplane::publish_key(svc.address, svc.port, proto),
                flags,
                priorities,
            })
        })
        .collect()
}
