//! Installing the shim and the CNI network configuration, atomically.
//!
//! A runtime may exec the shim or read the config directory at any moment: both are
//! written to a temp file in the target directory and renamed into place.

use std::fs;
use std::io;

use serde_json::{Value, json};

use super::config::Config;
use crate::cni::{LATEST_VERSION, NETWORK_NAME, PLUGIN_TYPE};

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

/// The conflist this node's runtime uses.
pub fn conflist(cfg: &Config) -> Value {
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
    json!({ "cniVersion": LATEST_VERSION, "name": NETWORK_NAME, "plugins": plugins })
}

pub fn write_conflist(cfg: &Config) -> io::Result<()> {
    fs::create_dir_all(&cfg.cni_conf_dir)?;
    let body = serde_json::to_vec_pretty(&conflist(cfg)).map_err(io::Error::other)?;
    crate::util::atomic_write(&cfg.conflist_path(), &body, 0o644)
}
