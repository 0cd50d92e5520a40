//! Kernel primitives, without policy: rtnetlink (`netlink`), network namespace handles
//! entered on short-lived threads (`netns`), the mount table and descriptor-based mounts
//! (`mount`), loop devices (`loopdev`), filesystem tools (`fstools`: blkid, mkfs, grow),
//! capability dropping (`caps`), and the one seam the volume plane reaches the volume ones
//! through (`volume_kernel`; `fake_volume` is its recording fake for tests). Nothing here
//! knows about pods or devices; nothing here imports anything above it.

pub mod caps;
pub mod fs;
pub mod fstools;
pub mod loopdev;
pub mod mount;
pub mod netlink;
pub mod netns;
pub mod volume_kernel;
#[cfg(test)]
pub mod fake_volume;
