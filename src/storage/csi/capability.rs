//! The one reading of a CSI `VolumeCapability`, for both sides: the node service (one
//! capability per call) and the controller (the capability list of CreateVolume,
//! ValidateVolumeCapabilities, ControllerExpandVolume). Each side maps a `CapabilityError`
//! to its gRPC code; the messages are the same.

use serde::{Deserialize, Serialize};

use crate::rpc::csi;
use crate::rpc::csi::volume_capability::AccessType;
use crate::rpc::csi::volume_capability::access_mode::Mode;
use crate::storage::fs::FsType;

/// What one capability asks for. Stored in the node's stage and publish records (the field
/// names and the string `fs_type` are part of that format).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Capability {
    pub block: bool,
    #[serde(default)]
    pub fs_type: String,
    #[serde(default)]
    pub mount_flags: Vec<String>,
    #[serde(default)]
    pub mount_group: String,
    /// `csi.v1` access mode number.
    pub access_mode: i32,
}

impl Capability {
    pub fn mode(&self) -> Mode {
        Mode::try_from(self.access_mode).unwrap_or(Mode::Unknown)
    }

    /// The filesystem asked for; `None` when any will do (or for block access).
    pub fn fs(&self) -> Option<FsType> {
        if self.block || self.fs_type.is_empty() { None } else { self.fs_type.parse().ok() }
    }
}

/// Why a capability (or a list of them) cannot be served. `field` names the request field
/// as the caller sent it (`volume_capability`, `volume_capabilities[2]`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CapabilityError {
    #[error("{0} is required")]
    Missing(String),
    #[error("{field}.access_mode {mode} is not a known mode")]
    UnknownMode { field: String, mode: i32 },
    /// A MULTI_NODE mode: nodeplane volumes are node-local. The node answers
    /// FAILED_PRECONDITION ("exceeds the volume's capabilities", per the spec), the
    /// controller INVALID_ARGUMENT.
    #[error("access mode {} exceeds the volume's capabilities: nodeplane volumes are node-local (single-node modes only)", .0.as_str_name())]
    MultiNode(Mode),
    #[error("fs_type {0:?} is not supported (ext4, xfs)")]
    UnsupportedFs(String),
    #[error("conflicting filesystem types {0:?} and {1:?}")]
    ConflictingFs(String, String),
    #[error("a volume is either block or mount, not both")]
    BlockAndMount,
    #[error("{0}")]
    MountFlags(String),
    #[error("volume_mount_group {0:?} is not a numeric group id")]
    MountGroup(String),
}

/// Read one capability: an access mode (single-node only), an access type, and for mount
/// access a supported filesystem (or none). Mount flags and group are checked by
/// [`check_mount_options`] where they are used (the node).
pub fn parse(c: &csi::VolumeCapability, field: &str) -> Result<Capability, CapabilityError> {
    let mode = c.access_mode.as_ref().ok_or_else(|| CapabilityError::Missing(format!("{field}.access_mode")))?.mode;
    let cap = match c.access_type.as_ref().ok_or_else(|| CapabilityError::Missing(format!("{field}.access_type")))? {
        AccessType::Block(_) => Capability {
            block: true,
            fs_type: String::new(),
            mount_flags: Vec::new(),
            mount_group: String::new(),
            access_mode: mode,
        },
        AccessType::Mount(m) => Capability {
            block: false,
            fs_type: m.fs_type.clone(),
            mount_flags: m.mount_flags.clone(),
            mount_group: m.volume_mount_group.clone(),
            access_mode: mode,
        },
    };
    match Mode::try_from(mode) {
        Ok(
            Mode::SingleNodeWriter
            | Mode::SingleNodeReaderOnly
            | Mode::SingleNodeSingleWriter
            | Mode::SingleNodeMultiWriter,
        ) => {}
        Ok(m @ (Mode::MultiNodeReaderOnly | Mode::MultiNodeSingleWriter | Mode::MultiNodeMultiWriter)) => {
            return Err(CapabilityError::MultiNode(m));
        }
        Ok(Mode::Unknown) | Err(_) => return Err(CapabilityError::UnknownMode { field: field.to_string(), mode }),
    }
    if !cap.block && !cap.fs_type.is_empty() && !matches!(cap.fs_type.parse::<FsType>(), Ok(FsType::Ext4 | FsType::Xfs))
    {
        return Err(CapabilityError::UnsupportedFs(cap.fs_type.clone()));
    }
    Ok(cap)
}

/// The mount flags (one option per entry, known to the mount code) and the numeric mount
/// group of a mount capability.
pub fn check_mount_options(cap: &Capability) -> Result<(), CapabilityError> {
    if cap.block {
        return Ok(());
    }
    crate::sys::mount::parse_mount_flags(&cap.mount_flags).map_err(CapabilityError::MountFlags)?;
    if !cap.mount_group.is_empty() && cap.mount_group.parse::<u32>().is_err() {
        return Err(CapabilityError::MountGroup(cap.mount_group.clone()));
    }
    Ok(())
}

/// What a list of capabilities asks a new volume to hold: raw block, or one filesystem
/// (`fs_param`, the StorageClass's choice, else the capabilities', else ext4). Empty,
/// mixed block and mount, or two different filesystems are errors.
pub fn volume_kind(caps: &[csi::VolumeCapability], fs_param: Option<&str>) -> Result<FsType, CapabilityError> {
    if caps.is_empty() {
        return Err(CapabilityError::Missing("volume_capabilities".into()));
    }
    let mut fs: Option<String> = fs_param.filter(|f| !f.is_empty()).map(str::to_string);
    let (mut block, mut mount) = (false, false);
    for (i, c) in caps.iter().enumerate() {
        let cap = parse(c, &format!("volume_capabilities[{i}]"))?;
        if cap.block {
            block = true;
            continue;
        }
        mount = true;
        if !cap.fs_type.is_empty() {
            if let Some(f) = &fs
                && f != &cap.fs_type
            {
                return Err(CapabilityError::ConflictingFs(f.clone(), cap.fs_type));
            }
            fs = Some(cap.fs_type);
        }
    }
    if block && mount {
        return Err(CapabilityError::BlockAndMount);
    }
    if block {
        return Ok(FsType::Raw);
    }
    let Some(fs) = fs else { return Ok(FsType::Ext4) };
    match fs.parse::<FsType>() {
        Ok(f @ (FsType::Ext4 | FsType::Xfs)) => Ok(f),
        _ => Err(CapabilityError::UnsupportedFs(fs)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::csi::volume_capability::{AccessMode, BlockVolume, MountVolume};

    fn cap(mode: Mode, t: AccessType) -> csi::VolumeCapability {
        csi::VolumeCapability { access_mode: Some(AccessMode { mode: mode as i32 }), access_type: Some(t) }
    }
    fn mnt(fs: &str) -> AccessType {
        AccessType::Mount(MountVolume { fs_type: fs.into(), ..Default::default() })
    }
    fn block() -> AccessType {
        AccessType::Block(BlockVolume {})
    }

    #[test]
    fn one_reading_for_both_sides() {
        let w = Mode::SingleNodeWriter;
        assert_eq!(volume_kind(&[cap(w, mnt(""))], None), Ok(FsType::Ext4));
        assert_eq!(volume_kind(&[cap(w, mnt(""))], Some("xfs")), Ok(FsType::Xfs));
        assert_eq!(volume_kind(&[cap(w, mnt("xfs")), cap(Mode::SingleNodeReaderOnly, mnt(""))], None), Ok(FsType::Xfs));
        assert_eq!(volume_kind(&[cap(w, block())], None), Ok(FsType::Raw));
        assert_eq!(volume_kind(&[], None), Err(CapabilityError::Missing("volume_capabilities".into())));
        assert_eq!(volume_kind(&[cap(w, block()), cap(w, mnt(""))], None), Err(CapabilityError::BlockAndMount));
        assert_eq!(
            volume_kind(&[cap(w, mnt("ext4"))], Some("xfs")),
            Err(CapabilityError::ConflictingFs("xfs".into(), "ext4".into()))
        );
        assert_eq!(volume_kind(&[cap(w, mnt(""))], Some("btrfs")), Err(CapabilityError::UnsupportedFs("btrfs".into())));
        // The same per-capability rules as the node: the second entry names itself.
        let e = volume_kind(
            &[cap(w, mnt("")), csi::VolumeCapability { access_mode: None, access_type: Some(mnt("")) }],
            None,
        );
        assert_eq!(e, Err(CapabilityError::Missing("volume_capabilities[1].access_mode".into())));
        assert_eq!(
            volume_kind(&[cap(Mode::MultiNodeMultiWriter, mnt(""))], None),
            Err(CapabilityError::MultiNode(Mode::MultiNodeMultiWriter))
        );
        assert!(matches!(
            volume_kind(&[cap(Mode::Unknown, mnt(""))], None),
            Err(CapabilityError::UnknownMode { mode: 0, .. })
        ));
        // "block" names a raw volume in the node API, never a mount filesystem.
        assert_eq!(parse(&cap(w, mnt("block")), "c"), Err(CapabilityError::UnsupportedFs("block".into())));
    }

    #[test]
    fn mount_options_are_checked_apart() {
        let mut c = parse(&cap(Mode::SingleNodeWriter, mnt("ext4")), "volume_capability").unwrap();
        assert_eq!(c.fs(), Some(FsType::Ext4));
        c.mount_group = "staff".into();
        assert_eq!(check_mount_options(&c), Err(CapabilityError::MountGroup("staff".into())));
        c.mount_group = "1000".into();
        c.mount_flags = vec!["noatime,ro".into()];
        assert!(matches!(check_mount_options(&c), Err(CapabilityError::MountFlags(_))));
        c.mount_flags = vec!["noatime".into()];
        assert_eq!(check_mount_options(&c), Ok(()));
    }
}
