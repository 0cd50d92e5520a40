//! Process-level tests of `nodeplane-controller`: the real binary, started with a config in a
//! private temp dir and listening on a Unix socket there (no network, no root), driven with the
//! generated tonic client.
//!
//! Every controller process and temp dir is owned by a [`Ctl`] guard that kills the process
//! (by its PID) and removes the dir when dropped, also when an assertion fails; on failure the
//! guard prints the controller's log.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ipnetwork::IpNetwork;
use nodeplane::rpc::controller as pb;
use pb::node_registry_client::NodeRegistryClient;
use tonic::Code;
use tonic::transport::Channel;

const BIN: &str = env!("CARGO_BIN_EXE_nodeplane-controller");
const ADMIN: &str = "@admin";

type Client = NodeRegistryClient<Channel>;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A random number without a crate: std's randomly keyed SipHash over a counter and the clock.
fn random_u64() -> u64 {
    use std::hash::BuildHasher;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    std::collections::hash_map::RandomState::new().hash_one((nanos, SEQ.fetch_add(1, Ordering::Relaxed)))
}

/// A fresh, empty temp dir, short enough for a Unix socket path inside it.
fn unique_dir(tag: &str) -> PathBuf {
    let name = format!("npctl-{tag}-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
    let mut base = std::env::temp_dir();
    if base.join(&name).join("controller.sock").as_os_str().len() > 100 {
        base = PathBuf::from("/tmp");
    }
    let dir = base.join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// One controller: its temp dir (data dir, config, socket, log) and its process, if running.
struct Ctl {
    dir: PathBuf,
    config: PathBuf,
    socket: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl Ctl {
    /// A controller with `pools` (a JSON array), not started yet.
    fn new(tag: &str, pools: serde_json::Value) -> Ctl {
        Ctl::with_config(tag, |data_dir, socket| {
            serde_json::json!({
                "dataDir": data_dir,
                "listen": format!("unix:{}", socket.display()),
                "pools": pools,
            })
            .to_string()
        })
    }

    /// A controller whose config file is whatever `make(data_dir, socket)` returns.
    fn with_config(tag: &str, make: impl FnOnce(&Path, &Path) -> String) -> Ctl {
        let dir = unique_dir(tag);
        let socket = dir.join("controller.sock");
        let config = dir.join("controller.json");
        std::fs::write(&config, make(&dir.join("data"), &socket)).unwrap();
        Ctl { log: dir.join("controller.log"), dir, config, socket, child: None }
    }

    fn address(&self) -> String {
        format!("unix:{}", self.socket.display())
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `nodeplane-controller token --config F IDENTITY`.
    fn token(&self, identity: &str) -> String {
        let out = Command::new(BIN)
            .args(["token", "--config"])
            .arg(&self.config)
            .arg(identity)
            .output()
            .expect("running the token subcommand");
        assert!(
            out.status.success(),
            "token {identity} failed: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let token = String::from_utf8(out.stdout).unwrap().trim().to_string();
        assert!(!token.is_empty(), "token {identity}: empty output");
        token
    }

    /// Tokens for many identities, minted in parallel processes (the secret must exist already,
    /// see `concurrent_first_token_mints_agree`).
    fn tokens(&self, identities: &[String]) -> Vec<String> {
        std::thread::scope(|s| {
            let handles: Vec<_> = identities
                .chunks(identities.len().div_ceil(8).max(1))
                .map(|chunk| s.spawn(move || chunk.iter().map(|id| self.token(id)).collect::<Vec<_>>()))
                .collect();
            handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
        })
    }

    /// Start `serve` and wait until the socket accepts connections (a stale socket left by a
    /// killed predecessor refuses them, so this cannot pass early).
    async fn start(&mut self) {
        assert!(self.child.is_none(), "controller already running");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let child = Command::new(BIN)
            .args(["serve", "--config"])
            .arg(&self.config)
            .env("NODEPLANE_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawning nodeplane-controller serve");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                panic!("controller exited during start-up: {status}\n{}", self.log_text());
            }
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return;
            }
            assert!(Instant::now() < deadline, "controller not ready within 10 s\n{}", self.log_text());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().expect("controller running").id() as i32
    }

    /// SIGKILL (Child::kill) and reap.
    fn kill9(&mut self) {
        let mut child = self.child.take().expect("controller running");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// SIGTERM and wait up to `within` for the exit.
    async fn terminate(&mut self, within: Duration) -> Result<ExitStatus, String> {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), nix::sys::signal::Signal::SIGTERM).unwrap();
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return Ok(status);
            }
            if Instant::now() >= deadline {
                return Err(format!("controller still running {within:?} after SIGTERM"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn client(&self) -> Client {
        let ch = nodeplane::rpc::connect(&self.address()).await.expect("connecting to the controller");
        NodeRegistryClient::new(ch)
    }
}

impl Drop for Ctl {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            let log = self.log_text();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("--- controller log ({}), last lines ---", self.log.display());
            for l in tail.into_iter().rev() {
                eprintln!("{l}");
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A request carrying `authorization: Bearer <token>`.
fn authed<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    req
}

fn reg_req(name: &str, i: usize) -> pb::RegisterRequest {
    pb::RegisterRequest {
        node_name: name.to_string(),
        underlay_addresses: vec![format!("192.0.2.{}", i % 250 + 1), format!("2001:db8::{:x}", i + 1)],
        vtep_mac: format!("02:00:00:00:{:02x}:{:02x}", i / 256, i % 256),
        wireguard_key: String::new(),
    }
}

async fn register(c: &mut Client, token: &str, name: &str, i: usize) -> Result<pb::Node, tonic::Status> {
    let resp = tokio::time::timeout(Duration::from_secs(5), c.register(authed(reg_req(name, i), token)))
        .await
        .expect("Register did not answer within 5 s")?;
    Ok(resp.into_inner().node.expect("RegisterResponse.node"))
}

async fn request_block(c: &mut Client, token: &str, name: &str, family: pb::Family) -> Result<pb::Node, tonic::Status> {
    let req = authed(pb::RequestBlockRequest { node_name: name.into(), family: family as i32 }, token);
    let resp = tokio::time::timeout(Duration::from_secs(5), c.request_block(req))
        .await
        .expect("RequestBlock did not answer within 5 s")?;
    Ok(resp.into_inner().node.expect("RequestBlockResponse.node"))
}

async fn remove_node(c: &mut Client, token: &str, name: &str) -> Result<Vec<String>, tonic::Status> {
    let req = authed(pb::RemoveNodeRequest { node_name: name.into() }, token);
    let resp = tokio::time::timeout(Duration::from_secs(5), c.remove_node(req))
        .await
        .expect("RemoveNode did not answer within 5 s")?;
    Ok(resp.into_inner().released_blocks)
}

async fn watch(c: &mut Client, token: &str, name: &str) -> Result<tonic::Streaming<pb::NodeList>, tonic::Status> {
    let req = authed(pb::WatchNodesRequest { node_name: name.into(), ..Default::default() }, token);
    Ok(tokio::time::timeout(Duration::from_secs(5), c.watch_nodes(req))
        .await
        .expect("WatchNodes did not answer within 5 s")?
        .into_inner())
}

async fn next_list(s: &mut tonic::Streaming<pb::NodeList>, within: Duration) -> Option<pb::NodeList> {
    match tokio::time::timeout(within, s.message()).await {
        Ok(r) => Some(r.expect("watch stream error").expect("watch stream ended")),
        Err(_) => None,
    }
}

/// The registry as the controller sees it: the first message of an admin WatchNodes.
async fn node_list(c: &mut Client, admin: &str) -> pb::NodeList {
    let mut s = watch(c, admin, "").await.expect("admin WatchNodes");
    next_list(&mut s, Duration::from_secs(5)).await.expect("first WatchNodes message within 5 s")
}

fn by_name(list: &pb::NodeList) -> BTreeMap<String, pb::Node> {
    list.nodes.iter().map(|n| (n.name.clone(), n.clone())).collect()
}

fn nets(node: &pb::Node) -> Vec<IpNetwork> {
    node.pod_blocks
        .iter()
        .map(|b| b.parse().unwrap_or_else(|_| panic!("node {}: block {b:?} is not a CIDR", node.name)))
        .collect()
}

fn family_blocks(node: &pb::Node, v4: bool) -> Vec<IpNetwork> {
    nets(node).into_iter().filter(|n| n.is_ipv4() == v4).collect()
}

fn overlaps(a: &IpNetwork, b: &IpNetwork) -> bool {
    a.is_ipv4() == b.is_ipv4() && (a.contains(b.network()) || b.contains(a.network()))
}

/// No block is held twice (or overlaps another), and every block is a properly aligned block of
/// one of `pools` (cidr, blockPrefix).
fn assert_blocks_consistent(list: &pb::NodeList, pools: &[(&str, u8)]) {
    let pools: Vec<(IpNetwork, u8)> = pools.iter().map(|(c, p)| (c.parse().unwrap(), *p)).collect();
    let mut all: Vec<(IpNetwork, &str)> = Vec::new();
    for node in &list.nodes {
        for b in nets(node) {
            let (pool, prefix) = pools
                .iter()
                .find(|(p, _)| p.is_ipv4() == b.is_ipv4() && p.contains(b.network()))
                .unwrap_or_else(|| panic!("node {}: block {b} is in no pool", node.name));
            assert_eq!(b.prefix(), *prefix, "node {}: block {b} of pool {pool} has the wrong size", node.name);
            assert_eq!(b.network(), b.ip(), "node {}: block {b} is not aligned", node.name);
            for (other, holder) in &all {
                assert!(!overlaps(&b, other), "block {b} of {} overlaps block {other} of {holder}", node.name);
            }
            all.push((b, &node.name));
        }
    }
}

fn assert_code<T: std::fmt::Debug>(r: Result<T, tonic::Status>, code: Code, what: &str) -> tonic::Status {
    match r {
        Ok(v) => panic!("{what}: expected {code:?}, got success {v:?}"),
        Err(s) => {
            assert_eq!(s.code(), code, "{what}: expected {code:?}, got {:?}: {}", s.code(), s.message());
            s
        }
    }
}

fn dual_pools(v4: &str, v4_prefix: u8, v6: &str, v6_prefix: u8) -> serde_json::Value {
    serde_json::json!([{"cidr": v4, "blockPrefix": v4_prefix}, {"cidr": v6, "blockPrefix": v6_prefix}])
}

// ---------------------------------------------------------------------------------------------
// 1. kill -9 during 50 concurrent registrations
// ---------------------------------------------------------------------------------------------

const CRASH_POOLS: [(&str, u8); 2] = [("10.244.0.0/18", 24), ("fd00:10:244::/58", 64)];
const CRASH_NODES: usize = 50;

async fn crash_round(round: usize, delay: Duration) {
    let mut ctl = Ctl::new(
        &format!("crash{round}"),
        dual_pools(CRASH_POOLS[0].0, CRASH_POOLS[0].1, CRASH_POOLS[1].0, CRASH_POOLS[1].1),
    );
    let names: Vec<String> = (0..CRASH_NODES).map(|i| format!("node-{i:02}")).collect();
    let admin = ctl.token(ADMIN); // creates the secret; the rest can then be minted in parallel
    let tokens = ctl.tokens(&names);
    ctl.start().await;

    // One connection per node, all made before the burst.
    let mut clients = Vec::new();
    for _ in 0..CRASH_NODES {
        clients.push(ctl.client().await);
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(CRASH_NODES + 1));
    let mut tasks = Vec::new();
    for (i, mut c) in clients.into_iter().enumerate() {
        let (barrier, token, name) = (barrier.clone(), tokens[i].clone(), names[i].clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            tokio::time::timeout(Duration::from_secs(10), c.register(authed(reg_req(&name, i), &token))).await
        }));
    }
    barrier.wait().await;
    tokio::time::sleep(delay).await;
    ctl.kill9();

    let mut answered: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut failures: BTreeMap<String, usize> = BTreeMap::new();
    for (i, t) in tasks.into_iter().enumerate() {
        match t.await.unwrap().unwrap_or_else(|_| panic!("{}: Register hung for 10 s across the crash", names[i])) {
            Ok(resp) => {
                let node = resp.into_inner().node.expect("RegisterResponse.node");
                assert_eq!(node.name, names[i]);
                answered.insert(names[i].clone(), node.pod_blocks);
            }
            Err(s) => {
                // Only the crash may fail a call: never a pool, auth or argument error.
                assert!(
                    matches!(s.code(), Code::Unavailable | Code::Unknown | Code::Cancelled | Code::Internal),
                    "{}: unexpected failure before the crash: {:?} {}",
                    names[i],
                    s.code(),
                    s.message()
                );
                *failures.entry(format!("{:?}", s.code())).or_default() += 1;
            }
        }
    }
    // The answers given before the crash are already consistent among themselves.
    let pre = pb::NodeList {
        nodes: answered
            .iter()
            .map(|(n, b)| pb::Node { name: n.clone(), pod_blocks: b.clone(), ..Default::default() })
            .collect(),
        ..Default::default()
    };
    assert_blocks_consistent(&pre, &CRASH_POOLS);

    // Restart on the same data dir and re-register everyone with the same request.
    let restart = Instant::now();
    ctl.start().await;
    let restart_ms = restart.elapsed().as_millis();
    let mut tasks = Vec::new();
    for i in 0..CRASH_NODES {
        let c = ctl.client().await;
        let (token, name) = (tokens[i].clone(), names[i].clone());
        tasks.push(tokio::spawn(async move {
            let mut c = c;
            register(&mut c, &token, &name, i).await
        }));
    }
    let mut after: BTreeMap<String, pb::Node> = BTreeMap::new();
    for (i, t) in tasks.into_iter().enumerate() {
        let node = t.await.unwrap().unwrap_or_else(|s| panic!("{}: re-register after restart: {s:?}", names[i]));
        after.insert(names[i].clone(), node);
    }
    for (name, blocks) in &answered {
        assert_eq!(&after[name].pod_blocks, blocks, "{name}: blocks changed across the kill -9");
    }
    for (name, node) in &after {
        assert_eq!(family_blocks(node, true).len(), 1, "{name}: IPv4 blocks {:?}", node.pod_blocks);
        assert_eq!(family_blocks(node, false).len(), 1, "{name}: IPv6 blocks {:?}", node.pod_blocks);
    }

    // The controller's own view: 50 nodes, the blocks just answered, nothing held twice.
    let mut admin_client = ctl.client().await;
    let list = node_list(&mut admin_client, &admin).await;
    let listed = by_name(&list);
    assert_eq!(listed.keys().collect::<Vec<_>>(), names.iter().collect::<Vec<_>>(), "registered nodes");
    for (name, node) in &listed {
        assert_eq!(node.pod_blocks, after[name].pod_blocks, "{name}: listed blocks differ from Register's answer");
        assert_eq!(family_blocks(node, true).len(), 1, "{name}: {:?}", node.pod_blocks);
        assert_eq!(family_blocks(node, false).len(), 1, "{name}: {:?}", node.pod_blocks);
    }
    assert_blocks_consistent(&list, &CRASH_POOLS);

    // A second restart (clean this time) changes nothing.
    drop(admin_client);
    ctl.terminate(Duration::from_secs(5)).await.expect("clean stop");
    ctl.start().await;
    let mut c = ctl.client().await;
    let again = node_list(&mut c, &admin).await;
    assert_eq!(by_name(&again), listed, "registry changed across a clean restart");

    eprintln!(
        "crash round {round}: kill -9 after {} ms: {} answered before the crash, failed {:?}; restart ready in {restart_ms} ms",
        delay.as_millis(),
        answered.len(),
        failures
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kill9_during_concurrent_registrations_keeps_blocks() {
    // Three random delays in 5..=40 ms, one from each third of the range so they differ.
    let delays: Vec<u64> =
        [(5u64, 16u64), (16, 28), (28, 41)].iter().map(|(lo, hi)| lo + random_u64() % (hi - lo)).collect();
    for (round, d) in delays.into_iter().enumerate() {
        crash_round(round, Duration::from_millis(d)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Re-registration and restarts
// ---------------------------------------------------------------------------------------------

const WIDE_POOLS: [(&str, u8); 2] = [("10.244.0.0/16", 24), ("fd00:10:244::/48", 64)];

fn wide_ctl(tag: &str) -> Ctl {
    Ctl::new(tag, dual_pools(WIDE_POOLS[0].0, WIDE_POOLS[0].1, WIDE_POOLS[1].0, WIDE_POOLS[1].1))
}

#[tokio::test(flavor = "multi_thread")]
async fn reregistration_and_restarts_keep_blocks() {
    let mut ctl = wide_ctl("rereg");
    ctl.start().await; // this time the secret is made by `serve`; `token` must reuse it
    let admin = ctl.token(ADMIN);
    let (ta, tb, tc) = (ctl.token("node-a"), ctl.token("node-b"), ctl.token("node-c"));
    let mut c = ctl.client().await;

    let a = register(&mut c, &ta, "node-a", 1).await.unwrap();
    let b = register(&mut c, &tb, "node-b", 2).await.unwrap();
    for n in [&a, &b] {
        assert_eq!(family_blocks(n, true).len(), 1, "{n:?}");
        assert_eq!(family_blocks(n, false).len(), 1, "{n:?}");
    }
    assert_eq!(a.underlay_addresses, reg_req("node-a", 1).underlay_addresses);
    assert_eq!(a.vtep_mac, reg_req("node-a", 1).vtep_mac);
    let again = register(&mut c, &ta, "node-a", 1).await.unwrap();
    assert_eq!(again.pod_blocks, a.pod_blocks, "re-registration must return the same blocks");

    // New underlay and VTEP MAC: same blocks, new addresses.
    let moved = pb::RegisterRequest {
        node_name: "node-a".into(),
        underlay_addresses: vec!["198.51.100.7".into()],
        vtep_mac: "02:aa:bb:cc:dd:ee".into(),
        wireguard_key: String::new(),
    };
    let a2 = c.register(authed(moved.clone(), &ta)).await.unwrap().into_inner();
    let a2n = a2.node.unwrap();
    assert_eq!(a2n.pod_blocks, a.pod_blocks);
    assert_eq!(a2n.underlay_addresses, moved.underlay_addresses);
    assert_eq!(a2n.vtep_mac, moved.vtep_mac);
    let mut cidrs = a2.cluster_cidrs.clone();
    cidrs.sort();
    assert_eq!(cidrs, vec!["10.244.0.0/16".to_string(), "fd00:10:244::/48".to_string()]);
    assert_eq!((a2.vxlan_vni, a2.vxlan_port), (4242, 4789), "defaults");

    // Invalid requests (an admin may register any node, but not nonsense).
    let bad_name = pb::RegisterRequest { node_name: "Node_A".into(), ..reg_req("x", 9) };
    assert_code(c.register(authed(bad_name, &admin)).await, Code::InvalidArgument, "bad node name");
    let no_underlay = pb::RegisterRequest { underlay_addresses: vec![], ..reg_req("node-b", 2) };
    assert_code(c.register(authed(no_underlay, &tb)).await, Code::InvalidArgument, "no underlay");
    let bad_ip = pb::RegisterRequest { underlay_addresses: vec!["not-an-ip".into()], ..reg_req("node-b", 2) };
    assert_code(c.register(authed(bad_ip, &tb)).await, Code::InvalidArgument, "bad underlay");
    let bad_mac = pb::RegisterRequest { vtep_mac: "zz".into(), ..reg_req("node-b", 2) };
    assert_code(c.register(authed(bad_mac, &tb)).await, Code::InvalidArgument, "bad mac");

    let before = node_list(&mut c, &admin).await;
    assert_eq!(before.nodes.len(), 2);

    // Clean restart (SIGTERM).
    drop(c);
    let status = ctl.terminate(Duration::from_secs(5)).await.unwrap();
    assert!(status.success(), "SIGTERM exit: {status}");
    ctl.start().await;
    let mut c = ctl.client().await;
    let after = node_list(&mut c, &admin).await;
    assert_eq!(by_name(&after), by_name(&before), "registry after SIGTERM + restart");
    assert_eq!(after.revision, before.revision, "revision survives a restart");
    assert_eq!(by_name(&after)["node-a"].underlay_addresses, moved.underlay_addresses, "updated underlay persisted");
    let a3 = c.register(authed(moved.clone(), &ta)).await.unwrap().into_inner().node.unwrap();
    assert_eq!(a3.pod_blocks, a.pod_blocks);
    assert_eq!(register(&mut c, &tb, "node-b", 2).await.unwrap().pod_blocks, b.pod_blocks);

    // The CLI `list` shows the same.
    let token_file = ctl.dir.join("admin.token");
    std::fs::write(&token_file, &admin).unwrap();
    let out = Command::new(BIN)
        .args(["list", "--controller", &ctl.address(), "--token-file"])
        .arg(&token_file)
        .output()
        .unwrap();
    assert!(out.status.success(), "list: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    for n in [&a, &b] {
        let line = text.lines().find(|l| l.starts_with(&format!("{}\t", n.name))).unwrap_or_else(|| panic!("{text}"));
        assert!(line.contains(&format!("blocks={}", n.pod_blocks.join(","))), "{line}");
    }

    // A new node gets new blocks; then kill -9 and restart: still all the same.
    let cn = register(&mut c, &tc, "node-c", 3).await.unwrap();
    let list = node_list(&mut c, &admin).await;
    assert_blocks_consistent(&list, &WIDE_POOLS);
    drop(c);
    ctl.kill9();
    ctl.start().await;
    let mut c = ctl.client().await;
    assert_eq!(by_name(&node_list(&mut c, &admin).await), by_name(&list), "registry after kill -9");
    assert_eq!(register(&mut c, &tc, "node-c", 3).await.unwrap().pod_blocks, cn.pod_blocks);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_with_open_watch_stream_exits_promptly() {
    // Every agent keeps a WatchNodes stream open, so a controller that waits for streams to end
    // on SIGTERM would never stop on its own (Kubernetes would SIGKILL it after the grace period).
    let mut ctl = wide_ctl("term");
    ctl.start().await;
    let admin = ctl.token(ADMIN);
    let ta = ctl.token("node-a");
    let mut c = ctl.client().await;
    register(&mut c, &ta, "node-a", 1).await.unwrap();
    let mut s = watch(&mut c, &ta, "node-a").await.unwrap();
    assert!(next_list(&mut s, Duration::from_secs(1)).await.is_some());
    let result = ctl.terminate(Duration::from_secs(5)).await;
    if let Err(e) = result {
        // Tell whether it is the open stream that holds the shutdown up.
        drop(s);
        drop(c);
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut after_close = None;
        while Instant::now() < deadline {
            if let Some(st) = ctl.child.as_mut().unwrap().try_wait().unwrap() {
                ctl.child = None;
                after_close = Some(st);
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "{e} while a WatchNodes stream was open; after the client closed the stream: {}",
            match after_close {
                Some(st) => format!("exited ({st}) - the open stream blocked the shutdown"),
                None => "still running".into(),
            }
        );
    }
    let status = result.unwrap();
    assert!(status.success(), "SIGTERM exit: {status}");
    // And the state is intact.
    ctl.start().await;
    let mut c = ctl.client().await;
    assert_eq!(node_list(&mut c, &admin).await.nodes.len(), 1);
}

// ---------------------------------------------------------------------------------------------
// 3. Authentication and authorisation
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn auth_rejects_missing_invalid_and_foreign_credentials() {
    let mut ctl = wide_ctl("auth");
    let admin = ctl.token(ADMIN);
    let ta = ctl.token("node-a");
    let tb = ctl.token("node-b");
    // A token minted with another controller's secret.
    let other = wide_ctl("auth-other");
    let foreign_a = other.token("node-a");
    let foreign_admin = other.token(ADMIN);
    assert_ne!(foreign_a, ta, "two data dirs must have different secrets");
    ctl.start().await;
    let mut c = ctl.client().await;

    // Missing credential, on every RPC.
    let s = assert_code(c.register(tonic::Request::new(reg_req("node-a", 1))).await, Code::Unauthenticated, "no token");
    assert!(!s.message().is_empty());
    assert_code(
        c.request_block(tonic::Request::new(pb::RequestBlockRequest {
            node_name: "node-a".into(),
            family: pb::Family::Ipv4 as i32,
        }))
        .await,
        Code::Unauthenticated,
        "RequestBlock without token",
    );
    assert_code(
        c.watch_nodes(tonic::Request::new(pb::WatchNodesRequest { node_name: "node-a".into(), ..Default::default() }))
            .await,
        Code::Unauthenticated,
        "WatchNodes without token",
    );
    assert_code(
        c.remove_node(tonic::Request::new(pb::RemoveNodeRequest { node_name: "node-a".into() })).await,
        Code::Unauthenticated,
        "RemoveNode without token",
    );

    // Garbage and malformed credentials.
    for (what, header) in [
        ("garbage token", "Bearer garbage".to_string()),
        ("empty bearer", "Bearer ".to_string()),
        ("no Bearer prefix", ta.clone()),
        ("basic auth", "Basic dXNlcjpwYXNz".to_string()),
        ("truncated signature", format!("Bearer {}", &ta[..ta.len() - 2])),
        ("forged identity", format!("Bearer {}", ta.replace("node-a", "node-b"))),
        ("admin with a node signature", format!("Bearer {}", ta.replace("node-a", ADMIN))),
        ("foreign secret", format!("Bearer {foreign_a}")),
    ] {
        let mut req = tonic::Request::new(reg_req("node-a", 1));
        req.metadata_mut().insert("authorization", header.parse().unwrap());
        assert_code(c.register(req).await, Code::Unauthenticated, what);
    }
    assert_code(
        c.remove_node(authed(pb::RemoveNodeRequest { node_name: "node-a".into() }, &foreign_admin)).await,
        Code::Unauthenticated,
        "foreign admin token on RemoveNode",
    );
    assert_code(watch(&mut c, &foreign_admin, "").await, Code::Unauthenticated, "foreign admin token on WatchNodes");

    // A node acting for another.
    assert_code(register(&mut c, &ta, "node-b", 2).await, Code::PermissionDenied, "node-a registering node-b");
    register(&mut c, &tb, "node-b", 2).await.unwrap();
    register(&mut c, &ta, "node-a", 1).await.unwrap();
    assert_code(
        request_block(&mut c, &ta, "node-b", pb::Family::Ipv4).await,
        Code::PermissionDenied,
        "node-a asking a block for node-b",
    );
    assert_code(watch(&mut c, &ta, "node-b").await, Code::PermissionDenied, "node-a watching as node-b");
    assert_code(remove_node(&mut c, &ta, "node-b").await, Code::PermissionDenied, "node token on RemoveNode (other)");

    // Only the admin changes or lists the policy and Services objects.
    let ch = nodeplane::rpc::connect(&ctl.address()).await.unwrap();
    let mut policies = pb::network_policies_client::NetworkPoliciesClient::new(ch.clone());
    let mut services = pb::services_client::ServicesClient::new(ch);
    let apply = || pb::ApplyObjectsRequest { json: "[]".into() };
    let e = assert_code(policies.apply_objects(authed(apply(), &ta)).await, Code::PermissionDenied, "policy apply");
    assert!(e.message().contains("may not change or list policy objects"), "{e:?}");
    assert_code(policies.list_objects(authed(pb::ListObjectsRequest {}, &ta)).await, Code::PermissionDenied, "list");
    let e = assert_code(services.apply_objects(authed(apply(), &ta)).await, Code::PermissionDenied, "Services apply");
    assert!(e.message().contains("may not change or list Services"), "{e:?}");
    assert_code(
        services.delete_objects(authed(pb::DeleteObjectsRequest { json: "[]".into() }, &tb)).await,
        Code::PermissionDenied,
        "Services delete",
    );
    assert!(policies.list_objects(authed(pb::ListObjectsRequest {}, &admin)).await.is_ok());
    assert!(services.list_objects(authed(pb::ListObjectsRequest {}, &admin)).await.is_ok());

    // Nothing was changed by the rejected calls.
    let list = node_list(&mut c, &admin).await;
    let nodes = by_name(&list);
    assert_eq!(nodes.keys().collect::<Vec<_>>(), ["node-a", "node-b"]);
    assert_eq!(nodes["node-b"].underlay_addresses, reg_req("node-b", 2).underlay_addresses);
    assert!(nodes["node-b"].pod_blocks.len() == 2, "node-b got no extra block: {:?}", nodes["node-b"].pod_blocks);

    // The right credentials work: a node may release itself; the admin may remove any node.
    assert!(watch(&mut c, &ta, "node-a").await.is_ok());
    assert_eq!(remove_node(&mut c, &ta, "node-a").await.unwrap(), nodes["node-a"].pod_blocks);
    assert_eq!(remove_node(&mut c, &admin, "node-b").await.unwrap(), nodes["node-b"].pod_blocks);

    // The token subcommand refuses identities that are not node names.
    let out = Command::new(BIN).args(["token", "--config"]).arg(&ctl.config).arg("Not_A_Node").output().unwrap();
    assert!(!out.status.success(), "token for an invalid node name must fail");
}

#[test]
fn concurrent_first_token_mints_agree() {
    // Minting tokens in parallel on a fresh data dir (e.g. a provisioning script minting one
    // token per node) must not create several secrets: every token must stay valid.
    let ctl = wide_ctl("mint");
    let n = 8;
    let tokens: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n).map(|_| s.spawn(|| ctl.token(ADMIN))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let distinct: HashSet<&String> = tokens.iter().collect();
    let now = ctl.token(ADMIN);
    let valid = tokens.iter().filter(|t| **t == now).count();
    assert_eq!(
        distinct.len(),
        1,
        "{n} concurrent `token @admin` runs on a fresh data dir produced {} different tokens; \
         only {valid} of {n} match the secret that stayed on disk",
        distinct.len()
    );
}

// ---------------------------------------------------------------------------------------------
// 4. Pool exhaustion, RemoveNode, RequestBlock
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn pool_exhaustion_removal_and_extra_blocks() {
    // Two blocks per family.
    let pools = [("10.9.0.0/23", 24u8), ("fd00:9::/63", 64u8)];
    let mut ctl = Ctl::new("exhaust", dual_pools(pools[0].0, pools[0].1, pools[1].0, pools[1].1));
    let admin = ctl.token(ADMIN);
    let names = ["n1", "n2", "n3"];
    let t: Vec<String> = names.iter().map(|n| ctl.token(n)).collect();
    ctl.start().await;
    let mut c = ctl.client().await;

    let n1 = register(&mut c, &t[0], "n1", 1).await.unwrap();
    let n2 = register(&mut c, &t[1], "n2", 2).await.unwrap();
    let s = assert_code(register(&mut c, &t[2], "n3", 3).await, Code::ResourceExhausted, "third node");
    let msg = s.message();
    assert!(
        msg.contains("IPv4") && msg.contains("10.9.0.0/23") && msg.contains("no free block"),
        "the message should name the family and pool: {msg:?}"
    );
    let list = node_list(&mut c, &admin).await;
    assert_eq!(by_name(&list).keys().collect::<Vec<_>>(), ["n1", "n2"], "a failed registration records nothing");
    // Re-registering existing nodes still works when the pools are full.
    assert_eq!(register(&mut c, &t[0], "n1", 1).await.unwrap().pod_blocks, n1.pod_blocks);
    assert_code(
        request_block(&mut c, &t[0], "n1", pb::Family::Ipv4).await,
        Code::ResourceExhausted,
        "RequestBlock with no free block",
    );

    // Remove n1: its blocks come back, and n3 gets exactly those.
    let released = remove_node(&mut c, &admin, "n1").await.unwrap();
    let mut r = released.clone();
    r.sort();
    let mut e = n1.pod_blocks.clone();
    e.sort();
    assert_eq!(r, e, "RemoveNode reports the node's blocks");
    assert_code(remove_node(&mut c, &admin, "n1").await, Code::NotFound, "removing n1 twice");
    let n3 = register(&mut c, &t[2], "n3", 3).await.unwrap();
    let mut got = n3.pod_blocks.clone();
    got.sort();
    assert_eq!(got, e, "n3 must receive n1's released blocks");
    // n1's token no longer finds a record for RequestBlock.
    assert_code(request_block(&mut c, &t[0], "n1", pb::Family::Ipv4).await, Code::NotFound, "removed node");

    // Free n2's blocks; RequestBlock gives n3 a second IPv4 block (n2's), and only one.
    remove_node(&mut c, &admin, "n2").await.unwrap();
    let more = request_block(&mut c, &t[2], "n3", pb::Family::Ipv4).await.unwrap();
    assert_eq!(family_blocks(&more, true).len(), 2, "{:?}", more.pod_blocks);
    assert_eq!(family_blocks(&more, false).len(), 1, "{:?}", more.pod_blocks);
    assert!(more.pod_blocks.contains(&family_blocks(&n2, true)[0].to_string()), "{:?}", more.pod_blocks);
    assert_code(
        request_block(&mut c, &t[2], "n3", pb::Family::Ipv4).await,
        Code::ResourceExhausted,
        "RequestBlock after the pool is used up",
    );
    assert_code(
        request_block(&mut c, &t[2], "n3", pb::Family::Unspecified).await,
        Code::InvalidArgument,
        "RequestBlock without a family",
    );
    // Re-registration keeps the extra block.
    assert_eq!(register(&mut c, &t[2], "n3", 3).await.unwrap().pod_blocks, more.pod_blocks);
    // n2 now finds no IPv4 block (n3 holds both), and its would-be IPv6 block is not leaked.
    let s = assert_code(register(&mut c, &t[1], "n2", 2).await, Code::ResourceExhausted, "n2 after n3 took its block");
    assert!(s.message().contains("IPv4"), "{}", s.message());
    let v6 = request_block(&mut c, &t[2], "n3", pb::Family::Ipv6).await.unwrap();
    assert_eq!(family_blocks(&v6, false).len(), 2, "the second IPv6 block is free: {:?}", v6.pod_blocks);
    let list = node_list(&mut c, &admin).await;
    assert_eq!(list.nodes.len(), 1);
    assert_blocks_consistent(&list, &pools);
}

#[tokio::test(flavor = "multi_thread")]
async fn failed_registration_releases_its_partial_allocation() {
    // Plenty of IPv4 blocks, one IPv6 block: the second node's IPv4 block, taken before the
    // IPv6 pool turns out to be full, must go back.
    let pools = [("10.10.0.0/22", 24u8), ("fd00:a::/64", 64u8)];
    let mut ctl = Ctl::new("partial", dual_pools(pools[0].0, pools[0].1, pools[1].0, pools[1].1));
    let admin = ctl.token(ADMIN);
    let (ta, tb) = (ctl.token("a"), ctl.token("b"));
    ctl.start().await;
    let mut c = ctl.client().await;
    let a = register(&mut c, &ta, "a", 1).await.unwrap();
    assert_eq!(a.pod_blocks, ["10.10.0.0/24", "fd00:a::/64"]);
    let s = assert_code(register(&mut c, &tb, "b", 2).await, Code::ResourceExhausted, "no IPv6 block left");
    assert!(s.message().contains("IPv6") && s.message().contains("fd00:a::/64"), "{}", s.message());
    // The IPv4 block "b" nearly got is the next one a asks for.
    let more = request_block(&mut c, &ta, "a", pb::Family::Ipv4).await.unwrap();
    assert_eq!(more.pod_blocks, ["10.10.0.0/24", "fd00:a::/64", "10.10.1.0/24"]);
    remove_node(&mut c, &admin, "a").await.unwrap();
    let b = register(&mut c, &tb, "b", 2).await.unwrap();
    assert_eq!(b.pod_blocks, ["10.10.0.0/24", "fd00:a::/64"]);
}

// ---------------------------------------------------------------------------------------------
// 5. WatchNodes
// ---------------------------------------------------------------------------------------------

/// Read full lists from `s` until one satisfies `pred`, for at most `within`.
async fn wait_for_list(
    s: &mut tonic::Streaming<pb::NodeList>,
    within: Duration,
    what: &str,
    pred: impl Fn(&pb::NodeList) -> bool,
) -> pb::NodeList {
    let deadline = tokio::time::Instant::now() + within;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match next_list(s, left).await {
            Some(l) if pred(&l) => return l,
            Some(l) => seen.push(l),
            None => panic!("{what}: no matching list within {within:?}; saw {seen:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn watch_streams_full_lists_on_every_change() {
    let mut ctl = wide_ctl("watch");
    let admin = ctl.token(ADMIN);
    let (ta, tb, tc) = (ctl.token("node-a"), ctl.token("node-b"), ctl.token("node-c"));
    ctl.start().await;
    let mut c = ctl.client().await;
    let a = register(&mut c, &ta, "node-a", 1).await.unwrap();
    let b = register(&mut c, &tb, "node-b", 2).await.unwrap();

    let mut wc = ctl.client().await;
    let mut admin_watch = watch(&mut wc, &admin, "").await.unwrap();
    let mut node_watch = watch(&mut wc, &tb, "node-b").await.unwrap();
    let first = next_list(&mut admin_watch, Duration::from_secs(1)).await.expect("first message within 1 s");
    let nodes = by_name(&first);
    assert_eq!(nodes.keys().collect::<Vec<_>>(), ["node-a", "node-b"], "the first message is the full list");
    assert_eq!(nodes["node-a"], a);
    assert_eq!(nodes["node-b"], b);
    let first_b = next_list(&mut node_watch, Duration::from_secs(1)).await.expect("node watch: first message");
    assert_eq!(by_name(&first_b), nodes, "a node's watch sees the same list");

    // A new node.
    let cn = register(&mut c, &tc, "node-c", 3).await.unwrap();
    let t0 = Instant::now();
    let l = wait_for_list(&mut admin_watch, Duration::from_secs(1), "after Register node-c", |l| {
        by_name(l).get("node-c") == Some(&cn)
    })
    .await;
    let join_ms = t0.elapsed().as_millis();
    assert_eq!(l.nodes.len(), 3, "still the full list: {l:?}");
    assert!(l.revision > first.revision, "revision grows: {} -> {}", first.revision, l.revision);
    let lb = wait_for_list(&mut node_watch, Duration::from_secs(1), "node-b's watch after node-c joined", |l| {
        by_name(l).contains_key("node-c")
    })
    .await;
    assert_eq!(lb.nodes.len(), 3);

    // A removal.
    remove_node(&mut c, &admin, "node-a").await.unwrap();
    let t0 = Instant::now();
    let l2 = wait_for_list(&mut admin_watch, Duration::from_secs(1), "after RemoveNode node-a", |l| {
        !by_name(l).contains_key("node-a")
    })
    .await;
    let leave_ms = t0.elapsed().as_millis();
    assert_eq!(by_name(&l2).keys().collect::<Vec<_>>(), ["node-b", "node-c"]);
    assert!(l2.revision > l.revision);
    wait_for_list(&mut node_watch, Duration::from_secs(1), "node-b's watch after node-a left", |l| {
        !by_name(l).contains_key("node-a")
    })
    .await;

    // A changed underlay is a change too.
    let moved = pb::RegisterRequest { underlay_addresses: vec!["198.51.100.3".into()], ..reg_req("node-c", 3) };
    c.register(authed(moved, &tc)).await.unwrap();
    wait_for_list(&mut admin_watch, Duration::from_secs(1), "after node-c moved", |l| {
        by_name(l).get("node-c").is_some_and(|n| n.underlay_addresses == ["198.51.100.3"])
    })
    .await;

    // A watch opened now starts with the current full list.
    let mut late = watch(&mut wc, &admin, "").await.unwrap();
    let now = next_list(&mut late, Duration::from_secs(1)).await.expect("late watcher's first message");
    assert_eq!(by_name(&now).keys().collect::<Vec<_>>(), ["node-b", "node-c"]);
    eprintln!("watch: join seen after {join_ms} ms, removal after {leave_ms} ms");
}

/// One simulated agent of the delta test: its view (the agent's own type) and its stream.
struct DeltaAgent {
    view: nodeplane::agent::cluster::Members,
    stream: Option<tonic::Streaming<pb::NodeList>>,
    /// Reconnects that resumed from a revision (each must start with a delta, not a snapshot).
    resumed: usize,
    snapshots: usize,
}

async fn open_delta(c: &mut Client, token: &str, a: &mut DeltaAgent, name: &str) {
    let req = pb::WatchNodesRequest {
        node_name: name.into(),
        deltas: true,
        since_revision: a.view.revision,
        epoch: a.view.epoch,
    };
    let resuming = a.view.revision != 0;
    let mut s = c.watch_nodes(authed(req, token)).await.expect("WatchNodes").into_inner();
    let first = next_list(&mut s, Duration::from_secs(5)).await.expect("a first message within 5 s");
    if resuming {
        assert!(!first.snapshot, "{name} resumed from revision {} but got a snapshot", a.view.revision);
        a.resumed += 1;
    }
    a.snapshots += usize::from(first.snapshot);
    a.view.apply(first).unwrap_or_else(|e| panic!("{name}: {e}"));
    a.stream = Some(s);
}

/// Apply whatever the stream has ready (each message must follow the view exactly).
async fn drain_delta(a: &mut DeltaAgent, name: &str) {
    let Some(s) = a.stream.as_mut() else { return };
    while let Ok(m) = tokio::time::timeout(Duration::from_millis(5), s.message()).await {
        let m = m.expect("stream error").expect("stream ended");
        a.snapshots += usize::from(m.snapshot);
        a.view.apply(m).unwrap_or_else(|e| panic!("{name}: a gap on a stream that never fell behind: {e}"));
    }
}

/// Issue 21: membership deltas under random joins, changes and leaves, with agents that
/// disconnect at random points (resuming from their revision, or from nothing); at the end
/// every agent's view equals the controller's, each delta applied exactly once in order
/// (a gap or a repeat fails `Members::apply`). NODEPLANE_DELTA_SEED replays a run.
#[tokio::test(flavor = "multi_thread")]
async fn delta_streams_converge_under_random_changes_and_disconnects() {
    let seed = std::env::var("NODEPLANE_DELTA_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(random_u64);
    eprintln!("NODEPLANE_DELTA_SEED={seed}");
    let mut x = seed | 1;
    let mut rnd = move |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n as u64) as usize
    };
    let mut ctl = wide_ctl("deltas");
    let admin = ctl.token(ADMIN);
    let names: Vec<String> = (0..24).map(|i| format!("n{i:02}")).collect();
    let tokens: Vec<String> = names.iter().map(|n| ctl.token(n)).collect();
    ctl.start().await;
    let mut c = ctl.client().await;
    let mut wc = ctl.client().await;
    let mut agents: Vec<DeltaAgent> =
        (0..6).map(|_| DeltaAgent { view: Default::default(), stream: None, resumed: 0, snapshots: 0 }).collect();
    let watcher = |i: usize| format!("n{i:02}");
    for i in 0..agents.len() {
        register(&mut c, &tokens[i], &names[i], i).await.unwrap();
    }
    let mut registered: std::collections::BTreeSet<usize> = (0..agents.len()).collect();
    for (i, a) in agents.iter_mut().enumerate() {
        open_delta(&mut wc, &tokens[i], a, &watcher(i)).await;
    }
    for step in 0..400 {
        let i = rnd(names.len());
        match rnd(100) {
            // Join, or change (a new underlay and MAC) of a registered node.
            0..=39 => {
                register(&mut c, &tokens[i], &names[i], i + 1000 * rnd(3)).await.unwrap();
                registered.insert(i);
            }
            // Leave (watching agents stay: their nodes are not removed).
            40..=54 if i >= agents.len() && registered.contains(&i) => {
                remove_node(&mut c, &admin, &names[i]).await.unwrap();
                registered.remove(&i);
            }
            // An agent drops its stream; it comes back later from its revision, or (one in
            // three) having lost its view (a restarted agent).
            55..=69 => {
                let a = rnd(agents.len());
                agents[a].stream = None;
                if rnd(3) == 0 {
                    agents[a].view = Default::default();
                }
            }
            70..=79 => {
                let a = rnd(agents.len());
                if agents[a].stream.is_none() {
                    open_delta(&mut wc, &tokens[a], &mut agents[a], &watcher(a)).await;
                }
            }
            _ => {
                let a = rnd(agents.len());
                drain_delta(&mut agents[a], &watcher(a)).await;
            }
        }
        if step % 50 == 0 {
            for (a, agent) in agents.iter_mut().enumerate() {
                drain_delta(agent, &watcher(a)).await;
            }
        }
    }
    // The controller's view: a client without deltas gets the complete list.
    let want = by_name(&node_list(&mut wc, &admin).await);
    assert_eq!(
        want.keys().cloned().collect::<std::collections::BTreeSet<_>>(),
        registered.iter().map(|&i| names[i].clone()).collect()
    );
    for (a, agent) in agents.iter_mut().enumerate() {
        if agent.stream.is_none() {
            open_delta(&mut wc, &tokens[a], agent, &watcher(a)).await;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while agent.view.nodes != want && Instant::now() < deadline {
            drain_delta(agent, &watcher(a)).await;
        }
        assert_eq!(agent.view.nodes, want, "agent {a}'s view (seed {seed})");
    }
    let resumed: usize = agents.iter().map(|a| a.resumed).sum();
    assert!(resumed > 0, "no agent resumed from a revision (seed {seed})");
    eprintln!(
        "deltas: {resumed} resumes from a revision, {} snapshots",
        agents.iter().map(|a| a.snapshots).sum::<usize>()
    );
}

// ---------------------------------------------------------------------------------------------
// 6. Bad configuration fails at start-up
// ---------------------------------------------------------------------------------------------

#[test]
fn bad_configuration_fails_at_startup() {
    type Make = Box<dyn Fn(&Path, &Path) -> String + Send + Sync>;
    let listen = |s: &Path| format!("unix:{}", s.display());
    let with_pools = move |pools: serde_json::Value| -> Make {
        Box::new(move |d: &Path, s: &Path| {
            serde_json::json!({"dataDir": d, "listen": listen(s), "pools": pools}).to_string()
        })
    };
    let cases: Vec<(&str, Make, Vec<&str>)> = vec![
        (
            "overlapping pools",
            with_pools(serde_json::json!([
                {"cidr": "10.0.0.0/16", "blockPrefix": 24},
                {"cidr": "10.0.128.0/17", "blockPrefix": 24}
            ])),
            vec!["overlaps", "10.0.128.0/17", "10.0.0.0/16"],
        ),
        (
            "identical IPv6 pools",
            with_pools(serde_json::json!([
                {"cidr": "fd00::/48", "blockPrefix": 64},
                {"cidr": "fd00::/48", "blockPrefix": 64}
            ])),
            vec!["overlaps", "fd00::/48"],
        ),
        (
            "block larger than the pool",
            with_pools(serde_json::json!([{"cidr": "10.0.0.0/16", "blockPrefix": 8}])),
            vec!["/8", "does not fit", "10.0.0.0/16"],
        ),
        (
            "IPv4 block too small",
            with_pools(serde_json::json!([{"cidr": "10.0.0.0/16", "blockPrefix": 31}])),
            vec!["/31", "too small", "IPv4"],
        ),
        (
            "IPv6 block too small",
            with_pools(serde_json::json!([{"cidr": "fd00::/48", "blockPrefix": 128}])),
            vec!["/128", "too small", "IPv6"],
        ),
        (
            "malformed CIDR",
            with_pools(serde_json::json!([{"cidr": "10.0.0.300/16", "blockPrefix": 24}])),
            vec!["10.0.0.300/16", "not a CIDR"],
        ),
        (
            "prefix out of range",
            with_pools(serde_json::json!([{"cidr": "10.0.0.0/33", "blockPrefix": 24}])),
            vec!["10.0.0.0/33", "not a CIDR"],
        ),
        (
            "host bits set",
            with_pools(serde_json::json!([{"cidr": "10.0.0.1/16", "blockPrefix": 24}])),
            vec!["10.0.0.1/16", "host bits"],
        ),
        (
            "missing pools",
            Box::new(move |d: &Path, s: &Path| serde_json::json!({"dataDir": d, "listen": listen(s)}).to_string()),
            vec!["pools"],
        ),
        ("empty pools", with_pools(serde_json::json!([])), vec!["pools", "at least one"]),
        (
            "relative unix socket path",
            Box::new(|d: &Path, _s: &Path| {
                serde_json::json!({"dataDir": d, "listen": "unix:controller.sock",
                    "pools": [{"cidr": "10.0.0.0/16", "blockPrefix": 24}]})
                .to_string()
            }),
            vec!["controller.sock", "absolute"],
        ),
        (
            "unknown field",
            Box::new(move |d: &Path, s: &Path| {
                serde_json::json!({"dataDir": d, "listen": listen(s), "pool": [],
                    "pools": [{"cidr": "10.0.0.0/16", "blockPrefix": 24}]})
                .to_string()
            }),
            vec!["pool"],
        ),
        (
            "VXLAN VNI out of range (24 bits)",
            Box::new(move |d: &Path, s: &Path| {
                serde_json::json!({"dataDir": d, "listen": listen(s), "vxlanVni": 16_777_216u32,
                    "pools": [{"cidr": "10.0.0.0/16", "blockPrefix": 24}]})
                .to_string()
            }),
            vec!["vxlanVni", "16777216"],
        ),
    ];

    let failures: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = cases
            .iter()
            .map(|(what, make, needles)| {
                s.spawn(move || -> Option<String> {
                    let ctl = Ctl::with_config("badcfg", |d, sock| make(d, sock));
                    let mut child = Command::new(BIN)
                        .args(["serve", "--config"])
                        .arg(&ctl.config)
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(Stdio::piped())
                        .spawn()
                        .unwrap();
                    let deadline = Instant::now() + Duration::from_secs(5);
                    let status = loop {
                        if let Some(st) = child.try_wait().unwrap() {
                            break Some(st);
                        }
                        if Instant::now() >= deadline {
                            let _ = child.kill();
                            let _ = child.wait();
                            break None;
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    };
                    let mut stderr = String::new();
                    use std::io::Read;
                    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
                    let Some(status) = status else {
                        return Some(format!("{what}: still running after 5 s (accepted the config)"));
                    };
                    if status.success() {
                        return Some(format!("{what}: exited 0"));
                    }
                    let missing: Vec<&&str> = needles.iter().filter(|n| !stderr.contains(**n)).collect();
                    if !missing.is_empty() {
                        return Some(format!("{what}: stderr lacks {missing:?}: {stderr:?}"));
                    }
                    if ctl.socket.exists() {
                        return Some(format!("{what}: the socket was created"));
                    }
                    None
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().unwrap()).collect()
    });
    assert!(failures.is_empty(), "bad configurations not rejected properly:\n{}", failures.join("\n"));
}
