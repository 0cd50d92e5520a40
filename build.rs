//! Compiles the protos in `proto/` into OUT_DIR with the vendored `protoc` (no network).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; prost-build reads PROTOC from the env.
    unsafe { std::env::set_var("PROTOC", protoc) };
    // google/protobuf/{descriptor,timestamp,wrappers}.proto ship with the vendored protoc.
    let wkt_include = protoc_bin_vendored::include_path()?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);

    let protos = [
        PathBuf::from("proto/nodeplane/controller/v1/controller.proto"),
        PathBuf::from("proto/nodeplane/node/v1/node.proto"),
        // CSI v1 (Identity, Controller, GroupController, SnapshotMetadata, Node).
        PathBuf::from("proto/csi/v1/csi.proto"),
        // kubelet plugin registration v1 (package `pluginregistration`).
        PathBuf::from("proto/pluginregistration/v1/api.proto"),
        // kubelet device plugin API v1beta1 (package `v1beta1`).
        PathBuf::from("proto/deviceplugin/v1beta1/api.proto"),
        // kubelet DRA plugin API v1 (package `k8s.io.kubelet.pkg.apis.dra.v1`).
        PathBuf::from("proto/dra/v1/api.proto"),
        // kubelet DRA device health v1alpha1 (package `v1alpha1`).
        PathBuf::from("proto/drahealth/v1alpha1/api.proto"),
    ];
    let includes = [PathBuf::from("proto"), wkt_include];

    tonic_prost_build::configure()
        // The crate does not depend on prost-types: Timestamp (the only
        // well-known message the CSI protos use; wrappers map to Option<primitive>)
        // is our own wire-identical type in src/rpc/mod.rs.
        .extern_path(".google.protobuf.Timestamp", "crate::rpc::Timestamp")
        // Kept for the wire-contract tests (field numbers and custom options).
        .file_descriptor_set_path(out_dir.join("nodeplane_descriptor.bin"))
        .compile_protos(&protos, &includes)?;
    for p in &protos {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    Ok(())
}
