//! Installing the shim and the CNI network configuration, atomically.
//!
//! A runtime may exec the shim or read the config directory at any moment: both are
//! written to a temp file in the target directory and renamed into place.

use std::fs;
use std::io;

use serde_json::{Value, json};

use super::config::Config;
use crate::net::cni::{NETWORK_NAME, PLUGIN_TYPE, version_cmp};

/// Copy the shim to `<cni-bin-dir>/nodeplane` unless an identical copy is already there.
pub fn install_shim(cfg: &Config) -> io::Result<bool> {
    let src = fs::read(&cfg.shim_source)
        .map_err(|e| io::Error::new(e.kind(), format!("reading shim {}: {e}", cfg.shim_source.display())))?;
    fs::create_dir_all(&cfg.cni_bin_dir)?;
    let dst = cfg.cni_bin_dir.join(PLUGIN_TYPE);
    if fs::read(&dst).is_ok_and(|cur| cur == src) {
        return Ok(false);
    }
    crate::sys::fs::atomic_write(&dst, &src, 0o755)?;
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
        let Some(ty) = p.get("type").and_then(Value::as_str) else {
            continue;
        };
        match plugin_versions(cfg, ty) {
            Some(supported) if !supported.contains(&version) => {
                let best = crate::net::cni::SUPPORTED_VERSIONS
                    .iter()
                    .rev()
                    .find(|v| version_cmp(v, &version).is_le() && supported.iter().any(|s| s == *v));
                if let Some(best) = best {
                    tracing::warn!(plugin = ty, from = %version, to = best, "chained plugin does not support the configured cniVersion; lowering");
                    version = best.to_string();
                }
            }
            Some(_) => {}
            None => {
                tracing::warn!(plugin = ty, dirs = ?cfg.plugin_dirs, "chained plugin not found or did not answer VERSION")
            }
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
    });
    // A configured MTU goes in the conflist; a derived one is the agent's to give.
    if let Some(mtu) = cfg.mtu {
        main["mtu"] = json!(mtu);
    }
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
    crate::sys::fs::atomic_write(&cfg.conflist_path(), &body, 0o644)
}

// ----- uninstall -----
//
// The agent installs the shim and the conflist once it is ready and never removes them:
// not on SIGTERM, not on a crash, not on an upgrade (a new agent replaces them atomically).
// A node must not flip NotReady because its agent restarts. Removing nodeplane from a node
// is therefore an explicit operator step, done after the agent is gone:
// `nodeplane-agent uninstall --config FILE`.

/// The agent's lock file in its state dir (see `agent::prepare`, which holds it for the
/// agent's whole life with `flock(LOCK_EX)`).
const AGENT_LOCK_FILE: &str = "agent.lock";

/// Byte strings every nodeplane shim build carries (an environment variable and a conflist
/// key the shim reads: both are part of its contract), used to recognise a shim of another
/// version than the one `shimSource` holds.
const SHIM_MARKERS: [&[u8]; 2] = [crate::net::shim::SOCKET_ENV.as_bytes(), b"pendingDeleteDir"];

/// What happened to one installed file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Removal {
    /// It was ours and is gone now.
    Removed,
    /// It was not there (already uninstalled).
    AlreadyGone,
    /// It was not ours and `--force` removed it anyway (the reason it did not look ours).
    ForceRemoved(String),
}

impl std::fmt::Display for Removal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Removal::Removed => f.write_str("removed"),
            Removal::AlreadyGone => f.write_str("already gone"),
            Removal::ForceRemoved(why) => {
                write!(f, "removed (--force; it was not nodeplane's: {why})")
            }
        }
    }
}

/// The outcome of a successful uninstall.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UninstallReport {
    pub conflist_path: std::path::PathBuf,
    pub conflist: Removal,
    pub shim_path: std::path::PathBuf,
    pub shim: Removal,
    /// Left-over temp files of interrupted atomic writes of ours that were removed too.
    pub temp_files_removed: Vec<std::path::PathBuf>,
}

impl UninstallReport {
    /// Nothing was there: the node was already uninstalled.
    pub fn was_already_uninstalled(&self) -> bool {
        self.conflist == Removal::AlreadyGone && self.shim == Removal::AlreadyGone
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    #[error(
        "an agent is running on state dir {state_dir} (it holds {lock}); stop it first (delete the DaemonSet or stop the \
         agent), then run uninstall again"
    )]
    AgentRunning { state_dir: std::path::PathBuf, lock: std::path::PathBuf },
    #[error(
        "{count} pod(s) still have nodeplane networking (leases in {dir} whose network namespace exists, e.g. {example}): \
         their DEL needs the shim; delete those pods first, or use --force to uninstall anyway"
    )]
    PodsAttached { count: usize, dir: std::path::PathBuf, example: String },
    #[error(
        "refusing to remove {path}: it is not nodeplane's ({why}); nothing was removed (use --force to remove it anyway)"
    )]
    Foreign { path: std::path::PathBuf, why: String },
    #[error("{context}: {source}")]
    Io { context: String, source: io::Error },
}

fn uio(context: impl Into<String>) -> impl FnOnce(io::Error) -> UninstallError {
    let context = context.into();
    move |source| UninstallError::Io { context, source }
}

/// Whether the file at `path` is there and ours: `Ok(None)` when absent, `Ok(Some(Ok(())))`
/// when ours, `Ok(Some(Err(why)))` when something else is there.
type Ownership = Option<Result<(), String>>;

fn regular_file(path: &std::path::Path) -> Result<Option<Result<(), String>>, UninstallError> {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(uio(format!("inspecting {}", path.display()))(e)),
        Ok(m) if m.file_type().is_symlink() => {
            Ok(Some(Err("it is a symbolic link, not a file nodeplane wrote".into())))
        }
        Ok(m) if !m.is_file() => Ok(Some(Err("it is not a regular file".into()))),
        Ok(_) => Ok(Some(Ok(()))),
    }
}

/// The conflist is ours when it parses, is named `nodeplane` and its first plugin has type
/// `nodeplane` (what `conflist` writes).
fn conflist_ownership(path: &std::path::Path) -> Result<Ownership, UninstallError> {
    match regular_file(path)? {
        Some(Ok(())) => {}
        other => return Ok(other),
    }
    let raw = match fs::read(path) {
        Ok(r) => r,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(uio(format!("reading {}", path.display()))(e)),
    };
    let v: Value = match serde_json::from_slice(&raw) {
        Ok(v) => v,
        Err(e) => {
            return Ok(Some(Err(format!("not a JSON network configuration list: {e}"))));
        }
    };
    let name = v.get("name").and_then(Value::as_str);
    if name != Some(NETWORK_NAME) {
        return Ok(Some(Err(format!("network name is {name:?}, not {NETWORK_NAME:?}"))));
    }
    let first = v
        .get("plugins")
        .and_then(Value::as_array)
        .and_then(|p| p.first())
        .and_then(|p| p.get("type"))
        .and_then(Value::as_str);
    if first != Some(PLUGIN_TYPE) {
        return Ok(Some(Err(format!("first plugin type is {first:?}, not {PLUGIN_TYPE:?}"))));
    }
    Ok(Some(Ok(())))
}

/// The shim is ours when it is a regular file identical to `shimSource`, or one carrying the
/// markers every nodeplane shim build has (another version of ours).
fn shim_ownership(path: &std::path::Path, source: &std::path::Path) -> Result<Ownership, UninstallError> {
    match regular_file(path)? {
        Some(Ok(())) => {}
        other => return Ok(other),
    }
    let installed = match fs::read(path) {
        Ok(r) => r,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(uio(format!("reading {}", path.display()))(e)),
    };
    if fs::read(source).is_ok_and(|src| src == installed) {
        return Ok(Some(Ok(())));
    }
    let has = |m: &[u8]| installed.windows(m.len()).any(|w| w == m);
    if SHIM_MARKERS.iter().all(|m| has(m)) {
        return Ok(Some(Ok(())));
    }
    Ok(Some(Err(format!("it differs from {} and is not a nodeplane shim build", source.display()))))
}

/// Take the agent's state-dir lock without waiting: `Ok(None)` when there is no state dir
/// or lock file (no agent ever ran there), `Err(AgentRunning)` while an agent holds it.
fn lock_out_agent(state_dir: &std::path::Path) -> Result<Option<fs::File>, UninstallError> {
    use std::os::fd::AsRawFd;
    let lock = state_dir.join(AGENT_LOCK_FILE);
    let f = match fs::File::open(&lock) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(uio(format!("opening {}", lock.display()))(e)),
    };
    // SAFETY: flock on a descriptor we own; the lock goes with it when `f` is dropped.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(UninstallError::AgentRunning { state_dir: state_dir.to_path_buf(), lock });
        }
        return Err(uio(format!("locking {}", lock.display()))(e));
    }
    Ok(Some(f))
}

/// Remove `path` and make the removal durable (fsync of its directory).
fn remove_durably(path: &std::path::Path) -> Result<bool, UninstallError> {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(uio(format!("removing {}", path.display()))(e)),
    }
    if let Some(dir) = path.parent() {
        fs::File::open(dir).and_then(|d| d.sync_all()).map_err(uio(format!("syncing {}", dir.display())))?;
    }
    Ok(true)
}

/// Temp files `sys::fs::atomic_write` leaves when interrupted (`.<name>.tmp<pid>.<seq>`).
fn stale_temp_files(path: &std::path::Path) -> Vec<std::path::PathBuf> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Vec::new();
    };
    let prefix = format!(".{}.tmp", name.to_string_lossy());
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix) && e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.path())
        .collect()
}

/// Pods (container ids) whose lease names a network namespace that still exists: the runtime
/// will want to DEL them, which needs the shim.
fn attached_pods(lease_dir: &std::path::Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(lease_dir) else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| serde_json::from_slice::<crate::net::ipam::Lease>(&fs::read(e.path()).ok()?).ok())
        .filter(|l| !l.netns.is_empty() && std::path::Path::new(&l.netns).exists())
        .map(|l| l.owner.container_id.clone())
        .collect()
}

/// Remove nodeplane from this node's container runtime: first the conflist (from then on the
/// runtime no longer picks nodeplane for new pods), then the shim.
///
/// * Refuses while an agent runs on `cfg.state_dir` (it holds the state-dir lock): the
///   operator stops the DaemonSet first. The lock is held during the removal, so no agent
///   can start meanwhile.
/// * Removes only files that are nodeplane's: a conflist named `nodeplane` whose first plugin
///   is `nodeplane`; a shim identical to `cfg.shim_source` or carrying the shim's markers.
///   Anything else at those paths is refused (and nothing is removed) unless `force`.
/// * Refuses while pods still have nodeplane networking (a lease whose network namespace
///   exists), unless `force`: their DEL needs the shim.
/// * Idempotent: files already gone are success.
/// * Leaves pods, leases, the bridge, routes and volumes alone: running pods keep their
///   network until they are deleted. With the shim and conflist gone the runtime can no longer
///   call nodeplane's DEL for them; their veths go with their network namespaces, and the
///   leases left in the state dir are freed by the next agent that starts there (a lease whose
///   namespace is gone is released at start).
pub fn uninstall(cfg: &Config, force: bool) -> Result<UninstallReport, UninstallError> {
    let _lock = lock_out_agent(&cfg.state_dir)?;
    let conflist_path = cfg.conflist_path();
    let shim_path = cfg.cni_bin_dir.join(PLUGIN_TYPE);
    let conf_own = conflist_ownership(&conflist_path)?;
    let shim_own = shim_ownership(&shim_path, &cfg.shim_source)?;
    // Decide everything before removing anything: a refusal leaves the node as it was.
    if !force {
        for (path, own) in [(&conflist_path, &conf_own), (&shim_path, &shim_own)] {
            if let Some(Err(why)) = own {
                return Err(UninstallError::Foreign { path: path.clone(), why: why.clone() });
            }
        }
    }
    if !force {
        let attached = attached_pods(&cfg.lease_dir());
        if let Some(example) = attached.first() {
            return Err(UninstallError::PodsAttached {
                count: attached.len(),
                dir: cfg.lease_dir(),
                example: example.clone(),
            });
        }
    }
    let outcome = |own: &Ownership, removed: bool| match (own, removed) {
        (_, false) => Removal::AlreadyGone,
        (Some(Err(why)), true) => Removal::ForceRemoved(why.clone()),
        _ => Removal::Removed,
    };
    let conflist = outcome(&conf_own, conf_own.is_some() && remove_durably(&conflist_path)?);
    let shim = outcome(&shim_own, shim_own.is_some() && remove_durably(&shim_path)?);
    let mut temp_files_removed = Vec::new();
    for t in stale_temp_files(&conflist_path).into_iter().chain(stale_temp_files(&shim_path)) {
        if remove_durably(&t)? {
            temp_files_removed.push(t);
        }
    }
    Ok(UninstallReport { conflist_path, conflist, shim_path, shim, temp_files_removed })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::TestDir;
    use std::os::fd::AsRawFd;
    use std::path::Path;

    /// A config rooted in `dir`, with a shim source file of known bytes.
    fn config(dir: &Path) -> Config {
        let shim = dir.join("shim-src");
        fs::write(&shim, b"\x7fELF nodeplane shim, this build").unwrap();
        let f = serde_json::from_value(json!({
            "nodeName": "n1",
            "root": dir.join("r"),
            "podCidrs": ["10.5.0.0/24"],
            "shimSource": shim,
            "csi": {"enabled": false},
            "devicePlugins": {"enabled": false},
        }))
        .unwrap();
        Config::resolve_with_env(f, &|_| None).unwrap()
    }

    fn install(cfg: &Config) {
        assert!(install_shim(cfg).unwrap());
        write_conflist(cfg).unwrap();
    }

    fn shim_path(cfg: &Config) -> std::path::PathBuf {
        cfg.cni_bin_dir.join(PLUGIN_TYPE)
    }

    #[test]
    fn removes_ours_then_is_idempotent() {
        let d = TestDir::new("uninst-ours");
        let cfg = config(&d.0);
        install(&cfg);
        // A temp file an interrupted install left behind.
        let stale = cfg.cni_conf_dir.join(".10-nodeplane.conflist.tmp999.0");
        fs::write(&stale, b"{").unwrap();
        let unrelated = cfg.cni_conf_dir.join("99-other.conflist");
        fs::write(&unrelated, b"{}").unwrap();

        let r = uninstall(&cfg, false).unwrap();
        assert_eq!((r.conflist.clone(), r.shim.clone()), (Removal::Removed, Removal::Removed));
        assert!(!r.was_already_uninstalled());
        assert_eq!(r.temp_files_removed, vec![stale.clone()]);
        assert!(!cfg.conflist_path().exists() && !shim_path(&cfg).exists() && !stale.exists());
        assert!(unrelated.exists(), "other networks' files are not touched");
        assert!(cfg.cni_bin_dir.is_dir() && cfg.cni_conf_dir.is_dir(), "the directories stay");

        let again = uninstall(&cfg, false).unwrap();
        assert_eq!((again.conflist.clone(), again.shim.clone()), (Removal::AlreadyGone, Removal::AlreadyGone));
        assert!(again.was_already_uninstalled());
        // Never installed at all (no dirs, no state dir): also success, and nothing is created.
        let fresh = TestDir::new("uninst-fresh");
        let cfg2 = config(&fresh.0);
        assert!(uninstall(&cfg2, false).unwrap().was_already_uninstalled());
        assert!(!cfg2.state_dir.exists() && !cfg2.cni_conf_dir.exists());
    }

    #[test]
    fn a_shim_of_another_nodeplane_version_is_ours() {
        let d = TestDir::new("uninst-other-version");
        let cfg = config(&d.0);
        install(&cfg);
        let mut other = b"\x7fELF an older nodeplane shim ".to_vec();
        other.extend_from_slice(crate::net::shim::SOCKET_ENV.as_bytes());
        other.extend_from_slice(b" pendingDeleteDir ");
        fs::write(shim_path(&cfg), &other).unwrap();
        let r = uninstall(&cfg, false).unwrap();
        assert_eq!(r.shim, Removal::Removed);
        assert!(!shim_path(&cfg).exists());
    }

    #[test]
    fn refuses_foreign_files_unless_forced() {
        let d = TestDir::new("uninst-foreign");
        let cfg = config(&d.0);
        install(&cfg);
        let ours_conflist = fs::read(cfg.conflist_path()).unwrap();

        // A conflist of another network at our path.
        fs::write(cfg.conflist_path(), br#"{"cniVersion":"1.0.0","name":"other","plugins":[{"type":"bridge"}]}"#)
            .unwrap();
        let e = uninstall(&cfg, false).unwrap_err();
        assert!(matches!(&e, UninstallError::Foreign { path, .. } if *path == cfg.conflist_path()), "{e}");
        assert!(e.to_string().contains("--force") && e.to_string().contains("\"other\""), "{e}");
        assert!(cfg.conflist_path().exists() && shim_path(&cfg).exists(), "a refusal removes nothing");
        // Named nodeplane but another plugin first; and not JSON at all.
        fs::write(cfg.conflist_path(), br#"{"name":"nodeplane","plugins":[{"type":"bridge"}]}"#).unwrap();
        assert!(matches!(uninstall(&cfg, false), Err(UninstallError::Foreign { .. })));
        fs::write(cfg.conflist_path(), b"garbage").unwrap();
        assert!(matches!(uninstall(&cfg, false), Err(UninstallError::Foreign { .. })));

        // Our conflist back, a foreign binary as the shim.
        fs::write(cfg.conflist_path(), &ours_conflist).unwrap();
        fs::write(shim_path(&cfg), b"#!/bin/sh\necho someone else's plugin\n").unwrap();
        let e = uninstall(&cfg, false).unwrap_err();
        assert!(matches!(&e, UninstallError::Foreign { path, .. } if *path == shim_path(&cfg)), "{e}");
        assert!(cfg.conflist_path().exists(), "the conflist is kept when the shim is refused");
        // A symbolic link (even to our own shim source) is not something we wrote.
        fs::remove_file(shim_path(&cfg)).unwrap();
        std::os::unix::fs::symlink(&cfg.shim_source, shim_path(&cfg)).unwrap();
        assert!(matches!(uninstall(&cfg, false), Err(UninstallError::Foreign { .. })));

        // --force removes both, and says they were not ours where that was so.
        fs::write(cfg.conflist_path(), b"garbage").unwrap();
        let r = uninstall(&cfg, true).unwrap();
        assert!(matches!(r.conflist, Removal::ForceRemoved(_)), "{:?}", r.conflist);
        assert!(matches!(r.shim, Removal::ForceRemoved(_)), "{:?}", r.shim);
        assert!(fs::symlink_metadata(shim_path(&cfg)).is_err() && !cfg.conflist_path().exists());
        assert!(cfg.shim_source.exists(), "the link's target is not touched");
    }

    #[test]
    fn refuses_while_an_agent_holds_the_state_dir() {
        let d = TestDir::new("uninst-locked");
        let cfg = config(&d.0);
        install(&cfg);
        fs::create_dir_all(&cfg.state_dir).unwrap();
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(cfg.state_dir.join("agent.lock"))
            .unwrap();
        // The same lock the agent takes (agent::prepare): another open file description.
        // SAFETY: flock on a descriptor `lock` owns.
        assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
        let e = uninstall(&cfg, true).unwrap_err();
        assert!(matches!(e, UninstallError::AgentRunning { .. }), "{e}");
        assert!(e.to_string().contains("stop it first"), "{e}");
        assert!(cfg.conflist_path().exists() && shim_path(&cfg).exists(), "nothing removed while the agent runs");
        drop(lock);
        let r = uninstall(&cfg, false).unwrap();
        assert_eq!((r.conflist, r.shim), (Removal::Removed, Removal::Removed));
    }
}
