//! Kernel primitives, without policy: rtnetlink (`netlink`), network namespace handles
//! entered on short-lived threads (`netns`), the mount table and descriptor-based mounts
//! (`mount`), loop devices (`loopdev`), capability dropping (`caps`). Nothing here knows
//! about pods, volumes or devices; nothing here imports anything above it.

pub mod caps;
pub mod fs;
pub mod loopdev;
pub mod mount;
pub mod netlink;
pub mod netns;
