//! `nodeplane-controller`: cluster IPAM and node registry (local mode: a plain process).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use nodeplane::controller;
use nodeplane::rpc::controller as pb;

#[derive(Parser)]
#[command(name = "nodeplane-controller", version, about = "nodeplane cluster controller")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
    /// Log format.
    #[arg(long, global = true, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the agent API.
    Serve {
        #[arg(long)]
        config: PathBuf,
    },
    /// Load a configuration as `serve` would and print it resolved (JSON); exit 2 if invalid.
    CheckConfig {
        #[arg(long)]
        config: PathBuf,
    },
    /// Print every Kubernetes API call the controller makes (JSON), for RBAC.
    ApiCalls,
    /// Print a credential for a node (or `@admin`), signed with the controller's secret (in
    /// Kubernetes mode read from its Secret, with the kubeconfig of the environment).
    Token {
        #[arg(long)]
        config: PathBuf,
        identity: String,
    },
    /// Remove a node from the cluster and free its blocks (admin credential).
    RemoveNode {
        #[arg(long)]
        controller: String,
        #[arg(long)]
        token_file: PathBuf,
        node: String,
    },
    /// Print the registered nodes and their blocks (admin credential).
    List {
        #[arg(long)]
        controller: String,
        #[arg(long)]
        token_file: PathBuf,
    },
}

fn bearer(token_file: &PathBuf) -> anyhow::Result<tonic::metadata::MetadataValue<tonic::metadata::Ascii>> {
    let token = std::fs::read_to_string(token_file).with_context(|| format!("reading {}", token_file.display()))?;
    Ok(format!("Bearer {}", token.trim()).parse()?)
}

async fn client(
    address: &str,
) -> anyhow::Result<pb::node_registry_client::NodeRegistryClient<tonic::transport::Channel>> {
    let ch = nodeplane::rpc::connect(address).await.with_context(|| format!("connecting to {address}"))?;
    Ok(pb::node_registry_client::NodeRegistryClient::new(ch))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    nodeplane::obs::logging::init_logging(args.log_format == "json");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    match args.cmd {
        Cmd::Serve { config } => {
            let cfg = controller::config::Config::load(&config)?;
            rt.block_on(controller::serve(cfg))?;
        }
        Cmd::CheckConfig { config } => match controller::config::Config::load(&config) {
            Ok(cfg) => println!("{}", serde_json::to_string_pretty(&cfg.to_json())?),
            Err(e) => {
                eprintln!("nodeplane-controller: {}: {e}", config.display());
                std::process::exit(2);
            }
        },
        Cmd::ApiCalls => println!("{}", serde_json::to_string_pretty(controller::kube::API_CALLS)?),
        Cmd::Token { config, identity } => {
            let cfg = controller::config::Config::load(&config)?;
            if identity != controller::auth::ADMIN && !controller::records::valid_node_name(&identity) {
                anyhow::bail!("{identity:?} is neither a valid node name nor {}", controller::auth::ADMIN);
            }
            let authority = rt.block_on(controller::token_authority(&cfg, None))?;
            println!("{}", authority.mint(&identity));
        }
        Cmd::RemoveNode { controller, token_file, node } => rt.block_on(async {
            let mut c = client(&controller).await?;
            let mut req = tonic::Request::new(pb::RemoveNodeRequest { node_name: node.clone() });
            req.metadata_mut().insert("authorization", bearer(&token_file)?);
            let resp = c.remove_node(req).await?.into_inner();
            println!("removed {node}; released {}", resp.released_blocks.join(", "));
            anyhow::Ok(())
        })?,
        Cmd::List { controller, token_file } => rt.block_on(async {
            let mut c = client(&controller).await?;
            let mut req = tonic::Request::new(pb::WatchNodesRequest { node_name: String::new() });
            req.metadata_mut().insert("authorization", bearer(&token_file)?);
            let mut stream = c.watch_nodes(req).await?.into_inner();
            let list = stream.message().await?.context("controller closed the stream")?;
            println!("revision {}", list.revision);
            for n in list.nodes {
                println!("{}\tunderlay={}\tblocks={}\tvtep={}", n.name, n.underlay_addresses.join(","), n.pod_blocks.join(","), n.vtep_mac);
            }
            anyhow::Ok(())
        })?,
    }
    Ok(())
}
