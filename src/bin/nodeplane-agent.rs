//! `nodeplane-agent`: the per-node daemon, and its two operator commands.
//!
//! `nodeplane-agent --config FILE` (or `nodeplane-agent serve --config FILE`) runs the agent;
//! `check-config` prints the resolved configuration; `uninstall` removes the shim and the
//! conflist from the node after the agent is gone.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use nodeplane::agent::config::Config;
use nodeplane::agent::install::{self, Removal, UninstallError};

#[derive(Parser)]
#[command(
    name = "nodeplane-agent",
    version,
    about = "nodeplane per-node agent (CNI datapath, CSI node plugin, device plugins)",
    long_about = "nodeplane per-node agent (CNI datapath, CSI node plugin, device plugins).\n\n\
                  Without a subcommand it serves: `nodeplane-agent --config FILE` is `nodeplane-agent serve --config FILE`.",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    /// Agent configuration file (JSON); required when serving.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Log format.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Args)]
struct ServeArgs {
    /// Agent configuration file (JSON).
    #[arg(long)]
    config: PathBuf,
    /// Log format.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the agent (the default when no subcommand is given).
    Serve(ServeArgs),
    /// Load the configuration exactly as `serve` does (file, then the environment fallbacks
    /// NODE_NAME, NODE_IPS, NODEPLANE_CONTROLLER_ADDRESS) and print it resolved, as JSON with
    /// absolute paths. Exit 2 with the error on a bad configuration.
    CheckConfig {
        /// Agent configuration file (JSON).
        #[arg(long)]
        config: PathBuf,
    },
    /// Remove nodeplane from this node's container runtime: the conflist first (so the
    /// runtime stops choosing nodeplane), then the shim.
    #[command(long_about = "Remove nodeplane from this node's container runtime: the conflist \
        (<cniConfDir>/10-nodeplane.conflist) first, so the runtime stops choosing nodeplane for new pods, then the \
        shim (<cniBinDir>/nodeplane).\n\n\
        The agent never removes these itself (not on SIGTERM, not on upgrade), so that a node does not turn NotReady \
        during a restart or a rollout. Run this after the agent is gone: it refuses while an agent holds the state \
        dir's lock. Recommended order: drain the node's pods, delete the DaemonSet, then run this (as a Job or on the \
        node).\n\n\
        Only nodeplane's files are removed: a conflist named \"nodeplane\" whose first plugin has type \"nodeplane\", \
        and a shim identical to shimSource or built by nodeplane. Anything else at those paths is refused (nothing \
        is removed) unless --force. Already gone is success.\n\n\
        Pods, leases, the bridge, routes, volumes and device assignments are not touched: running pods keep their \
        network until they are deleted. With the shim gone the runtime can no longer call nodeplane's DEL for them; \
        their interfaces go away with their network namespaces, and an agent started again on this state dir frees \
        the leases of namespaces that are gone.\n\n\
        Exit status: 0 removed or already gone; 3 refused (an agent is running, or a file is not nodeplane's); \
        2 bad configuration; 1 any other error.")]
    Uninstall {
        /// Agent configuration file (JSON), the one the agent ran with.
        #[arg(long)]
        config: PathBuf,
        /// Also remove files at nodeplane's paths that are not nodeplane's (never while an
        /// agent is running).
        #[arg(long)]
        force: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        None => {
            let Some(config) = cli.config else {
                use clap::CommandFactory;
                Cli::command()
                    .error(clap::error::ErrorKind::MissingRequiredArgument, "--config <CONFIG> is required to serve")
                    .exit()
            };
            serve(ServeArgs { config, log_format: cli.log_format })
        }
        Some(Cmd::Serve(a)) => serve(a),
        Some(Cmd::CheckConfig { config }) => check_config(&config),
        Some(Cmd::Uninstall { config, force }) => uninstall(&config, force),
    }
}

fn serve(args: ServeArgs) -> ExitCode {
    nodeplane::obs::logging::init_logging(args.log_format == "json");
    match run_agent(&args.config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // As `main` returning the error would print it.
            eprintln!("Error: {e:?}");
            ExitCode::FAILURE
        }
    }
}

fn run_agent(config: &std::path::Path) -> anyhow::Result<()> {
    let cfg = Config::load(config)?;
    // Before any work and before the first thread: every thread inherits the reduced sets.
    nodeplane::sys::caps::drop_and_log()?;
    let (cfg, dp, listener, _lock) = nodeplane::agent::prepare(cfg)?;
    let csi = nodeplane::agent::prepare_csi(&cfg)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(128)
        .thread_keep_alive(std::time::Duration::from_secs(10))
        .enable_all()
        .build()?;
    rt.block_on(nodeplane::agent::serve(cfg, dp, listener, csi))?;
    Ok(())
}

/// A configuration that cannot be used: exit 2.
fn bad_config(path: &std::path::Path, e: impl std::fmt::Display) -> ExitCode {
    eprintln!("nodeplane-agent: configuration {}: {e}", path.display());
    ExitCode::from(2)
}

fn check_config(path: &std::path::Path) -> ExitCode {
    match Config::load(path) {
        Ok(cfg) => {
            println!("{}", serde_json::to_string_pretty(&cfg.to_json()).expect("JSON values serialise"));
            ExitCode::SUCCESS
        }
        Err(e) => bad_config(path, e),
    }
}

fn uninstall(path: &std::path::Path, force: bool) -> ExitCode {
    // Only the paths matter here: the per-node values a DaemonSet passes in the environment
    // (node name, addresses, controller) get stand-ins when absent, so an operator can run
    // this on the node with just the configuration file.
    let env = |k: &str| {
        std::env::var(k).ok().filter(|v| !v.is_empty()).or_else(|| match k {
            nodeplane::agent::config::ENV_NODE_NAME => Some("uninstall".into()),
            nodeplane::agent::config::ENV_NODE_IPS => Some("127.0.0.1".into()),
            nodeplane::agent::config::ENV_CONTROLLER_ADDRESS => Some("127.0.0.1:1".into()),
            _ => None,
        })
    };
    let cfg = match Config::load_with_env(path, &env) {
        Ok(c) => c,
        Err(e) => return bad_config(path, e),
    };
    match install::uninstall(&cfg, force) {
        Ok(r) => {
            if r.was_already_uninstalled() {
                println!(
                    "nodeplane is already uninstalled from this node: {} and {} are not there",
                    r.conflist_path.display(),
                    r.shim_path.display()
                );
            } else {
                println!("conflist {}: {}", r.conflist_path.display(), r.conflist);
                println!("shim {}: {}", r.shim_path.display(), r.shim);
                for t in &r.temp_files_removed {
                    println!("left-over temp file {}: removed", t.display());
                }
                if matches!(r.conflist, Removal::ForceRemoved(_)) || matches!(r.shim, Removal::ForceRemoved(_)) {
                    eprintln!("nodeplane-agent: warning: --force removed a file that was not nodeplane's");
                }
                println!(
                    "nodeplane is uninstalled from this node's runtime; running pods keep their network until they are \
                     deleted (the runtime can no longer call nodeplane's DEL for them)"
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("nodeplane-agent uninstall: {e}");
            match e {
                UninstallError::AgentRunning { .. }
                | UninstallError::Foreign { .. }
                | UninstallError::PodsAttached { .. } => ExitCode::from(3),
                UninstallError::Io { .. } => ExitCode::FAILURE,
            }
        }
    }
}
