//! The CLI's output from typed reports built by hand: the JSON documents field by field,
//! every enum's words, and the summaries line by line.

use serde_json::{Value, json};

use super::{document, summary};
use crate::rpc::node as api;

/// A node with every section filled in: two conditions, a dual-stack network with a
/// healthy attachment and a broken one, two volumes, two device plugins, two kubelet
/// plugins, two kernel features and two service ports.
fn full_status() -> api::StatusReport {
    api::StatusReport {
        format: 2,
        node: "node-a".into(),
        version: "0.1.0".into(),
        pid: 4242,
        started_unix: 1_764_580_000,
        mode: api::Mode::Controller as i32,
        conditions: vec![
            api::Condition { name: "cni".into(), ready: true, detail: String::new() },
            api::Condition { name: "csi".into(), ready: false, detail: "recovery running".into() },
        ],
        network: Some(api::NetworkStatus {
            ready: true,
            bridge: Some(api::Bridge {
                name: "np0".into(),
                present: true,
                up: true,
                mac: Some("02:00:00:00:00:01".into()),
            }),
            blocks: vec![
                api::Block {
                    cidr: "10.244.1.0/24".into(),
                    gateway: "10.244.1.1".into(),
                    addresses: "254".into(),
                    allocated: 2,
                },
                api::Block {
                    cidr: "fd00:1::/64".into(),
                    gateway: "fd00:1::1".into(),
                    addresses: "18446744073709551614".into(),
                    allocated: 2,
                },
            ],
            attachments: vec![
                api::Attachment {
                    container_id: "0123456789abcdef0123456789abcdef".into(),
                    ifname: "eth0".into(),
                    pod: "default/web-0".into(),
                    state: api::LeaseState::Ready as i32,
                    ips: vec!["10.244.1.2".into(), "fd00:1::2".into()],
                    netns: "/run/netns/web-0".into(),
                    netns_present: true,
                    host_if: "veth1a2b3c".into(),
                    host_if_present: true,
                    host_if_on_bridge: true,
                },
                api::Attachment {
                    container_id: "short-id".into(),
                    ifname: "eth0".into(),
                    pod: String::new(),
                    state: api::LeaseState::Adding as i32,
                    ips: vec![],
                    netns: "/run/netns/gone".into(),
                    netns_present: false,
                    host_if: "veth9".into(),
                    host_if_present: true,
                    host_if_on_bridge: false,
                },
            ],
            unleased_host_veths: vec!["vethstray".into()],
            graveyard_links: 3,
        }),
        controller: Some(api::ControllerLink {
            address: "unix:/run/nodeplane/controller.sock".into(),
            connected: true,
            last_message_unix: Some(1_764_580_100.5),
            last_message_seconds_ago: Some(2.5),
            blocks: Some(api::BlockList { cidrs: vec!["10.244.1.0/24".into(), "fd00:1::/64".into()] }),
            encryption: "strict".into(),
            wireguard: Some(api::Wireguard {
                public_key: "pubkeyA=".into(),
                listen_port: 51871,
                peers: vec![
                    api::WireguardPeer {
                        public_key: "pubkeyB=".into(),
                        last_handshake_unix: 1_764_580_000,
                        ..Default::default()
                    },
                    api::WireguardPeer { public_key: "pubkeyC=".into(), ..Default::default() },
                ],
                error: String::new(),
            }),
        }),
        storage: Some(api::StorageStatus {
            ready: false,
            volume_dir: "/var/lib/nodeplane/volumes".into(),
            capacity_bytes: 10 << 30,
            provisioned_bytes: 3 << 30,
            available_bytes: 7 << 30,
            volumes: vec![
                api::VolumeStatus {
                    id: "vol-1".into(),
                    name: "pvc-1".into(),
                    size_bytes: 1 << 30,
                    fs_type: "ext4".into(),
                    backing_file: "/var/lib/nodeplane/volumes/vol-1.img".into(),
                    backing_file_present: true,
                    loop_devices: vec![api::LoopDevice {
                        device: "/dev/loop3".into(),
                        mounted_at: vec!["/staging/vol-1".into()],
                    }],
                    staged: Some(api::Stage {
                        path: "/staging/vol-1".into(),
                        state: api::StageState::Staged as i32,
                        mounted: true,
                    }),
                    published: vec![
                        api::Publish { path: "/pods/a/vol".into(), read_only: true, mounted: true },
                        api::Publish { path: "/pods/b/vol".into(), read_only: false, mounted: false },
                    ],
                },
                api::VolumeStatus {
                    id: "vol-2".into(),
                    name: "pvc-2".into(),
                    size_bytes: 2 << 30,
                    fs_type: String::new(),
                    backing_file: "/var/lib/nodeplane/volumes/vol-2.img".into(),
                    backing_file_present: false,
                    loop_devices: vec![],
                    staged: None,
                    published: vec![],
                },
            ],
        }),
        device_plugins: Some(api::DevicePlugins {
            plugins: vec![
                api::DevicePlugin {
                    resource: "nodeplane.dev/fuse".into(),
                    socket: "/var/lib/kubelet/device-plugins/fuse.sock".into(),
                    devices: vec![
                        api::PluginDevice { id: "fuse-0".into(), healthy: true },
                        api::PluginDevice { id: "fuse-1".into(), healthy: false },
                    ],
                },
                api::DevicePlugin {
                    resource: "nodeplane.dev/tun".into(),
                    socket: "/var/lib/kubelet/device-plugins/tun.sock".into(),
                    devices: vec![],
                },
            ],
        }),
        kubelet: Some(api::KubeletStatus {
            grace_seconds: 30.0,
            required: true,
            plugins: vec![
                api::KubeletPlugin {
                    name: "csi.nodeplane.dev".into(),
                    kind: api::PluginKind::Csi as i32,
                    socket: "/var/lib/kubelet/plugins_registry/csi.nodeplane.dev-reg.sock".into(),
                    state: api::RegistrationState::Registered as i32,
                    error: None,
                    since_unix: 1_764_580_000.0,
                    registered_unix: Some(1_764_580_000.0),
                    registrations: 1,
                    overdue: false,
                },
                api::KubeletPlugin {
                    name: "dra.nodeplane.dev".into(),
                    kind: api::PluginKind::Dra as i32,
                    socket: "/var/lib/kubelet/plugins_registry/dra.nodeplane.dev-reg.sock".into(),
                    state: api::RegistrationState::Refused as i32,
                    error: Some("version mismatch".into()),
                    since_unix: 951_782_400.0,
                    registered_unix: None,
                    registrations: 0,
                    overdue: true,
                },
            ],
        }),
        kernel: Some(api::KernelStatus {
            release: "6.1.0-18-amd64".into(),
            features: vec![
                api::KernelFeature {
                    name: "nftables".into(),
                    state: api::KernelFeatureState::Available as i32,
                    detail: String::new(),
                    required: true,
                },
                api::KernelFeature {
                    name: "vxlan".into(),
                    state: api::KernelFeatureState::Missing as i32,
                    detail: "module not found".into(),
                    required: false,
                },
            ],
        }),
        services: Some(api::ServicesStatus {
            idle: String::new(),
            revision: 7,
            synced: true,
            stream_connected: true,
            ports: vec![
                api::ServiceEntry {
                    id: "default/web:http".into(),
                    port: 80,
                    cluster_ips: vec!["10.96.0.10".into()],
                    external_ips: vec!["192.0.2.5".into()],
                    node_port: 30080,
                    endpoints: 3,
                    usable: 2,
                    local: 1,
                },
                api::ServiceEntry {
                    id: "kube-system/dns:dns".into(),
                    port: 53,
                    cluster_ips: vec!["10.96.0.53".into()],
                    external_ips: vec![],
                    node_port: 0,
                    endpoints: 0,
                    usable: 0,
                    local: 0,
                },
            ],
        }),
    }
}

fn keys(v: &Value) -> Vec<&str> {
    let mut k: Vec<&str> = v.as_object().expect("an object").keys().map(String::as_str).collect();
    k.sort_unstable();
    k
}

#[test]
fn status_document_carries_every_section() {
    let d = document::status(&full_status());
    assert_eq!(
        keys(&d),
        [
            "conditions",
            "controller",
            "devicePlugins",
            "format",
            "kernel",
            "kubelet",
            "mode",
            "network",
            "node",
            "pid",
            "services",
            "startedUnix",
            "storage",
            "version"
        ]
    );
    assert_eq!(d["format"], 2);
    assert_eq!(d["node"], "node-a");
    assert_eq!(d["version"], "0.1.0");
    assert_eq!(d["pid"], 4242);
    assert_eq!(d["startedUnix"], 1_764_580_000u64);
    assert_eq!(d["mode"], "controller");
    assert_eq!(
        d["conditions"],
        json!([
            {"name": "cni", "ready": true, "detail": ""},
            {"name": "csi", "ready": false, "detail": "recovery running"},
        ])
    );
}

#[test]
fn status_document_network_section() {
    let n = &document::status(&full_status())["network"];
    assert_eq!(n["ready"], true);
    assert_eq!(n["bridge"], json!({"name": "np0", "present": true, "up": true, "mac": "02:00:00:00:00:01"}));
    assert_eq!(
        n["blocks"][1],
        json!({"cidr": "fd00:1::/64", "gateway": "fd00:1::1", "addresses": "18446744073709551614", "allocated": 2})
    );
    assert_eq!(
        n["attachments"][1],
        json!({
            "containerId": "short-id",
            "ifname": "eth0",
            "pod": "",
            "state": "adding",
            "ips": [],
            "netns": "/run/netns/gone",
            "netnsPresent": false,
            "hostIf": "veth9",
            "hostIfPresent": true,
            "hostIfOnBridge": false,
        })
    );
    assert_eq!(n["attachments"][0]["state"], "ready");
    assert_eq!(n["attachments"][0]["ips"], json!(["10.244.1.2", "fd00:1::2"]));
    assert_eq!(n["unleasedHostVeths"], json!(["vethstray"]));
    assert_eq!(n["graveyardLinks"], 3);
}

#[test]
fn status_document_controller_and_storage_sections() {
    let d = document::status(&full_status());
    assert_eq!(
        d["controller"],
        json!({
            "address": "unix:/run/nodeplane/controller.sock",
            "connected": true,
            "lastMessageUnix": 1_764_580_100.5,
            "lastMessageSecondsAgo": 2.5,
            "blocks": ["10.244.1.0/24", "fd00:1::/64"],
            "encryption": "strict",
            "wireguard": {
                "publicKey": "pubkeyA=",
                "listenPort": 51871,
                "error": "",
                "peers": [
                    {"publicKey": "pubkeyB=", "endpoint": "", "allowedIps": [], "lastHandshakeUnix": 1_764_580_000,
                     "rxBytes": 0, "txBytes": 0},
                    {"publicKey": "pubkeyC=", "endpoint": "", "allowedIps": [], "lastHandshakeUnix": 0,
                     "rxBytes": 0, "txBytes": 0},
                ],
            },
        })
    );
    let s = &d["storage"];
    assert_eq!(s["ready"], false);
    assert_eq!(s["volumeDir"], "/var/lib/nodeplane/volumes");
    assert_eq!(s["capacityBytes"], 10u64 << 30);
    assert_eq!(s["provisionedBytes"], 3u64 << 30);
    assert_eq!(s["availableBytes"], 7u64 << 30);
    assert_eq!(
        s["volumes"][0],
        json!({
            "id": "vol-1",
            "name": "pvc-1",
            "sizeBytes": 1u64 << 30,
            "fsType": "ext4",
            "backingFile": "/var/lib/nodeplane/volumes/vol-1.img",
            "backingFilePresent": true,
            "loopDevices": [{"device": "/dev/loop3", "mountedAt": ["/staging/vol-1"]}],
            "staged": {"path": "/staging/vol-1", "state": "staged", "mounted": true},
            "published": [
                {"path": "/pods/a/vol", "readOnly": true, "mounted": true},
                {"path": "/pods/b/vol", "readOnly": false, "mounted": false},
            ],
        })
    );
    assert_eq!(s["volumes"][1]["staged"], Value::Null);
    assert_eq!(s["volumes"][1]["fsType"], "");
    assert_eq!(s["volumes"][1]["loopDevices"], json!([]));
}

#[test]
fn status_document_devices_kubelet_kernel_services_sections() {
    let d = document::status(&full_status());
    assert_eq!(
        d["devicePlugins"],
        json!([
            {
                "resource": "nodeplane.dev/fuse",
                "socket": "/var/lib/kubelet/device-plugins/fuse.sock",
                "devices": [{"id": "fuse-0", "health": "Healthy"}, {"id": "fuse-1", "health": "Unhealthy"}],
            },
            {"resource": "nodeplane.dev/tun", "socket": "/var/lib/kubelet/device-plugins/tun.sock", "devices": []},
        ])
    );
    assert_eq!(d["kubelet"]["graceSeconds"], 30.0);
    assert_eq!(d["kubelet"]["required"], true);
    assert_eq!(
        d["kubelet"]["plugins"][1],
        json!({
            "name": "dra.nodeplane.dev",
            "kind": "dra",
            "socket": "/var/lib/kubelet/plugins_registry/dra.nodeplane.dev-reg.sock",
            "state": "refused",
            "error": "version mismatch",
            "sinceUnix": 951_782_400.0,
            "registeredUnix": null,
            "registrations": 0,
            "overdue": true,
        })
    );
    assert_eq!(d["kubelet"]["plugins"][0]["error"], Value::Null);
    assert_eq!(d["kubelet"]["plugins"][0]["registeredUnix"], 1_764_580_000.0);
    assert_eq!(
        d["kernel"],
        json!({
            "release": "6.1.0-18-amd64",
            "features": [
                {"name": "nftables", "state": "available", "required": true, "detail": ""},
                {"name": "vxlan", "state": "missing", "required": false, "detail": "module not found"},
            ],
        })
    );
    let v = &d["services"];
    assert_eq!(v["idle"], Value::Null, "an empty idle reason is null");
    assert_eq!(v["revision"], 7);
    assert_eq!(v["synced"], true);
    assert_eq!(v["streamConnected"], true);
    assert_eq!(
        v["ports"][0],
        json!({
            "id": "default/web:http", "port": 80, "clusterIPs": ["10.96.0.10"], "externalIPs": ["192.0.2.5"],
            "nodePort": 30080, "endpoints": 3, "usable": 2, "local": 1,
        })
    );
    let idle = api::StatusReport {
        services: Some(api::ServicesStatus { idle: "kube-proxy programs Services here".into(), ..Default::default() }),
        ..Default::default()
    };
    assert_eq!(document::status(&idle)["services"]["idle"], "kube-proxy programs Services here");
}

#[test]
fn status_document_absent_sections_are_null() {
    let d = document::status(&api::StatusReport { node: "bare".into(), ..Default::default() });
    for section in ["network", "controller", "storage", "devicePlugins", "kubelet", "kernel", "services"] {
        assert_eq!(d[section], Value::Null, "{section}");
    }
    assert_eq!(d["conditions"], json!([]));
    assert_eq!(d["mode"], "unknown");
    assert_eq!(d["node"], "bare");
    // A controller link without blocks yet, a network without a bridge.
    let d = document::status(&api::StatusReport {
        network: Some(api::NetworkStatus::default()),
        controller: Some(api::ControllerLink::default()),
        ..Default::default()
    });
    assert_eq!(d["network"]["bridge"], Value::Null);
    assert_eq!(d["controller"]["blocks"], Value::Null);
    assert_eq!(d["controller"]["lastMessageUnix"], Value::Null);
}

#[test]
fn status_document_words_for_every_enum_value() {
    // 99 is a value a newer agent might send: it reads as the unspecified one.
    for (mode, word) in [
        (api::Mode::Unspecified as i32, "unknown"),
        (api::Mode::Standalone as i32, "standalone"),
        (api::Mode::Controller as i32, "controller"),
        (99, "unknown"),
    ] {
        assert_eq!(document::status(&api::StatusReport { mode, ..Default::default() })["mode"], word);
    }
    for (state, word) in [
        (api::LeaseState::Unspecified as i32, "unknown"),
        (api::LeaseState::Adding as i32, "adding"),
        (api::LeaseState::Ready as i32, "ready"),
        (99, "unknown"),
    ] {
        let r = api::StatusReport {
            network: Some(api::NetworkStatus {
                attachments: vec![api::Attachment { state, ..Default::default() }],
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(document::status(&r)["network"]["attachments"][0]["state"], word);
    }
    for (state, word) in [
        (api::StageState::Unspecified as i32, "unknown"),
        (api::StageState::Staging as i32, "staging"),
        (api::StageState::Staged as i32, "staged"),
    ] {
        let r = api::StatusReport {
            storage: Some(api::StorageStatus {
                volumes: vec![api::VolumeStatus {
                    staged: Some(api::Stage { state, ..Default::default() }),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(document::status(&r)["storage"]["volumes"][0]["staged"]["state"], word);
    }
    let plugin = |kind: api::PluginKind, state: api::RegistrationState| api::StatusReport {
        kubelet: Some(api::KubeletStatus {
            plugins: vec![api::KubeletPlugin { kind: kind as i32, state: state as i32, ..Default::default() }],
            ..Default::default()
        }),
        ..Default::default()
    };
    for (kind, word) in [
        (api::PluginKind::Unspecified, "unknown"),
        (api::PluginKind::Csi, "csi"),
        (api::PluginKind::DevicePlugin, "deviceplugin"),
        (api::PluginKind::Dra, "dra"),
    ] {
        let d = document::status(&plugin(kind, api::RegistrationState::Waiting));
        assert_eq!(d["kubelet"]["plugins"][0]["kind"], word);
    }
    for (state, word) in [
        (api::RegistrationState::Unspecified, "unknown"),
        (api::RegistrationState::Waiting, "waiting"),
        (api::RegistrationState::Registered, "registered"),
        (api::RegistrationState::Refused, "refused"),
        (api::RegistrationState::Unreachable, "unreachable"),
    ] {
        let d = document::status(&plugin(api::PluginKind::Csi, state));
        assert_eq!(d["kubelet"]["plugins"][0]["state"], word);
    }
    for (state, word) in [
        (api::KernelFeatureState::Unspecified, "unknown"),
        (api::KernelFeatureState::Available, "available"),
        (api::KernelFeatureState::Missing, "missing"),
        (api::KernelFeatureState::Unknown, "unknown"),
    ] {
        let r = api::StatusReport {
            kernel: Some(api::KernelStatus {
                features: vec![api::KernelFeature { state: state as i32, ..Default::default() }],
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(document::status(&r)["kernel"]["features"][0]["state"], word);
    }
}

fn finding(kind: &str, subject: &str, detail: &str, repair: Option<(api::RepairResult, &str)>) -> api::Finding {
    api::Finding {
        kind: kind.into(),
        subject: subject.into(),
        detail: detail.into(),
        repair: repair.map(|(result, message)| api::Repair { result: result as i32, message: message.into() }),
    }
}

#[test]
fn doctor_document_findings_repairs_and_errors() {
    let r = api::DoctorReport {
        format: 2,
        node: "node-a".into(),
        repair: true,
        findings: vec![
            finding("veth-without-lease", "veth77", "no lease names it", None),
            finding(
                "lease-without-pod",
                "10.244.1.9",
                "its ADD never completed",
                Some((api::RepairResult::Done, "released")),
            ),
            finding("mount-without-volume", "/mnt/x", "no volume", Some((api::RepairResult::Failed, "EBUSY"))),
            finding(
                "loop-device-without-file",
                "/dev/loop7",
                "bound to a deleted file",
                Some((api::RepairResult::Skipped, "in use")),
            ),
            finding("volume-without-backing-file", "vol-9", "gone", Some((api::RepairResult::Unspecified, ""))),
        ],
        errors: vec!["reading the mount table: permission denied".into()],
    };
    let d = document::doctor(&r);
    assert_eq!(keys(&d), ["errors", "findings", "format", "node", "repair"]);
    assert_eq!(d["format"], 2);
    assert_eq!(d["node"], "node-a");
    assert_eq!(d["repair"], true);
    // Without a repair, a finding has no "repair" key at all (not null).
    assert_eq!(
        d["findings"][0],
        json!({"kind": "veth-without-lease", "subject": "veth77", "detail": "no lease names it"})
    );
    assert_eq!(
        d["findings"][1],
        json!({"kind": "lease-without-pod", "subject": "10.244.1.9", "detail": "its ADD never completed",
               "repair": {"result": "done", "message": "released"}})
    );
    let results: Vec<&Value> = d["findings"].as_array().unwrap().iter().map(|f| &f["repair"]["result"]).collect();
    assert_eq!(results, [&Value::Null, &json!("done"), &json!("failed"), &json!("skipped"), &json!("unknown")]);
    assert_eq!(d["findings"][2]["repair"]["message"], "EBUSY");
    assert_eq!(d["errors"], json!(["reading the mount table: permission denied"]));
}

#[test]
fn doctor_exit_code_counts_what_is_left() {
    let code = |findings: Vec<api::Finding>, errors: Vec<String>| {
        document::doctor_exit_code(&document::doctor(&api::DoctorReport { findings, errors, ..Default::default() }))
    };
    let done = || finding("k", "s", "d", Some((api::RepairResult::Done, "")));
    assert_eq!(code(vec![], vec![]), 0, "nothing found");
    assert_eq!(code(vec![done(), done()], vec![]), 0, "everything repaired");
    assert_eq!(code(vec![done(), finding("k", "s", "d", None)], vec![]), 1, "a finding not repaired");
    assert_eq!(code(vec![finding("k", "s", "d", Some((api::RepairResult::Skipped, "")))], vec![]), 1, "skipped");
    assert_eq!(code(vec![finding("k", "s", "d", Some((api::RepairResult::Failed, "")))], vec![]), 1, "failed");
    assert_eq!(code(vec![done()], vec!["a check failed".into()]), 1, "an error");
}

#[test]
fn status_summary_of_a_full_report() {
    let out = summary::status(&document::status(&full_status()));
    let want = [
        "node node-a (controller mode), agent 0.1.0 pid 4242",
        "conditions: cni ready; csi NOT READY (recovery running)",
        "kernel: 6.1.0-18-amd64, 1 of 2 features probed available; vxlan MISSING (module not found)",
        "controller: unix:/run/nodeplane/controller.sock connected, last message 2.5s ago; blocks 10.244.1.0/24, fd00:1::/64",
        "encryption: strict, key pubkeyA=, 2 peer(s), 1 with a handshake",
        "network: bridge np0 up",
        "    block 10.244.1.0/24 gateway 10.244.1.1: 2 of 254 addresses leased",
        // An IPv6 /64's size is not shown.
        "    block fd00:1::/64 gateway fd00:1::1: 2 addresses leased",
        "  2 attachments",
        "    ATTACHMENT        POD           ADDRESSES             HOST VETH  STATE",
        // A 32-character container id is cut to 12; a short one is shown whole.
        "    0123456789ab/eth0 default/web-0 10.244.1.2, fd00:1::2 veth1a2b3c ok",
        "    short-id/eth0     -             -                     veth9      ADD in progress, netns gone, veth off bridge",
        "  host veths without a lease: vethstray (nodeplane doctor)",
        "storage: 2 volumes, 3072 MiB of 10240 MiB provisioned, 7168 MiB available (recovery running)",
        "    VOLUME SIZE     FS    FILE    LOOP       STAGED PUBLISHED",
        "    vol-1  1024 MiB ext4  present /dev/loop3 staged 2",
        "    vol-2  2048 MiB block MISSING -          -      0",
        "    vol-1 published at /pods/a/vol (read-only)",
        "    vol-1 published at /pods/b/vol (NOT MOUNTED)",
        "device plugins: 2 resources",
        "    nodeplane.dev/fuse: fuse-0 Healthy, fuse-1 Unhealthy",
        "    nodeplane.dev/tun: no devices",
        "services: 2 ports, revision 7",
        "    default/web:http 10.96.0.10,192.0.2.5 port 80 nodePort 30080: 3 endpoints (2 usable, 1 here)",
        "    kube-system/dns:dns 10.96.0.53 port 53: 0 endpoints (0 usable, 0 here)",
        "kubelet:",
        "    csi csi.nodeplane.dev: registered with kubelet at 2025-12-01T09:06:40Z",
        "    dra dra.nodeplane.dev: NOT REGISTERED with kubelet (refused: version mismatch) since 2000-02-29T00:00:00Z, overdue",
    ];
    assert_eq!(out.lines().collect::<Vec<_>>(), want);
    assert!(out.ends_with('\n'));
}

#[test]
fn status_summary_of_an_empty_report() {
    // Absent sections print nothing, except the network line, which says what is missing.
    let out = summary::status(&document::status(&api::StatusReport::default()));
    assert_eq!(
        out,
        "node  (unknown mode), agent  pid 0\n\
         conditions: -\n\
         network: bridge - MISSING, not ready for ADD (no block yet)\n  \
         0 attachments\n"
    );
}

#[test]
fn status_summary_of_troubles() {
    let r = api::StatusReport {
        network: Some(api::NetworkStatus {
            ready: false,
            bridge: Some(api::Bridge { name: "np0".into(), present: true, up: false, mac: None }),
            ..Default::default()
        }),
        controller: Some(api::ControllerLink { address: "10.0.0.1:7443".into(), ..Default::default() }),
        storage: Some(api::StorageStatus {
            ready: true,
            capacity_bytes: 1 << 30,
            available_bytes: 1 << 30,
            volumes: vec![api::VolumeStatus {
                id: "v".into(),
                size_bytes: 1 << 20,
                fs_type: "xfs".into(),
                backing_file_present: true,
                staged: Some(api::Stage { path: "/s".into(), state: api::StageState::Staging as i32, mounted: false }),
                ..Default::default()
            }],
            ..Default::default()
        }),
        device_plugins: Some(api::DevicePlugins::default()),
        kernel: Some(api::KernelStatus { release: "6.12.0".into(), features: vec![] }),
        services: Some(api::ServicesStatus::default()),
        ..Default::default()
    };
    let out = summary::status(&document::status(&r));
    let lines: Vec<&str> = out.lines().collect();
    for want in [
        "kernel: 6.12.0, 0 of 0 features probed available",
        "controller: 10.0.0.1:7443 NOT CONNECTED, last message never; blocks -",
        "network: bridge np0 DOWN, not ready for ADD (no block yet)",
        "storage: 1 volumes, 0 MiB of 1024 MiB provisioned, 1024 MiB available",
        "    v      1 MiB xfs present -    staging (not mounted) 0",
        "device plugins: 0 resources",
        "services: 0 ports, waiting for the controller",
    ] {
        assert!(lines.contains(&want), "{want:?} not in:\n{out}");
    }
    let idle = api::StatusReport {
        services: Some(api::ServicesStatus { idle: "kube-proxy programs Services here".into(), ..Default::default() }),
        ..Default::default()
    };
    let out = summary::status(&document::status(&idle));
    assert!(out.lines().any(|l| l == "services: 0 ports, NOT SERVED: kube-proxy programs Services here"), "{out}");
}

#[test]
fn doctor_summary() {
    let d = document::doctor(&api::DoctorReport {
        node: "node-a".into(),
        repair: false,
        findings: vec![finding("veth-without-lease", "veth77", "no lease names it", None)],
        errors: vec!["reading the mount table: permission denied".into()],
        ..Default::default()
    });
    assert_eq!(
        summary::doctor(&d),
        "node node-a: 1 findings\n  \
         veth-without-lease veth77: no lease names it\n  \
         error: reading the mount table: permission denied\n\
         run `nodeplane doctor --repair` to remove what can be removed safely\n"
    );
    let d = document::doctor(&api::DoctorReport {
        node: "node-a".into(),
        repair: true,
        findings: vec![
            finding(
                "lease-without-pod",
                "10.244.1.9",
                "its ADD never completed",
                Some((api::RepairResult::Done, "released")),
            ),
            finding(
                "loop-device-without-file",
                "/dev/loop7",
                "bound to a deleted file",
                Some((api::RepairResult::Skipped, "in use")),
            ),
        ],
        ..Default::default()
    });
    assert_eq!(
        summary::doctor(&d),
        "node node-a: 2 findings (repair asked for)\n  \
         lease-without-pod 10.244.1.9: its ADD never completed\n      \
         repair done: released\n  \
         loop-device-without-file /dev/loop7: bound to a deleted file\n      \
         repair skipped: in use\n"
    );
    let d = document::doctor(&api::DoctorReport { node: "node-a".into(), ..Default::default() });
    assert_eq!(summary::doctor(&d), "node node-a: 0 findings\n");
}

#[test]
fn csi_volume_and_snapshot_json() {
    use crate::rpc::csi;
    use crate::storage::csi::TOPOLOGY_KEY;
    use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};
    let on = |node: &str| csi::Topology { segments: [(TOPOLOGY_KEY.to_string(), node.to_string())].into() };
    let elsewhere = csi::Topology { segments: [("zone".to_string(), "z1".to_string())].into() };
    let mut v = csi::Volume {
        volume_id: "vol-1".into(),
        capacity_bytes: 1 << 30,
        volume_context: [("fsType".to_string(), "xfs".to_string())].into(),
        accessible_topology: vec![on("node-a"), elsewhere, on("node-b")],
        content_source: None,
    };
    // Only the segments under the topology key name nodes.
    assert_eq!(
        super::csi::volume(&v),
        json!({
            "volumeId": "vol-1",
            "capacityBytes": 1u64 << 30,
            "volumeContext": {"fsType": "xfs"},
            "nodes": ["node-a", "node-b"],
            "contentSource": null,
        })
    );
    v.content_source = Some(csi::VolumeContentSource {
        r#type: Some(Type::Snapshot(SnapshotSource { snapshot_id: "snap-1".into() })),
    });
    assert_eq!(super::csi::volume(&v)["contentSource"], json!({"snapshot": "snap-1"}));
    v.content_source =
        Some(csi::VolumeContentSource { r#type: Some(Type::Volume(VolumeSource { volume_id: "vol-0".into() })) });
    assert_eq!(super::csi::volume(&v)["contentSource"], json!({"volume": "vol-0"}));
    v.content_source = Some(csi::VolumeContentSource { r#type: None });
    assert_eq!(super::csi::volume(&v)["contentSource"], Value::Null);

    let mut s = csi::Snapshot {
        snapshot_id: "snap-1".into(),
        source_volume_id: "vol-1".into(),
        size_bytes: 4096,
        ready_to_use: true,
        creation_time: Some(crate::rpc::Timestamp { seconds: 1_764_580_000, nanos: 5 }),
        ..Default::default()
    };
    assert_eq!(
        super::csi::snapshot(&s),
        json!({
            "snapshotId": "snap-1",
            "sourceVolumeId": "vol-1",
            "sizeBytes": 4096,
            "readyToUse": true,
            "creationTime": 1_764_580_000,
        })
    );
    s.creation_time = None;
    assert_eq!(super::csi::snapshot(&s)["creationTime"], Value::Null);
}
