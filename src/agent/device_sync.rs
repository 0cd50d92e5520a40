//! Controller mode, DRA: report the node's DRA devices to the controller (`ReportDevices`,
//! the complete healthy set after every change and every [`RESEND`]; the controller
//! publishes them as the node's ResourceSlice pool), and ask it for the allocation of a claim
//! that kubelet names and that has no claim file here (`GetClaim`). The agent needs no API
//! access for either.

use std::sync::Arc;
use std::time::Duration;

use super::cluster::{Conn, LinkError};
use super::config::Config;
use crate::devices::dra::{self, AllocationResult, Attr, ClaimLookup, Devices};
use crate::rpc::controller as pb;
use crate::rpc::controller::node_registry_client::NodeRegistryClient;

/// A report is sent again this often without a change (a restarted controller learns the
/// devices within this time even before the agent reconnects).
pub const RESEND: Duration = Duration::from_secs(30);

/// The report of `devices`: the healthy ones, with their attributes and capacities.
pub fn report_of(node: &str, devices: &[dra::Device], epoch: u64) -> pb::ReportDevicesRequest {
    let devices = devices
        .iter()
        .filter(|d| d.healthy)
        .map(|d| pb::DraDevice {
            name: d.name.clone(),
            attributes: d
                .attributes()
                .into_iter()
                .map(|(k, v)| {
                    let value = match v {
                        Attr::Int(i) => pb::device_attribute::Value::Int(i),
                        Attr::Str(s) => pb::device_attribute::Value::String(s),
                        Attr::Version(v) => pb::device_attribute::Value::Version(v),
                    };
                    (k.to_string(), pb::DeviceAttribute { value: Some(value) })
                })
                .collect(),
            capacity: d.capacity().into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        })
        .collect();
    pb::ReportDevicesRequest { node_name: node.to_string(), driver: dra::DRIVER_NAME.to_string(), devices, epoch }
}

/// Report the devices until the process ends (reconnecting with backoff). The epoch is how
/// often kubelet has registered the DRA plugin: a new registration (kubelet restarted, and
/// deleted the node's slices) is reported at once.
pub async fn run(cfg: Arc<Config>, devices: Arc<Devices>, book: crate::kubelet::Registrations) {
    let Some(cc) = cfg.controller.clone() else { return };
    let link = Conn::new(cc);
    let mut changed = devices.subscribe();
    // The first report says what the first scan found (not an empty set before it).
    while !devices.scanned() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut backoff = Duration::from_millis(100);
    let mut last_error: Option<String> = None;
    loop {
        changed.borrow_and_update();
        let epoch = book.registrations(dra::DRIVER_NAME);
        let report = report_of(&cfg.node_name, &devices.list(), epoch);
        let count = report.devices.len();
        let sent = match link.get().await {
            Ok((token, ch)) => NodeRegistryClient::new(ch)
                .report_devices(token.authed(report))
                .await
                .map_err(LinkError::call("report devices")),
            Err(e) => Err(e),
        };
        match sent {
            Ok(_) => {
                if last_error.take().is_some() {
                    tracing::info!(devices = count, "DRA devices reported to the controller again");
                }
                tracing::debug!(devices = count, "DRA devices reported");
                backoff = Duration::from_millis(100);
                let resend = tokio::time::Instant::now() + RESEND;
                loop {
                    tokio::select! {
                        r = changed.changed() => if r.is_err() { return } else { break },
                        _ = tokio::time::sleep_until(resend) => break,
                        _ = tokio::time::sleep(Duration::from_millis(100)) => {
                            if book.registrations(dra::DRIVER_NAME) != epoch {
                                break;
                            }
                        }
                    }
                }
            }
            Err(e) => {
                link.reset().await;
                let e = e.to_string();
                if last_error.as_ref() != Some(&e) {
                    tracing::warn!(error = %e, "cannot report DRA devices to the controller; retrying");
                    last_error = Some(e);
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Claim allocations from the controller, for `dra::run`.
pub fn claim_lookup(cfg: &Config) -> Option<ClaimLookup> {
    let cc = cfg.controller.clone()?;
    let node = cfg.node_name.clone();
    let link = Arc::new(Conn::new(cc));
    Some(Arc::new(move |c: crate::rpc::dra::Claim| {
        let (link, node) = (link.clone(), node.clone());
        Box::pin(async move {
            let (token, ch) = link.get().await.map_err(|e| e.to_string())?;
            let req =
                token.authed(pb::GetClaimRequest { node_name: node, namespace: c.namespace, name: c.name, uid: c.uid });
            match NodeRegistryClient::new(ch).get_claim(req).await {
                Ok(r) => Ok(r
                    .into_inner()
                    .results
                    .into_iter()
                    .map(|r| AllocationResult { request: r.request, driver: r.driver, pool: r.pool, device: r.device })
                    .collect()),
                Err(s) => {
                    if matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Internal) {
                        link.reset().await;
                    }
                    Err(format!("{:?}: {}", s.code(), s.message()))
                }
            }
        })
    }))
}
