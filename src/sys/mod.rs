//! Kernel primitives, without policy: rtnetlink (`netlink`), network namespace handles
//! entered on short-lived threads (`netns`), the mount table and descriptor-based mounts
//! (`mount`), loop devices (`loopdev`), capability dropping (`caps`), atomic files and
//! Unix sockets (`fs`), and the network plane's kernel seam (`kernel`; its recording fake,
//! `fake`, exists in unit tests). Nothing here knows about pods, volumes or devices;
//! nothing here imports anything above it.

pub mod caps;
#[cfg(test)]
pub mod fake;
pub mod fs;
pub mod kernel;
pub mod loopdev;
pub mod mount;
pub mod netlink;
pub mod netns;
