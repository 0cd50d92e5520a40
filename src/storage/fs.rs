//! Filesystems on volumes: probe, make, measure and grow. The tools themselves run in
//! [`crate::sys::fstools`] (below the planes, so the kernel seam in
//! [`crate::sys::volume_kernel`] can reach them); this is the volume plane's name for them.

pub use crate::sys::fstools::*;
