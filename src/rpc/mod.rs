//! Generated gRPC code (compiled from `proto/` by `build.rs`) and shared helpers.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[allow(clippy::all)]
pub mod controller {
    tonic::include_proto!("nodeplane.controller.v1");
}

/// The agent's local node API (`nodeplane.node.v1`): the node-local volume store.
#[allow(clippy::all)]
pub mod node {
    tonic::include_proto!("nodeplane.node.v1");
}

/// CSI v1 (`csi.v1`): Identity, Controller, GroupController, SnapshotMetadata and Node.
/// Wire contract with kubelet and the CSI sidecars; see `proto/csi/v1/csi.proto`.
#[allow(clippy::all, clippy::pedantic, missing_docs, deprecated)]
pub mod csi {
    tonic::include_proto!("csi.v1");
}

/// Kubelet plugin registration v1 (package `pluginregistration`, served on
/// `<kubelet-root>/plugins_registry/<name>-reg.sock`).
#[allow(clippy::all, clippy::pedantic, missing_docs, deprecated)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// Where a gRPC server listens or a client dials: `unix:/abs/path` or `host:port`.
#[derive(Debug, Clone)]
pub enum Listen {
    Unix(std::path::PathBuf),
    Tcp(std::net::SocketAddr),
}

/// Parse `unix:/abs/path` or `host:port`.
pub fn parse_listen(s: &str) -> Result<Listen, String> {
    if let Some(path) = s.strip_prefix("unix:") {
        let p = std::path::PathBuf::from(path);
        if !p.is_absolute() {
            return Err(format!("listen {s:?}: the socket path must be absolute"));
        }
        return Ok(Listen::Unix(p));
    }
    s.parse().map(Listen::Tcp).map_err(|_| format!("listen {s:?} is neither unix:/path nor host:port"))
}

/// A client channel to a controller at `unix:/path` or `host:port`.
pub async fn connect(address: &str) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    match parse_listen(address) {
        Ok(Listen::Unix(path)) => connect_unix(&path).await,
        _ => {
            tonic::transport::Endpoint::from_shared(format!("http://{address}"))?
                .connect_timeout(std::time::Duration::from_secs(3))
                .connect()
                .await
        }
    }
}

/// Why a client channel could not be made. Transport errors print their causes (a refused
/// certificate says why).
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("{0}")]
    Address(String),
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("{}", tls::chain(.0))]
    Transport(#[from] tonic::transport::Error),
}

/// A client channel to a controller at `unix:/path` or `host:port`, over TLS when `tls` is
/// given (a TCP address without it is plaintext: callers refuse that unless configured
/// `insecure`).
pub async fn connect_with(
    address: &str,
    tls: Option<&tls::ClientFiles>,
) -> Result<tonic::transport::Channel, ConnectError> {
    match (parse_listen(address).map_err(ConnectError::Address)?, tls) {
        (Listen::Unix(path), _) => Ok(connect_unix(&path).await?),
        (Listen::Tcp(addr), Some(t)) => tls::connect(addr, t).await,
        (Listen::Tcp(_), None) => Ok(connect(address).await?),
    }
}

/// Run `f` on a blocking thread for a gRPC call: the one place a failed task (a panic)
/// becomes a status (INTERNAL).
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, tonic::Status> {
    tokio::task::spawn_blocking(f).await.map_err(|e| tonic::Status::internal(format!("the call's task failed: {e}")))
}

/// A gRPC client channel over the Unix socket at `path` (the authority is a placeholder;
/// every call goes to the socket).
pub async fn connect_unix(path: &std::path::Path) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let path = std::sync::Arc::new(path.to_path_buf());
    tonic::transport::Endpoint::from_static("http://unix.invalid")
        .connect_timeout(Duration::from_secs(3))
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                let s = tokio::net::UnixStream::connect(&*path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
}

/// Kubelet device plugin API v1beta1 (package `v1beta1`): `Registration` (kubelet) and
/// `DevicePlugin` (each plugin), over Unix sockets in `<kubelet>/device-plugins/`.
#[allow(clippy::all, clippy::pedantic, missing_docs, non_snake_case)]
pub mod deviceplugin {
    tonic::include_proto!("v1beta1");
}

/// Kubelet DRA kubelet-plugin API v1 (package `k8s.io.kubelet.pkg.apis.dra.v1`, service
/// `DRAPlugin`; registered as `v1.DRAPlugin`), over `<kubelet>/plugins/<driver>/dra.sock`.
#[allow(clippy::all, clippy::pedantic, missing_docs, non_snake_case)]
pub mod dra {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}

/// Kubelet DRA device health v1alpha1 (package `v1alpha1`, service `DRAResourceHealth`),
/// served on the same socket as [`dra`].
#[allow(clippy::all, clippy::pedantic, missing_docs, non_snake_case)]
pub mod drahealth {
    tonic::include_proto!("v1alpha1");
}

/// The serialized `FileDescriptorSet` of every proto the crate compiles
/// (with custom options such as `csi.v1.csi_secret`), for introspection and tests.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/nodeplane_descriptor.bin"));

/// `google.protobuf.Timestamp`, wire-identical (seconds = 1, nanos = 2).
///
/// Used by the generated CSI code (`Snapshot.creation_time`,
/// `VolumeGroupSnapshot.creation_time`) through an `extern_path` in `build.rs`,
/// so the crate needs no `prost-types` dependency.
#[derive(Clone, Copy, PartialEq, Eq, Hash, ::prost::Message)]
pub struct Timestamp {
    /// Seconds since the Unix epoch (may be negative).
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    /// Non-negative fraction of a second, 0..=999_999_999.
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

impl From<SystemTime> for Timestamp {
    fn from(t: SystemTime) -> Self {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Timestamp { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32 },
            Err(e) => {
                // Before the epoch: floor the seconds, keep nanos non-negative.
                let d = e.duration();
                let (mut secs, mut nanos) = (-(d.as_secs() as i64), -(d.subsec_nanos() as i32));
                if nanos < 0 {
                    secs -= 1;
                    nanos += 1_000_000_000;
                }
                Timestamp { seconds: secs, nanos }
            }
        }
    }
}

impl From<Timestamp> for SystemTime {
    fn from(t: Timestamp) -> Self {
        let nanos = Duration::from_nanos(t.nanos.clamp(0, 999_999_999) as u64);
        if t.seconds >= 0 {
            UNIX_EPOCH + Duration::from_secs(t.seconds as u64) + nanos
        } else {
            UNIX_EPOCH - Duration::from_secs(t.seconds.unsigned_abs()) + nanos
        }
    }
}

pub mod authority;
pub mod tls;

#[cfg(test)]
mod tests;

/// The layer every nodeplane gRPC server runs its responses through; see
/// [`oversize_is_resource_exhausted`].
pub fn response_layer() -> tower::util::MapResponseLayer<
    fn(tonic::codegen::http::Response<tonic::body::Body>) -> tonic::codegen::http::Response<tonic::body::Body>,
> {
    tower::util::MapResponseLayer::new(oversize_is_resource_exhausted)
}

/// tonic refuses a request larger than the server's limit (4 MiB) with OUT_OF_RANGE; gRPC's
/// status code table says RESOURCE_EXHAUSTED ("message larger than configured limit"), which
/// is what clients (kubelet, the sidecars) take as "too big", not "bad value". The refusal
/// itself already happens early: from the 5-byte message header, before the body is read.
pub fn oversize_is_resource_exhausted(
    mut r: tonic::codegen::http::Response<tonic::body::Body>,
) -> tonic::codegen::http::Response<tonic::body::Body> {
    use tonic::codegen::http::HeaderValue;
    let h = r.headers();
    let too_large = h.get("grpc-status").is_some_and(|v| v == "11")
        && h.get("grpc-message")
            .and_then(|m| m.to_str().ok())
            .is_some_and(|m| m.replace("%20", " ").starts_with("Error, decoded message length too large"));
    if too_large {
        r.headers_mut().insert("grpc-status", HeaderValue::from_static("8"));
    }
    r
}

/// The deadline a caller set on a call (its `grpc-timeout` header: digits and one of
/// `H M S m u n`), if any. Work that tonic cannot cancel (a blocking thread) checks it.
pub fn deadline_of(md: &tonic::metadata::MetadataMap) -> Option<std::time::Duration> {
    let v = md.get("grpc-timeout")?.to_str().ok()?;
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    let n: u64 = digits.parse().ok()?;
    use std::time::Duration;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod deadline_tests {
    #[test]
    fn grpc_timeout_header() {
        use std::time::Duration;
        let mut md = tonic::metadata::MetadataMap::new();
        assert_eq!(super::deadline_of(&md), None);
        for (v, d) in [
            ("1S", Duration::from_secs(1)),
            ("250m", Duration::from_millis(250)),
            ("2M", Duration::from_secs(120)),
            ("7u", Duration::from_micros(7)),
        ] {
            md.insert("grpc-timeout", v.parse().unwrap());
            assert_eq!(super::deadline_of(&md), Some(d), "{v}");
        }
        for bad in ["S", "1x", "1234567890S", "-1S"] {
            md.insert("grpc-timeout", bad.parse().unwrap());
            assert_eq!(super::deadline_of(&md), None, "{bad}");
        }
    }
}
