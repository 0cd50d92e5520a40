//! An LVM thin pool, through the LVM command-line tools (`lvcreate`, `lvs`, ...).
//!
//! There is no maintained Rust binding of LVM's library (liblvm2app was removed from LVM in
//! 2.03); the tools are LVM's supported interface, and TopoLVM's lvmd drives them the same
//! way. Every tool runs with an argument vector, never a shell, with LVM's
//! machine-readable report (`--reportformat json`) for what we read back. Failures carry
//! the tool, its arguments, exit status and stderr.
//!
//! Device nodes: where udev runs (`/run/udev/control` exists), LVM waits for it as usual.
//! Where it does not (a container without udev, the VM lane), the tools are told so
//! (`DM_DISABLE_UDEV=1`, udev synchronisation off) and device-mapper makes the nodes itself.
//!
//! Debian packages: `lvm2`, `thin-provisioning-tools` (`thin_check`, run at pool activation).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum LvmError {
    #[error("running {tool}: {source}")]
    Spawn { tool: &'static str, source: std::io::Error },
    #[error("{tool} {args} failed ({status}): {stderr}")]
    Failed { tool: &'static str, args: String, status: String, stderr: String },
    /// The logical volume is open (mounted, or held by another process).
    #[error("{lv} is in use: {stderr}")]
    InUse { lv: String, stderr: String },
    #[error("{tool}: unreadable report: {reason}")]
    Report { tool: &'static str, reason: String },
    #[error("thin pool {0} not found")]
    NoPool(String),
}

pub type Result<T, E = LvmError> = std::result::Result<T, E>;

/// The pool's size and how full its data and metadata are.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolStatus {
    /// Bytes of data space.
    pub size_bytes: u64,
    /// Percent of the data space in use (0..=100).
    pub data_percent: f64,
    /// Percent of the metadata space in use (0..=100).
    pub metadata_percent: f64,
}

/// One thin logical volume of the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThinLv {
    pub name: String,
    /// Virtual size, bytes.
    pub size_bytes: u64,
    pub active: bool,
    /// Open by someone (mounted, or a process holds the device).
    pub open: bool,
    /// The LV it is a snapshot of ("" for none).
    pub origin: String,
}

/// A thin pool `vg/pool` the store makes its volumes in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThinPool {
    pub vg: String,
    pub pool: String,
}

impl std::fmt::Display for ThinPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.vg, self.pool)
    }
}

impl ThinPool {
    pub fn new(vg: &str, pool: &str) -> Self {
        ThinPool { vg: vg.to_string(), pool: pool.to_string() }
    }

    /// `vg/name`, as the tools take a logical volume.
    fn lv(&self, name: &str) -> String {
        format!("{}/{name}", self.vg)
    }

    /// The device node of LV `name` (present while it is active).
    pub fn device(&self, name: &str) -> PathBuf {
        Path::new("/dev").join(&self.vg).join(name)
    }

    /// The pool's size and use.
    pub fn status(&self) -> Result<PoolStatus> {
        let rows = report(&["-o", "lv_name,lv_size,data_percent,metadata_percent,lv_attr", &self.lv(&self.pool)])?;
        let row = rows.into_iter().next().ok_or_else(|| LvmError::NoPool(self.to_string()))?;
        if !row.lv_attr.starts_with('t') {
            return Err(LvmError::NoPool(format!(
                "{self} (a logical volume, not a thin pool: attributes {})",
                row.lv_attr
            )));
        }
        Ok(PoolStatus {
            size_bytes: number(&row.lv_size)?,
            data_percent: percent(&row.data_percent)?,
            metadata_percent: percent(&row.metadata_percent)?,
        })
    }

    /// Every thin LV in the pool.
    pub fn list(&self) -> Result<Vec<ThinLv>> {
        let select = format!("pool_lv={}", self.pool);
        let rows = report(&["-o", "lv_name,lv_size,lv_active,lv_device_open,origin", "-S", &select, &self.vg])?;
        rows.into_iter()
            .map(|r| {
                Ok(ThinLv {
                    size_bytes: number(&r.lv_size)?,
                    active: r.lv_active == "active",
                    open: r.lv_device_open == "open",
                    origin: r.origin,
                    name: r.lv_name,
                })
            })
            .collect()
    }

    /// One thin LV, if it exists.
    pub fn get(&self, name: &str) -> Result<Option<ThinLv>> {
        Ok(self.list()?.into_iter().find(|l| l.name == name))
    }

    /// A new thin LV `name` of `size_bytes`, active.
    pub fn create(&self, name: &str, size_bytes: u64) -> Result<()> {
        let size = format!("{size_bytes}b");
        let pool = self.lv(&self.pool);
        lvm("lvcreate", &["-q", "-y", "-T", &pool, "-V", &size, "-n", name, "-K", "-ay"]).map(drop)
    }

    /// A thin snapshot `name` of `origin`, made in one instant (device-mapper suspends the
    /// origin, flushing and freezing a filesystem mounted on it, for the moment it takes).
    /// `writable`: a volume of its own (a clone or restore), active; otherwise a snapshot
    /// kept inactive (LVM's activation skip), as LVM does by default.
    pub fn snapshot(&self, origin: &str, name: &str, writable: bool) -> Result<()> {
        let o = self.lv(origin);
        if writable {
            lvm("lvcreate", &["-q", "-y", "-s", &o, "-n", name, "-kn", "-ay"]).map(drop)
        } else {
            lvm("lvcreate", &["-q", "-y", "-s", &o, "-n", name, "-ky"]).map(drop)
        }
    }

    pub fn rename(&self, from: &str, to: &str) -> Result<()> {
        lvm("lvrename", &["-q", &self.vg, from, to]).map(drop)
    }

    /// Grow LV `name` to `size_bytes` (its filesystem is the caller's).
    pub fn extend(&self, name: &str, size_bytes: u64) -> Result<()> {
        let size = format!("{size_bytes}b");
        lvm("lvextend", &["-q", "-L", &size, &self.lv(name)]).map(drop)
    }

    /// Activate LV `name` (snapshots included: `-K` overrides activation skip).
    pub fn activate(&self, name: &str) -> Result<()> {
        lvm("lvchange", &["-q", "-ay", "-K", &self.lv(name)]).map(drop)
    }

    /// Remove LV `name`. `lvremove` refuses an open LV: [`LvmError::InUse`]. A name that is
    /// not there is success.
    pub fn remove(&self, name: &str) -> Result<()> {
        match lvm("lvremove", &["-q", "-y", &self.lv(name)]) {
            Ok(_) => Ok(()),
            Err(LvmError::Failed { stderr, .. }) if stderr.contains("Failed to find logical volume") => Ok(()),
            Err(LvmError::Failed { stderr, .. }) if stderr.contains("in use") || stderr.contains("open") => {
                Err(LvmError::InUse { lv: self.lv(name), stderr })
            }
            Err(e) => Err(e),
        }
    }
}

/// One row of `lvs --reportformat json` (fields not asked for are empty).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Row {
    lv_name: String,
    lv_size: String,
    lv_attr: String,
    data_percent: String,
    metadata_percent: String,
    lv_active: String,
    lv_device_open: String,
    origin: String,
}

#[derive(Deserialize)]
struct Report {
    report: Vec<ReportLvs>,
}

#[derive(Deserialize)]
struct ReportLvs {
    #[serde(default)]
    lv: Vec<Row>,
}

/// `lvs` with sizes in bytes, parsed.
fn report(args: &[&str]) -> Result<Vec<Row>> {
    let mut all = vec!["--reportformat", "json", "--units", "b", "--nosuffix"];
    all.extend_from_slice(args);
    let out = lvm("lvs", &all)?;
    parse_report(&out)
}

fn parse_report(out: &str) -> Result<Vec<Row>> {
    let r: Report = serde_json::from_str(out).map_err(|e| LvmError::Report { tool: "lvs", reason: e.to_string() })?;
    Ok(r.report.into_iter().flat_map(|r| r.lv).collect())
}

fn number(s: &str) -> Result<u64> {
    s.trim().parse().map_err(|_| LvmError::Report { tool: "lvs", reason: format!("not a size in bytes: {s:?}") })
}

/// A percentage as `lvs` prints it ("12.50"; "" for none: 0).
fn percent(s: &str) -> Result<f64> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(0.0);
    }
    s.parse().map_err(|_| LvmError::Report { tool: "lvs", reason: format!("not a percentage: {s:?}") })
}

/// Run one LVM tool; its stdout on success.
fn lvm(tool: &'static str, args: &[&str]) -> Result<String> {
    let start = Instant::now();
    let mut cmd = Command::new(tool);
    if !Path::new("/run/udev/control").exists() {
        cmd.env("DM_DISABLE_UDEV", "1").args(["--config", "activation { udev_sync = 0 udev_rules = 0 }"]);
    }
    // LVM warns about every inherited descriptor; ours are close-on-exec, but the test
    // harness's may not be.
    cmd.env("LVM_SUPPRESS_FD_WARNINGS", "1");
    let out = cmd
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .map_err(|source| LvmError::Spawn { tool, source })?;
    tracing::debug!(tool, args = %args.join(" "), code = ?out.status.code(), elapsed_ms = start.elapsed().as_millis() as u64, "ran");
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    Err(LvmError::Failed {
        tool,
        args: args.join(" "),
        status: out.status.to_string(),
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_lvs_json() {
        let out = r#"  {
      "report": [
          {
              "lv": [
                  {"lv_name":"np-a", "lv_size":"268435456", "lv_active":"active", "lv_device_open":"open", "origin":""},
                  {"lv_name":"nps-a", "lv_size":"268435456", "lv_active":"", "lv_device_open":"", "origin":"np-a"}
              ]
          }
      ]
  }"#;
        let rows = parse_report(out).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(number(&rows[0].lv_size).unwrap(), 256 << 20);
        assert_eq!(rows[0].lv_device_open, "open");
        assert_eq!(rows[1].origin, "np-a");
        assert_eq!(percent("12.50").unwrap(), 12.5);
        assert_eq!(percent("").unwrap(), 0.0);
        assert!(percent("x").is_err());
        assert!(parse_report("not json").is_err());
    }
}
