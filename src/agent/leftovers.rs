//! Directories that agents before issue 43 made ahead and this one no longer uses: pools of
//! spare and made-ahead files, empty directories made ahead, ext4 templates. A node upgraded
//! from such an agent still has them; they are removed at start, under the state-dir lock.
//!
//! None of them holds anything in use. Each entry was never used (made ahead), already
//! released (a spare: a deleted volume's image or a released lease, kept to be recycled), or a
//! template of an empty filesystem. Volumes, leases and records live beside them, never in
//! them.

use std::io;
use std::path::{Path, PathBuf};

use super::config::Config;

/// The directories older agents made under this configuration's paths.
pub fn paths(cfg: &Config) -> Vec<PathBuf> {
    let leases = cfg.lease_dir();
    let name = leases.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut out = vec![
        // The IPAM's spare lease files: `<lease dir>.spare`, beside it.
        leases.with_file_name(format!("{name}.spare")),
        // The CSI node's spare record files.
        cfg.state_dir.join("csi").join(".spare"),
        // Empty target directories made ahead inside kubelet's plugin directory.
        cfg.kubelet_dir.join("plugins").join(crate::storage::csi::DRIVER_NAME).join(".unused-dirs"),
    ];
    if let Some(c) = &cfg.csi {
        // Released images, images made ahead, and ext4 templates per size.
        out.extend([".spare", ".unused", "fs-templates"].map(|d| c.volume_dir.join(d)));
    }
    out
}

/// Remove `paths` (directories) where they exist; log each one removed. A failure is logged
/// and start-up goes on: what is left only takes space.
pub fn remove(paths: &[PathBuf]) -> usize {
    let mut removed = 0;
    for p in paths {
        match remove_one(p) {
            Ok(true) => {
                removed += 1;
                tracing::info!(path = %p.display(), "removed a directory an older agent made ahead (no longer used)");
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(path = %p.display(), error = %e, "removing an older agent's directory"),
        }
    }
    removed
}

/// `Ok(false)`: nothing there. Never follows a symlink: only a real directory is removed.
fn remove_one(p: &Path) -> io::Result<bool> {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p).map(|()| true),
        Ok(_) => Err(io::Error::new(io::ErrorKind::InvalidInput, "not a directory; left alone")),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn only_the_old_pools_go_and_what_sits_beside_them_stays() {
        let root = std::env::temp_dir().join(format!("np-leftovers-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let vol = root.join("volumes");
        for d in [".spare", ".unused", "fs-templates/65536"] {
            fs::create_dir_all(vol.join(d)).unwrap();
            fs::write(vol.join(d).join("x.img"), b"old").unwrap();
        }
        fs::write(vol.join("pvc-a.img"), b"data").unwrap();
        let ipam = root.join("ipam.spare");
        fs::create_dir_all(&ipam).unwrap();
        fs::create_dir_all(root.join("ipam")).unwrap();
        fs::write(root.join("ipam/lease"), b"lease").unwrap();
        let linked = root.join("elsewhere");
        fs::create_dir_all(&linked).unwrap();
        std::os::unix::fs::symlink(&linked, root.join("link")).unwrap();

        let list = [".spare", ".unused", "fs-templates"].map(|d| vol.join(d));
        let mut all = list.to_vec();
        all.extend([ipam.clone(), root.join("absent"), root.join("link")]);
        assert_eq!(remove(&all), 4);
        for p in list.iter().chain([&ipam]) {
            assert!(!p.exists(), "{} is still there", p.display());
        }
        assert_eq!(fs::read(vol.join("pvc-a.img")).unwrap(), b"data");
        assert_eq!(fs::read(root.join("ipam/lease")).unwrap(), b"lease");
        assert!(linked.is_dir() && root.join("link").exists(), "a symlink is left alone");
        assert_eq!(remove(&all), 0, "a second start finds nothing");
        fs::remove_dir_all(&root).unwrap();
    }
}
