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
