//! Provisioning load against a running controller's CSI socket (used by
//! `scripts/bench-provision`): CreateVolume latency one call at a time, then volumes per
//! second with N concurrent callers, then DeleteVolume of everything (timed too).
//!
//!     provision_load <csi.sock> <sequential> <concurrent-volumes> <callers> <size-bytes>
//!
//! Prints one JSON object with the figures.

use std::time::Instant;

use nodeplane::rpc::csi;

use crate::{ext4_cap, pct};

type Client = csi::controller_client::ControllerClient<tonic::transport::Channel>;

async fn create(c: &mut Client, name: String, size: i64) -> String {
    c.create_volume(csi::CreateVolumeRequest {
        name,
        capacity_range: Some(csi::CapacityRange { required_bytes: size, limit_bytes: 0 }),
        volume_capabilities: vec![ext4_cap()],
        ..Default::default()
    })
    .await
    .expect("CreateVolume")
    .into_inner()
    .volume
    .unwrap()
    .volume_id
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
pub async fn main() {
    let a: Vec<String> = std::env::args().collect();
    let sock = std::path::PathBuf::from(&a[1]);
    let seq: usize = a[2].parse().unwrap();
    let conc: usize = a[3].parse().unwrap();
    let callers: usize = a[4].parse().unwrap();
    let size: i64 = a[5].parse().unwrap();
    let ch = nodeplane::rpc::connect_unix(&sock).await.expect("connecting");
    let mut c = Client::new(ch.clone());
    let mut ids = Vec::new();
    let mut lat = Vec::new();
    for i in 0..seq {
        let t = Instant::now();
        ids.push(create(&mut c, format!("pvc-seq-{i}"), size).await);
        lat.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let (p50, p90) = (pct(&mut lat.clone(), 0.5), pct(&mut lat, 0.9));
    let t = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..callers {
        let ch = ch.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = Client::new(ch);
            let mut mine = Vec::new();
            let mut i = w;
            while i < conc {
                mine.push(create(&mut c, format!("pvc-par-{i}"), size).await);
                i += callers;
            }
            mine
        }));
    }
    for t in tasks {
        ids.extend(t.await.unwrap());
    }
    let par_s = t.elapsed().as_secs_f64();
    let mut del = Vec::new();
    for id in &ids {
        let t = Instant::now();
        c.delete_volume(csi::DeleteVolumeRequest { volume_id: id.clone(), ..Default::default() })
            .await
            .expect("DeleteVolume");
        del.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    println!(
        "{}",
        serde_json::json!({
            "sequential": seq, "create_p50_ms": p50, "create_p90_ms": p90,
            "concurrent": conc, "callers": callers, "concurrent_s": par_s, "volumes_per_s": conc as f64 / par_s,
            "deleted": ids.len(), "delete_p50_ms": pct(&mut del.clone(), 0.5), "delete_p90_ms": pct(&mut del, 0.9),
        })
    );
}
