//! `nodeplane-agent`: the per-node daemon.

use std::path::PathBuf;

use clap::Parser;

#[derive(Parser)]
#[command(name = "nodeplane-agent", version, about = "nodeplane per-node agent (CNI datapath, CSI node plugin)")]
struct Args {
    /// Agent configuration file (JSON).
    #[arg(long)]
    config: PathBuf,
    /// Log format.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    nodeplane::util::init_logging(args.log_format == "json");
    let cfg = nodeplane::agent::config::Config::load(&args.config)?;
    let (dp, listener, _lock) = nodeplane::agent::prepare(cfg)?;
    let csi = nodeplane::agent::prepare_csi(&dp.cfg)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(128)
        .thread_keep_alive(std::time::Duration::from_secs(10))
        .enable_all()
        .build()?;
    rt.block_on(nodeplane::agent::serve(dp, listener, csi))?;
    Ok(())
}
