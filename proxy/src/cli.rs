//! Command line: `proxy run`, `proxy check`, `proxy status` and the other subcommands.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// eBPF-accelerated transparent proxy with Envoy-grade service discovery.
///
/// Applications in a cgroup connect to service addresses (VIP:port) as usual; kernel programs
/// attached to that cgroup pick a host from the host sets this daemon publishes and connect the
/// application straight to it.
#[derive(Debug, Parser)]
#[command(name = "proxy", version = crate::VERSION, propagate_version = true)]
pub struct Cli {
    /// Log filter, in tracing's EnvFilter syntax (e.g. `info`, `proxy=debug`). RUST_LOG also works.
    /// A running daemon's level can be changed with `POST /logging?level=debug` on its admin
    /// interface.
    #[arg(long, global = true, env = "PROXY_LOG", default_value = "info")]
    pub log: String,
    /// How log records are written to stderr: `text` (one readable line each) or `json` (one
    /// JSON object per line: timestamp, level, fields, target).
    #[arg(
        long,
        global = true,
        env = "PROXY_LOG_FORMAT",
        value_enum,
        default_value_t = crate::logging::LogFormat::Text
    )]
    pub log_format: crate::logging::LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon (as root): load and attach the kernel programs, publish the configured
    /// services, serve the admin interface (admin.address; `GET /` lists its endpoints); SIGINT
    /// or SIGTERM stops it, leaving the data path serving for the next start.
    Run {
        /// Configuration file (YAML or JSON). Required, unless --demo.
        #[arg(long, short, required_unless_present = "demo")]
        config: Option<PathBuf>,
        /// Run the embedded demo configuration instead of a file: one STATIC cluster of three
        /// loopback hosts behind 127.77.0.1:80 (what `cargo xtask demo` runs).
        #[arg(long, conflicts_with = "config")]
        demo: bool,
        /// Worker threads of the daemon's runtime (discovery, health checking, HTTP proxying),
        /// and threads of the proxy's epoll engine (plain TCP proxying), each (Envoy's
        /// --concurrency). Default: the CPUs the daemon may run on.
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
        concurrency: Option<u16>,
        /// Take over from the daemon running this instance, for a restart or an upgrade without
        /// a refused connect on the proxy path: it hands over its listening sockets through
        /// /run/proxy/<instance>-<hash of the pin directory>.takeover, stops accepting once this
        /// daemon accepts, drains its open connections (proxy.shutdown_timeout) and exits 0;
        /// this daemon adopts the data path as a normal start does. The configuration must keep
        /// proxy.listeners and bpffs (else the takeover is refused, this daemon exits 64 and the
        /// running one serves on). Without a running daemon, starts normally.
        #[arg(long)]
        takeover: bool,
        /// The user to run as once the data path is attached (the configuration's `user`,
        /// which this overrides): a name, name:group, or uid[:gid].
        #[arg(long)]
        user: Option<String>,
        /// Run without the seccomp filter once the data path is attached (the configuration's
        /// `seccomp: false`), e.g. to tell whether it is why a call fails with EPERM.
        #[arg(long)]
        no_seccomp: bool,
    },
    /// Connect to an address COUNT times from inside a cgroup (and optionally a network
    /// namespace) and report which backend answered (by the first line it sends) and what
    /// getpeername showed. Moving into the cgroup needs root. Exit status: 0 when every
    /// connection succeeded, 1 when any failed (the report is printed either way), 2 when the
    /// probe could not start.
    Probe(ProbeArgs),
    /// Print the services, clusters, hosts, health flags and weights of a running daemon, read
    /// from its admin interface.
    Status {
        /// Where to ask: the daemon's control socket (unix:/run/proxy/<instance>.admin, or its
        /// admin.control_socket; root's), or its read-only admin.address (ip:port, which
        /// anyone on the host may read).
        #[arg(long, default_value = "unix:/run/proxy/proxy.admin")]
        admin: proxy_core::config::AdminAddress,
        /// How long the whole answer may take, in seconds (a daemon with many thousands of
        /// services renders for a while).
        #[arg(long, default_value_t = 60)]
        timeout: u64,
        /// Print the daemon's `/routing` document (one line of JSON) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Ask a running daemon to re-read its configuration file and apply what changed (as
    /// SIGHUP does): untouched clusters keep their health state, DNS timers, Consul watches and
    /// xDS streams, and untouched services their kernel entries. Exit status 0 when applied,
    /// 64 with file:line:column when the file is invalid, 1 when the change needs a restart or
    /// could not be applied; in every refusal nothing changed.
    Reload {
        /// The daemon's control socket: unix:/run/proxy/<instance>.admin, or its
        /// admin.control_socket (root's). A TCP admin.address refuses a reload with 403 unless
        /// its config sets admin.allow_tcp_mutations.
        #[arg(long, default_value = "unix:/run/proxy/proxy.admin")]
        admin: proxy_core::config::AdminAddress,
        /// How long to wait for the daemon's answer, in seconds (a new cluster's first hosts
        /// are awaited).
        #[arg(long, default_value_t = 70)]
        timeout: u64,
    },
    /// Consul discovery chain tools.
    #[command(subcommand)]
    Chain(ChainCommand),
    /// Look at the kernel's data path of an instance.
    #[command(subcommand)]
    Dataplane(DataplaneCommand),
    /// Remove an instance's data path: detach its programs, remove its pins, the cgroup it
    /// created and the takeover and admin control sockets a killed daemon left. Stopping the
    /// daemon (SIGTERM) leaves the data path serving for the next start; this is how it goes
    /// for good. Refused while a daemon runs the instance. Needs root.
    Uninstall(InstanceArgs),
    /// Validate a configuration file and exit: status 0 if it is usable, 64 with
    /// file:line:column and the field if not. Needs no privileges and touches nothing.
    Check {
        /// Configuration file (YAML or JSON).
        #[arg(long, short)]
        config: PathBuf,
        /// Print the verdict as one line of JSON on stdout (`ok`, the counts and notes, or the
        /// error with its file, line, column and field); the exit status is the same.
        #[arg(long)]
        json: bool,
    },
    /// Print a shell completion script for this command line on stdout (e.g.
    /// `proxy completions bash > /etc/bash_completion.d/proxy`).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page, proxy(8), in roff on stdout (e.g. `proxy man | man -l -`).
    Man,
}

/// `proxy dataplane ...`.
#[derive(Debug, Subcommand)]
pub enum DataplaneCommand {
    /// Print what the kernel serves, read from the instance's pinned maps: every service, its
    /// hosts and their slots per priority, the live generation, the per-service and global
    /// counters. Works whether or not a daemon runs, and says which. Needs root (cap_bpf).
    Show {
        #[command(flatten)]
        instance: InstanceArgs,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// Which instance a command works on: the one a configuration file names, or one named here.
#[derive(Debug, clap::Args)]
pub struct InstanceArgs {
    /// Take the instance and bpffs (and, where they are shown, the service names) from this
    /// configuration file.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// The instance (without --config).
    #[arg(long, default_value = "proxy", conflicts_with = "config")]
    pub instance: String,
    /// The BPF filesystem (without --config).
    #[arg(long, default_value = "/sys/fs/bpf", conflicts_with = "config")]
    pub bpffs: PathBuf,
}

/// An instance as [`InstanceArgs`] name it.
pub struct Instance {
    pub bpffs: PathBuf,
    pub name: String,
    /// The configuration, when one was given.
    pub config: Option<proxy_core::config::Config>,
}

impl InstanceArgs {
    /// Loads the configuration, if one was given, and names the instance.
    pub fn resolve(&self) -> Result<Instance, proxy_core::config::ConfigError> {
        Ok(match &self.config {
            None => Instance {
                bpffs: self.bpffs.clone(),
                name: self.instance.clone(),
                config: None,
            },
            Some(path) => {
                let config = crate::load_config(path)?;
                Instance {
                    bpffs: PathBuf::from(&config.bpffs),
                    name: config.instance.clone(),
                    config: Some(config),
                }
            }
        })
    }
}

/// `proxy chain ...`.
#[derive(Debug, Subcommand)]
pub enum ChainCommand {
    /// Compile the discovery chain of a service from Consul config entries and print Consul's
    /// `CompiledDiscoveryChain` JSON on stdout. On an invalid entry or a chain Consul would
    /// reject, print Consul's error text on stderr and exit 1.
    Compile {
        /// A JSON array of config entries in Consul's API shape (Kind plus PascalCase fields).
        #[arg(long)]
        entries: PathBuf,
        /// The service whose chain to compile.
        #[arg(long)]
        service: String,
        /// The datacenter to compile in.
        #[arg(long, default_value = "dc1")]
        datacenter: String,
        /// Compile as if the service used this protocol (Consul's OverrideProtocol).
        #[arg(long)]
        override_protocol: Option<String>,
        /// Connect timeout for every resolver, as a Go duration (e.g. 3s; OverrideConnectTimeout).
        #[arg(long)]
        override_connect_timeout: Option<String>,
        /// Mesh gateway mode for every target: none, local or remote (OverrideMeshGateway).
        #[arg(long)]
        override_mesh_gateway: Option<String>,
        /// Trust domain for target SNI names.
        #[arg(long, default_value = proxy_chain::DEFAULT_TRUST_DOMAIN)]
        trust_domain: String,
    },
}

/// The options of `proxy probe`.
#[derive(Debug, clap::Args)]
pub struct ProbeArgs {
    /// Address to connect to, e.g. 127.77.0.1:80.
    pub target: std::net::SocketAddr,
    /// Number of connections (bounded: at most 1,000,000).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub count: u32,
    /// Join this cgroup v2 directory first (absolute, or relative to the cgroup v2 mount).
    #[arg(long)]
    pub cgroup: Option<String>,
    /// Then enter the network namespace at /run/netns/NAME.
    #[arg(long)]
    pub netns: Option<String>,
    /// Probe with UDP (one datagram per connected socket) instead of TCP.
    #[arg(long)]
    pub udp: bool,
    /// Per-connection timeout in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub timeout_ms: u64,
    /// What makes a TCP connection a success: the first line the server sends (`banner`,
    /// which names the backend), the connect alone (`connect`, for servers that wait for the
    /// client), or an HTTP response to `GET /` (`http`).
    #[arg(long, value_enum, default_value_t = crate::probe::Expect::Banner)]
    pub expect: crate::probe::Expect,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory as _, Parser as _};

    use super::{Cli, Command};
    use crate::logging::LogFormat;

    fn concurrency(args: &[&str]) -> Result<Option<u16>, clap::Error> {
        let cli = Cli::try_parse_from(["proxy", "run", "--demo"].iter().chain(args))?;
        match cli.command {
            Command::Run { concurrency, .. } => Ok(concurrency),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn log_format_is_text_or_json_and_anything_else_is_refused() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(
                ["proxy"]
                    .iter()
                    .chain(args)
                    .chain(&["check", "-c", "x.yaml"]),
            )
        };
        let format = |args: &[&str]| parse(args).expect("parses").log_format;
        assert_eq!(format(&[]), LogFormat::Text);
        assert_eq!(format(&["--log-format", "json"]), LogFormat::Json);
        assert_eq!(format(&["--log-format", "text"]), LogFormat::Text);
        // Global: also after the subcommand.
        let cli = Cli::try_parse_from(["proxy", "check", "-c", "x.yaml", "--log-format", "json"])
            .expect("parses");
        assert_eq!(cli.log_format, LogFormat::Json);
        let err = parse(&["--log-format", "xml"]).expect_err("xml is no format");
        let text = err.to_string();
        assert!(
            text.contains("invalid value 'xml' for '--log-format <LOG_FORMAT>'")
                && text.contains("[possible values: text, json]"),
            "{text}"
        );
    }

    #[test]
    fn run_needs_a_config_file_or_the_demo_and_not_both() {
        let run = |args: &[&str]| Cli::try_parse_from(["proxy", "run"].iter().chain(args));
        let err = run(&[]).expect_err("run without a configuration");
        assert!(
            err.to_string().contains(
                "the following required arguments were not provided:\n  --config <CONFIG>"
            ),
            "{err}"
        );
        let config = |args: &[&str]| match run(args).expect("parses").command {
            Command::Run { config, demo, .. } => (config, demo),
            other => panic!("parsed as {other:?}"),
        };
        assert_eq!(config(&["--demo"]), (None, true));
        assert_eq!(
            config(&["-c", "proxy.yaml"]),
            (Some("proxy.yaml".into()), false)
        );
        let err = run(&["--demo", "--config", "proxy.yaml"]).expect_err("both");
        assert!(
            err.to_string()
                .contains("the argument '--demo' cannot be used with '--config <CONFIG>'"),
            "{err}"
        );
    }

    #[test]
    fn the_version_names_the_commit_and_the_build_profile() {
        let version = Cli::command().render_version();
        assert!(
            version.starts_with(&format!("proxy {} (commit ", env!("CARGO_PKG_VERSION"))),
            "{version}"
        );
        let profile = if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        };
        assert!(
            version.trim_end().ends_with(&format!(", {profile} build)")),
            "{version}"
        );
    }

    #[test]
    fn completions_and_the_manual_page_cover_every_subcommand() {
        let mut completion = Vec::new();
        clap_complete::generate(
            clap_complete::Shell::Bash,
            &mut Cli::command(),
            "proxy",
            &mut completion,
        );
        let completion = String::from_utf8(completion).expect("utf-8");
        let mut man = Vec::new();
        clap_mangen::Man::new(Cli::command())
            .section("8")
            .render(&mut man)
            .expect("renders");
        let man = String::from_utf8(man).expect("utf-8");
        assert!(
            man.starts_with(".ie") && man.contains(".TH proxy 8"),
            "{man}"
        );
        for sub in Cli::command().get_subcommands() {
            let name = sub.get_name();
            assert!(completion.contains(name), "{name} has no completion");
            assert!(man.contains(name), "{name} is not in the manual page");
        }
    }

    #[test]
    fn run_takes_a_worker_count_from_1_to_1024_and_defaults_to_none() {
        assert_eq!(concurrency(&[]).expect("no flag"), None);
        assert_eq!(concurrency(&["--concurrency", "1"]).expect("1"), Some(1));
        assert_eq!(
            concurrency(&["--concurrency", "1024"]).expect("1024"),
            Some(1024)
        );
        for bad in ["0", "1025", "two"] {
            let err = concurrency(&["--concurrency", bad]).expect_err(bad);
            assert!(err.to_string().contains("--concurrency"), "{bad}: {err}");
        }
    }
}
