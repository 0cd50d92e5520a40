//! The legacy iptables backend (x_tables), read only: whether a table holds a chain.
//!
//! nft does not see what iptables-legacy wrote. Its rules live in the kernel's x_tables,
//! which iptables reads with `getsockopt(IPT_SO_GET_ENTRIES)`: the table as one blob of
//! entries (the same for ip6_tables, at the IPv6 level). A user chain starts with an entry whose ERROR target carries the chain's name,
//! so the name, NUL-ended, is in the blob.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `IPT_SO_GET_INFO` and `IPT_SO_GET_ENTRIES` (the same numbers for ip6_tables).
const SO_GET_INFO: libc::c_int = 64;
const SO_GET_ENTRIES: libc::c_int = 65;
/// `struct ipt_getinfo`: name[32], valid_hooks, hook_entry[5], underflow[5], num_entries,
/// size.
const INFO_LEN: usize = 84;
/// `struct ipt_get_entries` before its entries: name[32], size, padding to the entries'
/// 8-byte alignment.
const ENTRIES_HEAD: usize = 40;

/// Whether the legacy `table` of the family (IPv6 when `v6`) holds user chain `chain`.
/// False when the family's x_tables are not loaded or hold no such table: the table's
/// module is never loaded by asking.
pub fn legacy_chain_exists(v6: bool, table: &str, chain: &str) -> bool {
    let names = if v6 { "/proc/net/ip6_tables_names" } else { "/proc/net/ip_tables_names" };
    let loaded = std::fs::read_to_string(names).unwrap_or_default();
    if !loaded.lines().any(|l| l == table) {
        return false;
    }
    // The table may change between the two calls (its size with it): ask again.
    (0..3).find_map(|_| entries(v6, table)).is_some_and(|blob| {
        let mut needle = chain.as_bytes().to_vec();
        needle.push(0);
        blob.windows(needle.len()).any(|w| w == needle)
    })
}

/// The table's entries, or None on any error.
fn entries(v6: bool, table: &str) -> Option<Vec<u8>> {
    let (family, level) = if v6 { (libc::AF_INET6, libc::IPPROTO_IPV6) } else { (libc::AF_INET, libc::IPPROTO_IP) };
    // Any IP socket passes options it does not know to netfilter: a UDP one needs no
    // CAP_NET_RAW (iptables' raw socket does), only the CAP_NET_ADMIN the reading needs.
    // SAFETY: socket(2) with constant arguments; the descriptor is owned at once.
    let fd = unsafe { libc::socket(family, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fd is a new descriptor nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut name = [0u8; 32];
    name.get_mut(..table.len())?.copy_from_slice(table.as_bytes());
    let mut info = [0u8; INFO_LEN];
    info[..32].copy_from_slice(&name);
    get(&sock, level, SO_GET_INFO, &mut info)?;
    let size = u32::from_ne_bytes(info[80..84].try_into().ok()?) as usize;
    let mut buf = vec![0u8; ENTRIES_HEAD + size];
    buf[..32].copy_from_slice(&name);
    buf[32..36].copy_from_slice(&(size as u32).to_ne_bytes());
    get(&sock, level, SO_GET_ENTRIES, &mut buf)?;
    buf.drain(..ENTRIES_HEAD);
    Some(buf)
}

/// getsockopt into all of `buf`, which must come back whole.
fn get(sock: &OwnedFd, level: libc::c_int, opt: libc::c_int, buf: &mut [u8]) -> Option<()> {
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: buf is valid for len bytes, and len is passed by a valid pointer.
    let r = unsafe { libc::getsockopt(sock.as_raw_fd(), level, opt, buf.as_mut_ptr().cast(), &mut len) };
    (r == 0 && len as usize == buf.len()).then_some(())
}
