//! The `proxy` binary: parses the command line and hands over to the library.

#![forbid(unsafe_code)]

use std::{io::Write as _, process::ExitCode};

use clap::Parser as _;
use proxy::{
    EXIT_BAD_CONFIG,
    cli::{ChainCommand, Cli, Command, DataplaneCommand, InstanceArgs, ProbeArgs},
    daemon,
};
use proxy_core::config::Config;
use tracing_subscriber::util::SubscriberInitExt as _;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (logging, subscriber) = proxy::logging::LogControl::new(&cli.log, cli.log_format);
    // Also routes `log` records (aya's) through tracing.
    subscriber.init();
    match cli.command {
        Command::Check { config, json } => check(&config, json),
        Command::Completions { shell } => {
            let mut command = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut command, "proxy", &mut std::io::stdout());
            ExitCode::SUCCESS
        }
        Command::Man => man(),
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
        Command::Status {
            admin,
            timeout,
            json,
        } => status(&admin, timeout, json),
        Command::Reload { admin, timeout } => reload(&admin, timeout),
        Command::Uninstall(args) => uninstall(&args),
        Command::Dataplane(DataplaneCommand::Show { instance, json }) => {
            dataplane_show(&instance, json)
        }
        Command::Run {
            config,
            demo: _,
            concurrency,
            takeover,
            user,
            no_seccomp,
        } => {
            // Before anything else, and before any thread exists: a signal during the start
            // stops or reloads the daemon once it runs instead of killing it half-attached.
            if let Err(err) = daemon::hold_signals() {
                eprintln!("error: holding signals during the start: {err}");
                return ExitCode::FAILURE;
            }
            let run_flags = proxy::RunFlags { user, no_seccomp };
            let cfg = match run_config(config.as_deref(), &run_flags) {
                Ok(cfg) => cfg,
                Err(code) => return code,
            };
            let launch = proxy::admin::Launch {
                config_path: config,
                log_level: logging.current(),
                logging: Some(logging),
                takeover,
                run_flags,
                ..proxy::admin::Launch::default()
            };
            match daemon::run(cfg, concurrency.map(usize::from), launch) {
                Ok(()) => ExitCode::SUCCESS,
                Err(err) => run_failed(&err),
            }
        }
    }
}

/// `proxy check`: the file, and the user it names, are usable (exit 0), or why not (64); the
/// verdict as a table line or (`json`) one line of JSON on stdout.
fn check(path: &std::path::Path, json: bool) -> ExitCode {
    let verdict = proxy::check::check(path);
    let code = if verdict.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_BAD_CONFIG)
    };
    let printed = if json {
        print(&verdict, true, |_, _| Ok(()))
    } else {
        verdict.print_text(&mut std::io::stdout(), &mut std::io::stderr())
    };
    if printed.is_err() {
        return ExitCode::FAILURE;
    }
    code
}

/// `proxy man`: proxy(8) in roff on stdout.
fn man() -> ExitCode {
    let command = <Cli as clap::CommandFactory>::command();
    match clap_mangen::Man::new(command)
        .section("8")
        .render(&mut std::io::stdout())
    {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: writing the manual page: {err}");
            ExitCode::FAILURE
        }
    }
}

/// `proxy run`'s configuration: the file's (or the embedded default), with `--user` and
/// `--no-seccomp` applied; the exit status when it cannot be used.
fn run_config(
    config: Option<&std::path::Path>,
    run_flags: &proxy::RunFlags,
) -> Result<Config, ExitCode> {
    let mut cfg = match config.map(proxy::load_config) {
        None => Config::embedded_default(),
        Some(Ok(cfg)) => cfg,
        Some(Err(err)) => {
            eprintln!("error: {err}");
            return Err(ExitCode::from(EXIT_BAD_CONFIG));
        }
    };
    run_flags.apply(&mut cfg);
    if let Err(err) = proxy::check::steady_state_user(&cfg) {
        eprintln!("error: {err}");
        return Err(ExitCode::from(EXIT_BAD_CONFIG));
    }
    Ok(cfg)
}

/// `proxy run`'s status after an error: 64 when the configuration is why a takeover was
/// refused (not worth retrying: `proxy@.service` does not), 1 otherwise.
fn run_failed(err: &anyhow::Error) -> ExitCode {
    eprintln!("error: {err:#}");
    let refused = err
        .downcast_ref::<daemon::TakeoverError>()
        .is_some_and(daemon::TakeoverError::is_config);
    ExitCode::from(if refused { EXIT_BAD_CONFIG } else { 1 })
}

/// `proxy reload`: 0 when applied, 64 for an invalid file, 1 for any other refusal or error.
fn reload(admin: &proxy_core::config::AdminAddress, timeout: u64) -> ExitCode {
    use proxy::status::Reloaded;
    match proxy::status::reload(admin, std::time::Duration::from_secs(timeout)) {
        Ok(Reloaded::Done(summary)) => {
            println!("{summary}");
            ExitCode::SUCCESS
        }
        Ok(Reloaded::Invalid(why)) => {
            eprintln!("{why}");
            ExitCode::from(EXIT_BAD_CONFIG)
        }
        Ok(Reloaded::Refused(why)) => {
            eprintln!("{why}");
            ExitCode::FAILURE
        }
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
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
    if print(&report, args.json, proxy::probe::print_table).is_err() {
        return ExitCode::from(CANNOT_START);
    }
    ExitCode::from(proxy::probe::exit_status(&report))
}

/// The instance a command names; `Err` is the exit status for a bad configuration.
fn resolve(args: &InstanceArgs) -> Result<proxy::cli::Instance, ExitCode> {
    args.resolve().map_err(|err| {
        eprintln!("error: {err}");
        ExitCode::from(EXIT_BAD_CONFIG)
    })
}

/// `proxy uninstall`: 0 (also when nothing was installed), 64 for a bad configuration, 1 when a
/// daemon runs the instance or removing failed.
fn uninstall(args: &InstanceArgs) -> ExitCode {
    let at = match resolve(args) {
        Ok(at) => at,
        Err(code) => return code,
    };
    let (bpffs, instance) = (&at.bpffs, &at.name);
    let uninstalled = proxy::dataplane::uninstall(bpffs, instance);
    if uninstalled.is_ok() && daemon::remove_stale_takeover_socket(bpffs, instance) {
        println!("instance {instance:?}: stale takeover socket removed");
    }
    let control = at.config.as_ref().map_or_else(
        || proxy_core::config::Admin::default().control_path(instance),
        |c| c.admin.control_path(instance),
    );
    if uninstalled.is_ok() && proxy::admin::remove_stale_socket(&control) {
        println!("instance {instance:?}: stale admin control socket removed");
    }
    match uninstalled {
        Ok(None) => {
            println!(
                "instance {instance:?}: nothing pinned under {}",
                bpffs.join(instance).display()
            );
            ExitCode::SUCCESS
        }
        Ok(Some(done)) => {
            let cgroup = done.cgroup.map_or_else(
                || "no cgroup of its own".to_owned(),
                |c| format!("cgroup {} removed", c.display()),
            );
            let bpffs = done.bpffs.map_or_else(String::new, |b| {
                format!(", the bpffs it mounted at {} unmounted", b.display())
            });
            println!(
                "instance {instance:?} uninstalled: {} programs detached, pins removed, {cgroup}{bpffs}",
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
fn dataplane_show(args: &InstanceArgs, json: bool) -> ExitCode {
    let at = match resolve(args) {
        Ok(at) => at,
        Err(code) => return code,
    };
    let names: std::collections::BTreeMap<_, _> = at
        .config
        .iter()
        .flat_map(|cfg| &cfg.services)
        .map(|s| (daemon::service_key(s), s.name.clone()))
        .collect();
    let pins = at.bpffs.join(&at.name);
    let snapshot = match proxy::show::read(&pins, &names) {
        Ok(snapshot) => snapshot,
        Err(err) => {
            eprintln!("error: {err:#}");
            return ExitCode::FAILURE;
        }
    };
    if print(&snapshot, json, proxy::show::print).is_err() {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// Writes a command's report to stdout: one line of JSON with `json`, else `table`.
fn print<T: serde::Serialize>(
    report: &T,
    json: bool,
    table: fn(&T, &mut std::io::Stdout) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut out = std::io::stdout();
    if json {
        serde_json::to_writer(&mut out, report).map_err(std::io::Error::other)?;
        writeln!(out)
    } else {
        table(report, &mut out)
    }
}

/// `proxy status`.
fn status(admin: &proxy_core::config::AdminAddress, timeout: u64, json: bool) -> ExitCode {
    let timeout = std::time::Duration::from_secs(timeout);
    match proxy::status::run(admin, timeout, json, &mut std::io::stdout()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
