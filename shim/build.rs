//! scripts/build-shim sets NODEPLANE_CNI_FRONT for its static build of the shim binary: the
//! binary then starts at the front (`nodeplane_cni_front`), which relocates a static-pie
//! binary itself and so must not run in one a dynamic loader has relocated already.

fn main() {
    println!("cargo::rerun-if-env-changed=NODEPLANE_CNI_FRONT");
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if arch == "x86_64" && os == "linux" && std::env::var_os("NODEPLANE_CNI_FRONT").is_some() {
        println!("cargo::rustc-link-arg-bin=nodeplane-cni=-Wl,--entry=nodeplane_cni_entry");
    }
}
