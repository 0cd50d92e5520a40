//! Compiles the protos in `proto/` into OUT_DIR with the vendored `protoc` (no network).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; prost-build reads PROTOC from the env.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let protos = ["proto/nodeplane/controller/v1/controller.proto"];
    tonic_prost_build::configure().compile_protos(&protos, &["proto"])?;
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    Ok(())
}
