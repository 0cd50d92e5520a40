//! A kubelet as a process, for tests that restart or kill it (test code), and the kubelet of
//! every node of `scripts/local-cluster` (which also makes its one-shot Allocate): the device
//! manager of `tools/support/kubelet_devices.rs`, the plugin watcher of
//! `tools/support/kubelet_registration.rs` for CSI drivers and the DRA manager of
//! `tools/support/kubelet_dra.rs` for DRA drivers (registration, health stream).
//!
//! ```text
//! cargo build --release --example kubelet
//! target/release/examples/kubelet --kubelet-dir DIR --state FILE
//! target/release/examples/kubelet --kubelet-dir DIR --state FILE --allocate RES=ID,ID [--allocate …]
//! ```
//!
//! Serving (the first form):
//!
//! * serves `v1beta1.Registration` on `DIR/device-plugins/kubelet.sock`, removing a stale
//!   socket first (one left behind by a `kill -9`); each `Register` dials the plugin back,
//!   asks its options and consumes its `ListAndWatch` stream, as kubelet does;
//! * every 50 ms, like kubelet's plugin watcher (which uses fsnotify; polling is enough
//!   here), registers every socket in `DIR/plugins_registry/` that is new or was replaced:
//!   `GetInfo`, the CSI driver's `GetPluginInfo` and `NodeGetInfo`, then
//!   `NotifyRegistrationStatus`; a socket that vanished is forgotten;
//! * keeps what it learned in `FILE`, rewritten atomically (temp file + rename) after every
//!   change, so a reader never sees a partial file and a `kill -9` leaves the last state;
//!   times are Unix seconds (floats). Layout:
//!
//!   ```text
//!   {"pid", "running", "kubelet_socket", "started_at", "ready_at", "stopped_at", "writes",
//!    "resources": {"<resource>": {"endpoint", "socket", "version", "registrations",
//!        "registered_at", "lists", "lists_this_registration", "last_list_at", "streaming",
//!        "stream_end", "options", "served_options", "devices": [{"id", "health", "numa"}],
//!        "protocol_errors", "history": [{"at", "registration", "devices": ["id=Health", …]}]}},
//!    "registration_failures": […],
//!    "csi": {"drivers": {"<name>": {"endpoint", "versions", "node_id", "topology",
//!        "max_volumes", "registration_socket", "registered_at"}},
//!        "registrations", "failures": […]},
//!    "dra": {"drivers": {"<name>": {"endpoint", "versions", "registration_socket",
//!        "health": {"<device>": "Healthy|Unhealthy|Unknown"}}}, "registrations", "failures": […]}}
//!   ```
//!
//!   Everything is what this process learned: a new kubelet starts from nothing, as a
//!   restarted kubelet's device manager does (its checkpoint aside);
//! * prints `READY <pid>` on stdout once `kubelet.sock` is bound and the first state is
//!   written;
//! * on SIGTERM or SIGINT stops like kubelet: `kubelet.sock` is removed, every stream is
//!   dropped, the state is written with `"running": false`, exit 0.
//!
//! `--allocate RES=ID,ID` (the second form) is what kubelet does at container creation: it
//! reads `FILE` (written by the serving kubelet), dials the endpoint that registered `RES`
//! and calls `Allocate` with one container asking for those IDs, once per `--allocate`.
//! Prints one JSON object: per resource `{"ok": true, "containers": [{"envs", "mounts",
//! "devices", "annotations", "cdi_devices"}]}` or `{"ok": false, "code", "message"}`; exit 0
//! when every call succeeded, 2 when one was refused, 1 on bad usage.

#[path = "support/kubelet_devices.rs"]
mod kubelet_emulator;

#[allow(dead_code)]
#[path = "support/kubelet_registration.rs"]
mod csi_watcher;

#[path = "support/kubelet_dra.rs"]
mod dra_manager;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use kubelet_emulator::{KubeletEmulator, Resource};
use nodeplane::rpc::deviceplugin as dp;
use nodeplane::rpc::deviceplugin::device_plugin_client::DevicePluginClient;
use serde_json::{Value, json};
use tokio::signal::unix::{SignalKind, signal};

#[derive(Parser, Debug)]
#[command(about = "A kubelet emulator process: device plugin Registration and CSI plugin registration")]
struct Args {
    /// Kubelet's root directory (`--root-dir`: plugins_registry/ and plugins/ live there).
    #[arg(long)]
    kubelet_dir: PathBuf,

    /// The device plugin directory (kubelet.sock). A real kubelet always uses
    /// /var/lib/kubelet/device-plugins, whatever its root dir; default here:
    /// KUBELET_DIR/device-plugins.
    #[arg(long)]
    device_plugin_dir: Option<PathBuf>,

    /// The state file (written when serving, read by --allocate).
    #[arg(long)]
    state: PathBuf,

    /// One-shot: Allocate RES=ID,ID on the plugin the serving kubelet registered (repeatable).
    #[arg(long = "allocate", value_name = "RES=ID,ID")]
    allocate: Vec<String>,
}

impl Args {
    fn device_dir(&self) -> PathBuf {
        self.device_plugin_dir.clone().unwrap_or_else(|| self.kubelet_dir.join("device-plugins"))
    }
}

/// Instants as Unix seconds: one pair of readings taken at start.
struct Clock {
    inst: Instant,
    unix: f64,
}

impl Clock {
    fn new() -> Clock {
        let unix = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        Clock { inst: Instant::now(), unix }
    }
    fn unix(&self, t: Instant) -> f64 {
        match t.checked_duration_since(self.inst) {
            Some(d) => self.unix + d.as_secs_f64(),
            None => self.unix - self.inst.duration_since(t).as_secs_f64(),
        }
    }
    fn now(&self) -> f64 {
        self.unix(Instant::now())
    }
}

fn options_json(o: &dp::DevicePluginOptions) -> Value {
    json!({"pre_start_required": o.pre_start_required,
           "get_preferred_allocation_available": o.get_preferred_allocation_available})
}

fn resource_json(r: &Resource, clock: &Clock) -> Value {
    let devices: Vec<Value> =
        r.devices.iter().map(|d| json!({"id": d.id, "health": d.health, "numa": d.numa})).collect();
    let history: Vec<Value> = r
        .history
        .iter()
        .map(|(at, reg, list)| {
            json!({"at": clock.unix(*at), "registration": reg,
                   "devices": list.iter().map(|d| format!("{}={}", d.id, d.health)).collect::<Vec<_>>()})
        })
        .collect();
    json!({
        "endpoint": r.endpoint,
        "socket": r.socket,
        "version": r.version,
        "registrations": r.registrations,
        "registered_at": clock.unix(r.registered_at),
        "lists": r.messages,
        "lists_this_registration": r.messages_this_registration,
        "last_list_at": r.last_list_at.map(|t| clock.unix(t)),
        "streaming": r.streaming,
        "stream_end": r.stream_end,
        "options": r.options.as_ref().map(options_json),
        "served_options": options_json(&r.served_options),
        "devices": devices,
        "protocol_errors": r.protocol_errors,
        "history": history,
    })
}

/// What the CSI side learned, beyond what `csi_watcher` keeps.
#[derive(Default)]
struct CsiBook {
    /// Registration socket → when it was registered.
    registered_at: BTreeMap<PathBuf, f64>,
    registrations: u64,
}

fn csi_json(w: &csi_watcher::KubeletEmulator, book: &CsiBook) -> Value {
    let mut drivers = serde_json::Map::new();
    for (sock, r) in &w.registered {
        drivers.insert(
            r.name.clone(),
            json!({"endpoint": r.endpoint, "versions": r.versions, "node_id": r.node_id, "topology": r.topology,
                   "max_volumes": r.max_volumes, "registration_socket": sock,
                   "registered_at": book.registered_at.get(sock)}),
        );
    }
    json!({"drivers": drivers, "registrations": book.registrations, "failures": w.failures})
}

fn write_state(path: &Path, state: &Value) {
    let body = serde_json::to_vec_pretty(state).expect("state serialises");
    if let Err(e) = replace_unsynced(path, &body) {
        eprintln!("kubelet: writing {}: {e}", path.display());
    }
}

/// The emulator's state file is for tests to read while it runs: replaced whole (a reader never
/// sees half of it) but not fsynced (nothing reads it after a reboot). A failed write leaves no
/// temporary file behind.
fn replace_unsynced(path: &Path, body: &[u8]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    std::fs::write(&tmp, body).and_then(|()| std::fs::rename(&tmp, path)).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

fn dra_json(dra: &dra_manager::DraKubelet) -> Value {
    let drivers: serde_json::Map<String, Value> = dra
        .registrations_now()
        .into_iter()
        .map(|r| {
            let health: BTreeMap<String, &str> = dra
                .health(&r.name)
                .into_iter()
                .map(|(d, (h, _))| (d, match h { 1 => "Healthy", 2 => "Unhealthy", _ => "Unknown" }))
                .collect();
            (r.name.clone(), json!({"endpoint": r.endpoint, "versions": r.versions, "registration_socket": r.socket, "health": health}))
        })
        .collect();
    json!({"drivers": drivers, "registrations": dra.registrations(), "failures": dra.failures()})
}

async fn serve(args: Args) -> ExitCode {
    let clock = Clock::new();
    let started_at = clock.now();
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let mut kl = KubeletEmulator::with_device_dir(&args.kubelet_dir, &args.device_dir());
    kl.start().await;
    let ready_at = clock.now();
    let mut changes = kl.changes();
    let mut csi = csi_watcher::KubeletEmulator::new(&args.kubelet_dir);
    let mut book = CsiBook::default();
    let mut dra = dra_manager::DraKubelet::new(&args.kubelet_dir);
    dra.start();
    let mut writes = 0u64;
    let mut last: Option<Value> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let snapshot =
        |kl: &KubeletEmulator, csi: &csi_watcher::KubeletEmulator, book: &CsiBook, dra: &dra_manager::DraKubelet| {
            let resources: serde_json::Map<String, Value> =
                kl.resources().iter().map(|(k, r)| (k.clone(), resource_json(r, &clock))).collect();
            json!({
                "pid": std::process::id(),
                "kubelet_socket": kl.socket(),
                "started_at": started_at,
                "ready_at": ready_at,
                "resources": resources,
                "registration_failures": kl.failures(),
                "kubelet_instance": kl.instance(),
                "duplicate_registrations": kl.duplicates(),
                "csi": csi_json(csi, book),
                "dra": dra_json(dra),
            })
        };
    let mut announced = false;
    loop {
        let mut state = snapshot(&kl, &csi, &book, &dra);
        if last.as_ref() != Some(&state) {
            last = Some(state.clone());
            writes += 1;
            state["running"] = json!(true);
            state["writes"] = json!(writes);
            write_state(&args.state, &state);
        }
        if !announced {
            println!("READY {}", std::process::id());
            announced = true;
        }
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            r = changes.changed() => if r.is_err() { break },
            _ = tick.tick() => {
                // A plugin that does not answer must not stall this loop (nor SIGTERM) for long.
                let before: Vec<PathBuf> = csi.registered.keys().cloned().collect();
                match tokio::time::timeout(Duration::from_secs(2), csi.sync()).await {
                    Ok(n) => book.registrations += n as u64,
                    Err(_) => csi.failures.push("plugin watcher pass timed out after 2 s".into()),
                }
                let now = clock.now();
                book.registered_at.retain(|p, _| csi.registered.contains_key(p));
                for p in csi.registered.keys() {
                    if !before.contains(p) {
                        book.registered_at.insert(p.clone(), now);
                    }
                }
            }
        }
    }
    kl.stop().await;
    dra.stop();
    let mut state = snapshot(&kl, &csi, &book, &dra);
    state["running"] = json!(false);
    state["stopped_at"] = json!(clock.now());
    state["writes"] = json!(writes + 1);
    write_state(&args.state, &state);
    ExitCode::SUCCESS
}

fn container_json(c: &dp::ContainerAllocateResponse) -> Value {
    json!({
        "envs": c.envs.iter().collect::<BTreeMap<_, _>>(),
        "mounts": c.mounts.iter().map(|m| json!({"container_path": m.container_path, "host_path": m.host_path,
                                                 "read_only": m.read_only})).collect::<Vec<_>>(),
        "devices": c.devices.iter().map(|d| json!({"container_path": d.container_path, "host_path": d.host_path,
                                                   "permissions": d.permissions})).collect::<Vec<_>>(),
        "annotations": c.annotations.iter().collect::<BTreeMap<_, _>>(),
        "cdi_devices": c.cdi_devices.iter().map(|d| d.name.clone()).collect::<Vec<_>>(),
    })
}

async fn allocate(args: Args) -> ExitCode {
    let raw = match std::fs::read(&args.state) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("kubelet: reading {}: {e}", args.state.display());
            return ExitCode::from(1);
        }
    };
    let state: Value = match serde_json::from_slice(&raw) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("kubelet: parsing {}: {e}", args.state.display());
            return ExitCode::from(1);
        }
    };
    let mut out = serde_json::Map::new();
    let mut refused = false;
    for spec in &args.allocate {
        let Some((res, ids)) = spec.split_once('=') else {
            eprintln!("kubelet: --allocate {spec:?}: expected RES=ID,ID");
            return ExitCode::from(1);
        };
        let ids: Vec<String> = ids.split(',').filter(|s| !s.is_empty()).map(String::from).collect();
        let answer = match state["resources"][res]["endpoint"].as_str() {
            None => json!({"ok": false, "code": "NotRegistered",
                           "message": format!("{res:?} is not registered with this kubelet")}),
            Some(endpoint) => {
                let sock = args.device_dir().join(endpoint);
                match nodeplane::rpc::connect_unix(&sock).await {
                    Err(e) => json!({"ok": false, "code": "Unavailable",
                                     "message": format!("dialing {}: {e}", sock.display())}),
                    Ok(ch) => {
                        let req = dp::AllocateRequest {
                            container_requests: vec![dp::ContainerAllocateRequest { devices_ids: ids }],
                        };
                        match DevicePluginClient::new(ch).allocate(req).await {
                            Ok(r) => json!({"ok": true,
                                            "containers": r.get_ref().container_responses.iter().map(container_json).collect::<Vec<_>>()}),
                            Err(s) => json!({"ok": false, "code": format!("{:?}", s.code()), "message": s.message()}),
                        }
                    }
                }
            }
        };
        refused |= answer["ok"] != json!(true);
        out.insert(res.to_string(), answer);
    }
    println!("{}", Value::Object(out));
    if refused { ExitCode::from(2) } else { ExitCode::SUCCESS }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = Args::parse();
    if args.allocate.is_empty() { serve(args).await } else { allocate(args).await }
}
