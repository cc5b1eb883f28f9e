//! The `egress-sidecar` binary: command line, logging, runtime, then [`egress_sidecar::run`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use egress_sidecar::config::{self, Overrides};
use egress_sidecar::inject::{self, server::TlsFiles};
use egress_sidecar::{admin, reload, resident, shutdown, Listeners};

/// How long after the listeners are bound the start-up pages are released.
const RELEASE_AFTER: Duration = Duration::from_millis(50);

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
    /// Serve the Kubernetes mutating admission webhook that injects the sidecar (HTTPS).
    Inject(InjectArgs),
}

/// The injector's flags. Pod annotations (`egress-sidecar.io/...`) override the sidecar ones.
#[derive(Debug, Clone, Args)]
struct InjectArgs {
    /// HTTPS listen address.
    #[arg(long, env = "EGRESS_INJECT_LISTEN", default_value = "0.0.0.0:8443")]
    listen: SocketAddr,
    /// PEM certificate chain (e.g. cert-manager's tls.crt); re-read when it changes.
    #[arg(long, env = "EGRESS_INJECT_TLS_CERT")]
    tls_cert: PathBuf,
    /// PEM private key (e.g. cert-manager's tls.key).
    #[arg(long, env = "EGRESS_INJECT_TLS_KEY")]
    tls_key: PathBuf,
    /// Sidecar image.
    #[arg(long, env = "EGRESS_INJECT_IMAGE", default_value = concat!("egress-sidecar:", env!("CARGO_PKG_VERSION")))]
    image: String,
    /// `native` (initContainers, restartPolicy: Always; Kubernetes 1.29+) or `classic`.
    #[arg(long, env = "EGRESS_INJECT_MODE", default_value = "native", value_parser = parse_mode)]
    mode: inject::Mode,
    /// ConfigMap whose `config.yaml` key is the sidecar's config (default: built-in defaults).
    #[arg(long, env = "EGRESS_INJECT_CONFIG_MAP")]
    config_map: Option<String>,
    /// Sidecar CPU request.
    #[arg(long, env = "EGRESS_INJECT_CPU_REQUEST", default_value = "50m")]
    cpu_request: String,
    /// Sidecar memory request.
    #[arg(long, env = "EGRESS_INJECT_MEMORY_REQUEST", default_value = "32Mi")]
    memory_request: String,
    /// Sidecar memory limit.
    #[arg(long, env = "EGRESS_INJECT_MEMORY_LIMIT", default_value = "128Mi")]
    memory_limit: String,
    /// EGRESS_TLS_HOSTS for the sidecar.
    #[arg(long, env = "EGRESS_INJECT_TLS_HOSTS")]
    tls_hosts: Option<String>,
    /// NO_PROXY for application containers.
    #[arg(long, env = "EGRESS_INJECT_NO_PROXY", default_value = inject::DEFAULT_NO_PROXY)]
    no_proxy: String,
    /// After SIGTERM keep serving this long (the apiserver may still call a terminating pod).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    shutdown_linger: Duration,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    egress_sidecar::duration::human(text).map_err(|e| format!("{text:?} {e}"))
}

fn parse_mode(text: &str) -> Result<inject::Mode, String> {
    inject::Mode::parse(text).ok_or_else(|| format!("{text:?} is not native or classic"))
}

impl InjectArgs {
    fn settings(&self) -> inject::Settings {
        inject::Settings {
            image: self.image.clone(),
            mode: self.mode,
            config_map: self.config_map.clone(),
            cpu_request: self.cpu_request.clone(),
            memory_request: self.memory_request.clone(),
            memory_limit: self.memory_limit.clone(),
            tls_hosts: self.tls_hosts.clone(),
            no_proxy: self.no_proxy.clone(),
        }
    }
}

#[derive(Debug, Clone, Args)]
struct RunArgs {
    /// YAML config file.
    #[arg(long, env = "EGRESS_CONFIG")]
    config: Option<PathBuf>,
    /// Forward-proxy listen address (overrides the file).
    #[arg(long, env = "EGRESS_LISTEN")]
    listen: Option<String>,
    /// Forward-proxy Unix socket path (overrides the file's `listen_unix`; empty: none).
    #[arg(long, env = "EGRESS_LISTEN_UNIX")]
    listen_unix: Option<String>,
    /// Admin listen address (overrides the file).
    #[arg(long, env = "EGRESS_ADMIN")]
    admin: Option<String>,
}

impl RunArgs {
    /// Where the config comes from, at start and on every reload.
    fn source(&self) -> reload::ConfigSource {
        reload::ConfigSource {
            path: self.config.clone(),
            overrides: Overrides {
                listen: self.listen.clone(),
                listen_unix: self.listen_unix.clone(),
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
    // Before anything can load a library: only what is mapped now is released later.
    let startup = resident::StartupMappings::snapshot().unwrap_or_default();
    resident::fix_mmap_threshold();
    let cli = Cli::parse();
    match cli.command {
        None => serve(&cli.run, startup),
        Some(Command::Run(args)) => serve(&args, startup),
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
        Some(Command::Inject(args)) => serve_injector(&args),
    }
}

fn serve(args: &RunArgs, startup: resident::StartupMappings) -> ExitCode {
    let config = match args.load() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    on_runtime(async {
        // Signal handlers before the listeners: once applications can connect, a SIGTERM or
        // SIGHUP must not meet the default action (exit).
        let mut signals = shutdown::Signals::new();
        let watcher = reload::Watcher::new(args.source());
        let listeners = match Listeners::bind(&config).await {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("{e}");
                return ExitCode::FAILURE;
            }
        };
        let first_signal = async move {
            signals.recv().await;
            // A second signal means "now": skip the drain.
            tokio::spawn(async move {
                signals.recv().await;
                eprintln!("second signal: exiting without finishing the drain");
                std::process::exit(130);
            });
        };
        tokio::spawn(release_startup_pages(startup));
        tokio::spawn(resident::trim_heap_periodically(
            egress_sidecar::spare::release_surplus,
        ));
        egress_sidecar::run_with_reload(config, listeners, first_signal, Some(watcher)).await;
        ExitCode::SUCCESS
    })
}

/// Once the listeners serve, the code that parsed the command line and the config, built the
/// TLS roots and started the runtime will not run again: its pages go (see `resident`).
async fn release_startup_pages(startup: resident::StartupMappings) {
    // Set-up in `run_with_reload` (routers, pools, accept tasks) runs before this first poll
    // on the single-thread runtime; the delay covers the multi-threaded one.
    tokio::time::sleep(RELEASE_AFTER).await;
    match startup.release() {
        Ok(released) => tracing::debug!(
            mappings = released.mappings,
            kib = released.bytes / 1024,
            failed = released.failed,
            "released start-up pages"
        ),
        Err(e) => tracing::debug!(error = %e, "start-up pages not released"),
    }
}

fn serve_injector(args: &InjectArgs) -> ExitCode {
    let settings = args.settings();
    if let Err(e) = settings.validate() {
        eprintln!("{e}");
        return ExitCode::from(2);
    }
    on_runtime(async {
        let shutdown_signal = shutdown::signal();
        let files = TlsFiles {
            cert: args.tls_cert.clone(),
            key: args.tls_key.clone(),
        };
        let tls = match inject::server::watch_tls(files, Duration::from_secs(30)) {
            Ok(tls) => tls,
            Err(e) => {
                tracing::error!("{e}");
                return ExitCode::from(2);
            }
        };
        let listener = match inject::server::bind(args.listen).await {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("{e}");
                return ExitCode::FAILURE;
            }
        };
        let listen = listener.local_addr().map_or(args.listen, |a| a);
        tracing::info!(listen = %listen, image = %settings.image, mode = ?settings.mode, "injection webhook listening");
        let settings = std::sync::Arc::new(settings);
        inject::server::serve(listener, tls, settings, shutdown_signal, args.shutdown_linger).await;
        ExitCode::SUCCESS
    })
}

/// Logging, then `main` on the runtime; a runtime that cannot start is reported and exits 1.
fn on_runtime(main: impl std::future::Future<Output = ExitCode>) -> ExitCode {
    init_logging();
    let mut builder = if worker_threads() == 1 {
        // One core (a CPU limit of 1, or TOKIO_WORKER_THREADS=1): everything on the main thread,
        // as nginx's single worker does. The multi-threaded scheduler would add a thread, its
        // work-stealing queues, and a cross-thread wake for everything the main thread does.
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    // Each worker frees the buffers it keeps when the heap trim asks, as it goes idle: no
    // other thread can reach them (`spare`).
    builder.on_thread_park(egress_sidecar::spare::release_if_asked);
    match builder.enable_all().build() {
        Ok(runtime) => runtime.block_on(main),
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The worker threads tokio would start: `TOKIO_WORKER_THREADS`, else the cores this process
/// may use (`available_parallelism` reads the cgroup CPU quota too).
fn worker_threads() -> usize {
    std::env::var("TOKIO_WORKER_THREADS")
        .ok()
        .and_then(|n| n.trim().parse::<usize>().ok())
        .filter(|n| *n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Colour codes only for a person at a terminal (<https://no-color.org>): `kubectl logs`, Cloud
/// Logging and docker compose read a pipe, where the codes are noise around every field.
fn wants_colour() -> bool {
    use std::io::IsTerminal as _;
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    std::io::stderr().is_terminal() && !no_color
}

fn init_logging() {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    // `Targets` rather than `EnvFilter`: the same `level,target=level` syntax, without span and
    // field filters and without the regex engine they need (0.6 MB less code in the binary).
    let default = || Targets::new().with_default(LevelFilter::INFO);
    let filter = match std::env::var("EGRESS_LOG") {
        Ok(spec) => spec.parse::<Targets>().unwrap_or_else(|e| {
            eprintln!("EGRESS_LOG={spec:?} ignored ({e}); logging at info");
            default()
        }),
        Err(_) => default(),
    };
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let builder = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(wants_colour())
        .with_writer(std::io::stderr);
    match std::env::var("EGRESS_LOG_FORMAT").as_deref() {
        Ok("json") => builder.json().finish().with(filter).init(),
        _ => builder.finish().with(filter).init(),
    }
}
