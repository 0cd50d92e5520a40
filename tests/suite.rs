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
mod csi_root;
mod deviceplugin_kubelet_root;
mod deviceplugin_restart_root;
mod deviceplugin_root;
mod dra_root;
mod fake_apiserver;
mod fuzz_inputs;
mod kube_controller;
mod routes_root;
mod volume_root;
