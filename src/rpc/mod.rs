//! Generated gRPC code (compiled from `proto/` by `build.rs`) and shared helpers.

#[allow(clippy::all)]
pub mod controller {
    tonic::include_proto!("nodeplane.controller.v1");
}
