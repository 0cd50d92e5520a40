//! Services at scale, through a real controller and a real agent: N Services (each one port
//! and an EndpointSlice of 3 endpoints) applied to the controller in local mode; then
//! changes, each one EndpointSlice replaced, timed from the call to the controller until the
//! agent reports the change's revision in force (its `nodeplane_services_revision` gauge,
//! read from its metrics endpoint).
//!
//!     services_bench --controller ADDR --token-file F [--ca-file C] --metrics HOST:PORT
//!                    --from N0 --to N [--changes K]
//!
//! Services `bench/s<i>` for i in [N0, N): ClusterIP 10.(96 + i / 65536).(i / 256 % 256).(i % 256)
//! port 80, endpoints 10.250.x.y:8080 on a node that is not the agent's. Prints one JSON
//! object: how long the N - N0 Services took to be in force, and each change's latency.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use nodeplane::rpc::controller as pb;
use nodeplane::rpc::controller::services_client::ServicesClient;
use serde_json::json;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn cluster_ip(i: usize) -> String {
    format!("10.{}.{}.{}", 96 + i / 65536, (i / 256) % 256, i % 256)
}

fn endpoint(i: usize, k: usize, round: usize) -> String {
    let n = (i * 3 + k + round * 7919) % (250 * 256 * 256);
    format!("10.{}.{}.{}", 250 + n / 65536, (n / 256) % 256, n % 256 + 1)
}

fn objects(i: usize, round: usize, with_service: bool) -> Vec<serde_json::Value> {
    let name = format!("s{i}");
    let mut out = Vec::new();
    if with_service {
        out.push(json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "bench", "name": name},
            "spec": {"clusterIP": cluster_ip(i), "clusterIPs": [cluster_ip(i)],
                     "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}}));
    }
    let eps: Vec<_> = (0..3).map(|k| json!({"addresses": [endpoint(i, k, round)], "nodeName": "elsewhere"})).collect();
    out.push(json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": "bench", "name": format!("{name}-1"), "labels": {"kubernetes.io/service-name": name}},
        "addressType": "IPv4", "endpoints": eps, "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}));
    out
}

/// The agent's `nodeplane_services_revision` (HTTP/1.0 GET of its metrics).
fn agent_revision(metrics: &str) -> u64 {
    let Ok(mut s) = std::net::TcpStream::connect(metrics) else { return 0 };
    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n");
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.lines()
        .find_map(|l| l.strip_prefix("nodeplane_services_revision "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

fn wait_revision(metrics: &str, want: u64, limit: Duration) -> Option<Instant> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if agent_revision(metrics) >= want {
            return Some(Instant::now());
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    None
}

pub fn main() {
    let controller = arg("--controller").expect("--controller");
    let token = std::fs::read_to_string(arg("--token-file").expect("--token-file")).expect("token file");
    let metrics = arg("--metrics").expect("--metrics");
    let from: usize = arg("--from").map_or(0, |v| v.parse().unwrap());
    let to: usize = arg("--to").expect("--to").parse().unwrap();
    let changes: usize = arg("--changes").map_or(50, |v| v.parse().unwrap());
    let tls = arg("--ca-file").map(|ca_file| nodeplane::rpc::tls::ClientFiles {
        ca_file: ca_file.into(),
        cert_file: None,
        key_file: None,
        server_name: None,
    });
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let bearer: tonic::metadata::MetadataValue<_> = format!("Bearer {}", token.trim()).parse().unwrap();
    let mut client = rt.block_on(async {
        ServicesClient::new(nodeplane::rpc::connect_with(&controller, tls.as_ref()).await.expect("connect"))
            .max_decoding_message_size(64 << 20)
    });
    let mut apply = |objs: Vec<serde_json::Value>| -> u64 {
        let doc = json!({"apiVersion": "v1", "kind": "List", "items": objs}).to_string();
        let mut req = tonic::Request::new(pb::ApplyObjectsRequest { json: doc });
        req.metadata_mut().insert("authorization", bearer.clone());
        rt.block_on(client.apply_objects(req)).expect("apply").into_inner().revision
    };
    // Load: 500 Services (and their slices) per call.
    let t0 = Instant::now();
    let mut last = 0;
    for start in (from..to).step_by(500) {
        let objs: Vec<_> = (start..(start + 500).min(to)).flat_map(|i| objects(i, 0, true)).collect();
        last = apply(objs);
    }
    let applied = t0.elapsed();
    let in_force = wait_revision(&metrics, last, Duration::from_secs(600)).map(|t| t.duration_since(t0));
    // Changes: one slice each, its endpoints moved.
    let mut lat = Vec::new();
    for c in 0..changes {
        let i = (c * 7_919) % to;
        let t = Instant::now();
        let rev = apply(objects(i, c + 1, false));
        match wait_revision(&metrics, rev, Duration::from_secs(30)) {
            Some(done) => lat.push(done.duration_since(t).as_secs_f64() * 1000.0),
            None => lat.push(f64::INFINITY),
        }
    }
    println!(
        "{}",
        json!({"services": to, "added": to - from, "apply_seconds": applied.as_secs_f64(),
               "in_force_seconds": in_force.map(|d| d.as_secs_f64()), "change_ms": lat})
    );
}
