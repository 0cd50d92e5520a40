//! Installing the shim and the CNI network configuration, atomically.
//!
//! A runtime may exec the shim or read the config directory at any moment: both are
//! written to a temp file in the target directory and renamed into place.

use std::fs;
use std::io;

use serde_json::{Value, json};

use super::config::Config;
use crate::cni::{NETWORK_NAME, PLUGIN_TYPE, version_cmp};

/// Copy the shim to `<cni-bin-dir>/nodeplane` unless an identical copy is already there.
pub fn install_shim(cfg: &Config) -> io::Result<bool> {
    let src = fs::read(&cfg.shim_source)
        .map_err(|e| io::Error::new(e.kind(), format!("reading shim {}: {e}", cfg.shim_source.display())))?;
    fs::create_dir_all(&cfg.cni_bin_dir)?;
    let dst = cfg.cni_bin_dir.join(PLUGIN_TYPE);
    if fs::read(&dst).is_ok_and(|cur| cur == src) {
        return Ok(false);
    }
    crate::util::atomic_write(&dst, &src, 0o755)?;
    Ok(true)
}

/// Ask a plugin binary which spec versions it supports (CNI VERSION command).
fn plugin_versions(cfg: &Config, plugin_type: &str) -> Option<Vec<String>> {
    let bin = cfg.plugin_dirs.iter().map(|d| d.join(plugin_type)).find(|p| p.is_file())?;
    let mut child = std::process::Command::new(&bin)
        .env_clear()
        .env("CNI_COMMAND", "VERSION")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    use std::io::Write;
    let _ = child.stdin.take()?.write_all(br#"{"cniVersion":"0.4.0"}"#);
    let out = child.wait_with_output().ok()?;
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    Some(v.get("supportedVersions")?.as_array()?.iter().filter_map(|x| x.as_str().map(String::from)).collect())
}

/// The conflist version: the configured one, lowered to the highest version every chained
/// plugin supports (a plugin that cannot be asked is assumed to follow the configuration).
pub fn negotiate_version(cfg: &Config) -> String {
    let mut version = cfg.cni_version.clone();
    for p in &cfg.chained_plugins {
        let Some(ty) = p.get("type").and_then(Value::as_str) else { continue };
        match plugin_versions(cfg, ty) {
            Some(supported) if !supported.contains(&version) => {
                let best = crate::cni::SUPPORTED_VERSIONS
                    .iter()
                    .rev()
                    .find(|v| version_cmp(v, &version).is_le() && supported.iter().any(|s| s == *v));
                if let Some(best) = best {
                    tracing::warn!(plugin = ty, from = %version, to = best, "chained plugin does not support the configured cniVersion; lowering");
                    version = best.to_string();
                }
            }
            Some(_) => {}
            None => tracing::warn!(plugin = ty, dirs = ?cfg.plugin_dirs, "chained plugin not found or did not answer VERSION"),
        }
    }
    version
}

/// The conflist this node's runtime uses.
pub fn conflist(cfg: &Config, version: &str) -> Value {
    let mut main = json!({
        "type": PLUGIN_TYPE,
        "agentSocket": cfg.cni_socket,
        "pendingDeleteDir": cfg.pending_delete_dir(),
        "mtu": cfg.mtu,
    });
    if !cfg.dns.is_empty() {
        let d = &cfg.dns;
        main["dns"] = json!({"nameservers": d.nameservers, "search": d.search, "options": d.options});
        if let Some(domain) = &d.domain {
            main["dns"]["domain"] = json!(domain);
        }
    }
    let mut plugins = vec![main];
    plugins.extend(cfg.chained_plugins.iter().cloned());
    json!({ "cniVersion": version, "name": NETWORK_NAME, "plugins": plugins })
}

pub fn write_conflist(cfg: &Config) -> io::Result<()> {
    fs::create_dir_all(&cfg.cni_conf_dir)?;
    let body = serde_json::to_vec_pretty(&conflist(cfg, &negotiate_version(cfg))).map_err(io::Error::other)?;
    crate::util::atomic_write(&cfg.conflist_path(), &body, 0o644)
}
