//! The `proxy` binary: parses the command line and hands over to the library.

use std::process::ExitCode;

use clap::Parser as _;
use proxy::{
    EXIT_BAD_CONFIG,
    cli::{Cli, Command},
    daemon,
};
use proxy_core::config::Config;

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(&cli.log);
    match cli.command {
        Command::Check { config } => match Config::load(&config) {
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
        Command::Run { config } => {
            let cfg = match config.as_deref().map(Config::load) {
                None => Config::embedded_default(),
                Some(Ok(cfg)) => cfg,
                Some(Err(err)) => {
                    eprintln!("error: {err}");
                    return ExitCode::from(EXIT_BAD_CONFIG);
                }
            };
            match daemon::run(cfg) {
                Ok(()) => ExitCode::SUCCESS,
                Err(err) => {
                    eprintln!("error: {err:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn init_tracing(filter: &str) {
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| filter.to_owned());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .init();
}
