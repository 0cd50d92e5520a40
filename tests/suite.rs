//! The cargo integration tests, one module per file of this directory, in one test binary.
//!
//! One binary, not one per file: every test binary is linked with the release profile's thin
//! LTO over all of the dependencies (about 30 s each on two cores), so twelve binaries cost
//! minutes of every CI run. Tests still run as before (cargo's harness, two at a time on
//! this machine); a file's tests are `cargo test --release --test suite <file>::`. Each file
//! names what it leaves on the machine (temp dirs, namespaces) with its own prefix and the
//! process id, so files sharing the process do not collide.

mod controller;
mod controller_tls;
mod crypt_root;
mod csi_root;
mod deviceplugin_kubelet_root;
mod deviceplugin_restart_root;
mod deviceplugin_root;
mod dra_root;
mod fuzz_inputs;
mod kube_controller;
mod lvm_root;
mod netlink_root;
mod routes_root;
mod volume_root;
mod wireguard_root;

// Test support shared by several files above, compiled once.
#[path = "../tools/support/cdi_validate.rs"]
mod cdi_validate;
#[path = "../tools/support/https_get.rs"]
mod https_get;
#[path = "../tools/support/kubelet_devices.rs"]
mod kubelet_emulator;

/// The CNI shim: built statically by scripts/build-shim (its own package, shim/) into the
/// directory cargo puts this package's binaries in.
pub fn shim() -> &'static str {
    static PATH: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let p = std::path::Path::new(env!("CARGO_BIN_EXE_nodeplane-agent")).with_file_name("nodeplane-cni");
        assert!(p.is_file(), "{} is missing: run scripts/build-shim (scripts/test does)", p.display());
        p.display().to_string()
    });
    &PATH
}

/// How much slower this machine runs than the one the tests' time spans were chosen on:
/// `NODEPLANE_TIME_SCALE` (scripts/vm-test sets 5 under software emulation; 1 otherwise).
/// Scale only spans that give something time to happen, never a bound a test asserts.
pub fn time_scale() -> f64 {
    let scale = std::env::var("NODEPLANE_TIME_SCALE").ok().and_then(|v| v.parse::<f64>().ok());
    scale.filter(|s| *s >= 1.0).unwrap_or(1.0)
}

/// How many times, 100 ms apart, a test retries an unmount that failed with EBUSY.
///
/// Tests run two at a time in one process, and a test reads and writes files in the volumes
/// it mounts. A child that another test spawns at that moment gets a copy of the descriptor:
/// the descriptor table is copied when the child is made, and close-on-exec descriptors
/// close only when it execs. Until then the mount is busy. Under software emulation that can
/// outlast the next call, so an unmount right after a read fails. A node has the same race
/// with any short-lived reader, and kubelet retries a failed unpublish or unstage; so do the
/// tests. A holder that stays still fails the test after these retries.
pub const BUSY_RETRIES: u32 = 50;

/// Unmount `at` (no flags), retrying EBUSY ([`BUSY_RETRIES`]); panics naming the holders.
#[track_caller]
pub fn umount(at: &std::path::Path) {
    for attempt in 1.. {
        match nix::mount::umount2(at, nix::mount::MntFlags::empty()) {
            Ok(()) => return,
            Err(nix::errno::Errno::EBUSY) if attempt <= BUSY_RETRIES => {
                eprintln!("NOTE: umount {}: EBUSY (attempt {attempt}); held by: {:?}", at.display(), holders_under(at));
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            Err(e) => panic!("umount {}: {e}; held by: {:?}", at.display(), holders_under(at)),
        }
    }
}

/// Whether a CSI call failed on an unmount's EBUSY, the answer a retry may change
/// ([`BUSY_RETRIES`]). Says so on stderr, with the attempt.
pub fn busy_unmount<T>(r: &Result<T, tonic::Status>, attempt: u32) -> bool {
    let busy = matches!(r, Err(s) if s.code() == tonic::Code::Internal && s.message().contains("EBUSY"));
    if busy && attempt <= BUSY_RETRIES {
        eprintln!("NOTE: {} (attempt {attempt}): retrying, as kubelet would", r.as_ref().err().unwrap().message());
        return true;
    }
    false
}

/// Processes with a working directory or an open file at or under `at` (`pid: path`), to
/// tell who keeps a mount busy.
pub fn holders_under(at: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        let pid = p.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let cwd = std::fs::read_link(p.path().join("cwd")).into_iter();
        let fds = std::fs::read_dir(p.path().join("fd"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|f| std::fs::read_link(f.path()).ok());
        for l in cwd.chain(fds).filter(|l| l.starts_with(at)) {
            let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
            out.push(format!("{pid} ({}): {}", comm.trim(), l.display()));
        }
    }
    out
}
