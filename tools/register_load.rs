//! Registration load generator for `scripts/bench-cluster`: fires N real gRPC `Register`
//! calls, for N distinct node names, at a running `nodeplane-controller`, and prints one JSON
//! object with the throughput and latency.
//!
//!     cargo build --release --examples
//!     target/release/examples/benches register_load --controller unix:/tmp/x/controller.sock \
//!         --config /tmp/x/controller.json -n 200 --concurrency 16
//!
//! Credentials are minted like `nodeplane-controller token NODE` does: with the controller's
//! signing secret, read from the `secretFile` of its configuration (the controller must have
//! started once, which creates it). Each registration opens its own connection, like an agent
//! starting up.
//! Every answer is checked: one block per configured family, and no block handed to two nodes.
//! Exit status 1 when any call failed or a check did not hold.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use nodeplane::controller::{auth::Authority, config::Config};
use nodeplane::rpc::controller as pb;
use nodeplane::util::Family;
use pb::node_registry_client::NodeRegistryClient;
use tokio::sync::Mutex;

use crate::{bearer, pctl, r3};

#[derive(Parser)]
#[command(about = "Fire N Register calls at a nodeplane-controller")]
struct Args {
    /// Controller address (`unix:/path` or `host:port`).
    #[arg(long)]
    controller: String,
    /// The controller's configuration file (for the token-signing secret and the pools).
    #[arg(long)]
    config: PathBuf,
    /// Number of registrations (distinct node names).
    #[arg(short = 'n', long, default_value_t = 200)]
    n: usize,
    /// Registrations in flight at once.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Node name prefix (names are `<prefix>-<i>`).
    #[arg(long, default_value = "loadnode")]
    prefix: String,
    /// TLS to a TCP controller: the CA bundle its certificate chains to (each new connection
    /// then includes a TLS handshake, as a starting agent's does).
    #[arg(long)]
    ca_file: Option<PathBuf>,
}

/// The TLS settings of every connection (`--ca-file`).
static TLS: std::sync::OnceLock<Option<nodeplane::rpc::tls::ClientFiles>> = std::sync::OnceLock::new();

async fn connect(address: &str) -> Result<tonic::transport::Channel, String> {
    let tls = TLS.get().and_then(|t| t.as_ref());
    nodeplane::rpc::connect_with(address, tls).await.map_err(|e| format!("connect: {e}"))
}

struct Outcome {
    latencies: Vec<Duration>,
    errors: Vec<String>,
    blocks: HashMap<String, String>, // block -> node
    problems: Vec<String>,
}

async fn register_one(
    address: &str,
    name: &str,
    token: &str,
    underlay: String,
) -> Result<pb::RegisterResponse, String> {
    let mut client = NodeRegistryClient::new(connect(address).await?);
    let req = pb::RegisterRequest {
        node_name: name.to_string(),
        underlay_addresses: vec![underlay],
        vtep_mac: String::new(),
        wireguard_key: String::new(),
    };
    client
        .register(bearer(req, token))
        .await
        .map(|r| r.into_inner())
        .map_err(|s| format!("{}: {}", s.code(), s.message()))
}

pub fn main() {
    let args = Args::parse();
    let _ =
        TLS.set(args.ca_file.clone().map(|ca_file| nodeplane::rpc::tls::ClientFiles { ca_file, ..Default::default() }));
    if args.n == 0 || args.concurrency == 0 {
        eprintln!("register_load: -n and --concurrency must be positive");
        std::process::exit(2);
    }
    let cfg = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("register_load: {e}");
            std::process::exit(2);
        }
    };
    // Read, never create: the secret belongs to the running controller.
    let secret = match std::fs::read(&cfg.secret_file) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("register_load: reading {}: {e} (has the controller started?)", cfg.secret_file.display());
            std::process::exit(2);
        }
    };
    let families: Vec<Family> = {
        let mut f: Vec<Family> = cfg.pools.iter().map(|p| Family::of(&p.net)).collect();
        f.sort();
        f.dedup();
        f
    };
    let authority = Authority::new(secret);
    // Everything that is not the call itself happens before the clock starts.
    let work: Vec<(String, String, String)> = (0..args.n)
        .map(|i| {
            let name = format!("{}-{i:05}", args.prefix);
            let token = authority.mint(&name);
            // 198.18.0.0/15 (RFC 2544): addresses only ever stored, never used.
            let underlay = format!("198.18.{}.{}", i / 250, 1 + i % 250);
            (name, token, underlay)
        })
        .collect();

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let result = rt.block_on(async move {
        let queue = Arc::new(Mutex::new(work.into_iter()));
        let out = Arc::new(Mutex::new(Outcome {
            latencies: Vec::new(),
            errors: Vec::new(),
            blocks: HashMap::new(),
            problems: Vec::new(),
        }));
        let address = Arc::new(args.controller.clone());
        let families = Arc::new(families);
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..args.concurrency.min(args.n) {
            let (queue, out, address, families) = (queue.clone(), out.clone(), address.clone(), families.clone());
            tasks.push(tokio::spawn(async move {
                loop {
                    let Some((name, token, underlay)) = queue.lock().await.next() else { break };
                    let t = Instant::now();
                    let r = register_one(&address, &name, &token, underlay).await;
                    let took = t.elapsed();
                    let mut o = out.lock().await;
                    match r {
                        Ok(resp) => {
                            o.latencies.push(took);
                            let blocks = resp.node.map(|n| n.pod_blocks).unwrap_or_default();
                            let mut fams: Vec<Family> =
                                blocks.iter().map(|b| if b.contains(':') { Family::V6 } else { Family::V4 }).collect();
                            fams.sort();
                            if fams != *families {
                                o.problems.push(format!("{name}: blocks {blocks:?} are not one per family"));
                            }
                            for b in blocks {
                                if let Some(prev) = o.blocks.insert(b.clone(), name.clone()) {
                                    o.problems.push(format!("block {b} handed to {prev} and {name}"));
                                }
                            }
                        }
                        Err(e) => o.errors.push(format!("{name}: {e}")),
                    }
                }
            }));
        }
        for t in tasks {
            t.await.map_err(|e| format!("task: {e}"))?;
        }
        let secs = t0.elapsed().as_secs_f64();
        let o = Arc::try_unwrap(out).map_err(|_| "outcome still shared".to_string())?.into_inner();
        Ok::<_, String>((secs, o))
    });
    let (secs, o) = match result {
        Ok(x) => x,
        Err(e) => {
            eprintln!("register_load: {e}");
            std::process::exit(1);
        }
    };
    let mut latencies: Vec<f64> = o.latencies.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    latencies.sort_by(f64::total_cmp);
    let ok = latencies.len();
    let summary = serde_json::json!({
        "n": args.n,
        "ok": ok,
        "errors": o.errors.len(),
        "concurrency": args.concurrency,
        "connection": "per-registration",
        "seconds": r3(secs),
        "per_second": r3(ok as f64 / secs),
        "p50_ms": r3(pctl(&latencies, 0.50)),
        "p90_ms": r3(pctl(&latencies, 0.90)),
        "p99_ms": r3(pctl(&latencies, 0.99)),
        "max_ms": r3(pctl(&latencies, 1.0)),
        "distinct_blocks": o.blocks.len(),
        "problems": o.problems.iter().take(10).collect::<Vec<_>>(),
        "first_errors": o.errors.iter().take(10).collect::<Vec<_>>(),
    });
    println!("{summary}");
    if !o.errors.is_empty() || !o.problems.is_empty() {
        std::process::exit(1);
    }
}
