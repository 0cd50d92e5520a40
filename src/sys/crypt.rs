//! dm-crypt with LUKS2 headers, through `cryptsetup` (Debian package `cryptsetup`).
//!
//! A volume's LUKS2 container is made with [`format`], unlocked into a device-mapper mapping
//! with [`open`], grown with [`resize`] and locked again with [`close`]. Every run of the
//! tool has an argument vector, never a shell; failures carry the tool, its arguments, exit
//! status and stderr.
//!
//! The key goes to cryptsetup only through its stdin (`--key-file=-`: every byte up to
//! end-of-file is the passphrase, no newline handling). It never appears in an argument,
//! the environment, a file or a log line; [`Key`]'s `Debug` prints no byte of it, and its
//! memory is overwritten when dropped.
//!
//! Device nodes: where udev runs (`/run/udev/control` exists), cryptsetup waits for it as
//! usual. Where it does not (a container without udev, the VM lane), libdevmapper is told so
//! (`DM_DISABLE_UDEV=1`: no udev synchronisation, no udev rules) and makes
//! `/dev/mapper/<name>` itself. cryptsetup has no option of its own for this.
//!
//! Which mappings are open is read from the kernel, not from cryptsetup: `/dev/mapper/<name>`
//! (one `stat`), confirmed in sysfs (`/sys/dev/block/M:m/dm/{name,uuid}`, `slaves/`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// The prefix of every mapping this crate makes: `npc-<volume id>`.
pub const MAPPING_PREFIX: &str = "npc-";

/// Device-mapper's longest name (`DM_NAME_LEN` 128, with its NUL).
const DM_NAME_MAX: usize = 127;

/// The LUKS2 label a container carries between [`format`] and [`mark_formatted`]: its
/// mapping has not been given a filesystem yet, so what it reads (the decryption of
/// whatever the device held) is not data.
const FRESH_LABEL: &str = "nodeplane-fresh";

/// The exit code cryptsetup gives for a passphrase that opens no key slot.
const EXIT_WRONG_KEY: i32 = 2;
/// The exit code for a device that is not active (`close`, `status`).
const EXIT_NOT_ACTIVE: i32 = 4;
/// The exit code for a device in use (`close` of a mounted mapping).
const EXIT_BUSY: i32 = 5;

#[derive(Debug, thiserror::Error)]
pub enum CryptError {
    #[error("running cryptsetup: {0}")]
    Spawn(std::io::Error),
    #[error("cryptsetup {args} failed ({status}): {stderr}")]
    Failed { args: String, status: String, stderr: String },
    /// The key opens none of the container's key slots.
    #[error("the key does not open the LUKS container on {device}")]
    WrongKey { device: String },
    /// The mapping is open (mounted, or held by a process).
    #[error("mapping {name} is in use: {stderr}")]
    InUse { name: String, stderr: String },
    #[error("reading {path}: {source}")]
    Io { path: String, source: std::io::Error },
    /// This kernel seam has no device-mapper (the recording fakes of unit tests).
    #[error("dm-crypt is not available here")]
    Unavailable,
}

pub type Result<T, E = CryptError> = std::result::Result<T, E>;

/// A passphrase. Its bytes never show in `Debug` output and are overwritten on drop.
pub struct Key(Vec<u8>);

impl Key {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Key(bytes.into())
    }
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key(<{} bytes, redacted>)", self.0.len())
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        for b in self.0.iter_mut() {
            // SAFETY: `b` is a valid, aligned, exclusive reference to a byte of our own
            // buffer; volatile only so the compiler does not drop the write as dead.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
    }
}

/// An open dm-crypt mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub name: String,
    /// `/dev/mapper/<name>`.
    pub path: PathBuf,
    /// The mapping's major and minor numbers.
    pub num: (u32, u32),
    /// The device it decrypts (`/dev/loop3`, `/dev/dm-2`), from sysfs.
    pub backing: PathBuf,
    /// The backing device's major and minor numbers.
    pub backing_num: (u32, u32),
}

/// The mapping name of volume `id`: `npc-<id>` when it fits device-mapper's 127
/// characters, else `npc-h` + 32 hex digits of the id's SHA-256.
pub fn mapping_name(id: &str) -> String {
    let plain = format!("{MAPPING_PREFIX}{id}");
    if plain.len() <= DM_NAME_MAX {
        return plain;
    }
    use sha2::Digest;
    let digest = sha2::Sha256::digest(id.as_bytes());
    format!("{MAPPING_PREFIX}h{}", hex::encode(&digest[..16]))
}

/// `/dev/mapper/<name>`.
pub fn mapper_path(name: &str) -> PathBuf {
    Path::new("/dev/mapper").join(name)
}

/// Make a LUKS2 container on `dev` whose only key slot opens with `key`, labelled fresh
/// (see [`is_fresh`]). Whatever `dev` held is lost: the caller probes it first.
///
/// The key slot uses PBKDF2 with 1000 iterations (the least cryptsetup takes), not the
/// default argon2id with a benchmarked cost. Key stretching slows down guessing a weak
/// passphrase; the key here is 256 random bits, which no number of iterations makes
/// harder to guess. argon2id's memory cost (up to 1 GiB per open, chosen by benchmark)
/// would only make every stage slow and could fail a stage on a node short of memory.
///
/// The header is 2 MiB (16 KiB metadata, 1 MiB key slots area: room for four PBKDF2 key
/// slots, enough to rotate a key) instead of the default 16 MiB, so a small volume keeps
/// its room for the filesystem.
pub fn format(dev: &Path, key: &Key) -> Result<()> {
    let d = dev.to_string_lossy();
    let args = [
        "luksFormat",
        "--type",
        "luks2",
        "--batch-mode",
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--luks2-metadata-size",
        "16k",
        "--luks2-keyslots-size",
        "1m",
        "--label",
        FRESH_LABEL,
        "--key-file=-",
        &d,
    ];
    cryptsetup(&args, Some(key), &[]).map(drop)
}

/// Open the LUKS container on `dev` as mapping `name` with `key`; returns
/// `/dev/mapper/<name>`. [`CryptError::WrongKey`] when the key opens no key slot.
///
/// `--disable-keyring`: the volume key goes into the device-mapper table, not the kernel
/// keyring, so [`resize`] later needs no passphrase.
pub fn open(dev: &Path, name: &str, key: &Key) -> Result<PathBuf> {
    let d = dev.to_string_lossy();
    let args = ["open", "--type", "luks2", "--disable-keyring", "--key-file=-", &d, name];
    let out = cryptsetup(&args, Some(key), &[EXIT_WRONG_KEY])?;
    if out.code == Some(EXIT_WRONG_KEY) {
        return Err(CryptError::WrongKey { device: d.into_owned() });
    }
    Ok(mapper_path(name))
}

/// The key slot `key` opens on the LUKS container on `dev`, `None` when it opens none
/// (nothing is opened).
pub fn key_slot(dev: &Path, key: &Key) -> Result<Option<u32>> {
    let d = dev.to_string_lossy();
    let args = ["open", "--type", "luks2", "--test-passphrase", "--verbose", "--key-file=-", &d];
    let out = cryptsetup(&args, Some(key), &[EXIT_WRONG_KEY])?;
    if out.code == Some(EXIT_WRONG_KEY) {
        return Ok(None);
    }
    parse_unlocked_slot(&out.stdout).map(Some).ok_or_else(|| CryptError::Failed {
        args: args.join(" "),
        status: "0".into(),
        stderr: "no \"Key slot N unlocked.\" line in its output".into(),
    })
}

/// What the re-keying of a copy needs to know of a LUKS2 header (from `luksDump`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// How many passphrase key slots it has (bound or not; the reencryption slot aside).
    pub key_slots: usize,
    /// Whether a reencryption was started and not finished (the `online-reencrypt`
    /// requirement): only `reencrypt` opens it until it is resumed to its end.
    pub reencrypting: bool,
}

/// The header of the LUKS container on `dev`.
pub fn header(dev: &Path) -> Result<Header> {
    let d = dev.to_string_lossy();
    let out = cryptsetup(&["luksDump", &d], None, &[])?;
    Ok(parse_header(&out.stdout))
}

/// Add `new` as a passphrase of the container on `dev`, authorised by `existing` (which
/// goes through stdin; `new` through a pipe the tool reads as `/proc/self/fd/3`, not
/// `/dev/fd/3`: that symlink is udev's or the container runtime's, and a node without
/// udev has none). The new slot
/// uses the same cheap PBKDF2 as [`format`]'s. [`CryptError::WrongKey`] when `existing`
/// opens no key slot.
pub fn add_key(dev: &Path, existing: &Key, new: &Key) -> Result<()> {
    let d = dev.to_string_lossy();
    let args = [
        "luksAddKey",
        "--batch-mode",
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--key-file=-",
        &d,
        "/proc/self/fd/3",
    ];
    let out = run(&args, Some(existing), Some(new), &[EXIT_WRONG_KEY])?;
    if out.code == Some(EXIT_WRONG_KEY) {
        return Err(CryptError::WrongKey { device: d.into_owned() });
    }
    Ok(())
}

/// Start re-encrypting the container on `dev` to a new, random volume key that only
/// `key` (in key slot `slot`) will open: every other key slot goes at the end. This only
/// writes the reencryption's metadata (`--init-only`); [`reencrypt_resume`] does the
/// work. Offline: no mapping of `dev` may be open.
pub fn reencrypt_init(dev: &Path, key: &Key, slot: u32) -> Result<()> {
    let d = dev.to_string_lossy();
    let slot = slot.to_string();
    let args = [
        "reencrypt",
        "--init-only",
        "--batch-mode",
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--key-slot",
        &slot,
        "--key-file=-",
        &d,
    ];
    key_run(&args, key, &d)
}

/// Run (or resume, after a crash) the reencryption started on `dev` to its end: every
/// block is read, decrypted with the old volume key and written under the new one, so it
/// takes time in proportion to the device's size. `key` must open it.
pub fn reencrypt_resume(dev: &Path, key: &Key) -> Result<()> {
    let d = dev.to_string_lossy();
    let args = ["reencrypt", "--resume-only", "--batch-mode", "--key-file=-", &d];
    key_run(&args, key, &d)
}

/// Run cryptsetup with `key` on stdin; exit code 2 is [`CryptError::WrongKey`].
fn key_run(args: &[&str], key: &Key, device: &str) -> Result<()> {
    let out = cryptsetup(args, Some(key), &[EXIT_WRONG_KEY])?;
    if out.code == Some(EXIT_WRONG_KEY) {
        return Err(CryptError::WrongKey { device: device.to_string() });
    }
    Ok(())
}

/// Close mapping `name`. A mapping that is not open is success; one in use is
/// [`CryptError::InUse`].
pub fn close(name: &str) -> Result<()> {
    let out = cryptsetup(&["close", name], None, &[EXIT_NOT_ACTIVE, EXIT_BUSY])?;
    match out.code {
        Some(EXIT_BUSY) => Err(CryptError::InUse { name: name.to_string(), stderr: out.stderr }),
        _ => Ok(()),
    }
}

/// Grow mapping `name` to its (grown) backing device. Needs no passphrase: the mapping was
/// opened with its key in the table ([`open`]).
pub fn resize(name: &str) -> Result<()> {
    cryptsetup(&["resize", name], None, &[]).map(drop)
}

/// Whether the container on `dev` still carries the label [`format`] gives it: its mapping
/// has never held a filesystem, so it is blank whatever it reads.
pub fn is_fresh(dev: &Path) -> Result<bool> {
    let d = dev.to_string_lossy();
    let out = cryptsetup(&["luksDump", &d], None, &[])?;
    Ok(out.stdout.lines().any(|l| l.strip_prefix("Label:").is_some_and(|v| v.trim() == FRESH_LABEL)))
}

/// Take the fresh label off the container on `dev`: its mapping now holds a filesystem.
pub fn mark_formatted(dev: &Path) -> Result<()> {
    let d = dev.to_string_lossy();
    cryptsetup(&["config", "--label", "", &d], None, &[]).map(drop)
}

/// Mapping `name`, when it is open: `/dev/mapper/<name>` confirmed in sysfs to be a
/// dm-crypt mapping of that name.
pub fn mapping(name: &str) -> Result<Option<Mapping>> {
    let path = mapper_path(name);
    let Some(num) = super::mount::block_node(&path) else { return Ok(None) };
    let sys = PathBuf::from(format!("/sys/dev/block/{}:{}", num.0, num.1));
    if read_trimmed(&sys.join("dm/name"))?.as_deref() != Some(name) {
        return Ok(None);
    }
    describe(name.to_string(), path, num, &sys)
}

/// Every open dm-crypt mapping whose name starts with [`MAPPING_PREFIX`], from sysfs.
pub fn mappings() -> Result<Vec<Mapping>> {
    let dir = Path::new("/sys/class/block");
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(CryptError::Io { path: dir.display().to_string(), source }),
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let sys = e.path();
        let Some(name) = read_trimmed(&sys.join("dm/name"))? else { continue };
        if !name.starts_with(MAPPING_PREFIX) {
            continue;
        }
        let Some(num) = read_trimmed(&sys.join("dev"))?.as_deref().and_then(parse_dev) else { continue };
        let path = mapper_path(&name);
        out.extend(describe(name, path, num, &sys)?);
    }
    Ok(out)
}

/// The mapping behind sysfs directory `sys`, if it is a dm-crypt one with one backing device.
fn describe(name: String, path: PathBuf, num: (u32, u32), sys: &Path) -> Result<Option<Mapping>> {
    if !read_trimmed(&sys.join("dm/uuid"))?.is_some_and(|u| u.starts_with("CRYPT-")) {
        return Ok(None);
    }
    let slaves = sys.join("slaves");
    let Ok(mut entries) = std::fs::read_dir(&slaves) else { return Ok(None) };
    let Some(slave) = entries.next().and_then(|e| e.ok()) else { return Ok(None) };
    let Some(backing_num) = read_trimmed(&slave.path().join("dev"))?.as_deref().and_then(parse_dev) else {
        return Ok(None);
    };
    let backing = Path::new("/dev").join(slave.file_name());
    Ok(Some(Mapping { name, path, num, backing, backing_num }))
}

/// `"253:4"` → (253, 4).
fn parse_dev(s: &str) -> Option<(u32, u32)> {
    let (a, b) = s.split_once(':')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// A sysfs attribute, trimmed; `None` when it does not exist.
fn read_trimmed(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s.trim().to_string())),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) => Ok(None),
        Err(source) => Err(CryptError::Io { path: path.display().to_string(), source }),
    }
}

/// `Key slot N unlocked.` in `cryptsetup --verbose` output → N.
fn parse_unlocked_slot(stdout: &str) -> Option<u32> {
    stdout.lines().find_map(|l| l.trim().strip_prefix("Key slot ")?.strip_suffix(" unlocked.")?.parse().ok())
}

/// The [`Header`] in a `luksDump`'s text.
fn parse_header(dump: &str) -> Header {
    let reencrypting =
        dump.lines().any(|l| l.strip_prefix("Requirements:").is_some_and(|v| v.contains("online-reencrypt")));
    let mut section = "";
    let mut key_slots = 0;
    for l in dump.lines() {
        if !l.starts_with([' ', '\t']) && l.ends_with(':') {
            section = l.trim_end_matches(':');
        } else if section == "Keyslots"
            && let Some((n, kind)) = l.strip_prefix("  ").and_then(|r| r.split_once(": "))
            && n.bytes().all(|b| b.is_ascii_digit())
            && kind.starts_with("luks2")
        {
            key_slots += 1;
        }
    }
    Header { key_slots, reencrypting }
}

struct Output {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Run cryptsetup with `args`, `key` (if any) written to its stdin from a thread of its own
/// (so a tool that fails before reading cannot block us); success or an exit code in
/// `ok_codes` is an [`Output`].
fn cryptsetup(args: &[&str], key: Option<&Key>, ok_codes: &[i32]) -> Result<Output> {
    run(args, key, None, ok_codes)
}

/// [`cryptsetup`], and `fd3` (if any) written to a pipe the tool has as its descriptor 3
/// (`/proc/self/fd/3`): a second key that never touches a file, an argument or the environment.
fn run(args: &[&str], key: Option<&Key>, fd3: Option<&Key>, ok_codes: &[i32]) -> Result<Output> {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let start = Instant::now();
    let mut cmd = Command::new("cryptsetup");
    if !Path::new("/run/udev/control").exists() {
        cmd.env("DM_DISABLE_UDEV", "1");
    }
    cmd.args(args)
        .stdin(if key.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // Both ends close-on-exec; the child gets a copy of the read end as its fd 3 (dup2
    // clears close-on-exec on the copy), the write end stays with us.
    let pipe = fd3
        .map(|_| nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC))
        .transpose()
        .map_err(|e| CryptError::Spawn(std::io::Error::from(e)))?;
    if let Some((r, _)) = &pipe {
        let r = r.as_raw_fd();
        // SAFETY: dup2 and fcntl are async-signal-safe; `r` is open in the child (inherited,
        // closed only at exec), and fd 3 is ours to replace.
        unsafe {
            cmd.pre_exec(move || {
                let rc = if r == 3 { libc::fcntl(3, libc::F_SETFD, 0) } else { libc::dup2(r, 3) };
                if rc < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let spawned = cmd.spawn();
    let writer = pipe.map(|(r, w)| {
        drop(r);
        std::fs::File::from(w)
    });
    let mut child = spawned.map_err(CryptError::Spawn)?;
    let out = std::thread::scope(|s| {
        if let (Some(k), Some(mut stdin)) = (key, child.stdin.take()) {
            // A tool that exits without reading gives EPIPE here; its exit status says why.
            s.spawn(move || drop(stdin.write_all(k.bytes())));
        }
        if let (Some(k), Some(mut w)) = (fd3, writer) {
            s.spawn(move || drop(w.write_all(k.bytes())));
        }
        child.wait_with_output()
    })
    .map_err(CryptError::Spawn)?;
    let code = out.status.code();
    tracing::debug!(tool = "cryptsetup", args = %args.join(" "), ?code, elapsed_ms = start.elapsed().as_millis() as u64, "ran");
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    if out.status.success() || code.is_some_and(|c| ok_codes.contains(&c)) {
        return Ok(Output { code, stdout: String::from_utf8_lossy(&out.stdout).into_owned(), stderr });
    }
    Err(CryptError::Failed { args: args.join(" "), status: out.status.to_string(), stderr })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_names_fit_device_mapper() {
        assert_eq!(mapping_name("pvc-1"), "npc-pvc-1");
        let long = "a".repeat(128);
        let n = mapping_name(&long);
        assert_eq!(n.len(), 4 + 1 + 32);
        assert!(n.starts_with("npc-h"));
        assert_eq!(n, mapping_name(&long), "deterministic");
        assert_eq!(mapping_name(&"b".repeat(123)).len(), 127);
        assert!(mapping_name(&"b".repeat(124)).starts_with("npc-h"));
    }

    #[test]
    fn keys_do_not_print() {
        let k = Key::new("secret-passphrase");
        assert_eq!(format!("{k:?}"), "Key(<17 bytes, redacted>)");
    }

    #[test]
    fn parses_key_slots_and_pending_reencryption() {
        let dump = "LUKS header information\nVersion:       \t2\nRequirements:\tonline-reencrypt-v2 \n\n\
                    Data segments:\n  0: crypt\n\toffset: 2097152 [bytes]\n  1: crypt\n\
                    Keyslots:\n  0: luks2\n\tKey:        512 bits\n  1: luks2\n  2: luks2 (unbound)\n\
                    \tKey:        512 bits\n  3: reencrypt (unbound)\n\tKey:        8 bits\nTokens:\n\
                    Digests:\n  0: pbkdf2\n  1: pbkdf2\n";
        assert_eq!(parse_header(dump), Header { key_slots: 3, reencrypting: true });
        let done =
            "Requirements:\t(no requirements)\nKeyslots:\n  2: luks2\n\tKey:        512 bits\nDigests:\n  1: pbkdf2\n";
        assert_eq!(parse_header(done), Header { key_slots: 1, reencrypting: false });
        assert_eq!(
            parse_unlocked_slot("No usable token is available.\nKey slot 2 unlocked.\nCommand successful.\n"),
            Some(2)
        );
        assert_eq!(parse_unlocked_slot("Command successful.\n"), None);
    }

    #[test]
    fn parses_dev_numbers() {
        assert_eq!(parse_dev("253:4"), Some((253, 4)));
        assert_eq!(parse_dev("x"), None);
    }

    /// luksFormat works on a plain file (no device-mapper needed): format, the fresh label,
    /// the key test, and a wrong key told apart.
    #[test]
    fn format_a_file_and_test_keys() {
        if Command::new("cryptsetup").arg("--version").output().is_err() {
            eprintln!("cryptsetup not installed; skipping");
            return;
        }
        let p = std::env::temp_dir().join(format!("np-crypt-{}.img", std::process::id()));
        std::fs::File::create(&p).unwrap().set_len(8 << 20).unwrap();
        let key = Key::new("0123456789abcdef");
        let r = (|| -> Result<()> {
            format(&p, &key)?;
            assert!(is_fresh(&p)?);
            assert!(key_slot(&p, &key)?.is_some());
            assert!(key_slot(&p, &Key::new("wrong"))?.is_none());
            mark_formatted(&p)?;
            assert!(!is_fresh(&p)?);
            // Re-keying as far as a plain file goes (running the reencryption wants a
            // block device): a second key slot, then a pending reencryption.
            assert_eq!(key_slot(&p, &key)?, Some(0));
            let own = Key::new("fedcba9876543210");
            assert!(matches!(add_key(&p, &Key::new("wrong"), &own), Err(CryptError::WrongKey { .. })));
            assert_eq!(header(&p)?, Header { key_slots: 1, reencrypting: false });
            add_key(&p, &key, &own)?;
            assert_eq!(key_slot(&p, &own)?, Some(1));
            assert_eq!(header(&p)?, Header { key_slots: 2, reencrypting: false });
            reencrypt_init(&p, &own, 1)?;
            assert!(header(&p)?.reencrypting);
            assert!(key_slot(&p, &own)?.is_some());
            Ok(())
        })();
        std::fs::remove_file(&p).unwrap();
        r.unwrap();
    }
}
