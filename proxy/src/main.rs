//! The `proxy` binary: parses the command line and hands over to the library.

#![forbid(unsafe_code)]

use std::{io::Write as _, process::ExitCode};

use clap::Parser as _;
use proxy::{
    EXIT_BAD_CONFIG,
    cli::{ChainCommand, Cli, Command, DataplaneCommand, ProbeArgs},
    daemon,
};
use proxy_core::config::Config;

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(&cli.log);
    match cli.command {
        Command::Check { config } => match proxy::load_config(&config) {
            Ok(cfg) => {
                println!(
                    "{}: ok ({} clusters, {} services)",
                    config.display(),
                    cfg.clusters.len(),
                    cfg.services.len()
                );
                ExitCode::SUCCESS
            }
            Err(err) => {
                eprintln!("error: {err}");
                ExitCode::from(EXIT_BAD_CONFIG)
            }
        },
        Command::Probe(args) => probe(&args),
        Command::Chain(ChainCommand::Compile {
            entries,
            service,
            datacenter,
            override_protocol,
            override_connect_timeout,
            override_mesh_gateway,
            trust_domain,
        }) => {
            let overrides = || -> anyhow::Result<proxy_chain::Overrides> {
                Ok(proxy_chain::Overrides {
                    protocol: override_protocol.unwrap_or_default(),
                    connect_timeout: match override_connect_timeout {
                        Some(d) => proxy_chain::GoDuration::parse(&d).map_err(|e| {
                            anyhow::anyhow!("--override-connect-timeout {d:?}: {e}")
                        })?,
                        None => proxy_chain::GoDuration::default(),
                    },
                    mesh_gateway: match override_mesh_gateway {
                        Some(m) => m
                            .parse()
                            .map_err(|e| anyhow::anyhow!("--override-mesh-gateway: {e}"))?,
                        None => proxy_chain::MeshGatewayMode::default(),
                    },
                    trust_domain,
                })
            };
            let result = overrides().and_then(|o| {
                let text = proxy_core::config::read_config_file(&entries)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", entries.display()))?;
                proxy_chain::compile_json_cli(&text, &service, &datacenter, o)
                    .map_err(anyhow::Error::from)
            });
            match result {
                Ok(json) => {
                    // A closed pipe (`| head`) is not an error worth a panic.
                    let _ = writeln!(std::io::stdout(), "{json}");
                    ExitCode::SUCCESS
                }
                Err(err) => {
                    eprintln!("{err}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Status { admin, timeout } => status(admin, timeout),
        Command::Uninstall {
            config,
            instance,
            bpffs,
        } => uninstall(config.as_deref(), &instance, &bpffs),
        Command::Dataplane(DataplaneCommand::Show {
            config,
            instance,
            bpffs,
            json,
        }) => dataplane_show(config.as_deref(), &instance, &bpffs, json),
        Command::Run {
            config,
            concurrency,
        } => {
            let cfg = match config.as_deref().map(proxy::load_config) {
                None => Config::embedded_default(),
                Some(Ok(cfg)) => cfg,
                Some(Err(err)) => {
                    eprintln!("error: {err}");
                    return ExitCode::from(EXIT_BAD_CONFIG);
                }
            };
            match daemon::run(cfg, concurrency.map(usize::from)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(err) => {
                    eprintln!("error: {err:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// `proxy probe`: 0 when every connection succeeded, 1 when any failed, 2 when it could not
/// start.
fn probe(args: &ProbeArgs) -> ExitCode {
    const CANNOT_START: u8 = 2;
    let setup = || -> anyhow::Result<()> {
        if let Some(cgroup) = &args.cgroup {
            proxy::probe::join_cgroup(&proxy::dataplane::resolve_cgroup(cgroup)?)?;
        }
        if let Some(name) = &args.netns {
            let path = std::path::Path::new("/run/netns").join(name);
            proxy::enter_netns(&path).map_err(|e| {
                anyhow::anyhow!("entering network namespace {}: {e}", path.display())
            })?;
        }
        Ok(())
    };
    if let Err(err) = setup() {
        eprintln!("error: {err:#}");
        return ExitCode::from(CANNOT_START);
    }
    let report = proxy::probe::run(&proxy::probe::ProbeOptions {
        target: args.target,
        count: args.count,
        udp: args.udp,
        timeout: std::time::Duration::from_millis(args.timeout_ms),
        expect: args.expect,
    });
    let printed = if args.json {
        serde_json::to_writer(std::io::stdout(), &report)
            .map_err(std::io::Error::other)
            .and_then(|()| writeln!(std::io::stdout()))
    } else {
        proxy::probe::print_table(&report, &mut std::io::stdout())
    };
    if printed.is_err() {
        return ExitCode::from(CANNOT_START);
    }
    ExitCode::from(proxy::probe::exit_status(&report))
}

fn init_tracing(filter: &str) {
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| filter.to_owned());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .init();
}

/// `proxy uninstall`: 0 (also when nothing was installed), 64 for a bad configuration, 1 when a
/// daemon runs the instance or removing failed.
fn uninstall(
    config: Option<&std::path::Path>,
    instance: &str,
    bpffs: &std::path::Path,
) -> ExitCode {
    let (bpffs, instance) = match config.map(proxy::load_config) {
        None => (bpffs.to_owned(), instance.to_owned()),
        Some(Err(err)) => {
            eprintln!("error: {err}");
            return ExitCode::from(EXIT_BAD_CONFIG);
        }
        Some(Ok(cfg)) => (std::path::PathBuf::from(cfg.bpffs), cfg.instance),
    };
    match proxy::dataplane::uninstall(&bpffs, &instance) {
        Ok(None) => {
            println!(
                "instance {instance:?}: nothing pinned under {}",
                bpffs.join(&instance).display()
            );
            ExitCode::SUCCESS
        }
        Ok(Some(done)) => {
            let cgroup = done.cgroup.map_or_else(
                || "no cgroup of its own".to_owned(),
                |c| format!("cgroup {} removed", c.display()),
            );
            println!(
                "instance {instance:?} uninstalled: {} programs detached, pins removed, {cgroup}",
                done.links
            );
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}

/// `proxy dataplane show`: 0, 64 for a bad configuration, 1 when the maps cannot be read.
fn dataplane_show(
    config: Option<&std::path::Path>,
    instance: &str,
    bpffs: &std::path::Path,
    json: bool,
) -> ExitCode {
    let (pins, names) = match config.map(proxy::load_config) {
        None => (bpffs.join(instance), std::collections::BTreeMap::new()),
        Some(Err(err)) => {
            eprintln!("error: {err}");
            return ExitCode::from(EXIT_BAD_CONFIG);
        }
        Some(Ok(cfg)) => (
            std::path::Path::new(&cfg.bpffs).join(&cfg.instance),
            cfg.services
                .iter()
                .map(|s| (daemon::service_key(s), s.name.clone()))
                .collect(),
        ),
    };
    let snapshot = match proxy::show::read(&pins, &names) {
        Ok(snapshot) => snapshot,
        Err(err) => {
            eprintln!("error: {err:#}");
            return ExitCode::FAILURE;
        }
    };
    let printed = if json {
        serde_json::to_writer_pretty(std::io::stdout(), &snapshot)
            .map_err(std::io::Error::other)
            .and_then(|()| writeln!(std::io::stdout()))
    } else {
        proxy::show::print(&snapshot, &mut std::io::stdout())
    };
    if printed.is_err() {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// `proxy status`.
fn status(admin: std::net::SocketAddr, timeout: u64) -> ExitCode {
    let timeout = std::time::Duration::from_secs(timeout);
    match proxy::status::run(admin, timeout, &mut std::io::stdout()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
