//! Pins the wire contract of the generated CSI and plugin-registration code.
//!
//! Expected field numbers, wire types and option numbers are written out here by
//! hand from the upstream definitions (CSI spec `csi.proto`, kubelet
//! `pluginregistration/v1/api.proto`), independently of `proto/`: a typo in a
//! field number, a type, a package or an option in the .proto files fails here.

use std::collections::HashMap;

use prost::Message;

use super::csi;
use super::deviceplugin as dp;
use super::pluginregistration as reg;
use super::{FILE_DESCRIPTOR_SET, Timestamp};

// ---------------------------------------------------------------------------
// A tiny protobuf wire writer/reader, independent of prost's generated code.
// ---------------------------------------------------------------------------

const VARINT: u8 = 0;
const LEN: u8 = 2;

fn varint(mut v: u64, out: &mut Vec<u8>) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

fn key(field: u32, wire: u8, out: &mut Vec<u8>) {
    varint(u64::from(field) << 3 | u64::from(wire), out);
}

/// A length-delimited field (string, bytes, sub-message, map entry).
fn ld(field: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    key(field, LEN, &mut out);
    varint(payload.len() as u64, &mut out);
    out.extend_from_slice(payload);
    out
}

/// A varint field (int32/int64/bool/enum).
fn vi(field: u32, v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    key(field, VARINT, &mut out);
    varint(v, &mut out);
    out
}

/// One `map<string, string>` entry as field `field`.
fn map_entry(field: u32, k: &str, v: &str) -> Vec<u8> {
    ld(field, &[ld(1, k.as_bytes()), ld(2, v.as_bytes())].concat())
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Wire {
    Varint(u64),
    Len(Vec<u8>),
    Fixed64(u64),
    Fixed32(u32),
}

fn read_varint(buf: &[u8], pos: &mut usize) -> u64 {
    let mut v = 0u64;
    let mut shift = 0;
    loop {
        let b = buf[*pos];
        *pos += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return v;
        }
        shift += 7;
    }
}

/// Splits an encoded message into (field number, value), sorted by field
/// number (stable, so repeated fields keep their order).
fn fields(buf: &[u8]) -> Vec<(u32, Wire)> {
    let mut pos = 0;
    let mut out = Vec::new();
    while pos < buf.len() {
        let k = read_varint(buf, &mut pos);
        let (field, wire) = ((k >> 3) as u32, (k & 7) as u8);
        let value = match wire {
            0 => Wire::Varint(read_varint(buf, &mut pos)),
            1 => {
                let v = u64::from_le_bytes(buf[pos..pos + 8].try_into().unwrap());
                pos += 8;
                Wire::Fixed64(v)
            }
            2 => {
                let n = read_varint(buf, &mut pos) as usize;
                let v = buf[pos..pos + n].to_vec();
                pos += n;
                Wire::Len(v)
            }
            5 => {
                let v = u32::from_le_bytes(buf[pos..pos + 4].try_into().unwrap());
                pos += 4;
                Wire::Fixed32(v)
            }
            w => panic!("unexpected wire type {w} for field {field}"),
        };
        out.push((field, value));
    }
    out.sort_by_key(|(f, _)| *f);
    out
}

fn len(v: &[u8]) -> Wire {
    Wire::Len(v.to_vec())
}

fn entry(k: &str, v: &str) -> Wire {
    Wire::Len([ld(1, k.as_bytes()), ld(2, v.as_bytes())].concat())
}

fn one(k: &str, v: &str) -> HashMap<String, String> {
    HashMap::from([(k.to_string(), v.to_string())])
}

// ---------------------------------------------------------------------------
// Encoding: prost output carries the upstream field numbers and wire types.
// ---------------------------------------------------------------------------

fn mount_ext4_writer() -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    csi::VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: vec!["noatime".into()],
            volume_mount_group: "1000".into(),
        })),
        access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
    }
}

#[test]
fn volume_capability_oneof_and_access_mode_numbers() {
    use csi::volume_capability::{AccessMode, AccessType, BlockVolume, access_mode::Mode};

    // mount = 2 (MountVolume: fs_type 1, mount_flags 2, volume_mount_group 3),
    // access_mode = 3 (AccessMode: mode 1, SINGLE_NODE_WRITER = 1).
    let got = fields(&mount_ext4_writer().encode_to_vec());
    let mount = [ld(1, b"ext4"), ld(2, b"noatime"), ld(3, b"1000")].concat();
    assert_eq!(got, vec![(2, len(&mount)), (3, len(&vi(1, 1)))]);

    // block = 1 (empty message), SINGLE_NODE_MULTI_WRITER = 7.
    let block = csi::VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume {})),
        access_mode: Some(AccessMode { mode: Mode::SingleNodeMultiWriter as i32 }),
    };
    assert_eq!(fields(&block.encode_to_vec()), vec![(1, len(&[])), (3, len(&vi(1, 7)))]);
}

#[test]
fn access_mode_enum_values() {
    use csi::volume_capability::access_mode::Mode;
    let want = [
        (Mode::Unknown, 0),
        (Mode::SingleNodeWriter, 1),
        (Mode::SingleNodeReaderOnly, 2),
        (Mode::MultiNodeReaderOnly, 3),
        (Mode::MultiNodeSingleWriter, 4),
        (Mode::MultiNodeMultiWriter, 5),
        (Mode::SingleNodeSingleWriter, 6),
        (Mode::SingleNodeMultiWriter, 7),
    ];
    for (m, n) in want {
        assert_eq!(m as i32, n, "{m:?}");
    }
    assert_eq!(Mode::SingleNodeMultiWriter.as_str_name(), "SINGLE_NODE_MULTI_WRITER");
}

#[test]
fn node_stage_volume_request_numbers() {
    let req = csi::NodeStageVolumeRequest {
        volume_id: "v".into(),
        publish_context: one("k", "p"),
        staging_target_path: "/s".into(),
        volume_capability: Some(mount_ext4_writer()),
        secrets: one("a", "b"),
        volume_context: one("c", "d"),
    };
    let cap = mount_ext4_writer().encode_to_vec();
    assert_eq!(
        fields(&req.encode_to_vec()),
        vec![
            (1, len(b"v")),
            (2, entry("k", "p")),
            (3, len(b"/s")),
            (4, len(&cap)),
            (5, entry("a", "b")),
            (6, entry("c", "d")),
        ]
    );
    // No oneof at the top level: prost writes fields in number order, so the
    // exact bytes are those a reference implementation produces.
    let exact = [
        ld(1, b"v"),
        map_entry(2, "k", "p"),
        ld(3, b"/s"),
        ld(4, &cap),
        map_entry(5, "a", "b"),
        map_entry(6, "c", "d"),
    ]
    .concat();
    assert_eq!(req.encode_to_vec(), exact);
}

#[test]
fn node_publish_unpublish_unstage_numbers() {
    let req = csi::NodePublishVolumeRequest {
        volume_id: "v".into(),
        publish_context: one("k", "p"),
        staging_target_path: "/s".into(),
        target_path: "/t".into(),
        volume_capability: Some(mount_ext4_writer()),
        readonly: true,
        secrets: one("a", "b"),
        volume_context: one("c", "d"),
    };
    assert_eq!(
        fields(&req.encode_to_vec()),
        vec![
            (1, len(b"v")),
            (2, entry("k", "p")),
            (3, len(b"/s")),
            (4, len(b"/t")),
            (5, len(&mount_ext4_writer().encode_to_vec())),
            (6, Wire::Varint(1)),
            (7, entry("a", "b")),
            (8, entry("c", "d")),
        ]
    );

    let unpub = csi::NodeUnpublishVolumeRequest { volume_id: "v".into(), target_path: "/t".into() };
    assert_eq!(unpub.encode_to_vec(), [ld(1, b"v"), ld(2, b"/t")].concat());

    let unstage = csi::NodeUnstageVolumeRequest { volume_id: "v".into(), staging_target_path: "/s".into() };
    assert_eq!(unstage.encode_to_vec(), [ld(1, b"v"), ld(2, b"/s")].concat());
}

#[test]
fn node_stats_expand_info_numbers() {
    use csi::volume_usage::Unit;

    let req = csi::NodeGetVolumeStatsRequest {
        volume_id: "v".into(),
        volume_path: "/p".into(),
        staging_target_path: "/s".into(),
    };
    assert_eq!(req.encode_to_vec(), [ld(1, b"v"), ld(2, b"/p"), ld(3, b"/s")].concat());

    // usage = 1 (VolumeUsage: available 1, total 2, used 3, unit 4; BYTES = 1,
    // INODES = 2), volume_condition = 2 (abnormal 1, message 2).
    let resp = csi::NodeGetVolumeStatsResponse {
        usage: vec![
            csi::VolumeUsage { available: 30, total: 100, used: 70, unit: Unit::Bytes as i32 },
            csi::VolumeUsage { available: 3, total: 10, used: 7, unit: Unit::Inodes as i32 },
        ],
        volume_condition: Some(csi::VolumeCondition { abnormal: true, message: "gone".into() }),
    };
    let bytes_usage = [vi(1, 30), vi(2, 100), vi(3, 70), vi(4, 1)].concat();
    let inode_usage = [vi(1, 3), vi(2, 10), vi(3, 7), vi(4, 2)].concat();
    let cond = [vi(1, 1), ld(2, b"gone")].concat();
    assert_eq!(resp.encode_to_vec(), [ld(1, &bytes_usage), ld(1, &inode_usage), ld(2, &cond)].concat());

    // NodeExpandVolumeRequest: volume_id 1, volume_path 2, capacity_range 3,
    // staging_target_path 4, volume_capability 5, secrets 6.
    let exp = csi::NodeExpandVolumeRequest {
        volume_id: "v".into(),
        volume_path: "/p".into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 1 << 30, limit_bytes: 0 }),
        staging_target_path: "/s".into(),
        volume_capability: Some(mount_ext4_writer()),
        secrets: one("a", "b"),
    };
    assert_eq!(
        exp.encode_to_vec(),
        [
            ld(1, b"v"),
            ld(2, b"/p"),
            ld(3, &vi(1, 1 << 30)),
            ld(4, b"/s"),
            ld(5, &mount_ext4_writer().encode_to_vec()),
            map_entry(6, "a", "b"),
        ]
        .concat()
    );
    let exp_resp = csi::NodeExpandVolumeResponse { capacity_bytes: 2 << 30 };
    assert_eq!(exp_resp.encode_to_vec(), vi(1, 2 << 30));

    // NodeGetInfoResponse: node_id 1, max_volumes_per_node 2,
    // accessible_topology 3 (Topology.segments = 1).
    let info = csi::NodeGetInfoResponse {
        node_id: "n1".into(),
        max_volumes_per_node: 64,
        accessible_topology: Some(csi::Topology { segments: one("topology.csi.nodeplane.dev/node", "n1") }),
    };
    assert_eq!(
        info.encode_to_vec(),
        [ld(1, b"n1"), vi(2, 64), ld(3, &map_entry(1, "topology.csi.nodeplane.dev/node", "n1")),].concat()
    );
}

#[test]
fn create_volume_request_numbers() {
    use csi::volume_content_source::{SnapshotSource, Type};

    let topo = |n: &str| csi::Topology { segments: one("zone", n) };
    let req = csi::CreateVolumeRequest {
        name: "pvc-1".into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 10, limit_bytes: 20 }),
        volume_capabilities: vec![mount_ext4_writer(), mount_ext4_writer()],
        parameters: one("fs", "xfs"),
        secrets: one("a", "b"),
        volume_content_source: Some(csi::VolumeContentSource {
            r#type: Some(Type::Snapshot(SnapshotSource { snapshot_id: "snap".into() })),
        }),
        accessibility_requirements: Some(csi::TopologyRequirement {
            requisite: vec![topo("z1")],
            preferred: vec![topo("z2")],
        }),
        mutable_parameters: one("iops", "100"),
    };
    let cap = mount_ext4_writer().encode_to_vec();
    let topo_bytes = |n: &str| map_entry(1, "zone", n);
    assert_eq!(
        fields(&req.encode_to_vec()),
        vec![
            (1, len(b"pvc-1")),
            (2, len(&[vi(1, 10), vi(2, 20)].concat())),
            (3, len(&cap)),
            (3, len(&cap)),
            (4, entry("fs", "xfs")),
            (5, entry("a", "b")),
            // VolumeContentSource.snapshot = 1 (SnapshotSource.snapshot_id = 1).
            (6, len(&ld(1, &ld(1, b"snap")))),
            // TopologyRequirement: requisite 1, preferred 2.
            (7, len(&[ld(1, &topo_bytes("z1")), ld(2, &topo_bytes("z2"))].concat())),
            (8, entry("iops", "100")),
        ]
    );

    // VolumeContentSource.volume = 2 (VolumeSource.volume_id = 1).
    let clone = csi::VolumeContentSource {
        r#type: Some(Type::Volume(csi::volume_content_source::VolumeSource { volume_id: "src".into() })),
    };
    assert_eq!(clone.encode_to_vec(), ld(2, &ld(1, b"src")));

    // CreateVolumeResponse.volume = 1; Volume: capacity_bytes 1, volume_id 2,
    // volume_context 3, content_source 4, accessible_topology 5.
    let resp = csi::CreateVolumeResponse {
        volume: Some(csi::Volume {
            capacity_bytes: 4096,
            volume_id: "vol-1".into(),
            volume_context: one("c", "d"),
            content_source: Some(clone.clone()),
            accessible_topology: vec![topo("z1")],
        }),
    };
    let volume =
        [vi(1, 4096), ld(2, b"vol-1"), map_entry(3, "c", "d"), ld(4, &clone.encode_to_vec()), ld(5, &topo_bytes("z1"))]
            .concat();
    assert_eq!(resp.encode_to_vec(), ld(1, &volume));
}

#[test]
fn identity_and_capability_numbers() {
    use csi::node_service_capability::{Rpc, rpc::Type as NodeCap};
    use csi::plugin_capability::{self, service::Type as Svc, volume_expansion::Type as Exp};

    let info = csi::GetPluginInfoResponse {
        name: "csi.nodeplane.dev".into(),
        vendor_version: "0.1.0".into(),
        manifest: one("k", "v"),
    };
    assert_eq!(info.encode_to_vec(), [ld(1, b"csi.nodeplane.dev"), ld(2, b"0.1.0"), map_entry(3, "k", "v")].concat());

    // PluginCapability: oneof type { service = 1; volume_expansion = 2 }.
    let caps = csi::GetPluginCapabilitiesResponse {
        capabilities: vec![
            csi::PluginCapability {
                r#type: Some(plugin_capability::Type::Service(plugin_capability::Service {
                    r#type: Svc::ControllerService as i32,
                })),
            },
            csi::PluginCapability {
                r#type: Some(plugin_capability::Type::Service(plugin_capability::Service {
                    r#type: Svc::VolumeAccessibilityConstraints as i32,
                })),
            },
            csi::PluginCapability {
                r#type: Some(plugin_capability::Type::VolumeExpansion(plugin_capability::VolumeExpansion {
                    r#type: Exp::Online as i32,
                })),
            },
        ],
    };
    assert_eq!(
        caps.encode_to_vec(),
        [ld(1, &ld(1, &vi(1, 1))), ld(1, &ld(1, &vi(1, 2))), ld(1, &ld(2, &vi(1, 1))),].concat()
    );
    assert_eq!(Svc::GroupControllerService as i32, 3);
    assert_eq!(Svc::SnapshotMetadataService as i32, 4);
    assert_eq!(Exp::Offline as i32, 2);

    // NodeServiceCapability: oneof type { rpc = 1 }, RPC.type = 1.
    let want = [
        (NodeCap::StageUnstageVolume, 1),
        (NodeCap::GetVolumeStats, 2),
        (NodeCap::ExpandVolume, 3),
        (NodeCap::VolumeCondition, 4),
        (NodeCap::SingleNodeMultiWriter, 5),
        (NodeCap::VolumeMountGroup, 6),
    ];
    for (cap, n) in want {
        let msg = csi::NodeServiceCapability {
            r#type: Some(csi::node_service_capability::Type::Rpc(Rpc { r#type: cap as i32 })),
        };
        assert_eq!(msg.encode_to_vec(), ld(1, &vi(1, n)), "{cap:?}");
    }

    use csi::controller_service_capability::rpc::Type as Ctl;
    let want = [
        (Ctl::CreateDeleteVolume, 1),
        (Ctl::PublishUnpublishVolume, 2),
        (Ctl::ListVolumes, 3),
        (Ctl::GetCapacity, 4),
        (Ctl::CreateDeleteSnapshot, 5),
        (Ctl::ListSnapshots, 6),
        (Ctl::CloneVolume, 7),
        (Ctl::PublishReadonly, 8),
        (Ctl::ExpandVolume, 9),
        (Ctl::ListVolumesPublishedNodes, 10),
        (Ctl::VolumeCondition, 11),
        (Ctl::GetVolume, 12),
        (Ctl::SingleNodeMultiWriter, 13),
        (Ctl::ModifyVolume, 14),
        (Ctl::GetSnapshot, 15),
    ];
    for (cap, n) in want {
        assert_eq!(cap as i32, n, "{cap:?}");
    }
    use csi::group_controller_service_capability::rpc::Type as Grp;
    assert_eq!(Grp::CreateDeleteGetVolumeGroupSnapshot as i32, 1);
    assert_eq!(csi::BlockMetadataType::FixedLength as i32, 1);
    assert_eq!(csi::BlockMetadataType::VariableLength as i32, 2);
}

#[test]
fn wrappers_and_timestamp_on_the_wire() {
    // ProbeResponse.ready is a google.protobuf.BoolValue (field 1, value 1).
    let ready = csi::ProbeResponse { ready: Some(true) };
    assert_eq!(ready.encode_to_vec(), ld(1, &vi(1, 1)));
    // "Not ready yet" is a present-but-false wrapper, distinct from unset.
    let not_ready = csi::ProbeResponse { ready: Some(false) };
    assert_eq!(not_ready.encode_to_vec(), ld(1, &[]));
    assert_eq!(csi::ProbeResponse { ready: None }.encode_to_vec(), Vec::<u8>::new());

    // GetCapacityResponse: available_capacity 1, maximum_volume_size 2 and
    // minimum_volume_size 3 as Int64Value.
    let cap = csi::GetCapacityResponse {
        available_capacity: 1000,
        maximum_volume_size: Some(500),
        minimum_volume_size: Some(1),
    };
    assert_eq!(cap.encode_to_vec(), [vi(1, 1000), ld(2, &vi(1, 500)), ld(3, &vi(1, 1))].concat());

    // Snapshot: size_bytes 1, snapshot_id 2, source_volume_id 3,
    // creation_time 4 (Timestamp: seconds 1, nanos 2), ready_to_use 5,
    // group_snapshot_id 6.
    let snap = csi::Snapshot {
        size_bytes: 7,
        snapshot_id: "s".into(),
        source_volume_id: "v".into(),
        creation_time: Some(Timestamp { seconds: 1_700_000_000, nanos: 5 }),
        ready_to_use: true,
        group_snapshot_id: "g".into(),
    };
    assert_eq!(
        snap.encode_to_vec(),
        [vi(1, 7), ld(2, b"s"), ld(3, b"v"), ld(4, &[vi(1, 1_700_000_000), vi(2, 5)].concat()), vi(5, 1), ld(6, b"g"),]
            .concat()
    );
}

#[test]
fn timestamp_system_time_round_trip() {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};
    let t = UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789);
    let ts = Timestamp::from(t);
    assert_eq!(ts, Timestamp { seconds: 1_700_000_000, nanos: 123_456_789 });
    assert_eq!(SystemTime::from(ts), t);
    let before = UNIX_EPOCH - Duration::new(1, 250_000_000);
    let ts = Timestamp::from(before);
    assert_eq!(ts, Timestamp { seconds: -2, nanos: 750_000_000 });
    assert_eq!(SystemTime::from(ts), before);
}

#[test]
fn plugin_registration_numbers() {
    let info = reg::PluginInfo {
        r#type: "CSIPlugin".into(),
        name: "csi.nodeplane.dev".into(),
        endpoint: "/var/lib/kubelet/plugins/csi.nodeplane.dev/csi.sock".into(),
        supported_versions: vec!["1.0.0".into(), "1.12.0".into()],
    };
    assert_eq!(
        info.encode_to_vec(),
        [
            ld(1, b"CSIPlugin"),
            ld(2, b"csi.nodeplane.dev"),
            ld(3, b"/var/lib/kubelet/plugins/csi.nodeplane.dev/csi.sock"),
            ld(4, b"1.0.0"),
            ld(4, b"1.12.0"),
        ]
        .concat()
    );
    let st = reg::RegistrationStatus { plugin_registered: true, error: "e".into() };
    assert_eq!(st.encode_to_vec(), [vi(1, 1), ld(2, b"e")].concat());
    assert!(reg::InfoRequest {}.encode_to_vec().is_empty());
    assert!(reg::RegistrationStatusResponse {}.encode_to_vec().is_empty());

    assert_eq!(reg::registration_server::SERVICE_NAME, "pluginregistration.Registration");
}

/// Upstream's field names (they reach JSON and reflection): the descriptor holds each as a
/// `FieldDescriptorProto.name` (field 1, length-delimited).
fn descriptor_has_field_name(name: &str) -> bool {
    let mut needle = vec![0x0a, name.len() as u8];
    needle.extend_from_slice(name.as_bytes());
    FILE_DESCRIPTOR_SET.windows(needle.len()).any(|w| w == needle.as_slice())
}

#[test]
fn device_plugin_v1beta1_numbers_and_names() {
    let req = dp::RegisterRequest {
        version: "v1beta1".into(),
        endpoint: "nodeplane-kvm.sock".into(),
        resource_name: "nodeplane.dev/kvm".into(),
        options: Some(dp::DevicePluginOptions { pre_start_required: true, get_preferred_allocation_available: true }),
    };
    assert_eq!(
        req.encode_to_vec(),
        [
            ld(1, b"v1beta1"),
            ld(2, b"nodeplane-kvm.sock"),
            ld(3, b"nodeplane.dev/kvm"),
            ld(4, &[vi(1, 1), vi(2, 1)].concat())
        ]
        .concat()
    );
    let dev = dp::Device {
        id: "kvm".into(),
        health: "Healthy".into(),
        topology: Some(dp::TopologyInfo { nodes: vec![dp::NumaNode { id: 1 }] }),
    };
    assert_eq!(dev.encode_to_vec(), [ld(1, b"kvm"), ld(2, b"Healthy"), ld(3, &ld(1, &vi(1, 1)))].concat());
    let pref = dp::ContainerPreferredAllocationRequest {
        available_device_i_ds: vec!["a".into()],
        must_include_device_i_ds: vec!["b".into()],
        allocation_size: 2,
    };
    assert_eq!(pref.encode_to_vec(), [ld(1, b"a"), ld(2, b"b"), vi(3, 2)].concat());
    let resp = dp::ContainerAllocateResponse {
        envs: one("K", "V"),
        mounts: vec![dp::Mount { container_path: "/c".into(), host_path: "/h".into(), read_only: true }],
        devices: vec![dp::DeviceSpec {
            container_path: "/dev/x".into(),
            host_path: "/dev/x".into(),
            permissions: "rw".into(),
        }],
        annotations: one("a", "b"),
        cdi_devices: vec![dp::CdiDevice { name: "nodeplane.dev/kvm=kvm".into() }],
    };
    assert_eq!(
        resp.encode_to_vec(),
        [
            map_entry(1, "K", "V"),
            ld(2, &[ld(1, b"/c"), ld(2, b"/h"), vi(3, 1)].concat()),
            ld(3, &[ld(1, b"/dev/x"), ld(2, b"/dev/x"), ld(3, b"rw")].concat()),
            map_entry(4, "a", "b"),
            ld(5, &ld(1, b"nodeplane.dev/kvm=kvm")),
        ]
        .concat()
    );
    assert_eq!(dp::ContainerAllocateRequest { devices_ids: vec!["x".into()] }.encode_to_vec(), ld(1, b"x"));
    assert_eq!(dp::PreStartContainerRequest { devices_ids: vec!["x".into()] }.encode_to_vec(), ld(1, b"x"));
    assert_eq!(dp::ContainerPreferredAllocationResponse { device_i_ds: vec!["x".into()] }.encode_to_vec(), ld(1, b"x"));
    for name in ["ID", "available_deviceIDs", "must_include_deviceIDs", "deviceIDs", "devices_ids", "cdi_devices"] {
        assert!(descriptor_has_field_name(name), "field name {name:?} missing from the descriptor");
    }
    assert_eq!(dp::registration_server::SERVICE_NAME, "v1beta1.Registration");
    assert_eq!(dp::device_plugin_server::SERVICE_NAME, "v1beta1.DevicePlugin");
}

#[test]
fn dra_v1_and_health_v1alpha1_numbers_and_names() {
    use super::dra;
    use super::drahealth as health;
    let claim = dra::Claim { namespace: "ns".into(), uid: "u-1".into(), name: "c".into() };
    let claim_bytes = [ld(1, b"ns"), ld(2, b"u-1"), ld(3, b"c")].concat();
    assert_eq!(claim.encode_to_vec(), claim_bytes);
    assert_eq!(dra::NodePrepareResourcesRequest { claims: vec![claim.clone()] }.encode_to_vec(), ld(1, &claim_bytes));
    assert_eq!(dra::NodeUnprepareResourcesRequest { claims: vec![claim] }.encode_to_vec(), ld(1, &claim_bytes));
    let dev = dra::Device {
        request_names: vec!["r".into()],
        pool_name: "p".into(),
        device_name: "d".into(),
        cdi_device_ids: vec!["nodeplane.dev/dra=x".into()],
    };
    let dev_bytes = [ld(1, b"r"), ld(2, b"p"), ld(3, b"d"), ld(4, b"nodeplane.dev/dra=x")].concat();
    assert_eq!(dev.encode_to_vec(), dev_bytes);
    let one = dra::NodePrepareResourceResponse { devices: vec![dev], error: "e".into() };
    let one_bytes = [ld(1, &dev_bytes), ld(2, b"e")].concat();
    assert_eq!(one.encode_to_vec(), one_bytes);
    let resp = dra::NodePrepareResourcesResponse { claims: [("u-1".to_string(), one)].into() };
    assert_eq!(resp.encode_to_vec(), ld(1, &[ld(1, b"u-1"), ld(2, &one_bytes)].concat()));
    let un = dra::NodeUnprepareResourcesResponse {
        claims: [("u-1".to_string(), dra::NodeUnprepareResourceResponse { error: "e".into() })].into(),
    };
    assert_eq!(un.encode_to_vec(), ld(1, &[ld(1, b"u-1"), ld(2, &ld(1, b"e"))].concat()));
    assert_eq!(dra::dra_plugin_server::SERVICE_NAME, "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin");

    let h = health::DeviceHealth {
        device: Some(health::DeviceIdentifier { pool_name: "p".into(), device_name: "d".into() }),
        health: health::HealthStatus::Unhealthy as i32,
        last_updated_time: 1_700_000_000,
        health_check_timeout_seconds: 30,
        message: "gone".into(),
    };
    let h_bytes =
        [ld(1, &[ld(1, b"p"), ld(2, b"d")].concat()), vi(2, 2), vi(3, 1_700_000_000), vi(4, 30), ld(5, b"gone")]
            .concat();
    assert_eq!(h.encode_to_vec(), h_bytes);
    assert_eq!(health::NodeWatchResourcesResponse { devices: vec![h] }.encode_to_vec(), ld(1, &h_bytes));
    assert_eq!(health::NodeWatchResourcesRequest {}.encode_to_vec(), Vec::<u8>::new());
    assert_eq!((health::HealthStatus::Unknown as i32, health::HealthStatus::Healthy as i32), (0, 1));
    assert_eq!(health::dra_resource_health_server::SERVICE_NAME, "v1alpha1.DRAResourceHealth");
    for name in [
        "request_names",
        "pool_name",
        "device_name",
        "cdi_device_ids",
        "last_updated_time",
        "health_check_timeout_seconds",
    ] {
        assert!(descriptor_has_field_name(name), "field name {name:?} missing from the descriptor");
    }
}

#[test]
fn grpc_service_names() {
    assert_eq!(csi::identity_server::SERVICE_NAME, "csi.v1.Identity");
    assert_eq!(csi::controller_server::SERVICE_NAME, "csi.v1.Controller");
    assert_eq!(csi::group_controller_server::SERVICE_NAME, "csi.v1.GroupController");
    assert_eq!(csi::snapshot_metadata_server::SERVICE_NAME, "csi.v1.SnapshotMetadata");
    assert_eq!(csi::node_server::SERVICE_NAME, "csi.v1.Node");
}

// ---------------------------------------------------------------------------
// Decoding: bytes laid out by hand from the upstream numbering (what kubelet
// or a sidecar sends) decode into the right Rust fields.
// ---------------------------------------------------------------------------

#[test]
fn decode_node_publish_from_upstream_numbering() {
    use csi::volume_capability::{AccessType, access_mode::Mode};

    // Deliberately out of field order, with an unknown field 99 a newer peer
    // might add: both must be accepted.
    let cap = [ld(1, &[]), ld(3, &vi(1, 7))].concat(); // block, SINGLE_NODE_MULTI_WRITER
    let bytes = [
        ld(4, b"/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/pv/mount"),
        ld(1, b"vol-9"),
        ld(3, b"/var/lib/kubelet/plugins/kubernetes.io/csi/csi.nodeplane.dev/x/globalmount"),
        ld(5, &cap),
        vi(6, 1),
        map_entry(7, "user", "secret"),
        map_entry(8, "csi.storage.k8s.io/ephemeral", "false"),
        map_entry(2, "devicePath", "/dev/loop3"),
        ld(99, b"future"),
    ]
    .concat();
    let req = csi::NodePublishVolumeRequest::decode(bytes.as_slice()).unwrap();
    assert_eq!(req.volume_id, "vol-9");
    assert_eq!(req.publish_context, one("devicePath", "/dev/loop3"));
    assert!(req.staging_target_path.ends_with("/globalmount"));
    assert!(req.target_path.ends_with("/mount"));
    let vc = req.volume_capability.unwrap();
    assert!(matches!(vc.access_type, Some(AccessType::Block(_))));
    assert_eq!(vc.access_mode.unwrap().mode(), Mode::SingleNodeMultiWriter);
    assert!(req.readonly);
    assert_eq!(req.secrets, one("user", "secret"));
    assert_eq!(req.volume_context, one("csi.storage.k8s.io/ephemeral", "false"));
}

#[test]
fn decode_node_stage_and_stats_from_upstream_numbering() {
    use csi::volume_capability::AccessType;

    let mount = [ld(1, b"xfs"), ld(2, b"nodiscard"), ld(2, b"noatime"), ld(3, b"2000")].concat();
    let cap = [ld(2, &mount), ld(3, &vi(1, 1))].concat();
    let bytes = [
        ld(1, b"vol-1"),
        map_entry(2, "k", "p"),
        ld(3, b"/stage"),
        ld(4, &cap),
        map_entry(5, "a", "b"),
        map_entry(6, "c", "d"),
    ]
    .concat();
    let req = csi::NodeStageVolumeRequest::decode(bytes.as_slice()).unwrap();
    assert_eq!(req.volume_id, "vol-1");
    assert_eq!(req.publish_context, one("k", "p"));
    assert_eq!(req.staging_target_path, "/stage");
    assert_eq!(req.secrets, one("a", "b"));
    assert_eq!(req.volume_context, one("c", "d"));
    match req.volume_capability.unwrap().access_type {
        Some(AccessType::Mount(m)) => {
            assert_eq!(m.fs_type, "xfs");
            assert_eq!(m.mount_flags, ["nodiscard", "noatime"]);
            assert_eq!(m.volume_mount_group, "2000");
        }
        other => panic!("expected mount, got {other:?}"),
    }

    let usage = [vi(1, 30), vi(2, 100), vi(3, 70), vi(4, 2)].concat();
    let bytes = [ld(2, &[vi(1, 1), ld(2, b"backing file missing")].concat()), ld(1, &usage)].concat();
    let resp = csi::NodeGetVolumeStatsResponse::decode(bytes.as_slice()).unwrap();
    assert_eq!(resp.usage.len(), 1);
    let u = &resp.usage[0];
    assert_eq!((u.available, u.total, u.used), (30, 100, 70));
    assert_eq!(u.unit(), csi::volume_usage::Unit::Inodes);
    let c = resp.volume_condition.unwrap();
    assert!(c.abnormal);
    assert_eq!(c.message, "backing file missing");
}

#[test]
fn decode_create_volume_and_plugin_info_from_upstream_numbering() {
    let topo = map_entry(1, "topology.csi.nodeplane.dev/node", "n2");
    let bytes = [
        ld(1, b"pvc-7"),
        ld(2, &[vi(1, 1 << 30), vi(2, 2 << 30)].concat()),
        ld(3, &[ld(2, &ld(1, b"ext4")), ld(3, &vi(1, 1))].concat()),
        map_entry(4, "type", "thin"),
        map_entry(5, "a", "b"),
        ld(6, &ld(2, &ld(1, b"vol-src"))),
        ld(7, &[ld(1, &topo), ld(2, &topo)].concat()),
        map_entry(8, "iops", "3000"),
    ]
    .concat();
    let req = csi::CreateVolumeRequest::decode(bytes.as_slice()).unwrap();
    assert_eq!(req.name, "pvc-7");
    let cr = req.capacity_range.unwrap();
    assert_eq!((cr.required_bytes, cr.limit_bytes), (1 << 30, 2 << 30));
    assert_eq!(req.volume_capabilities.len(), 1);
    assert_eq!(req.parameters, one("type", "thin"));
    assert_eq!(req.secrets, one("a", "b"));
    match req.volume_content_source.unwrap().r#type {
        Some(csi::volume_content_source::Type::Volume(v)) => assert_eq!(v.volume_id, "vol-src"),
        other => panic!("expected volume source, got {other:?}"),
    }
    let ar = req.accessibility_requirements.unwrap();
    assert_eq!(ar.requisite[0].segments, one("topology.csi.nodeplane.dev/node", "n2"));
    assert_eq!(ar.preferred.len(), 1);
    assert_eq!(req.mutable_parameters, one("iops", "3000"));

    let bytes = [ld(4, b"1.0.0"), ld(1, b"CSIPlugin"), ld(3, b"/csi.sock"), ld(2, b"csi.nodeplane.dev")].concat();
    let info = reg::PluginInfo::decode(bytes.as_slice()).unwrap();
    assert_eq!(info.r#type, "CSIPlugin");
    assert_eq!(info.name, "csi.nodeplane.dev");
    assert_eq!(info.endpoint, "/csi.sock");
    assert_eq!(info.supported_versions, ["1.0.0"]);

    let st = reg::RegistrationStatus::decode([vi(1, 0), ld(2, b"bad")].concat().as_slice());
    let st = st.unwrap();
    assert!(!st.plugin_registered);
    assert_eq!(st.error, "bad");
}

// ---------------------------------------------------------------------------
// Descriptor: packages, services, methods and custom options as compiled.
// A minimal hand-written subset of google/protobuf/descriptor.proto.
// ---------------------------------------------------------------------------

mod desc {
    #[derive(Clone, PartialEq, ::prost::Message)]
    pub struct FileDescriptorSet {
        #[prost(message, repeated, tag = "1")]
        pub file: Vec<FileDescriptorProto>,
    }
    #[derive(Clone, PartialEq, ::prost::Message)]
    pub struct FileDescriptorProto {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub package: String,
        #[prost(string, repeated, tag = "3")]
        pub dependency: Vec<String>,
        #[prost(message, repeated, tag = "4")]
        pub message_type: Vec<DescriptorProto>,
        #[prost(message, repeated, tag = "5")]
        pub enum_type: Vec<EnumDescriptorProto>,
        #[prost(message, repeated, tag = "6")]
        pub service: Vec<ServiceDescriptorProto>,
        #[prost(message, repeated, tag = "7")]
        pub extension: Vec<FieldDescriptorProto>,
        #[prost(string, tag = "12")]
        pub syntax: String,
    }
    #[derive(Clone, PartialEq, ::prost::Message)]
    pub struct DescriptorProto {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(message, repeated, tag = "2")]
        pub field: Vec<FieldDescriptorProto>,
        #[prost(message, repeated, tag = "3")]
        pub nested_type: Vec<DescriptorProto>,
        #[prost(message, repeated, tag = "4")]
        pub enum_type: Vec<EnumDescriptorProto>,
        #[prost(message, optional, tag = "7")]
        pub options: Option<AlphaOptions>,
        #[prost(message, repeated, tag = "8")]
        pub oneof_decl: Vec<OneofDescriptorProto>,
    }
    #[derive(Clone, PartialEq, ::prost::Message)]
    pub struct FieldDescriptorProto {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub extendee: String,
        #[prost(int32, tag = "3")]
        pub number: i32,
        #[prost(int32, tag = "4")]
        pub label: i32,
        #[prost(int32, tag = "5")]
        pub r#type: i32,
        #[prost(string, tag = "6")]
        pub type_name: String,
        #[prost(message, optional, tag = "8")]
        pub options: Option<FieldOptions>,
        #[prost(int32, optional, tag = "9")]
        pub oneof_index: Option<i32>,
    }
    #[derive(Clone, PartialEq, ::prost::Message)]
    pub struct OneofDescriptorProto {
        #[prost(string, tag = "1")]
        pub name: String,
    }
    /// FieldOptions with the CSI extensions (csi_secret 1059, alpha_field 1060).
    #[derive(Clone, PartialEq, ::prost::Message)]
    pub struct FieldOptions {
        #[prost(bool, optional, tag = "1059")]
        pub csi_secret: Option<bool>,
        #[prost(bool, optional, tag = "1060")]
        pub alpha_field: Option<bool>,
    }
    /// Message/enum/enum-value/method/service options: CSI alpha marker 1060.
    #[derive(Clone, PartialEq, ::prost::Message)]
    pub struct AlphaOptions {
        #[prost(bool, optional, tag = "1060")]
        pub alpha: Option<bool>,
    }
    #[derive(Clone, PartialEq, ::prost::Message)]
    pub struct EnumDescriptorProto {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(message, repeated, tag = "2")]
        pub value: Vec<EnumValueDescriptorProto>,
    }
    #[derive(Clone, PartialEq, ::prost::Message)]
    pub struct EnumValueDescriptorProto {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(int32, tag = "2")]
        pub number: i32,
        #[prost(message, optional, tag = "3")]
        pub options: Option<AlphaOptions>,
    }
    #[derive(Clone, PartialEq, ::prost::Message)]
    pub struct ServiceDescriptorProto {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(message, repeated, tag = "2")]
        pub method: Vec<MethodDescriptorProto>,
        #[prost(message, optional, tag = "3")]
        pub options: Option<AlphaOptions>,
    }
    #[derive(Clone, PartialEq, ::prost::Message)]
    pub struct MethodDescriptorProto {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub input_type: String,
        #[prost(string, tag = "3")]
        pub output_type: String,
        #[prost(message, optional, tag = "4")]
        pub options: Option<AlphaOptions>,
        #[prost(bool, tag = "5")]
        pub client_streaming: bool,
        #[prost(bool, tag = "6")]
        pub server_streaming: bool,
    }
}

// FieldDescriptorProto.Type / Label numbers.
const T_INT32: i32 = 5;
const T_INT64: i32 = 3;
const T_BOOL: i32 = 8;
const T_STRING: i32 = 9;
const T_MESSAGE: i32 = 11;
const T_ENUM: i32 = 14;
const OPTIONAL: i32 = 1;
const REPEATED: i32 = 3;

fn file(package: &str) -> desc::FileDescriptorProto {
    let set = desc::FileDescriptorSet::decode(FILE_DESCRIPTOR_SET).unwrap();
    set.file.into_iter().find(|f| f.package == package).unwrap_or_else(|| panic!("no {package}"))
}

/// Finds a (possibly nested, dot-separated) message.
fn message<'a>(f: &'a desc::FileDescriptorProto, path: &str) -> &'a desc::DescriptorProto {
    let mut parts = path.split('.');
    let first = parts.next().unwrap();
    let mut m = f.message_type.iter().find(|m| m.name == first).unwrap_or_else(|| panic!("{path}"));
    for p in parts {
        m = m.nested_type.iter().find(|n| n.name == p).unwrap_or_else(|| panic!("{path}"));
    }
    m
}

/// (name, number, type, label, type_name or "") for every field.
type FieldSig = (&'static str, i32, i32, i32, &'static str);

fn assert_fields(f: &desc::FileDescriptorProto, path: &str, want: &[FieldSig]) {
    let m = message(f, path);
    let got: Vec<(String, i32, i32, i32, String)> =
        m.field.iter().map(|x| (x.name.clone(), x.number, x.r#type, x.label, x.type_name.clone())).collect();
    let want: Vec<(String, i32, i32, i32, String)> =
        want.iter().map(|(n, num, t, l, tn)| (n.to_string(), *num, *t, *l, tn.to_string())).collect();
    assert_eq!(got, want, "fields of {path}");
}

#[test]
fn csi_descriptor_services_and_methods() {
    let f = file("csi.v1");
    assert_eq!(f.syntax, "proto3");
    for dep in ["google/protobuf/descriptor.proto", "google/protobuf/timestamp.proto", "google/protobuf/wrappers.proto"]
    {
        assert!(f.dependency.iter().any(|d| d == dep), "missing import {dep}");
    }
    let svc = |name: &str| f.service.iter().find(|s| s.name == name).unwrap();
    let methods = |name: &str| -> Vec<String> { svc(name).method.iter().map(|m| m.name.clone()).collect() };
    assert_eq!(methods("Identity"), ["GetPluginInfo", "GetPluginCapabilities", "Probe"]);
    assert_eq!(
        methods("Controller"),
        [
            "CreateVolume",
            "DeleteVolume",
            "ControllerPublishVolume",
            "ControllerUnpublishVolume",
            "ValidateVolumeCapabilities",
            "ListVolumes",
            "GetCapacity",
            "ControllerGetCapabilities",
            "CreateSnapshot",
            "DeleteSnapshot",
            "ListSnapshots",
            "GetSnapshot",
            "ControllerExpandVolume",
            "ControllerGetVolume",
            "ControllerModifyVolume",
        ]
    );
    assert_eq!(
        methods("GroupController"),
        [
            "GroupControllerGetCapabilities",
            "CreateVolumeGroupSnapshot",
            "DeleteVolumeGroupSnapshot",
            "GetVolumeGroupSnapshot",
        ]
    );
    assert_eq!(methods("SnapshotMetadata"), ["GetMetadataAllocated", "GetMetadataDelta"]);
    assert_eq!(
        methods("Node"),
        [
            "NodeStageVolume",
            "NodeUnstageVolume",
            "NodePublishVolume",
            "NodeUnpublishVolume",
            "NodeGetVolumeStats",
            "NodeExpandVolume",
            "NodeGetCapabilities",
            "NodeGetInfo",
        ]
    );
    // Every method takes <Name>Request and returns <Name>Response; only the
    // SnapshotMetadata methods stream (server side).
    for s in &f.service {
        for m in &s.method {
            assert_eq!(m.input_type, format!(".csi.v1.{}Request", m.name));
            assert_eq!(m.output_type, format!(".csi.v1.{}Response", m.name));
            assert!(!m.client_streaming);
            assert_eq!(m.server_streaming, s.name == "SnapshotMetadata", "{}", m.name);
            let alpha = m.options.as_ref().and_then(|o| o.alpha).unwrap_or(false);
            let want_alpha =
                matches!(m.name.as_str(), "GetSnapshot" | "ControllerGetVolume" | "ControllerModifyVolume");
            assert_eq!(alpha, want_alpha, "alpha_method on {}", m.name);
        }
        let alpha = s.options.as_ref().and_then(|o| o.alpha).unwrap_or(false);
        assert_eq!(alpha, s.name == "SnapshotMetadata", "alpha_service on {}", s.name);
    }
}

#[test]
fn csi_descriptor_custom_option_declarations() {
    let f = file("csi.v1");
    let mut got: Vec<(String, i32, String)> = f
        .extension
        .iter()
        .map(|e| {
            assert_eq!((e.r#type, e.label), (T_BOOL, OPTIONAL), "{}", e.name);
            (e.name.clone(), e.number, e.extendee.clone())
        })
        .collect();
    got.sort();
    let mut want: Vec<(String, i32, String)> = [
        ("alpha_enum", 1060, ".google.protobuf.EnumOptions"),
        ("alpha_enum_value", 1060, ".google.protobuf.EnumValueOptions"),
        ("alpha_field", 1060, ".google.protobuf.FieldOptions"),
        ("alpha_message", 1060, ".google.protobuf.MessageOptions"),
        ("alpha_method", 1060, ".google.protobuf.MethodOptions"),
        ("alpha_service", 1060, ".google.protobuf.ServiceOptions"),
        ("csi_secret", 1059, ".google.protobuf.FieldOptions"),
    ]
    .iter()
    .map(|(n, num, e)| (n.to_string(), *num, e.to_string()))
    .collect();
    want.sort();
    assert_eq!(got, want);
}

fn walk<'a>(prefix: &str, msgs: &'a [desc::DescriptorProto], out: &mut Vec<(String, &'a desc::DescriptorProto)>) {
    for m in msgs {
        let path = if prefix.is_empty() { m.name.clone() } else { format!("{prefix}.{}", m.name) };
        walk(&path, &m.nested_type, out);
        out.push((path, m));
    }
}

#[test]
fn csi_descriptor_secret_and_alpha_annotations() {
    let f = file("csi.v1");
    let mut all = Vec::new();
    walk("", &f.message_type, &mut all);

    // Upstream marks exactly the `secrets` maps with csi_secret, and there are
    // 19 of them (every request that carries credentials).
    let mut secret_fields = Vec::new();
    let mut alpha_fields = Vec::new();
    for (path, m) in &all {
        for fd in &m.field {
            let o = fd.options.clone().unwrap_or_default();
            if o.csi_secret == Some(true) {
                assert_eq!(fd.name, "secrets", "{path}.{}", fd.name);
                secret_fields.push(path.clone());
            } else {
                assert_ne!(fd.name, "secrets", "{path}.secrets must carry csi_secret");
            }
            if o.alpha_field == Some(true) {
                alpha_fields.push(format!("{path}.{}", fd.name));
            }
        }
    }
    secret_fields.sort();
    let mut want_secrets = vec![
        "ControllerExpandVolumeRequest",
        "ControllerModifyVolumeRequest",
        "ControllerPublishVolumeRequest",
        "ControllerUnpublishVolumeRequest",
        "CreateSnapshotRequest",
        "CreateVolumeGroupSnapshotRequest",
        "CreateVolumeRequest",
        "DeleteSnapshotRequest",
        "DeleteVolumeGroupSnapshotRequest",
        "DeleteVolumeRequest",
        "GetMetadataAllocatedRequest",
        "GetMetadataDeltaRequest",
        "GetSnapshotRequest",
        "GetVolumeGroupSnapshotRequest",
        "ListSnapshotsRequest",
        "NodeExpandVolumeRequest",
        "NodePublishVolumeRequest",
        "NodeStageVolumeRequest",
        "ValidateVolumeCapabilitiesRequest",
    ];
    want_secrets.sort();
    assert_eq!(secret_fields, want_secrets);

    alpha_fields.sort();
    let mut want_alpha = vec![
        "CreateVolumeRequest.mutable_parameters",
        "GetCapacityResponse.minimum_volume_size",
        "ListVolumesResponse.VolumeStatus.volume_condition",
        "NodeExpandVolumeRequest.secrets",
        "NodeGetVolumeStatsResponse.volume_condition",
        "ValidateVolumeCapabilitiesRequest.mutable_parameters",
        "ValidateVolumeCapabilitiesResponse.Confirmed.mutable_parameters",
    ];
    want_alpha.sort();
    assert_eq!(alpha_fields, want_alpha);

    let mut alpha_msgs: Vec<&str> = all
        .iter()
        .filter(|(_, m)| m.options.as_ref().and_then(|o| o.alpha) == Some(true))
        .map(|(p, _)| p.as_str())
        .collect();
    alpha_msgs.sort();
    assert_eq!(
        alpha_msgs,
        [
            "ControllerGetVolumeRequest",
            "ControllerGetVolumeResponse",
            "ControllerModifyVolumeRequest",
            "ControllerModifyVolumeResponse",
            "GetSnapshotRequest",
            "GetSnapshotResponse",
            "VolumeCondition",
        ]
    );

    // alpha_enum_value markers.
    let mut alpha_values = Vec::new();
    for (path, m) in &all {
        for e in &m.enum_type {
            for v in &e.value {
                if v.options.as_ref().and_then(|o| o.alpha) == Some(true) {
                    alpha_values.push(format!("{path}.{}.{}={}", e.name, v.name, v.number));
                }
            }
        }
    }
    alpha_values.sort();
    let mut want_values = vec![
        "ControllerServiceCapability.RPC.Type.GET_SNAPSHOT=15",
        "ControllerServiceCapability.RPC.Type.GET_VOLUME=12",
        "ControllerServiceCapability.RPC.Type.MODIFY_VOLUME=14",
        "ControllerServiceCapability.RPC.Type.SINGLE_NODE_MULTI_WRITER=13",
        "ControllerServiceCapability.RPC.Type.VOLUME_CONDITION=11",
        "NodeServiceCapability.RPC.Type.SINGLE_NODE_MULTI_WRITER=5",
        "NodeServiceCapability.RPC.Type.VOLUME_CONDITION=4",
        "PluginCapability.Service.Type.SNAPSHOT_METADATA_SERVICE=4",
        "VolumeCapability.AccessMode.Mode.SINGLE_NODE_MULTI_WRITER=7",
        "VolumeCapability.AccessMode.Mode.SINGLE_NODE_SINGLE_WRITER=6",
    ];
    want_values.sort();
    assert_eq!(alpha_values, want_values);
}

// Field tables, one field a line: (name, number, type, label, type name).
#[test]
#[rustfmt::skip]
fn csi_descriptor_node_messages() {
    let f = file("csi.v1");
    let cap = ".csi.v1.VolumeCapability";
    assert_fields(&f, "NodeStageVolumeRequest", &[
        ("volume_id", 1, T_STRING, OPTIONAL, ""),
        ("publish_context", 2, T_MESSAGE, REPEATED, ".csi.v1.NodeStageVolumeRequest.PublishContextEntry"),
        ("staging_target_path", 3, T_STRING, OPTIONAL, ""),
        ("volume_capability", 4, T_MESSAGE, OPTIONAL, cap),
        ("secrets", 5, T_MESSAGE, REPEATED, ".csi.v1.NodeStageVolumeRequest.SecretsEntry"),
        ("volume_context", 6, T_MESSAGE, REPEATED, ".csi.v1.NodeStageVolumeRequest.VolumeContextEntry"),
    ]);
    assert_fields(&f, "NodeUnstageVolumeRequest", &[
        ("volume_id", 1, T_STRING, OPTIONAL, ""),
        ("staging_target_path", 2, T_STRING, OPTIONAL, ""),
    ]);
    assert_fields(&f, "NodePublishVolumeRequest", &[
        ("volume_id", 1, T_STRING, OPTIONAL, ""),
        ("publish_context", 2, T_MESSAGE, REPEATED, ".csi.v1.NodePublishVolumeRequest.PublishContextEntry"),
        ("staging_target_path", 3, T_STRING, OPTIONAL, ""),
        ("target_path", 4, T_STRING, OPTIONAL, ""),
        ("volume_capability", 5, T_MESSAGE, OPTIONAL, cap),
        ("readonly", 6, T_BOOL, OPTIONAL, ""),
        ("secrets", 7, T_MESSAGE, REPEATED, ".csi.v1.NodePublishVolumeRequest.SecretsEntry"),
        ("volume_context", 8, T_MESSAGE, REPEATED, ".csi.v1.NodePublishVolumeRequest.VolumeContextEntry"),
    ]);
    assert_fields(&f, "NodeUnpublishVolumeRequest", &[
        ("volume_id", 1, T_STRING, OPTIONAL, ""),
        ("target_path", 2, T_STRING, OPTIONAL, ""),
    ]);
    assert_fields(&f, "NodeGetVolumeStatsRequest", &[
        ("volume_id", 1, T_STRING, OPTIONAL, ""),
        ("volume_path", 2, T_STRING, OPTIONAL, ""),
        ("staging_target_path", 3, T_STRING, OPTIONAL, ""),
    ]);
    assert_fields(&f, "NodeGetVolumeStatsResponse", &[
        ("usage", 1, T_MESSAGE, REPEATED, ".csi.v1.VolumeUsage"),
        ("volume_condition", 2, T_MESSAGE, OPTIONAL, ".csi.v1.VolumeCondition"),
    ]);
    assert_fields(&f, "VolumeUsage", &[
        ("available", 1, T_INT64, OPTIONAL, ""),
        ("total", 2, T_INT64, OPTIONAL, ""),
        ("used", 3, T_INT64, OPTIONAL, ""),
        ("unit", 4, T_ENUM, OPTIONAL, ".csi.v1.VolumeUsage.Unit"),
    ]);
    assert_fields(&f, "VolumeCondition", &[
        ("abnormal", 1, T_BOOL, OPTIONAL, ""),
        ("message", 2, T_STRING, OPTIONAL, ""),
    ]);
    assert_fields(&f, "NodeGetInfoResponse", &[
        ("node_id", 1, T_STRING, OPTIONAL, ""),
        ("max_volumes_per_node", 2, T_INT64, OPTIONAL, ""),
        ("accessible_topology", 3, T_MESSAGE, OPTIONAL, ".csi.v1.Topology"),
    ]);
    assert_fields(&f, "NodeExpandVolumeRequest", &[
        ("volume_id", 1, T_STRING, OPTIONAL, ""),
        ("volume_path", 2, T_STRING, OPTIONAL, ""),
        ("capacity_range", 3, T_MESSAGE, OPTIONAL, ".csi.v1.CapacityRange"),
        ("staging_target_path", 4, T_STRING, OPTIONAL, ""),
        ("volume_capability", 5, T_MESSAGE, OPTIONAL, cap),
        ("secrets", 6, T_MESSAGE, REPEATED, ".csi.v1.NodeExpandVolumeRequest.SecretsEntry"),
    ]);
    assert_fields(&f, "NodeExpandVolumeResponse", &[
        ("capacity_bytes", 1, T_INT64, OPTIONAL, ""),
    ]);
    assert_fields(&f, "VolumeCapability", &[
        ("block", 1, T_MESSAGE, OPTIONAL, ".csi.v1.VolumeCapability.BlockVolume"),
        ("mount", 2, T_MESSAGE, OPTIONAL, ".csi.v1.VolumeCapability.MountVolume"),
        ("access_mode", 3, T_MESSAGE, OPTIONAL, ".csi.v1.VolumeCapability.AccessMode"),
    ]);
    assert_fields(&f, "VolumeCapability.MountVolume", &[
        ("fs_type", 1, T_STRING, OPTIONAL, ""),
        ("mount_flags", 2, T_STRING, REPEATED, ""),
        ("volume_mount_group", 3, T_STRING, OPTIONAL, ""),
    ]);
    // block and mount share the oneof "access_type"; access_mode does not.
    let vc = message(&f, "VolumeCapability");
    let oneofs: Vec<&str> = vc.oneof_decl.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(oneofs, ["access_type"]);
    let idx: Vec<Option<i32>> = vc.field.iter().map(|x| x.oneof_index).collect();
    assert_eq!(idx, [Some(0), Some(0), None]);
    // Map entries really are map<string, string>.
    assert_fields(&f, "NodeStageVolumeRequest.PublishContextEntry", &[
        ("key", 1, T_STRING, OPTIONAL, ""),
        ("value", 2, T_STRING, OPTIONAL, ""),
    ]);
}

#[test]
#[rustfmt::skip]
fn csi_descriptor_controller_and_identity_messages() {
    let f = file("csi.v1");
    assert_fields(&f, "CreateVolumeRequest", &[
        ("name", 1, T_STRING, OPTIONAL, ""),
        ("capacity_range", 2, T_MESSAGE, OPTIONAL, ".csi.v1.CapacityRange"),
        ("volume_capabilities", 3, T_MESSAGE, REPEATED, ".csi.v1.VolumeCapability"),
        ("parameters", 4, T_MESSAGE, REPEATED, ".csi.v1.CreateVolumeRequest.ParametersEntry"),
        ("secrets", 5, T_MESSAGE, REPEATED, ".csi.v1.CreateVolumeRequest.SecretsEntry"),
        ("volume_content_source", 6, T_MESSAGE, OPTIONAL, ".csi.v1.VolumeContentSource"),
        ("accessibility_requirements", 7, T_MESSAGE, OPTIONAL, ".csi.v1.TopologyRequirement"),
        ("mutable_parameters", 8, T_MESSAGE, REPEATED, ".csi.v1.CreateVolumeRequest.MutableParametersEntry"),
    ]);
    assert_fields(&f, "Volume", &[
        ("capacity_bytes", 1, T_INT64, OPTIONAL, ""),
        ("volume_id", 2, T_STRING, OPTIONAL, ""),
        ("volume_context", 3, T_MESSAGE, REPEATED, ".csi.v1.Volume.VolumeContextEntry"),
        ("content_source", 4, T_MESSAGE, OPTIONAL, ".csi.v1.VolumeContentSource"),
        ("accessible_topology", 5, T_MESSAGE, REPEATED, ".csi.v1.Topology"),
    ]);
    assert_fields(&f, "ProbeResponse", &[
        ("ready", 1, T_MESSAGE, OPTIONAL, ".google.protobuf.BoolValue"),
    ]);
    assert_fields(&f, "GetCapacityResponse", &[
        ("available_capacity", 1, T_INT64, OPTIONAL, ""),
        ("maximum_volume_size", 2, T_MESSAGE, OPTIONAL, ".google.protobuf.Int64Value"),
        ("minimum_volume_size", 3, T_MESSAGE, OPTIONAL, ".google.protobuf.Int64Value"),
    ]);
    assert_fields(&f, "Snapshot", &[
        ("size_bytes", 1, T_INT64, OPTIONAL, ""),
        ("snapshot_id", 2, T_STRING, OPTIONAL, ""),
        ("source_volume_id", 3, T_STRING, OPTIONAL, ""),
        ("creation_time", 4, T_MESSAGE, OPTIONAL, ".google.protobuf.Timestamp"),
        ("ready_to_use", 5, T_BOOL, OPTIONAL, ""),
        ("group_snapshot_id", 6, T_STRING, OPTIONAL, ""),
    ]);
    assert_fields(&f, "ListVolumesRequest", &[
        ("max_entries", 1, T_INT32, OPTIONAL, ""),
        ("starting_token", 2, T_STRING, OPTIONAL, ""),
    ]);
    assert_fields(&f, "GetMetadataDeltaRequest", &[
        ("base_snapshot_id", 1, T_STRING, OPTIONAL, ""),
        ("target_snapshot_id", 2, T_STRING, OPTIONAL, ""),
        ("starting_offset", 3, T_INT64, OPTIONAL, ""),
        ("max_results", 4, T_INT32, OPTIONAL, ""),
        ("secrets", 5, T_MESSAGE, REPEATED, ".csi.v1.GetMetadataDeltaRequest.SecretsEntry"),
    ]);
    let pc = message(&f, "PluginCapability");
    let oneofs: Vec<&str> = pc.oneof_decl.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(oneofs, ["type"]);
    // The one top-level enum.
    assert_eq!(f.enum_type.len(), 1);
    let e = &f.enum_type[0];
    assert_eq!(e.name, "BlockMetadataType");
    let values: Vec<(&str, i32)> = e.value.iter().map(|v| (v.name.as_str(), v.number)).collect();
    assert_eq!(values, [("UNKNOWN", 0), ("FIXED_LENGTH", 1), ("VARIABLE_LENGTH", 2)]);
}

#[test]
#[rustfmt::skip]
fn pluginregistration_descriptor() {
    let f = file("pluginregistration");
    assert_eq!(f.syntax, "proto3");
    assert_fields(&f, "PluginInfo", &[
        ("type", 1, T_STRING, OPTIONAL, ""),
        ("name", 2, T_STRING, OPTIONAL, ""),
        ("endpoint", 3, T_STRING, OPTIONAL, ""),
        ("supported_versions", 4, T_STRING, REPEATED, ""),
    ]);
    assert_fields(&f, "RegistrationStatus", &[
        ("plugin_registered", 1, T_BOOL, OPTIONAL, ""),
        ("error", 2, T_STRING, OPTIONAL, ""),
    ]);
    assert_fields(&f, "RegistrationStatusResponse", &[]);
    assert_fields(&f, "InfoRequest", &[]);
    assert_eq!(f.service.len(), 1);
    let s = &f.service[0];
    assert_eq!(s.name, "Registration");
    let m: Vec<(&str, &str, &str)> = s.method.iter()
        .map(|m| (m.name.as_str(), m.input_type.as_str(), m.output_type.as_str()))
        .collect();
    assert_eq!(m, [
        ("GetInfo", ".pluginregistration.InfoRequest", ".pluginregistration.PluginInfo"),
        ("NotifyRegistrationStatus", ".pluginregistration.RegistrationStatus",
            ".pluginregistration.RegistrationStatusResponse"),
    ]);
}
