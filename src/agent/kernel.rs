//! The start-up check of the kernel: the features this agent's enabled parts use
//! ([`crate::sys::features`]), probed once, one log line per feature that is missing, kept
//! for `nodeplane status`; a missing one the agent cannot work without fails the `kernel`
//! readiness condition (registered only then, so a sound node's condition list is as before).

use super::config::Config;
use crate::obs::health::Health;
use crate::rpc::node as api;
use crate::sys::features::{self, Availability, Feature, KernelReport};

/// The features the parts `cfg` enables depend on.
pub(crate) fn features_for(cfg: &Config) -> Vec<Feature> {
    // The datapath (always on): lease cookies; egress masquerade when it is on.
    let mut f = vec![Feature::NetnsCookie];
    if cfg.masquerade {
        f.insert(0, Feature::NftInetNat);
    }
    if cfg.csi.is_some() {
        f.extend([Feature::Openat2, Feature::LoopConfigure, Feature::StatxMountId]);
    }
    if cfg.controller.is_some() && cfg.network_policy {
        f.push(Feature::BridgeNetfilter);
    }
    // The controller decides on encryption: probed with one, judged by `encryption`.
    if cfg.controller.is_some() {
        f.push(Feature::Wireguard);
    }
    f
}

/// Probe (on a blocking thread: `nft --check` is a process), log, and judge readiness.
pub(crate) async fn check(cfg: &Config, health: &Health) -> KernelReport {
    let wanted = features_for(cfg);
    let report = match tokio::task::spawn_blocking(move || features::probe(&wanted)).await {
        Ok(r) => r,
        Err(e) => KernelReport { release: format!("unknown (the probe panicked: {e})"), checks: Vec::new() },
    };
    for c in &report.checks {
        match &c.availability {
            Availability::Available => {}
            Availability::Missing(why) => tracing::warn!(
                release = %report.release,
                feature = c.feature.name(),
                "kernel feature missing: {why}; {}",
                c.feature.without()
            ),
            Availability::Unknown(why) => {
                tracing::warn!(release = %report.release, feature = c.feature.name(), "kernel feature not probed: {why}")
            }
        }
    }
    // br_netfilter's readiness is the `networkpolicy` condition's (it heals when the module
    // is loaded later); the others cannot appear while the agent runs.
    let fatal: Vec<String> = report
        .checks
        .iter()
        .filter(|c| c.feature != Feature::BridgeNetfilter && c.feature.required())
        .filter_map(|c| match &c.availability {
            Availability::Missing(why) => Some(format!("{}: {why} ({})", c.feature.name(), c.feature.without())),
            _ => None,
        })
        .collect();
    tracing::info!(
        release = %report.release,
        missing = report.checks.iter().filter(|c| c.availability != Availability::Available).count(),
        "kernel features probed"
    );
    if !fatal.is_empty() {
        health.condition("kernel").set(false, format!("kernel {}: {}", report.release, fatal.join("; ")));
    }
    report
}

/// The report as `nodeplane status` carries it.
pub(crate) fn status(r: &KernelReport) -> api::KernelStatus {
    api::KernelStatus {
        release: r.release.clone(),
        features: r
            .checks
            .iter()
            .map(|c| {
                let (state, detail) = match &c.availability {
                    Availability::Available => (api::KernelFeatureState::Available, String::new()),
                    Availability::Missing(why) => {
                        (api::KernelFeatureState::Missing, format!("{why}; {}", c.feature.without()))
                    }
                    Availability::Unknown(why) => (api::KernelFeatureState::Unknown, why.clone()),
                };
                api::KernelFeature {
                    name: c.feature.name().to_string(),
                    state: state as i32,
                    detail,
                    required: c.feature.required(),
                }
            })
            .collect(),
    }
}
