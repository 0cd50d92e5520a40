//! The kernel as the volume plane sees it: one object covering everything the volume store
//! and the CSI node service ask of it (the mount table, device numbers, mounts made through
//! `openat2` descriptors beneath the kubelet dir, unmounts, `statvfs`, loop devices and the
//! filesystem tools).
//!
//! [`Kernel`] is the real one: each method delegates to [`super::mount`],
//! [`super::loopdev`] or [`super::fstools`], unchanged. Tests hand the store and the node
//! service [`super::fake_volume::FakeKernel`] instead, which models loop devices, a mount
//! table and filesystems in memory, so stage, publish and their rollbacks run without root.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use nix::mount::MsFlags;

use super::crypt::{CryptError, Header, Key, Mapping};
use super::fstools::{FsError, FsType};
use super::loopdev::{AttachOptions, DetachError, LoopBinding, LoopInfo64};
use super::mount::{Beneath, MountEntry, MountOptions};

/// Why a mount beneath a root did not happen.
#[derive(Debug)]
pub enum MountError {
    /// The source could not be opened beneath the root (gone, a symlink on the way, outside).
    Source(io::Error),
    /// The target could not be opened beneath the root.
    Target(io::Error),
    /// `mount(2)` refused.
    Mount(nix::errno::Errno),
}

/// What `statvfs(3)` reports, in bytes-per-fragment units as the kernel gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsStats {
    pub fragment_size: u64,
    pub blocks: u64,
    pub blocks_free: u64,
    pub blocks_available: u64,
    pub files: u64,
    pub files_free: u64,
    pub files_available: u64,
}

/// Everything the volume store and the CSI node service ask of the kernel.
pub trait VolumeKernel: Send + Sync {
    /// This process' mount table (`/proc/self/mountinfo`).
    fn mount_table(&self) -> io::Result<Vec<MountEntry>>;
    /// The topmost mount on `path` (what a lookup of the path sees), `None` when nothing is
    /// mounted there.
    fn top_mount(&self, path: &Path) -> io::Result<Option<MountEntry>>;
    /// Major and minor numbers of the device node `dev` (`st_rdev`).
    fn dev_numbers(&self, dev: &Path) -> io::Result<(u32, u32)>;
    /// When `path` (followed) is a block device node: its major and minor numbers.
    fn block_node(&self, path: &Path) -> Option<(u32, u32)>;

    /// Mount the filesystem on `dev` at `target`, opened beneath `root` without following
    /// any symlink.
    fn mount_device(
        &self,
        dev: &Path,
        root: &Path,
        target: &Path,
        fs_type: &str,
        opts: &MountOptions,
    ) -> Result<(), MountError>;
    /// Bind-mount the device node `dev` onto the file `target` (opened beneath `root`),
    /// read-only when asked (raw block publication).
    fn bind_device(&self, dev: &Path, root: &Path, target: &Path, read_only: bool) -> Result<(), MountError>;
    /// Bind-mount `source` onto `target`, both opened beneath `root`, then apply
    /// `read_only` and the per-mount `flags` (filesystem publication).
    fn bind_dir(
        &self,
        root: &Path,
        source: &Path,
        target: &Path,
        read_only: bool,
        flags: MsFlags,
    ) -> Result<(), MountError>;
    /// Unmount the topmost mount on `path` (`UMOUNT_NOFOLLOW`).
    fn unmount(&self, path: &Path) -> nix::Result<()>;
    fn statvfs(&self, path: &Path) -> nix::Result<FsStats>;

    /// Bind `backing` (named `name`) to a free loop device; returns `/dev/loopN`.
    fn loop_attach(&self, backing: &File, name: &Path, opts: AttachOptions) -> io::Result<PathBuf>;
    /// Unbind `dev` if it is still bound to the file `(st_dev, st_ino)`.
    fn loop_detach(&self, dev: &Path, st_dev: u64, st_ino: u64) -> Result<(), DetachError>;
    /// The loop devices bound to the file `(st_dev, st_ino)` whose path is `path`.
    fn loop_find_backed_by(&self, path: &Path, st_dev: u64, st_ino: u64) -> io::Result<Vec<LoopBinding>>;
    /// Every bound loop device.
    fn loop_bound_devices(&self) -> io::Result<Vec<LoopBinding>>;
    /// Size of a block device in bytes.
    fn device_size(&self, dev: &Path) -> io::Result<u64>;
    /// Tell a loop device its file changed size; returns the new device size.
    fn loop_set_capacity(&self, dev: &Path) -> io::Result<u64>;
    /// `LOOP_GET_STATUS64` of a loop device.
    fn loop_status(&self, dev: &Path) -> io::Result<LoopInfo64>;

    /// The filesystem (or other signature) on `dev`; `None` when blank.
    fn fs_probe(&self, dev: &Path) -> Result<Option<String>, FsError>;
    /// [`Self::fs_probe`] of the loop device `dev` bound to `image`: the real kernel spawns
    /// no blkid when the image holds no data at all.
    fn fs_probe_loop(&self, dev: &Path, _image: &Path) -> Result<Option<String>, FsError> {
        self.fs_probe(dev)
    }
    fn mkfs(&self, dev: &Path, fs: FsType) -> Result<(), FsError>;
    /// The size the filesystem of type `fs` on `dev` spans; `None` when it holds none.
    fn fs_size(&self, dev: &Path, fs: FsType) -> Result<Option<u64>, FsError>;
    /// Grow the filesystem to its device: ext4 through the device, xfs through a mount point.
    fn grow_fs(&self, dev_or_mountpoint: &Path, fs: FsType) -> Result<(), FsError>;

    // dm-crypt ([`super::crypt`]). The defaults are a kernel without device-mapper (the
    // recording fake): no mapping is ever open, and making one fails.

    /// Make a fresh LUKS2 container on `dev` ([`super::crypt::format`]).
    fn crypt_format(&self, _dev: &Path, _key: &Key) -> Result<(), CryptError> {
        Err(CryptError::Unavailable)
    }
    /// Open the container on `dev` as mapping `name`; returns its device node.
    fn crypt_open(&self, _dev: &Path, _name: &str, _key: &Key) -> Result<PathBuf, CryptError> {
        Err(CryptError::Unavailable)
    }
    /// The key slot `key` opens on `dev`'s container, `None` when none.
    fn crypt_key_slot(&self, _dev: &Path, _key: &Key) -> Result<Option<u32>, CryptError> {
        Err(CryptError::Unavailable)
    }
    /// Key slots and pending reencryption of `dev`'s container ([`super::crypt::header`]).
    fn crypt_header(&self, _dev: &Path) -> Result<Header, CryptError> {
        Err(CryptError::Unavailable)
    }
    /// Add passphrase `new` to `dev`'s container, authorised by `existing`.
    fn crypt_add_key(&self, _dev: &Path, _existing: &Key, _new: &Key) -> Result<(), CryptError> {
        Err(CryptError::Unavailable)
    }
    /// Start re-encrypting `dev` to a new volume key kept by key slot `slot` alone.
    fn crypt_reencrypt_init(&self, _dev: &Path, _key: &Key, _slot: u32) -> Result<(), CryptError> {
        Err(CryptError::Unavailable)
    }
    /// Run a started reencryption of `dev` to its end.
    fn crypt_reencrypt_resume(&self, _dev: &Path, _key: &Key) -> Result<(), CryptError> {
        Err(CryptError::Unavailable)
    }
    /// Close mapping `name` (not open: success; in use: [`CryptError::InUse`]).
    fn crypt_close(&self, _name: &str) -> Result<(), CryptError> {
        Ok(())
    }
    /// Grow mapping `name` to its backing device.
    fn crypt_resize(&self, _name: &str) -> Result<(), CryptError> {
        Err(CryptError::Unavailable)
    }
    /// Whether the container on `dev` has never been given a filesystem.
    fn crypt_is_fresh(&self, _dev: &Path) -> Result<bool, CryptError> {
        Err(CryptError::Unavailable)
    }
    /// Record on `dev`'s container that its mapping now holds a filesystem.
    fn crypt_mark_formatted(&self, _dev: &Path) -> Result<(), CryptError> {
        Err(CryptError::Unavailable)
    }
    /// Mapping `name`, when open.
    fn crypt_mapping(&self, _name: &str) -> Result<Option<Mapping>, CryptError> {
        Ok(None)
    }
    /// Every open mapping named `npc-*`.
    fn crypt_mappings(&self) -> Result<Vec<Mapping>, CryptError> {
        Ok(Vec::new())
    }
}

/// The real kernel.
#[derive(Clone, Default)]
pub struct Kernel;

impl VolumeKernel for Kernel {
    fn mount_table(&self) -> io::Result<Vec<MountEntry>> {
        super::mount::mount_table()
    }

    fn top_mount(&self, path: &Path) -> io::Result<Option<MountEntry>> {
        match super::mount::top_mount(path) {
            Err(e) if e.kind() == io::ErrorKind::Unsupported => {
                Ok(self.mount_table()?.into_iter().rev().find(|m| m.mount_point == path))
            }
            r => r,
        }
    }

    fn dev_numbers(&self, dev: &Path) -> io::Result<(u32, u32)> {
        super::mount::dev_numbers(dev)
    }

    fn block_node(&self, path: &Path) -> Option<(u32, u32)> {
        super::mount::block_node(path)
    }

    fn mount_device(
        &self,
        dev: &Path,
        root: &Path,
        target: &Path,
        fs_type: &str,
        opts: &MountOptions,
    ) -> Result<(), MountError> {
        let at = Beneath::open(root, target).map_err(MountError::Target)?;
        super::mount::mount_device(dev, &at.proc_path(), fs_type, opts).map_err(MountError::Mount)
    }

    fn bind_device(&self, dev: &Path, root: &Path, target: &Path, read_only: bool) -> Result<(), MountError> {
        let at = Beneath::open(root, target).map_err(MountError::Target)?;
        super::mount::bind_mount(dev, &at.proc_path(), target, read_only, MsFlags::empty()).map_err(MountError::Mount)
    }

    fn bind_dir(
        &self,
        root: &Path,
        source: &Path,
        target: &Path,
        read_only: bool,
        flags: MsFlags,
    ) -> Result<(), MountError> {
        let from = Beneath::open(root, source).map_err(MountError::Source)?;
        let at = Beneath::open(root, target).map_err(MountError::Target)?;
        super::mount::bind_mount(&from.proc_path(), &at.proc_path(), target, read_only, flags)
            .map_err(MountError::Mount)
    }

    fn unmount(&self, path: &Path) -> nix::Result<()> {
        nix::mount::umount2(path, nix::mount::MntFlags::UMOUNT_NOFOLLOW)
    }

    fn statvfs(&self, path: &Path) -> nix::Result<FsStats> {
        let st = nix::sys::statvfs::statvfs(path)?;
        Ok(FsStats {
            fragment_size: st.fragment_size() as u64,
            blocks: st.blocks() as u64,
            blocks_free: st.blocks_free() as u64,
            blocks_available: st.blocks_available() as u64,
            files: st.files() as u64,
            files_free: st.files_free() as u64,
            files_available: st.files_available() as u64,
        })
    }

    fn loop_attach(&self, backing: &File, name: &Path, opts: AttachOptions) -> io::Result<PathBuf> {
        super::loopdev::attach(backing, name, opts)
    }

    fn loop_detach(&self, dev: &Path, st_dev: u64, st_ino: u64) -> Result<(), DetachError> {
        super::loopdev::detach(dev, st_dev, st_ino)
    }

    fn loop_find_backed_by(&self, path: &Path, st_dev: u64, st_ino: u64) -> io::Result<Vec<LoopBinding>> {
        super::loopdev::find_backed_by(path, st_dev, st_ino)
    }

    fn loop_bound_devices(&self) -> io::Result<Vec<LoopBinding>> {
        super::loopdev::bound_devices()
    }

    fn device_size(&self, dev: &Path) -> io::Result<u64> {
        super::loopdev::device_size(dev)
    }

    fn loop_set_capacity(&self, dev: &Path) -> io::Result<u64> {
        super::loopdev::set_capacity(dev)
    }

    fn loop_status(&self, dev: &Path) -> io::Result<LoopInfo64> {
        File::open(dev).and_then(|f| super::loopdev::status(&f))
    }

    fn fs_probe(&self, dev: &Path) -> Result<Option<String>, FsError> {
        super::fstools::probe_type(dev, None)
    }

    fn fs_probe_loop(&self, dev: &Path, image: &Path) -> Result<Option<String>, FsError> {
        super::fstools::probe_type(dev, Some(image))
    }

    fn mkfs(&self, dev: &Path, fs: FsType) -> Result<(), FsError> {
        super::fstools::mkfs(dev, fs)
    }

    fn fs_size(&self, dev: &Path, fs: FsType) -> Result<Option<u64>, FsError> {
        super::fstools::fs_size_bytes(dev, fs)
    }

    fn grow_fs(&self, dev_or_mountpoint: &Path, fs: FsType) -> Result<(), FsError> {
        super::fstools::grow_fs(dev_or_mountpoint, fs)
    }

    fn crypt_format(&self, dev: &Path, key: &Key) -> Result<(), CryptError> {
        super::crypt::format(dev, key)
    }

    fn crypt_open(&self, dev: &Path, name: &str, key: &Key) -> Result<PathBuf, CryptError> {
        super::crypt::open(dev, name, key)
    }

    fn crypt_key_slot(&self, dev: &Path, key: &Key) -> Result<Option<u32>, CryptError> {
        super::crypt::key_slot(dev, key)
    }

    fn crypt_header(&self, dev: &Path) -> Result<Header, CryptError> {
        super::crypt::header(dev)
    }

    fn crypt_add_key(&self, dev: &Path, existing: &Key, new: &Key) -> Result<(), CryptError> {
        super::crypt::add_key(dev, existing, new)
    }

    fn crypt_reencrypt_init(&self, dev: &Path, key: &Key, slot: u32) -> Result<(), CryptError> {
        super::crypt::reencrypt_init(dev, key, slot)
    }

    fn crypt_reencrypt_resume(&self, dev: &Path, key: &Key) -> Result<(), CryptError> {
        super::crypt::reencrypt_resume(dev, key)
    }

    fn crypt_close(&self, name: &str) -> Result<(), CryptError> {
        super::crypt::close(name)
    }

    fn crypt_resize(&self, name: &str) -> Result<(), CryptError> {
        super::crypt::resize(name)
    }

    fn crypt_is_fresh(&self, dev: &Path) -> Result<bool, CryptError> {
        super::crypt::is_fresh(dev)
    }

    fn crypt_mark_formatted(&self, dev: &Path) -> Result<(), CryptError> {
        super::crypt::mark_formatted(dev)
    }

    fn crypt_mapping(&self, name: &str) -> Result<Option<Mapping>, CryptError> {
        super::crypt::mapping(name)
    }

    fn crypt_mappings(&self) -> Result<Vec<Mapping>, CryptError> {
        super::crypt::mappings()
    }
}
