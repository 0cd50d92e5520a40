//! Small helpers shared by the agent and the shim.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Fill `buf` from the kernel's random source.
pub fn fill_random(buf: &mut [u8]) {
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: writing into our own buffer, bounded by its length.
        let n = unsafe {
            libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0)
        };
        if n > 0 {
            filled += n as usize;
        }
    }
}

/// Bind a Unix socket for a gRPC server: parent directory created (0750), a stale socket
/// removed, the new one 0600 before anyone can be told about it.
pub fn bind_unix_socket(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o750).create(dir)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
            std::fs::remove_file(path)?;
            tracing::info!(socket = %path.display(), "removed stale socket");
        }
        Ok(_) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket; not removing it", path.display()),
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let l = std::os::unix::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600))?;
    l.set_nonblocking(true)?;
    tokio::net::UnixListener::from_std(l)
}

/// A Unix time (whole seconds) as RFC 3339 in UTC, `YYYY-MM-DDTHH:MM:SSZ` (as Kubernetes
/// writes timestamps).
pub fn utc_rfc3339(unix_secs: i64) -> String {
    let (days, rem) = (unix_secs.div_euclid(86_400), unix_secs.rem_euclid(86_400));
    // Days since 1970-01-01 to a civil date (proleptic Gregorian, eras of 400 years).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem / 60 % 60, rem % 60)
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

/// FNV-1a, 64 bit: stable across versions and processes (used to derive interface names).
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            h ^= 0xff;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        for b in *p {
            h ^= *b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Write `data` to `path` atomically: a temp file in the same directory, fsync'd, renamed
/// over the target, directory fsync'd. A reader sees the old file or the new one, never part.
pub fn atomic_write(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    let dir = path.parent().ok_or_else(|| io::Error::other("path has no parent"))?;
    let name = path.file_name().ok_or_else(|| io::Error::other("path has no file name"))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    // Unique per call: two threads of one process may write the same file at once.
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tmp_name.push(format!(".tmp{}.{seq}", std::process::id()));
    let tmp = dir.join(tmp_name);
    let result = (|| {
        let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp)?;
        f.write_all(data)?;
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Write `data` to `path` atomically without fsync: survives the writer's crash (the page
/// cache is the kernel's), not a power cut. Used for state that a reboot invalidates anyway.
pub fn atomic_write_nosync(path: &Path, data: &[u8]) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    // A failed write (a full disk) must not leave its partial temporary file behind.
    fs::write(&tmp, data).and_then(|()| fs::rename(&tmp, path)).inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}

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

/// The kernel's boot id (changes on every boot).
pub fn read_boot_id(path: &Path) -> io::Result<String> {
    Ok(fs::read_to_string(path)?.trim().to_string())
}

/// Logging for the daemons, set up in one place: stderr, level from `NODEPLANE_LOG`
/// (default info), JSON or text, colours only on a terminal.
pub fn init_logging(json: bool) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("NODEPLANE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
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
    #[test]
    fn utc_rfc3339_formats_unix_seconds() {
        assert_eq!(super::utc_rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::utc_rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(super::utc_rfc3339(1_764_580_000), "2025-12-01T09:06:40Z");
        assert_eq!(super::utc_rfc3339(-1), "1969-12-31T23:59:59Z");
    }
}
