//! Scale load for `scripts/bench-scale`: N simulated agents in one process, each a real gRPC
//! client of a running `nodeplane-controller` (its own token, `Register`, then a
//! `WatchNodes` stream with deltas, applied like an agent applies them: a delta that does
//! not follow the view asks for a snapshot again). Then joins and leaves, one at a time, and
//! what follows is measured: registration rate, how long until every simulated agent has
//! seen a change, the bytes each agent received per change, the controller's RSS and CPU.
//! With `--volumes K`, every agent also follows its node's `WatchVolumes` stream (deltas)
//! and answers like a node whose store makes and removes what it is asked for
//! (`ReportVolumes`); then K volumes are created and deleted through the controller's CSI
//! socket, one at a time: the call latency and how many volume-stream messages (and bytes)
//! all agents together received per change, which must not grow with N.
//!
//!     target/release/examples/benches scale_load --controller unix:/tmp/x/controller.sock \
//!         --config /tmp/x/controller.json --nodes 5000 --joins 100 --leaves 100
//!
//! Each agent keeps its view as a bitmap over the names this tool knows (N + joins), so the
//! tool itself stays small at 5,000 × 5,000; at the end every agent's view is compared with
//! the controller's membership (`views_equal`). Prints one JSON object. Exit status 1 when a
//! call failed, a change was not seen by every agent in time, or a view differs.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use nodeplane::controller::{auth::Authority, config::Config};
use nodeplane::rpc::controller as pb;
use pb::node_registry_client::NodeRegistryClient;
use prost::Message;
use serde_json::json;

use crate::{bearer, pctl, process_cpu_ms, r3};

#[derive(Parser)]
#[command(about = "N simulated agents against a nodeplane-controller")]
struct Args {
    /// Controller address (`unix:/path` or `host:port`).
    #[arg(long)]
    controller: String,
    /// The controller's configuration file (token-signing secret).
    #[arg(long)]
    config: PathBuf,
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    #[arg(long, default_value_t = 20)]
    joins: usize,
    #[arg(long, default_value_t = 20)]
    leaves: usize,
    /// The controller's PID, for its RSS and CPU.
    #[arg(long)]
    controller_pid: Option<u32>,
    #[arg(long, default_value = "sim")]
    prefix: String,
    /// Register the N nodes and stop (peers for a real agent).
    #[arg(long)]
    register_only: bool,
    /// TLS to a TCP controller: the CA bundle its certificate chains to.
    #[arg(long)]
    ca_file: Option<PathBuf>,
    /// Where the nodes' underlay addresses and VTEP MACs start (another run's nodes must
    /// not share them).
    #[arg(long, default_value_t = 0)]
    index_offset: usize,
    /// Volumes created and deleted through the controller's CSI socket (0: no volume phase).
    #[arg(long, default_value_t = 0)]
    volumes: usize,
}

/// Registrations in flight at once.
const CONCURRENCY: usize = 32;
/// Streams opened at once while the agents connect (each waits for its snapshot).
const CONNECT_WAVE: usize = 64;
/// How long one change may take to reach every agent before the run fails (seconds).
const CHANGE_TIMEOUT: u64 = 30;

static OFFSET: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The change being watched for: node `index` present (join) or absent (leave).
#[derive(Clone, Copy)]
struct Event {
    id: u64,
    index: usize,
    join: bool,
    t0: Instant,
}

struct Shared {
    names: HashMap<String, usize>,
    words: usize,
    event: Mutex<Option<Event>>,
    /// Agents that have seen the current event, and when (since its t0).
    seen: Mutex<Vec<Duration>>,
    seen_all: tokio::sync::Notify,
    agents: usize,
    bytes: AtomicU64,
    messages: AtomicU64,
    snapshots: AtomicU64,
    gaps: AtomicU64,
    watching: AtomicUsize,
    views: Mutex<Vec<Vec<u64>>>,
    vol_bytes: AtomicU64,
    vol_messages: AtomicU64,
    vol_complete: AtomicU64,
}

impl Shared {
    fn observe(&self, bits: &[u64], last: &mut u64) {
        let Some(ev) = *self.event.lock().unwrap() else { return };
        if ev.id == *last {
            return;
        }
        let has = bits[ev.index / 64] & (1 << (ev.index % 64)) != 0;
        if has == ev.join {
            *last = ev.id;
            let took = ev.t0.elapsed();
            let mut seen = self.seen.lock().unwrap();
            seen.push(took);
            if seen.len() == self.agents {
                self.seen_all.notify_one();
            }
        }
    }
}

fn underlay(i: usize) -> String {
    // 198.18.0.0/16 (RFC 2544): stored, never used.
    format!("198.18.{}.{}", i / 250, 1 + i % 250)
}

async fn register(ch: &tonic::transport::Channel, name: &str, token: &str, i: usize) -> Result<(), String> {
    let i = i + OFFSET.load(Ordering::Relaxed);
    // A VTEP MAC of its own, so the node is reachable over VXLAN (locally administered).
    let mac =
        format!("02:5e:{:02x}:{:02x}:{:02x}:{:02x}", (i >> 24) & 0xff, (i >> 16) & 0xff, (i >> 8) & 0xff, i & 0xff);
    let req = pb::RegisterRequest {
        node_name: name.into(),
        underlay_addresses: vec![underlay(i)],
        vtep_mac: mac,
        wireguard_key: String::new(),
    };
    NodeRegistryClient::new(ch.clone())
        .register(bearer(req, token))
        .await
        .map(|_| ())
        .map_err(|s| format!("register {name}: {s}"))
}

/// One simulated agent: follow the stream forever, applying it to a bitmap view.
async fn agent(
    slot: usize,
    ch: tonic::transport::Channel,
    name: String,
    token: String,
    sh: Arc<Shared>,
    ready: tokio::sync::oneshot::Sender<()>,
) {
    let mut ready = Some(ready);
    let (mut epoch, mut revision) = (0u64, 0u64);
    let mut bits = vec![0u64; sh.words];
    let mut last = 0u64;
    loop {
        let mut in_snapshot = false;
        let req = pb::WatchNodesRequest { node_name: name.clone(), deltas: true, since_revision: revision, epoch };
        let mut stream = match NodeRegistryClient::new(ch.clone()).watch_nodes(bearer(req, &token)).await {
            Ok(s) => s.into_inner(),
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        while let Ok(Some(m)) = stream.message().await {
            sh.bytes.fetch_add(m.encoded_len() as u64, Ordering::Relaxed);
            sh.messages.fetch_add(1, Ordering::Relaxed);
            if m.snapshot {
                // In parts: the view is replaced from the first part on, complete at the last.
                if !in_snapshot {
                    sh.snapshots.fetch_add(1, Ordering::Relaxed);
                    bits.iter_mut().for_each(|w| *w = 0);
                }
                for n in &m.nodes {
                    if let Some(&i) = sh.names.get(&n.name) {
                        bits[i / 64] |= 1 << (i % 64);
                    }
                }
                in_snapshot = m.more;
                if in_snapshot {
                    continue;
                }
                (epoch, revision) = (m.epoch, m.revision);
            } else if m.epoch != epoch || m.base_revision != revision {
                sh.gaps.fetch_add(1, Ordering::Relaxed);
                (epoch, revision) = (0, 0);
                break;
            } else {
                for n in &m.removed {
                    if let Some(&i) = sh.names.get(n) {
                        bits[i / 64] &= !(1 << (i % 64));
                    }
                }
                for n in &m.nodes {
                    if let Some(&i) = sh.names.get(&n.name) {
                        bits[i / 64] |= 1 << (i % 64);
                    }
                }
                revision = m.revision;
            }
            sh.views.lock().unwrap()[slot].clone_from(&bits);
            if let Some(r) = ready.take() {
                sh.watching.fetch_add(1, Ordering::SeqCst);
                let _ = r.send(());
            }
            sh.observe(&bits, &mut last);
        }
    }
}

/// One simulated node's volume side: follow its desired set (deltas, kept across
/// reconnects like the agent keeps it) and report a store that holds exactly the present
/// volumes, after every message.
async fn volume_agent(
    ch: tonic::transport::Channel,
    name: String,
    token: String,
    sh: Arc<Shared>,
    ready: tokio::sync::oneshot::Sender<()>,
) {
    const CAPACITY: u64 = 1 << 40;
    let mut ready = Some(ready);
    let mut view = nodeplane::agent::volume_sync::DesiredView::default();
    let mut client = NodeRegistryClient::new(ch);
    loop {
        let (since_revision, epoch) = view.resume();
        let req = pb::WatchVolumesRequest { node_name: name.clone(), deltas: true, since_revision, epoch };
        let mut stream = match client.watch_volumes(bearer(req, &token)).await {
            Ok(s) => s.into_inner(),
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        while let Ok(Some(m)) = stream.message().await {
            sh.vol_bytes.fetch_add(m.encoded_len() as u64, Ordering::Relaxed);
            sh.vol_messages.fetch_add(1, Ordering::Relaxed);
            sh.vol_complete.fetch_add(u64::from(m.complete), Ordering::Relaxed);
            if view.apply(m).is_err() {
                sh.gaps.fetch_add(1, Ordering::Relaxed);
                break;
            }
            let set = view.set();
            let volumes: Vec<pb::VolumeState> = set
                .volumes
                .iter()
                .filter(|d| d.present)
                .map(|d| pb::VolumeState {
                    id: d.id.clone(),
                    size_bytes: d.size_bytes,
                    fs_type: d.fs_type.clone(),
                    backing_file_present: true,
                    name: d.name.clone(),
                    ..Default::default()
                })
                .collect();
            let used: u64 = volumes.iter().map(|v| v.size_bytes).sum();
            let report = pb::ReportVolumesRequest {
                node_name: name.clone(),
                capacity_bytes: CAPACITY,
                available_bytes: CAPACITY.saturating_sub(used),
                volumes,
                revision: set.revision,
                ..Default::default()
            };
            if client.report_volumes(bearer(report, &token)).await.is_err() {
                break;
            }
            if let Some(r) = ready.take() {
                let _ = r.send(());
            }
        }
    }
}

/// (RSS in MiB, CPU seconds) of a process.
fn usage(pid: Option<u32>) -> (f64, f64) {
    let Some(pid) = pid else { return (0.0, 0.0) };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss_kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0);
    (rss_kib / 1024.0, process_cpu_ms(pid) / 1000.0)
}

async fn volume_phase(
    args: &Args,
    cfg: &Config,
    chans: &[tonic::transport::Channel],
    names: &[String],
    tokens: &[String],
    sh: &Arc<Shared>,
    failures: &mut Vec<String>,
) -> Result<serde_json::Value, String> {
    use nodeplane::rpc::csi;
    let n = names.len();
    let t = Instant::now();
    let mut waiting = Vec::new();
    for i in 0..n {
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(volume_agent(chans[i % chans.len()].clone(), names[i].clone(), tokens[i].clone(), sh.clone(), tx));
        waiting.push(rx);
        if waiting.len() == CONNECT_WAVE || i == n - 1 {
            for rx in waiting.drain(..) {
                tokio::time::timeout(Duration::from_secs(120), rx)
                    .await
                    .map_err(|_| "a volume stream got no set in 120 s")?
                    .map_err(|_| "volume agent ended")?;
            }
        }
    }
    let open_s = t.elapsed().as_secs_f64();
    let csi_ch = nodeplane::rpc::connect_with(&format!("unix:{}", cfg.csi_socket.display()), None)
        .await
        .map_err(|e| e.to_string())?;
    let mut ctl = csi::controller_client::ControllerClient::new(csi_ch);
    let cap = csi::VolumeCapability {
        access_mode: Some(csi::volume_capability::AccessMode {
            mode: csi::volume_capability::access_mode::Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(csi::volume_capability::AccessType::Mount(csi::volume_capability::MountVolume {
            fs_type: "ext4".into(),
            ..Default::default()
        })),
    };
    let (m0, b0) = (sh.vol_messages.load(Ordering::SeqCst), sh.vol_bytes.load(Ordering::SeqCst));
    let (mut create_ms, mut delete_ms, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..args.volumes {
        // Spread over the nodes: each volume preferring another one.
        let node = &names[(k * 7919) % n];
        let pref = csi::Topology {
            segments: [(nodeplane::storage::csi::TOPOLOGY_KEY.to_string(), node.clone())].into_iter().collect(),
        };
        let req = csi::CreateVolumeRequest {
            name: format!("{}-vol-{k:04}", args.prefix),
            capacity_range: Some(csi::CapacityRange { required_bytes: 1 << 30, limit_bytes: 0 }),
            volume_capabilities: vec![cap.clone()],
            accessibility_requirements: Some(csi::TopologyRequirement { requisite: vec![], preferred: vec![pref] }),
            ..Default::default()
        };
        let t0 = Instant::now();
        match ctl.create_volume(req).await {
            Ok(r) => {
                create_ms.push(t0.elapsed().as_secs_f64() * 1000.0);
                ids.push(r.into_inner().volume.unwrap_or_default().volume_id);
            }
            Err(s) => failures.push(format!("CreateVolume {k}: {s}")),
        }
    }
    for id in ids {
        let t0 = Instant::now();
        match ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: id.clone(), ..Default::default() }).await {
            Ok(_) => delete_ms.push(t0.elapsed().as_secs_f64() * 1000.0),
            Err(s) => failures.push(format!("DeleteVolume {id}: {s}")),
        }
    }
    // Two changes of the desired set per volume (placed, ready) and per delete (going, gone).
    let changes = (4 * create_ms.len()).max(1) as f64;
    let (msgs, bytes) = (sh.vol_messages.load(Ordering::SeqCst) - m0, sh.vol_bytes.load(Ordering::SeqCst) - b0);
    create_ms.sort_by(f64::total_cmp);
    delete_ms.sort_by(f64::total_cmp);
    Ok(json!({
        "volumes": args.volumes,
        "streams_open_seconds": r3(open_s),
        "create_ms": {"median": r3(pctl(&create_ms, 0.5)), "p99": r3(pctl(&create_ms, 0.99))},
        "delete_ms": {"median": r3(pctl(&delete_ms, 0.5)), "p99": r3(pctl(&delete_ms, 0.99))},
        "stream_messages_per_change_all_agents": r3(msgs as f64 / changes),
        "stream_bytes_per_change_all_agents": r3(bytes as f64 / changes),
        "complete_sets_after_open": sh.vol_complete.load(Ordering::SeqCst).saturating_sub(n as u64),
    }))
}

pub fn main() {
    let args = Args::parse();
    if args.index_offset + args.nodes + args.joins > 62_000 {
        eprintln!(
            "scale_load: --index-offset + --nodes + --joins must stay below 62,000 (198.18.0.0/16; 198.19/16 is the test underlay)"
        );
        std::process::exit(2);
    }
    OFFSET.store(args.index_offset, Ordering::Relaxed);
    let cfg = Config::load(&args.config).unwrap_or_else(|e| {
        eprintln!("scale_load: {e}");
        std::process::exit(2)
    });
    let secret = std::fs::read(&cfg.secret_file).unwrap_or_else(|e| {
        eprintln!("scale_load: reading {}: {e} (has the controller started?)", cfg.secret_file.display());
        std::process::exit(2)
    });
    let authority = Authority::new(secret);
    let n = args.nodes;
    let total = n + args.joins;
    let names: Vec<String> = (0..total)
        .map(|i| if i < n { format!("{}-{i:05}", args.prefix) } else { format!("{}-join-{:04}", args.prefix, i - n) })
        .collect();
    let tokens: Vec<String> = names.iter().map(|n| authority.mint(n)).collect();
    let sh = Arc::new(Shared {
        names: names.iter().enumerate().map(|(i, n)| (n.clone(), i)).collect(),
        words: total.div_ceil(64),
        event: Mutex::new(None),
        seen: Mutex::new(Vec::new()),
        seen_all: tokio::sync::Notify::new(),
        agents: n,
        bytes: AtomicU64::new(0),
        messages: AtomicU64::new(0),
        snapshots: AtomicU64::new(0),
        gaps: AtomicU64::new(0),
        watching: AtomicUsize::new(0),
        views: Mutex::new(vec![Vec::new(); n]),
        vol_bytes: AtomicU64::new(0),
        vol_messages: AtomicU64::new(0),
        vol_complete: AtomicU64::new(0),
    });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let result: Result<serde_json::Value, String> = rt.block_on(async {
        // The agents' calls are spread over HTTP/2 connections, one per 100 agents.
        let conns = n.div_ceil(100).max(1);
        let mut chans = Vec::new();
        for _ in 0..conns {
            let tls = args.ca_file.clone().map(|ca_file| nodeplane::rpc::tls::ClientFiles { ca_file, ..Default::default() });
            chans.push(nodeplane::rpc::connect_with(&args.controller, tls.as_ref()).await.map_err(|e| format!("connect: {e}"))?);
        }
        let (_, cpu0) = usage(args.controller_pid);

        // 1. Registration of N nodes.
        let t = Instant::now();
        let next = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..CONCURRENCY.min(n).max(1) {
            let (next, chans, names, tokens) = (next.clone(), chans.clone(), names.clone(), tokens.clone());
            tasks.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= n {
                        return Ok::<(), String>(());
                    }
                    register(&chans[i % chans.len()], &names[i], &tokens[i], i).await?;
                }
            }));
        }
        for t in tasks {
            t.await.map_err(|e| e.to_string())??;
        }
        let reg_s = t.elapsed().as_secs_f64();
        let (rss_registered, _) = usage(args.controller_pid);
        if args.register_only {
            return Ok(json!({"nodes": n, "registration": {"seconds": r3(reg_s), "per_second": r3(n as f64 / reg_s)}, "failures": []}));
        }

        // 2. Every agent watching, connecting in waves.
        let t = Instant::now();
        let mut waiting = Vec::new();
        for i in 0..n {
            let (tx, rx) = tokio::sync::oneshot::channel();
            tokio::spawn(agent(i, chans[i % chans.len()].clone(), names[i].clone(), tokens[i].clone(), sh.clone(), tx));
            waiting.push(rx);
            if waiting.len() == CONNECT_WAVE || i == n - 1 {
                for rx in waiting.drain(..) {
                    tokio::time::timeout(Duration::from_secs(120), rx).await.map_err(|_| "an agent got no snapshot in 120 s")?.map_err(|_| "agent ended")?;
                }
            }
        }
        let watch_s = t.elapsed().as_secs_f64();
        let snapshot_bytes = sh.bytes.load(Ordering::SeqCst);
        let (rss_watching, _) = usage(args.controller_pid);

        // 3. Joins, then leaves, one at a time: each until every agent has seen it.
        let mut phases = serde_json::Map::new();
        let mut failures = Vec::new();
        let mut rss_peak = rss_watching;
        let mut ev_id = 0;
        for (phase, count) in [("join", args.joins), ("leave", args.leaves.min(args.joins))] {
            let bytes0 = sh.bytes.load(Ordering::SeqCst);
            let msgs0 = sh.messages.load(Ordering::SeqCst);
            let mut all_seen = Vec::new();
            let mut each = Vec::new();
            for k in 0..count {
                let i = n + k;
                ev_id += 1;
                sh.seen.lock().unwrap().clear();
                let t0 = Instant::now();
                *sh.event.lock().unwrap() = Some(Event { id: ev_id, index: i, join: phase == "join", t0 });
                let ch = &chans[i % chans.len()];
                if phase == "join" {
                    register(ch, &names[i], &tokens[i], i).await?;
                } else {
                    let req = pb::RemoveNodeRequest { node_name: names[i].clone() };
                    NodeRegistryClient::new(ch.clone()).remove_node(bearer(req, &tokens[i])).await.map_err(|s| format!("remove {}: {s}", names[i]))?;
                }
                let deadline = t0 + Duration::from_secs(CHANGE_TIMEOUT);
                let all = loop {
                    let notified = sh.seen_all.notified();
                    if sh.seen.lock().unwrap().len() >= n {
                        break true;
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    if tokio::time::timeout(left, notified).await.is_err() {
                        break false;
                    }
                };
                if !all {
                    failures.push(format!("{phase} of {}: seen by {} of {n} agents in {CHANGE_TIMEOUT} s", names[i], sh.seen.lock().unwrap().len()));
                    continue;
                }
                let seen = sh.seen.lock().unwrap().clone();
                all_seen.push(seen.iter().max().copied().unwrap_or_default().as_secs_f64() * 1000.0);
                each.extend(seen.iter().map(|d| d.as_secs_f64() * 1000.0));
                rss_peak = rss_peak.max(usage(args.controller_pid).0);
            }
            *sh.event.lock().unwrap() = None;
            all_seen.sort_by(f64::total_cmp);
            each.sort_by(f64::total_cmp);
            let bytes = sh.bytes.load(Ordering::SeqCst) - bytes0;
            let msgs = sh.messages.load(Ordering::SeqCst) - msgs0;
            phases.insert(
                phase.to_string(),
                json!({
                    "changes": count,
                    "all_agents_ms": {"median": r3(pctl(&all_seen, 0.5)), "p99": r3(pctl(&all_seen, 0.99)), "max": r3(all_seen.last().copied().unwrap_or(0.0))},
                    "one_agent_ms": {"median": r3(pctl(&each, 0.5)), "p99": r3(pctl(&each, 0.99))},
                    "bytes_per_change_per_agent": r3(bytes as f64 / (count.max(1) * n) as f64),
                    "messages_per_change_per_agent": r3(msgs as f64 / (count.max(1) * n) as f64),
                }),
            );
        }
        // 3b. Volumes: every agent follows its node's volume set; K created and deleted.
        let mut volumes = serde_json::Value::Null;
        if args.volumes > 0 {
            volumes = volume_phase(&args, &cfg, &chans, &names[..n], &tokens[..n], &sh, &mut failures).await?;
            rss_peak = rss_peak.max(usage(args.controller_pid).0);
        }
        let (rss_end, cpu_end) = usage(args.controller_pid);

        // 4. Every agent's view = the controller's membership (the names this tool made).
        let mut ch = NodeRegistryClient::new(chans[0].clone());
        let req = pb::WatchNodesRequest { node_name: names[0].clone(), deltas: true, ..Default::default() };
        let mut s = ch.watch_nodes(bearer(req, &tokens[0])).await.map_err(|e| e.to_string())?.into_inner();
        let mut want = vec![0u64; sh.words];
        loop {
            let part = s.message().await.map_err(|e| e.to_string())?.ok_or("no snapshot")?;
            for node in &part.nodes {
                if let Some(&i) = sh.names.get(&node.name) {
                    want[i / 64] |= 1 << (i % 64);
                }
            }
            if !part.more {
                break;
            }
        }
        // The last delta may still be on its way to some agents.
        let deadline = Instant::now() + Duration::from_secs(10);
        let equal = loop {
            let equal = sh.views.lock().unwrap().iter().filter(|v| **v == want).count();
            if equal == n || Instant::now() > deadline {
                break equal;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if equal != n {
            failures.push(format!("{} of {n} agents' views differ from the controller's", n - equal));
        }
        Ok(json!({
            "nodes": n,
            "connections": conns,
            "registration": {"seconds": r3(reg_s), "per_second": r3(n as f64 / reg_s)},
            "watching": {"seconds": r3(watch_s), "snapshot_bytes_per_agent": r3(snapshot_bytes as f64 / n as f64)},
            "phases": phases,
            "volumes": volumes,
            "snapshots": sh.snapshots.load(Ordering::SeqCst),
            "gaps": sh.gaps.load(Ordering::SeqCst),
            "views_equal": equal,
            "controller": {
                "rss_mib_registered": r3(rss_registered),
                "rss_mib_watching": r3(rss_watching),
                "rss_mib_peak": r3(rss_peak.max(rss_end)),
                "cpu_seconds": r3(cpu_end - cpu0),
            },
            "failures": failures,
        }))
    });
    match result {
        Ok(v) => {
            let failed = !v["failures"].as_array().is_none_or(|f| f.is_empty());
            println!("{v}");
            // Agents' streams are still open: leave without waiting for them.
            std::process::exit(i32::from(failed));
        }
        Err(e) => {
            eprintln!("scale_load: {e}");
            std::process::exit(1);
        }
    }
}
