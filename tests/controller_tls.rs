//! The controller's agent API on TCP with TLS: the real binary on a loopback port, with
//! certificates made by `nodeplane-controller certs`, driven by the agent's own client
//! code (`rpc::connect_with`). No root needed.
//!
//! What must be refused is refused at the transport (plaintext, a wrong CA, a wrong name,
//! an expired certificate), a rotated certificate reaches new connections while an
//! established WatchNodes stream goes on, and a node's client certificate acts for that
//! node only, on every RPC. The health endpoint is TLS with the same certificate.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nodeplane::rpc::controller as pb;
use nodeplane::rpc::tls::ClientFiles;
use pb::node_registry_client::NodeRegistryClient;
use tonic::Code;
use tonic::transport::Channel;

const BIN: &str = env!("CARGO_BIN_EXE_nodeplane-controller");

use crate::https_get;

type Client = NodeRegistryClient<Channel>;

fn run(args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).output().expect("running nodeplane-controller");
    assert!(out.status.success(), "{args:?}: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A controller serving TLS on a loopback port, with its CA (and a second, foreign CA) in
/// its temp dir; killed by PID and removed when dropped.
struct TlsCtl {
    dir: PathBuf,
    config: PathBuf,
    addr: String,
    health: u16,
    child: Option<Child>,
}

impl TlsCtl {
    fn new(tag: &str) -> TlsCtl {
        let dir = std::env::temp_dir().join(format!("npctl-tls-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let tls = dir.join("tls");
        run(&["certs", "init", "--dir", tls.to_str().unwrap(), "--san", "127.0.0.1", "--san", "controller.test"]);
        run(&["certs", "init", "--dir", dir.join("foreign").to_str().unwrap(), "--san", "127.0.0.1"]);
        let addr = format!("127.0.0.1:{}", free_port());
        let health = free_port();
        let config = dir.join("controller.json");
        let cfg = serde_json::json!({
            "dataDir": dir.join("data"),
            "listen": addr,
            "healthAddress": format!("127.0.0.1:{health}"),
            "pools": [{"cidr": "10.244.0.0/16", "blockPrefix": 24}],
            "tls": {"dir": tls, "clientCaFile": tls.join("ca.crt"), "reloadSeconds": 1},
        });
        std::fs::write(&config, cfg.to_string()).unwrap();
        let mut c = TlsCtl { dir, config, addr, health, child: None };
        c.start();
        c
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("controller.log")).unwrap_or_default()
    }

    fn start(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("controller.log")).unwrap();
        let child = Command::new(BIN)
            .args(["serve", "--config"])
            .arg(&self.config)
            .env("NODEPLANE_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.log().contains("ready (TLS)") {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                panic!("controller exited: {st}\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "controller not ready\n{}", self.log());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn token(&self, identity: &str) -> String {
        run(&["token", "--config", self.config.to_str().unwrap(), identity]).trim().to_string()
    }

    fn ca(&self) -> PathBuf {
        self.dir.join("tls/ca.crt")
    }

    /// Issue into `dir/<name>` with the controller's CA: a serving pair for `sans` or a
    /// node's client pair.
    fn issue(&self, name: &str, what: &[&str], days: i64) -> PathBuf {
        let out = self.dir.join(name);
        let ca_dir = self.dir.join("tls");
        let mut args = vec!["certs", "issue", "--ca-dir", ca_dir.to_str().unwrap(), "--out", out.to_str().unwrap()];
        args.extend_from_slice(what);
        let d = days.to_string();
        args.extend_from_slice(&["--days", &d]);
        run(&args);
        out
    }

    /// `GET path` on the health endpoint over TLS, verified against `ca` as `name`.
    fn health_get(&self, path: &str, ca: &Path, name: &str, alpn: &[&[u8]]) -> Result<(u16, String), String> {
        https_get::get(self.health, path, https_get::Mode::Verified { ca, name, alpn })
    }

    async fn connect(&self, files: &ClientFiles) -> Result<Client, String> {
        nodeplane::rpc::connect_with(&self.addr, Some(files))
            .await
            .map(NodeRegistryClient::new)
            .map_err(|e| e.to_string())
    }

    fn files(&self, name: Option<&str>, client: Option<&Path>) -> ClientFiles {
        ClientFiles {
            ca_file: self.ca(),
            server_name: name.map(String::from),
            cert_file: client.map(|d| d.join("tls.crt")),
            key_file: client.map(|d| d.join("tls.key")),
        }
    }
}

impl Drop for TlsCtl {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- controller log ---\n{}", self.log());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn bearer<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

fn register(node: &str) -> pb::RegisterRequest {
    pb::RegisterRequest {
        node_name: node.into(),
        underlay_addresses: vec!["192.0.2.7".into()],
        vtep_mac: String::new(),
        wireguard_key: String::new(),
    }
}

/// The node list an admin sees (a fresh TLS connection).
async fn admin_list(ctl: &TlsCtl, admin: &str) -> pb::NodeList {
    let mut c = ctl.connect(&ctl.files(None, None)).await.expect("admin connects");
    let mut s = c
        .watch_nodes(bearer(pb::WatchNodesRequest { node_name: String::new(), ..Default::default() }, admin))
        .await
        .unwrap()
        .into_inner();
    s.message().await.unwrap().unwrap()
}

/// The first call on a channel to `files` fails (at connect, or, for a refused client
/// certificate, at the first request: TLS 1.3 finishes the client's side of the handshake
/// before the server has checked its certificate). Returns the error text.
async fn refused(ctl: &TlsCtl, files: &ClientFiles, token: &str) -> String {
    match ctl.connect(files).await {
        Err(e) => e,
        Ok(mut c) => match c.register(bearer(register("node-x"), token)).await {
            Err(s) => format!("{:?}: {}", s.code(), s.message()),
            Ok(_) => panic!("{files:?}: the call was served"),
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_refusals() {
    let ctl = TlsCtl::new("refuse");
    let admin = ctl.token("@admin");
    // The right CA, by IP SAN and by DNS SAN: served.
    assert_eq!(admin_list(&ctl, &admin).await.nodes.len(), 0);
    let mut c = ctl.connect(&ctl.files(Some("controller.test"), None)).await.unwrap();
    c.register(bearer(register("node-a"), &ctl.token("node-a"))).await.expect("a node registers over TLS");

    // Plaintext with a valid token: the TLS listener never serves it, and the log says why.
    let plain = nodeplane::rpc::connect_with(&ctl.addr, None).await;
    let served = match plain {
        Err(_) => false,
        Ok(ch) => NodeRegistryClient::new(ch).register(bearer(register("node-a"), &admin)).await.is_ok(),
    };
    assert!(!served, "a token over plaintext must never be accepted");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !ctl.log().contains("TLS handshake failed") {
        assert!(Instant::now() < deadline, "no handshake failure logged");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A CA that did not sign the controller's certificate.
    let mut foreign = ctl.files(None, None);
    foreign.ca_file = ctl.dir.join("foreign/ca.crt");
    let e = refused(&ctl, &foreign, &admin).await;
    assert!(e.contains("UnknownIssuer") || e.contains("unknown issuer"), "{e}");
    // A name the certificate does not carry.
    let e = refused(&ctl, &ctl.files(Some("other.test"), None), &admin).await;
    assert!(e.contains("NotValidForName") || e.contains("not valid for name"), "{e}");

    // Expired: rotate the serving pair to an expired one; new connections refuse it.
    let expired = ctl.issue("expired", &["--san", "127.0.0.1"], -1);
    for f in ["tls.key", "tls.crt"] {
        std::fs::copy(expired.join(f), ctl.dir.join("tls").join(f)).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let e = loop {
        match ctl.connect(&ctl.files(None, None)).await {
            Err(e) => break e,
            Ok(_) => {
                assert!(Instant::now() < deadline, "the expired certificate was never served");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert!(e.contains("Expired") || e.contains("expired"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_keeps_established_streams() {
    let ctl = TlsCtl::new("rotate");
    let admin = ctl.token("@admin");
    let mut c = ctl.connect(&ctl.files(None, None)).await.unwrap();
    let mut stream = c
        .watch_nodes(bearer(pb::WatchNodesRequest { node_name: String::new(), ..Default::default() }, &admin))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stream.message().await.unwrap().unwrap().nodes.len(), 0);

    // A new pair naming only rotated.test, written as a Secret update would (two files, one
    // after the other: the half-written state must not be served).
    let new = ctl.issue("rotated", &["--san", "rotated.test"], 30);
    for f in ["tls.crt", "tls.key"] {
        std::fs::copy(new.join(f), ctl.dir.join("tls").join(f)).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while ctl.connect(&ctl.files(Some("rotated.test"), None)).await.is_err() {
        assert!(Instant::now() < deadline, "the rotated certificate was never served\n{}", ctl.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(ctl.log().contains("serving certificate reloaded"));
    // New connections get the new certificate: the old name is no longer in it.
    let e = refused(&ctl, &ctl.files(None, None), &admin).await;
    assert!(e.contains("NotValidForName") || e.contains("not valid for name"), "{e}");

    // The stream opened before the rotation still delivers: a node registering now shows up.
    let mut c2 = ctl.connect(&ctl.files(Some("rotated.test"), None)).await.unwrap();
    c2.register(bearer(register("node-r"), &ctl.token("node-r"))).await.unwrap();
    let list = tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .expect("the old stream went quiet")
        .unwrap()
        .unwrap();
    assert_eq!(list.nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["node-r"]);
    // And the old connection still carries new calls.
    c.register(bearer(register("node-s"), &ctl.token("node-s")))
        .await
        .expect("the established connection serves new calls");
    // The health endpoint follows the same files.
    let ca = ctl.ca();
    assert_eq!(ctl.health_get("/healthz", &ca, "rotated.test", &[]).map(|r| r.0), Ok(200));
    let e = ctl.health_get("/healthz", &ca, "127.0.0.1", &[]).unwrap_err();
    assert!(e.contains("NotValidForName") || e.contains("not valid for name"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_endpoint_is_tls_with_the_serving_certificate() {
    let ctl = TlsCtl::new("health");
    let ca = ctl.ca();
    // kubelet's HTTPS probe (no ALPN, no verification) answers.
    assert_eq!(https_get::get(ctl.health, "/readyz", https_get::Mode::Probe), Ok((200, "ok\n".to_string())));
    // A client offering no ALPN and a scraper offering h2 and http/1.1: both get HTTP/1.1
    // over TLS, verified like the agent API. The client CA is on (mTLS) and they send no
    // certificate: probes carry none.
    for alpn in [&[][..], &[&b"h2"[..], &b"http/1.1"[..]][..]] {
        assert_eq!(ctl.health_get("/healthz", &ca, "127.0.0.1", alpn), Ok((200, "ok\n".to_string())), "ALPN {alpn:?}");
        assert_eq!(ctl.health_get("/readyz", &ca, "controller.test", alpn).map(|r| r.0), Ok(200));
    }
    let (code, body) = ctl.health_get("/metrics", &ca, "127.0.0.1", &[]).unwrap();
    assert_eq!(code, 200);
    assert!(body.contains("nodeplane_controller_leader 1"), "{body}");
    // Plain HTTP gets no answer: the handshake fails and the connection is closed.
    let e = https_get::get(ctl.health, "/healthz", https_get::Mode::Plain).unwrap_err();
    assert!(e.contains("no HTTP response"), "{e}");
    // The wrong CA and the wrong name are refused as on the agent API.
    let e = ctl.health_get("/healthz", &ctl.dir.join("foreign/ca.crt"), "127.0.0.1", &[]).unwrap_err();
    assert!(e.contains("UnknownIssuer") || e.contains("unknown issuer"), "{e}");
    let e = ctl.health_get("/healthz", &ca, "other.test", &[]).unwrap_err();
    assert!(e.contains("NotValidForName") || e.contains("not valid for name"), "{e}");
    // A client that insists on h2 is refused at the handshake rather than spoken HTTP/1.1 to.
    assert!(ctl.health_get("/healthz", &ca, "127.0.0.1", &[b"h2"]).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_act_for_their_node_only() {
    let ctl = TlsCtl::new("mtls");
    let admin = ctl.token("@admin");
    let a = ctl.issue("node-a", &["--node", "node-a"], 30);
    let mut c = ctl.connect(&ctl.files(None, Some(&a))).await.unwrap();
    // No token: the certificate is the credential.
    let resp = c
        .register(tonic::Request::new(register("node-a")))
        .await
        .expect("node-a registers by certificate")
        .into_inner();
    assert!(!resp.node.unwrap().pod_blocks.is_empty(), "node-a got a block");
    let names: Vec<String> = admin_list(&ctl, &admin).await.nodes.into_iter().map(|n| n.name).collect();
    assert_eq!(names, ["node-a"]);

    // For node-b, every RPC is refused.
    let b = "node-b".to_string();
    let denied = |r: Result<(), tonic::Status>, what: &str| {
        let s = r.expect_err(what);
        assert_eq!(s.code(), Code::PermissionDenied, "{what}: {s:?}");
    };
    denied(c.register(tonic::Request::new(register(&b))).await.map(|_| ()), "Register");
    denied(
        c.request_block(tonic::Request::new(pb::RequestBlockRequest {
            node_name: b.clone(),
            family: pb::Family::Ipv4 as i32,
        }))
        .await
        .map(|_| ()),
        "RequestBlock",
    );
    denied(
        c.watch_nodes(tonic::Request::new(pb::WatchNodesRequest { node_name: b.clone(), ..Default::default() }))
            .await
            .map(|_| ()),
        "WatchNodes",
    );
    denied(
        c.remove_node(tonic::Request::new(pb::RemoveNodeRequest { node_name: b.clone() })).await.map(|_| ()),
        "RemoveNode",
    );
    denied(
        c.watch_volumes(tonic::Request::new(pb::WatchVolumesRequest { node_name: b.clone(), ..Default::default() }))
            .await
            .map(|_| ()),
        "WatchVolumes",
    );
    denied(
        c.report_volumes(tonic::Request::new(pb::ReportVolumesRequest { node_name: b.clone(), ..Default::default() }))
            .await
            .map(|_| ()),
        "ReportVolumes",
    );
    // The node's certificate with the admin's token is not an admin.
    let s = c.register(bearer(register(&b), &admin)).await.unwrap_err();
    assert_eq!(s.code(), Code::Unauthenticated, "{s:?}");
    assert!(s.message().contains("client certificate names node \"node-a\""), "{s:?}");
    // Nothing was registered for node-b by any of that.
    let names: Vec<String> = admin_list(&ctl, &admin).await.nodes.into_iter().map(|n| n.name).collect();
    assert_eq!(names, ["node-a"]);

    // An expired client certificate, and one from another CA, are refused at the handshake.
    let old = ctl.issue("node-a-old", &["--node", "node-a"], -1);
    let e = refused(&ctl, &ctl.files(None, Some(&old)), "").await;
    assert!(!e.contains("PermissionDenied"), "refused by TLS, not by the RPC: {e}");
    let other = ctl.dir.join("other-ca");
    run(&["certs", "init", "--dir", other.to_str().unwrap(), "--san", "x.test"]);
    let forged = ctl.dir.join("forged");
    run(&[
        "certs",
        "issue",
        "--ca-dir",
        other.to_str().unwrap(),
        "--out",
        forged.to_str().unwrap(),
        "--node",
        "node-a",
    ]);
    let e = refused(&ctl, &ctl.files(None, Some(&forged)), "").await;
    assert!(!e.contains("PermissionDenied"), "refused by TLS, not by the RPC: {e}");
}
