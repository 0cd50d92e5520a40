//! Kernel primitives, without policy: rtnetlink (`netlink`), network namespace handles
//! (`netns`: entered only around one `socket` call), the mount table and descriptor-based mounts
//! (`mount`), loop devices (`loopdev`), image copies and filesystem freezes (`imagecopy`),
//! what a device holds beyond blkid's signatures (`probe`), filesystem tools (`fstools`:
//! blkid, mkfs, grow), dm-crypt (`crypt`: LUKS2 through cryptsetup),
//! capability dropping (`caps`), atomic files and Unix sockets (`fs`), descriptors passed over
//! Unix sockets (`fdpass`), the legacy iptables tables, read only (`xtables`).
//!
//! The planes reach the kernel through two seams: `net_kernel` (links, addresses, routes,
//! namespaces for the pod network) and `volume_kernel` (loop devices, mounts, filesystem
//! tools for volumes), each with its real implementation here and a recording fake for unit
//! tests (`fake_net`, `fake_volume`). Nothing here knows about pods, volumes or devices;
//! nothing here imports anything above it.

pub mod caps;
pub mod crypt;
#[cfg(test)]
pub mod fake_net;
#[cfg(test)]
pub mod fake_volume;
pub mod features;
pub use nodeplane_cni::fdpass;
pub mod fs;
pub mod fstools;
pub mod imagecopy;
pub mod loopdev;
pub mod lvm;
pub mod mount;
pub mod net_kernel;
pub mod netlink;
pub mod netns;
pub mod probe;
pub mod volume_kernel;
pub mod wireguard;
pub mod xtables;
