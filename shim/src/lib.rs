//! The CNI side of nodeplane that runs outside the agent: the CNI contract (`cni`: spec,
//! versions, error codes, results, the shim↔agent wire), the shim's logic (`shim`), the queue
//! of DELs the shim could not deliver (`pending_del`), descriptor passing (`fdpass`) and the
//! network-namespace check (`nsfs`).
//!
//! A crate of its own so that the shim binary (`nodeplane-cni`) is small and statically
//! linked: the runtime execs it on the host, with the host's C library, whatever Debian the
//! agent's image was built on (scripts/build-shim). The agent uses the same modules through
//! `nodeplane::net` and `nodeplane::sys`.

pub mod cni;
pub mod fdpass;
pub mod fsutil;
pub mod nsfs;
pub mod pending_del;
pub mod shim;

/// FNV-1a, 64 bit: stable across versions and processes (used to derive interface names).
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            h ^= 0xff;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        for b in *p {
            h ^= *b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}
