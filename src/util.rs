//! Small pure helpers shared by every room: random bytes, a stable hash, time formatting,
//! crash points for tests, loading a JSON configuration file, and unit-test directories.

use std::fs;
use std::io;
use std::path::Path;

/// An IP address family. Ordered IPv4 first (the order a node's blocks are handed out in).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(net: &ipnetwork::IpNetwork) -> Family {
        if net.is_ipv4() { Family::V4 } else { Family::V6 }
    }
    /// The family of a `v6` flag (as netlink calls take it).
    pub fn from_v6(v6: bool) -> Family {
        if v6 { Family::V6 } else { Family::V4 }
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        })
    }
}

/// Fill `buf` from the kernel's random source. getrandom(2) without flags fails only when
/// interrupted (retried) or on a kernel older than 3.17; that panics rather than spin.
pub fn fill_random(buf: &mut [u8]) {
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: writing into our own buffer, bounded by its length.
        let n = unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        if n >= 0 {
            filled += n as usize;
            continue;
        }
        let e = std::io::Error::last_os_error();
        assert!(e.kind() == std::io::ErrorKind::Interrupted, "the kernel's random source failed: {e}");
    }
}

/// Whole seconds since the Unix epoch (0 on a clock set before it).
pub fn unix_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A Unix time (whole seconds) as RFC 3339 in UTC, `YYYY-MM-DDTHH:MM:SSZ` (as Kubernetes
/// writes timestamps). Times beyond the years ±9999 (`time`'s range) read as the epoch.
pub fn utc_rfc3339(unix_secs: i64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp(unix_secs).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    let (y, m, d) = (t.year(), t.month() as u8, t.day());
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", t.hour(), t.minute(), t.second())
}

/// Fault injection for the crash-safety tests: when the environment variable
/// `NODEPLANE_CRASH_AT` names `point` (comma-separated list), the process aborts right
/// there, like a `kill -9`: no unwinding, no cleanup. Unset (production), this is one
/// cached lookup.
pub fn crash_point(point: &str) {
    static SPEC: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let spec = SPEC.get_or_init(|| std::env::var("NODEPLANE_CRASH_AT").ok().filter(|s| !s.is_empty()));
    if let Some(s) = spec
        && s.split(',').any(|p| p == point)
    {
        eprintln!("NODEPLANE_CRASH_AT: crashing at {point}");
        std::process::abort();
    }
}

pub use nodeplane_cni::fnv1a;

/// A configuration file that cannot be used (shared by the agent and the controller).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {0}: {1}")]
    Read(std::path::PathBuf, io::Error),
    #[error("parsing {0}: {1}")]
    Parse(std::path::PathBuf, serde_json::Error),
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// Read and parse a JSON configuration file.
pub fn load_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let raw = fs::read(path).map_err(|e| ConfigError::Read(path.to_path_buf(), e))?;
    serde_json::from_slice(&raw).map_err(|e| ConfigError::Parse(path.to_path_buf(), e))
}

/// A fresh directory for a unit test, removed when dropped (also when the test panics).
#[cfg(test)]
pub struct TestDir(pub std::path::PathBuf);

#[cfg(test)]
impl TestDir {
    pub fn new(tag: &str) -> Self {
        let d = std::env::temp_dir().join(format!("np-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).expect("creating test dir");
        TestDir(d)
    }
}

#[cfg(test)]
impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::Family;

    #[test]
    fn families_print_and_order_ipv4_first() {
        let v4: ipnetwork::IpNetwork = "10.8.0.0/24".parse().unwrap();
        let v6: ipnetwork::IpNetwork = "fd00:8::/64".parse().unwrap();
        assert_eq!((Family::of(&v4), Family::of(&v6)), (Family::V4, Family::V6));
        assert_eq!(format!("{} {}", Family::V4, Family::V6), "IPv4 IPv6");
        assert!(Family::V4 < Family::V6);
        assert_eq!(Family::from_v6(true), Family::V6);
    }

    #[test]
    fn utc_rfc3339_formats_unix_seconds() {
        assert_eq!(super::utc_rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::utc_rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(super::utc_rfc3339(1_764_580_000), "2025-12-01T09:06:40Z");
        assert_eq!(super::utc_rfc3339(-1), "1969-12-31T23:59:59Z");
    }
}
