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
        #[command(flatten)]
        tls: TlsArgs,
        node: String,
    },
    /// Print the registered nodes and their blocks (admin credential).
    List {
        #[arg(long)]
        controller: String,
        #[arg(long)]
        token_file: PathBuf,
        #[command(flatten)]
        tls: TlsArgs,
    },
    /// Make certificates without cert-manager: a CA, serving and node client certificates.
    Certs {
        #[command(subcommand)]
        cmd: CertsCmd,
    },
}

/// How the CLI reaches a TCP controller: TLS with `--ca-file`, else plaintext (which a TLS
/// controller refuses).
#[derive(clap::Args)]
struct TlsArgs {
    /// CA bundle the controller's certificate must chain to.
    #[arg(long)]
    ca_file: Option<PathBuf>,
    /// The name to verify the certificate against (default: the address's host).
    #[arg(long)]
    server_name: Option<String>,
}

#[derive(Subcommand)]
enum CertsCmd {
    /// The CA in DIR (`ca.crt`, `ca.key`; made if missing) and a serving certificate for
    /// the SANs (`tls.crt`, `tls.key`), the layout of a `kubernetes.io/tls` Secret.
    Init {
        #[arg(long)]
        dir: PathBuf,
        /// A DNS name or IP address the controller is reached by. Repeatable.
        #[arg(long, required = true)]
        san: Vec<String>,
        #[arg(long, default_value_t = 365)]
        days: i64,
    },
    /// A certificate signed by the CA in CA_DIR, written to OUT/tls.crt and OUT/tls.key:
    /// serving (`--san`) or a node's client certificate (`--node`, CN=system:node:<node>).
    Issue {
        #[arg(long)]
        ca_dir: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long)]
        san: Vec<String>,
        #[arg(long, conflicts_with = "san")]
        node: Option<String>,
        /// Validity in days; negative: already expired (for testing what refuses it).
        #[arg(long, default_value_t = 365, allow_negative_numbers = true)]
        days: i64,
    },
}

/// `tls.crt` and `tls.key` in `dir`.
fn write_pair(dir: &std::path::Path, (cert, key): (String, String)) -> anyhow::Result<()> {
    use controller::certs::{TLS_CERT, TLS_KEY};
    Ok(controller::certs::write_pair(&dir.join(TLS_CERT), &dir.join(TLS_KEY), &cert, &key)?)
}

fn bearer(token_file: &PathBuf) -> anyhow::Result<tonic::metadata::MetadataValue<tonic::metadata::Ascii>> {
    let token = std::fs::read_to_string(token_file).with_context(|| format!("reading {}", token_file.display()))?;
    Ok(format!("Bearer {}", token.trim()).parse()?)
}

async fn client(
    address: &str,
    tls: &TlsArgs,
) -> anyhow::Result<pb::node_registry_client::NodeRegistryClient<tonic::transport::Channel>> {
    let files = tls.ca_file.clone().map(|ca_file| nodeplane::rpc::tls::ClientFiles {
        ca_file,
        server_name: tls.server_name.clone(),
        ..Default::default()
    });
    let ch = nodeplane::rpc::connect_with(address, files.as_ref())
        .await
        .map_err(|e| anyhow::anyhow!("connecting to {address}: {e}"))?;
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
        Cmd::RemoveNode { controller, token_file, tls, node } => rt.block_on(async {
            let mut c = client(&controller, &tls).await?;
            let mut req = tonic::Request::new(pb::RemoveNodeRequest { node_name: node.clone() });
            req.metadata_mut().insert("authorization", bearer(&token_file)?);
            let resp = c.remove_node(req).await?.into_inner();
            println!("removed {node}; released {}", resp.released_blocks.join(", "));
            anyhow::Ok(())
        })?,
        Cmd::List { controller, token_file, tls } => rt.block_on(async {
            let mut c = client(&controller, &tls).await?;
            let mut req = tonic::Request::new(pb::WatchNodesRequest { node_name: String::new(), ..Default::default() });
            req.metadata_mut().insert("authorization", bearer(&token_file)?);
            let mut stream = c.watch_nodes(req).await?.into_inner();
            let list = stream.message().await?.context("controller closed the stream")?;
            println!("revision {}", list.revision);
            for n in list.nodes {
                println!(
                    "{}\tunderlay={}\tblocks={}\tvtep={}",
                    n.name,
                    n.underlay_addresses.join(","),
                    n.pod_blocks.join(","),
                    n.vtep_mac
                );
            }
            anyhow::Ok(())
        })?,
        Cmd::Certs { cmd: CertsCmd::Init { dir, san, days } } => {
            let ca = controller::certs::ca_in(&dir, 3650)?;
            write_pair(&dir, ca.issue_server(&san, days)?)?;
            println!("{}", dir.display());
        }
        Cmd::Certs { cmd: CertsCmd::Issue { ca_dir, out, san, node, days } } => {
            let ca = controller::certs::ca_of_dir(&ca_dir)?.with_context(|| {
                format!("{} holds no CA (ca.crt and ca.key): make one with `certs init`", ca_dir.display())
            })?;
            let pair = match node {
                Some(n) => {
                    if !controller::records::valid_node_name(&n) {
                        anyhow::bail!("{n:?} is not a valid node name");
                    }
                    ca.issue_client(&format!("{}{n}", nodeplane::rpc::tls::NODE_CN_PREFIX), days)
                }
                None => ca.issue_server(&san, days),
            };
            write_pair(&out, pair?)?;
            println!("{}", out.display());
        }
    }
    Ok(())
}
