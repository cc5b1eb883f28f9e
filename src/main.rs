//! The `egress-sidecar` binary: command line, logging, runtime, then [`egress_sidecar::run`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use egress_sidecar::config::{self, Overrides};
use egress_sidecar::{admin, reload, shutdown, Listeners};

#[derive(Debug, Parser)]
#[command(
    name = "egress-sidecar",
    version,
    about = "A localhost egress proxy with capped per-upstream connection pools"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve (the default).
    Run(RunArgs),
    /// Validate a config and print the effective config (exit 2 on problems).
    Check(RunArgs),
    /// GET /readyz on the admin listener; exit 0 when ready, 1 when not.
    Healthcheck {
        /// Admin address.
        #[arg(long, env = "EGRESS_ADMIN", default_value = config::DEFAULT_ADMIN)]
        admin: SocketAddr,
    },
}

#[derive(Debug, Clone, Args)]
struct RunArgs {
    /// YAML config file.
    #[arg(long, env = "EGRESS_CONFIG")]
    config: Option<PathBuf>,
    /// Forward-proxy listen address (overrides the file).
    #[arg(long, env = "EGRESS_LISTEN")]
    listen: Option<String>,
    /// Admin listen address (overrides the file).
    #[arg(long, env = "EGRESS_ADMIN")]
    admin: Option<String>,
}

impl RunArgs {
    /// Where the config comes from, at start and on every reload.
    fn source(&self) -> reload::Source {
        reload::Source {
            path: self.config.clone(),
            overrides: Overrides {
                listen: self.listen.clone(),
                admin: self.admin.clone(),
                tls_hosts: std::env::var("EGRESS_TLS_HOSTS").ok(),
            },
        }
    }

    fn load(&self) -> Result<config::Config, config::ConfigError> {
        let source = self.source();
        config::load(source.path.as_deref(), &source.overrides)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        None => serve(&cli.run),
        Some(Command::Run(args)) => serve(&args),
        Some(Command::Check(args)) => match args.load() {
            Ok(config) => {
                print!("{}", config::to_yaml(&config));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(2)
            }
        },
        Some(Command::Healthcheck { admin }) => match admin::probe(admin, Duration::from_secs(2)) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => {
                eprintln!("not ready");
                ExitCode::from(1)
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(1)
            }
        },
    }
}

fn serve(args: &RunArgs) -> ExitCode {
    let config = match args.load() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    init_logging();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let listeners = match Listeners::bind(&config).await {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("{e}");
                return ExitCode::FAILURE;
            }
        };
        let first_signal = async {
            shutdown::signal().await;
            // A second signal means "now": skip the drain.
            tokio::spawn(async {
                shutdown::signal().await;
                eprintln!("second signal: exiting without finishing the drain");
                std::process::exit(130);
            });
        };
        egress_sidecar::run_with_reload(config, listeners, first_signal, Some(args.source())).await;
        ExitCode::SUCCESS
    })
}

fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("EGRESS_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match std::env::var("EGRESS_LOG_FORMAT").as_deref() {
        Ok("json") => builder.json().init(),
        _ => builder.init(),
    }
}
