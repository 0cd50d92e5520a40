//! Small state files recycled instead of unlinked: a directory of spare files beside the
//! state, taken to write a new file (written, then renamed into place) and given back when a
//! file is removed (renamed into the pool) or replaced (exchanged with its replacement).
//!
//! Why: on ext4 without a journal (this project's test VMs, and nodes set up that way), the
//! kernel will not reuse an inode freed in the last 60 s (300 s while its inode table block is
//! still dirty), and every file creation in that block group first looks at each such inode
//! in turn (`recently_deleted`, one buffer-cache lookup each). A node that creates and
//! removes a few files per volume or pod pays for every file removed in the last minutes on
//! every file it creates: in a `perf` profile of `scripts/bench-csi` 40% of the agent's CPU
//! time was that scan. A file that is recycled is never freed, and one taken from the pool
//! is never allocated. Elsewhere it is still cheaper than an unlink and a create: one rename.
//!
//! A spare holds whatever its last use left until it is taken, and is overwritten when taken:
//! a reader that opened a file just before it was removed still reads what it held. Every
//! file is written whole and renamed into place, so a crash leaves either the old file or
//! the new one, and at worst a spare with content (spares are never read). Only small state
//! files belong here; a volume's image never does (a holder of its descriptor, such as a
//! loop device, would then reach whatever the inode held next).
//!
//! A pool can also hold only what was never used ([`Spares::made_ahead`]): empty files or empty
//! directories made ahead at idle priority and handed out once ([`Spares::place`]), never
//! given back. A volume's image and the CSI staging and target
//! directories come from such pools, so creating a volume allocates no inode on the request
//! path either, and nothing that was once an image is ever reused.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak, mpsc};

/// What a pool holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
}

/// Spare files in one directory, for files of one filesystem and one mode.
#[derive(Debug)]
pub struct Spares {
    dir: PathBuf,
    mode: u32,
    cap: usize,
    kind: Kind,
    /// Only entries never used: made by the pool, handed out once, never given back.
    unused_only: bool,
    files: Mutex<Vec<PathBuf>>,
    next: AtomicU64,
    /// Wakes the thread that keeps spares made ahead ([`Spares::keep_ready`]), with how many.
    filler: Mutex<Option<(mpsc::Sender<()>, usize)>>,
}

impl Spares {
    /// The pool in `dir` (made 0700 when missing), keeping at most `cap` spares; files it
    /// gives out get `mode`. The spares a previous run left are kept (their names are
    /// numbers; anything else there is removed).
    pub fn open(dir: PathBuf, mode: u32, cap: usize) -> io::Result<Spares> {
        Self::open_as(dir, mode, cap, Kind::File, false)
    }

    /// A pool of `kind` entries that were never used, made with `mode` (under the umask, as
    /// `open(2)` and `mkdir(2)` apply it) by [`Spares::keep_ready`] and handed out once by
    /// [`Spares::place`]. Of what a previous run left, only the
    /// empty files (or empty directories) with numbers for names are kept; any other file is
    /// unlinked (one taken and written but not yet in place at a crash), a directory with
    /// anything in it left where it is.
    pub fn made_ahead(dir: PathBuf, kind: Kind, mode: u32, cap: usize) -> io::Result<Spares> {
        Self::open_as(dir, mode, cap, kind, true)
    }

    fn open_as(dir: PathBuf, mode: u32, cap: usize, kind: Kind, unused_only: bool) -> io::Result<Spares> {
        fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
        let mut files = Vec::new();
        let mut next = 0;
        for e in fs::read_dir(&dir)?.flatten() {
            let path = e.path();
            let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
            let fits = match kind {
                Kind::File => e.file_type().is_ok_and(|t| t.is_file()),
                Kind::Dir => is_dir,
            };
            let unused = || match kind {
                Kind::File => e.metadata().is_ok_and(|m| m.len() == 0),
                Kind::Dir => fs::read_dir(&path).is_ok_and(|mut d| d.next().is_none()),
            };
            match e.file_name().to_str().and_then(|n| n.parse::<u64>().ok()) {
                Some(n) if files.len() < cap && fits && (!unused_only || unused()) => {
                    next = next.max(n + 1);
                    files.push(path);
                }
                // Never a directory with anything in it: that is left, and logged.
                _ if is_dir => {
                    if let Err(e) = fs::remove_dir(&path) {
                        tracing::warn!(error = %e, path = %path.display(), "not a spare, left in place");
                    }
                }
                _ => {
                    let _ = fs::remove_file(&path);
                }
            }
        }
        Ok(Spares {
            dir,
            mode,
            cap,
            kind,
            unused_only,
            files: Mutex::new(files),
            next: AtomicU64::new(next),
            filler: Mutex::new(None),
        })
    }

    /// Put an entry of a [`Spares::made_ahead`] pool at `dest`, which must not exist
    /// (`renameat2(RENAME_NOREPLACE)`: `AlreadyExists` when it does, and the entry stays in
    /// the pool). `Ok(false)` when the pool had none ready or the entry could not go there
    /// (`dest`'s directory missing, another filesystem or mount, a kernel that cannot rename
    /// without replacing, or anything else): the caller makes `dest` itself then, and its own
    /// error is the one to report. An entry that failed for a reason of its own is removed, so
    /// that one bad entry never fails the calls after it. The thread that makes entries ahead
    /// is woken only after the rename: making one holds the pool directory's lock, which the
    /// rename out of it needs too.
    pub fn place(&self, dest: &Path) -> io::Result<bool> {
        debug_assert!(self.unused_only);
        let spare = self.files.lock().unwrap().pop();
        let placed = match spare {
            None => Ok(false),
            Some(spare) => match rename2(&spare, dest, libc::RENAME_NOREPLACE) {
                Ok(()) => Ok(true),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    self.keep_or_drop(spare);
                    Err(e)
                }
                Err(e) => {
                    match e.raw_os_error() {
                        // The destination's doing: the entry is as good as before.
                        Some(libc::ENOENT | libc::EXDEV | libc::EINVAL | libc::ENOSYS) => self.keep_or_drop(spare),
                        _ => {
                            tracing::debug!(error = %e, spare = %spare.display(), dest = %dest.display(), "a spare that could not be placed is removed");
                            self.discard(&spare);
                        }
                    }
                    Ok(false)
                }
            },
        };
        self.wake_if_low(self.len());
        placed
    }

    /// The pool's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How many spares the pool holds.
    pub fn len(&self) -> usize {
        self.files.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn take(&self) -> Option<PathBuf> {
        let (taken, left) = {
            let mut files = self.files.lock().unwrap();
            (files.pop(), files.len())
        };
        self.wake_if_low(left);
        taken
    }

    /// Wake the thread that makes spares ahead when the pool holds `left`, fewer than it
    /// keeps ready.
    fn wake_if_low(&self, left: usize) {
        if let Some((wake, ready)) = &*self.filler.lock().unwrap()
            && left < *ready
        {
            let _ = wake.send(());
        }
    }

    /// Remove a spare from the disk (a directory in a pool of directories).
    fn discard(&self, path: &Path) {
        let _ = match self.kind {
            Kind::File => fs::remove_file(path),
            Kind::Dir => fs::remove_dir(path),
        };
    }

    /// Keep `ready` spares made ahead (at most the pool's cap), on a thread that runs only
    /// when a CPU has nothing else to do: the pool is filled at once and topped up whenever
    /// a write takes it below `ready`. A node's first volumes (or a burst of them larger
    /// than the removals before it gave back) then allocate no inode on the request path.
    /// The thread ends with the pool.
    pub fn keep_ready(self: &Arc<Self>, ready: usize) {
        let ready = ready.min(self.cap);
        let (wake, woken) = mpsc::channel::<()>();
        *self.filler.lock().unwrap() = Some((wake, ready));
        let pool: Weak<Spares> = Arc::downgrade(self);
        let spawned = std::thread::Builder::new().name("spares-fill".into()).spawn(move || {
            let idle = libc::sched_param { sched_priority: 0 };
            // SAFETY: sets this thread's own scheduling policy.
            if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &idle) } != 0 {
                tracing::debug!(error = %io::Error::last_os_error(), "spare files: SCHED_IDLE");
            }
            // The pool is held for one file at a time: once its owner drops it, at most the
            // file being made is made.
            loop {
                loop {
                    let Some(p) = pool.upgrade() else { return };
                    if p.len() >= ready || !p.make_one() {
                        break;
                    }
                }
                if woken.recv().is_err() {
                    return;
                }
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, dir = %self.dir.display(), "no thread to make spare files ahead; they are made as needed");
        }
    }

    /// Make one spare; `false` when that failed (a full disk: writes make their own files).
    fn make_one(&self) -> bool {
        let path = self.fresh_name();
        let made = match self.kind {
            Kind::File => OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(self.mode)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)
                .map(drop),
            Kind::Dir => fs::DirBuilder::new().mode(self.mode).create(&path),
        };
        match made {
            Ok(()) => {
                self.put(path);
                true
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => true,
            Err(e) => {
                tracing::debug!(error = %e, dir = %self.dir.display(), "making a spare file");
                false
            }
        }
    }

    fn put(&self, path: PathBuf) {
        self.files.lock().unwrap().push(path);
    }

    /// A free name in the pool.
    fn fresh_name(&self) -> PathBuf {
        loop {
            let p = self.dir.join(self.next.fetch_add(1, Ordering::Relaxed).to_string());
            if p.symlink_metadata().is_err() {
                return p;
            }
        }
    }

    /// Write `data` to `dest` whole: into a spare (or a new file in the pool's directory when
    /// there is none) that is then renamed over `dest`, after an fsync of its content when
    /// `sync` (the caller syncs the directory when the name must be durable too). The file
    /// `dest` replaces becomes a spare.
    pub fn write(&self, dest: &Path, data: &[u8], sync: bool) -> io::Result<()> {
        debug_assert!(!self.unused_only && self.kind == Kind::File);
        let (path, new) = match self.take() {
            Some(p) => (p, false),
            None => (self.fresh_name(), true),
        };
        let written = (|| {
            let mut o = OpenOptions::new();
            // No O_TRUNC: ext4 flushes a file truncated to 0 when it is closed (auto_da_alloc),
            // which would put a write-back on the request path; the old content is cut to the
            // new length after the write instead (the file is not in place yet).
            o.write(true).custom_flags(libc::O_CLOEXEC);
            if new {
                o.create_new(true).mode(self.mode);
            }
            let mut f = o.open(&path)?;
            f.write_all(data)?;
            if f.metadata()?.len() > data.len() as u64 {
                f.set_len(data.len() as u64)?;
            }
            f.set_permissions(fs::Permissions::from_mode(self.mode))?;
            if sync {
                f.sync_all()?;
            }
            Ok::<(), io::Error>(())
        })();
        if let Err(e) = written {
            self.keep_or_drop(path);
            return Err(e);
        }
        match exchange(&path, dest) {
            // The replaced file has the spare's name now: it is the spare.
            Ok(()) => {
                self.keep_or_drop(path);
                Ok(())
            }
            // Nothing to replace (or no RENAME_EXCHANGE here: the replaced file is freed).
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::EINVAL) | Some(libc::ENOSYS)) => {
                fs::rename(&path, dest).inspect_err(|_| self.keep_or_drop(path.clone()))
            }
            // `dest` is on another filesystem than the pool: a temporary file beside it.
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
                self.keep_or_drop(path);
                write_beside(dest, data, self.mode, sync)
            }
            Err(e) => {
                self.keep_or_drop(path);
                Err(e)
            }
        }
    }

    /// Keep `path` (in the pool's directory) as a spare while there is room, else unlink it.
    fn keep_or_drop(&self, path: PathBuf) {
        if !path.exists() {
            return;
        }
        let mut files = self.files.lock().unwrap();
        if files.len() < self.cap {
            files.push(path);
        } else {
            drop(files);
            self.discard(&path);
        }
    }

    /// Remove the file at `path` as `remove_file` does (the name is gone when this returns;
    /// `NotFound` when there was none), keeping its inode as a spare while the pool has room.
    pub fn remove(&self, path: &Path) -> io::Result<()> {
        debug_assert!(!self.unused_only && self.kind == Kind::File);
        if self.len() >= self.cap {
            return fs::remove_file(path);
        }
        let spare = self.fresh_name();
        match fs::rename(path, &spare) {
            Ok(()) => {
                // A directory or anything else than a file is not a spare.
                if fs::symlink_metadata(&spare).is_ok_and(|m| m.is_file()) {
                    self.put(spare);
                    Ok(())
                } else {
                    let _ = fs::rename(&spare, path);
                    fs::remove_file(path)
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => fs::remove_file(path),
            Err(e) => Err(e),
        }
    }
}

/// Write `data` to `dest` through `<dest>.tmp` renamed over it.
fn write_beside(dest: &Path, data: &[u8], mode: u32, sync: bool) -> io::Result<()> {
    let mut t = dest.as_os_str().to_owned();
    t.push(".tmp");
    let t = PathBuf::from(t);
    let r = (|| {
        let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&t)?;
        f.write_all(data)?;
        if sync {
            f.sync_all()?;
        }
        fs::rename(&t, dest)
    })();
    if r.is_err() {
        let _ = fs::remove_file(&t);
    }
    r
}

/// Exchange the names `a` and `b` atomically (`renameat2(RENAME_EXCHANGE)`).
fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    rename2(a, b, libc::RENAME_EXCHANGE)
}

/// `renameat2(a, b, flags)`, both paths resolved from the working directory as given.
fn rename2(a: &Path, b: &Path, flags: libc::c_uint) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let a = std::ffi::CString::new(a.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let b = std::ffi::CString::new(b.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: two NUL-terminated paths, resolved from the working directory as given.
    let r = unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), flags) };
    if r == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

#[cfg(test)]
fn inode(p: &Path) -> u64 {
    std::os::unix::fs::MetadataExt::ino(&fs::metadata(p).unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(dir: &Path) -> Spares {
        Spares::open(dir.join(".spare"), 0o600, 4).unwrap()
    }

    #[test]
    fn a_removed_file_is_the_next_one_written() {
        let t = crate::util::TestDir::new("spares-reuse");
        let p = pool(&t.0);
        let a = t.0.join("a.json");
        p.write(&a, b"first, and long", false).unwrap();
        assert_eq!(fs::read(&a).unwrap(), b"first, and long");
        let ino = inode(&a);
        p.remove(&a).unwrap();
        assert!(!a.exists(), "removed as remove_file removes");
        assert_eq!(p.len(), 1);
        assert_eq!(p.remove(&a).unwrap_err().kind(), io::ErrorKind::NotFound);
        let b = t.0.join("b.json");
        p.write(&b, b"second", false).unwrap();
        assert_eq!(inode(&b), ino, "the same inode, not a new one");
        assert_eq!(fs::read(&b).unwrap(), b"second", "nothing of the old content left");
        assert!(p.is_empty());
        assert_eq!(fs::metadata(&b).unwrap().permissions().mode() & 0o777, 0o600);
    }

    #[test]
    fn a_replaced_file_becomes_a_spare() {
        let t = crate::util::TestDir::new("spares-exchange");
        let p = pool(&t.0);
        let a = t.0.join("a.json");
        p.write(&a, b"old", false).unwrap();
        let old = inode(&a);
        p.remove(&t.0.join("missing")).unwrap_err();
        // One spare to write into: the old file is exchanged out and kept.
        let other = t.0.join("other");
        fs::write(&other, b"x").unwrap();
        p.remove(&other).unwrap();
        p.write(&a, b"new", true).unwrap();
        assert_eq!(fs::read(&a).unwrap(), b"new");
        assert_ne!(inode(&a), old);
        assert_eq!(p.len(), 1, "the replaced file is the spare now");
        let c = t.0.join("c.json");
        p.write(&c, b"c", false).unwrap();
        assert_eq!(inode(&c), old);
        assert_eq!(fs::read(&c).unwrap(), b"c");
    }

    #[test]
    fn spares_are_made_ahead_and_topped_up() {
        let t = crate::util::TestDir::new("spares-ahead");
        let p = Arc::new(pool(&t.0));
        p.keep_ready(3);
        let wait = |n: usize| {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while p.len() != n || fs::read_dir(p.dir()).unwrap().count() != n {
                assert!(std::time::Instant::now() < deadline, "{} spares, not {n}", p.len());
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        };
        wait(3);
        let made: Vec<u64> = fs::read_dir(p.dir()).unwrap().map(|e| inode(&e.unwrap().path())).collect();
        let a = t.0.join("a.json");
        p.write(&a, b"a", false).unwrap();
        assert!(made.contains(&inode(&a)), "written into a spare made ahead");
        assert_eq!(fs::metadata(&a).unwrap().permissions().mode() & 0o777, 0o600);
        wait(3);
        // Never beyond the cap (4 here), whatever is asked.
        let q = Arc::new(Spares::open(t.0.join("other"), 0o600, 2).unwrap());
        q.keep_ready(10);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while q.len() < 2 {
            assert!(std::time::Instant::now() < deadline);
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(fs::read_dir(q.dir()).unwrap().count(), 2);
    }

    #[test]
    fn the_pool_is_bounded_and_survives_a_restart() {
        let t = crate::util::TestDir::new("spares-cap");
        let p = pool(&t.0);
        for i in 0..6 {
            let f = t.0.join(format!("{i}.json"));
            fs::write(&f, b"data").unwrap();
            p.remove(&f).unwrap();
            assert!(!f.exists());
        }
        assert_eq!(p.len(), 4, "at most the cap; the rest unlinked");
        assert_eq!(fs::read_dir(p.dir()).unwrap().count(), 4);
        // Something that is no spare in the pool's directory is removed when it opens.
        fs::write(p.dir().join("stray"), b"").unwrap();
        drop(p);
        let p = pool(&t.0);
        assert_eq!(p.len(), 4);
        assert!(!p.dir().join("stray").exists());
        // New names do not collide with the spares already there.
        let d = t.0.join("d");
        fs::write(&d, b"").unwrap();
        let p = Spares::open(t.0.join(".spare"), 0o600, 8).unwrap();
        p.remove(&d).unwrap();
        assert_eq!(p.len(), 5);
        // A directory is never taken in.
        let sub = t.0.join("sub");
        fs::create_dir(&sub).unwrap();
        assert!(p.remove(&sub).is_err());
        assert!(sub.is_dir(), "left where it was");
        assert_eq!(p.len(), 5);
    }

    fn wait_len(p: &Spares, n: usize) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while p.len() < n {
            assert!(std::time::Instant::now() < deadline, "{} made ahead, not {n}", p.len());
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    #[test]
    fn directories_made_ahead_are_placed_once_and_never_over_anything() {
        let t = crate::util::TestDir::new("spares-dirs");
        let p = Arc::new(Spares::made_ahead(t.0.join(".dirs"), Kind::Dir, 0o750, 4).unwrap());
        p.keep_ready(2);
        wait_len(&p, 2);
        let made: Vec<u64> = fs::read_dir(p.dir()).unwrap().map(|e| inode(&e.unwrap().path())).collect();
        let a = t.0.join("a");
        assert!(p.place(&a).unwrap());
        assert!(a.is_dir() && made.contains(&inode(&a)), "one of the directories made ahead");
        assert_eq!(fs::read_dir(&a).unwrap().count(), 0);
        // Something already there: refused, nothing moved, the spare kept.
        wait_len(&p, 2);
        let before = p.len();
        let b = t.0.join("b");
        fs::write(&b, b"data").unwrap();
        assert_eq!(p.place(&b).unwrap_err().kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(fs::read(&b).unwrap(), b"data");
        fs::create_dir(t.0.join("c")).unwrap();
        assert_eq!(
            p.place(&t.0.join("c")).unwrap_err().kind(),
            io::ErrorKind::AlreadyExists,
            "not even an empty directory"
        );
        assert_eq!(p.len(), before);
        // No parent: the caller makes it (with its parents), the spare is kept.
        assert!(!p.place(&t.0.join("no/such")).unwrap());
        assert_eq!(p.len(), before);
        // A spare that vanished is dropped, not handed out again.
        let gone = p.files.lock().unwrap().last().cloned().unwrap();
        fs::remove_dir(&gone).unwrap();
        assert!(!p.place(&t.0.join("d")).unwrap() || t.0.join("d").is_dir());
        assert!(!p.files.lock().unwrap().contains(&gone));
        // A restart keeps the empty ones; one with content is left alone, a file removed.
        drop(p);
        let spare_dir = t.0.join(".dirs");
        fs::create_dir(spare_dir.join("90")).unwrap();
        fs::write(spare_dir.join("90/x"), b"").unwrap();
        fs::write(spare_dir.join("91"), b"").unwrap();
        let p = Spares::made_ahead(spare_dir.clone(), Kind::Dir, 0o750, 4).unwrap();
        assert!(spare_dir.join("90/x").exists(), "never removed with what it holds");
        assert!(!spare_dir.join("91").exists());
        assert!(!p.files.lock().unwrap().iter().any(|f| f.ends_with("90")));
        assert!(p.len() >= 1);
    }

    #[test]
    fn files_made_ahead_are_handed_out_unused() {
        let t = crate::util::TestDir::new("spares-unused");
        let dest = |i: u32| t.0.join(format!("img-{i}"));
        let p = Arc::new(Spares::made_ahead(t.0.join(".img"), Kind::File, 0o600, 3).unwrap());
        assert!(!p.place(&dest(0)).unwrap(), "nothing made yet");
        assert!(!dest(0).exists());
        p.keep_ready(3);
        wait_len(&p, 3);
        let made: Vec<u64> = fs::read_dir(p.dir()).unwrap().map(|e| inode(&e.unwrap().path())).collect();
        assert!(p.place(&dest(1)).unwrap());
        let m = fs::metadata(dest(1)).unwrap();
        assert!(m.is_file() && m.len() == 0 && made.contains(&inode(&dest(1))), "an empty file made ahead");
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
        // Something at the destination: refused, left as it was, the spare kept.
        wait_len(&p, 3);
        fs::write(dest(2), b"data").unwrap();
        assert_eq!(p.place(&dest(2)).unwrap_err().kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(fs::read(dest(2)).unwrap(), b"data");
        assert_eq!(p.len(), 3);
        // A file in the pool with something in it is no spare at the next start.
        let f = p.files.lock().unwrap().last().cloned().unwrap();
        fs::write(&f, b"image data").unwrap();
        drop(p);
        let q = Spares::made_ahead(t.0.join(".img"), Kind::File, 0o600, 8).unwrap();
        assert!(!f.exists(), "a used file is no spare");
        assert_eq!(q.len(), 2);
        for i in 10..12 {
            assert!(q.place(&dest(i)).unwrap());
            assert_eq!(fs::metadata(dest(i)).unwrap().len(), 0);
        }
        assert!(!q.place(&dest(20)).unwrap());
    }

    #[test]
    fn writes_without_spares_make_new_files_and_keep_what_they_replace() {
        let t = crate::util::TestDir::new("spares-empty");
        let p = pool(&t.0);
        let a = t.0.join("a.json");
        p.write(&a, b"one", true).unwrap();
        assert!(p.is_empty(), "made new, nothing replaced");
        let first = inode(&a);
        p.write(&a, b"two", false).unwrap();
        assert_eq!(fs::read(&a).unwrap(), b"two");
        assert_eq!(p.len(), 1, "the first version is a spare now");
        p.write(&a, b"three", false).unwrap();
        assert_eq!(inode(&a), first, "written into the spare");
        assert_eq!(fs::read(&a).unwrap(), b"three");
        assert_eq!(fs::read_dir(p.dir()).unwrap().count(), 1, "one spare, no temporary file");
        // A destination whose directory is missing: the error, and the spare kept.
        assert_eq!(p.write(&t.0.join("no/such"), b"x", false).unwrap_err().kind(), io::ErrorKind::NotFound);
        assert_eq!(p.len(), 1);
    }
}
