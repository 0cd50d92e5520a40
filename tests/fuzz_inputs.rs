//! Bad-input fuzzing (issue #8): the CNI shim as the runtime execs it, the CNI request parser
//! and its wire framing, CSI Node request validation and device plugin request validation.
//! Property-based (proptest): generated inputs, each checked against an independent model of
//! the answer it must get — no panic, no hang, the right error code, oversized input refused
//! early.
//!
//! Cases per target default to the numbers in `cases(..)` calls below (chosen so the whole file
//! runs in well under 90 s on 2 cores in `cargo test --release`); `PROPTEST_CASES=N` sets every
//! target to N. Failure persistence is off (nothing is written into the repo); a failure prints
//! the minimal input and proptest's seed.
//!
//! The `*_root` tests run a real `nodeplane-agent` (CNI + CSI + device plugins) in a private
//! network namespace (`unshare --net`, the mount namespace shared so its mounts show in
//! `/proc/self/mountinfo` here) inside `/tmp/npfz-<pid>-<name>`, and need root: they FAIL
//! without it. The sandbox guard kills that agent by PID, unmounts, detaches loop devices
//! under the sandbox and removes it, also when a test panics.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStringExt;
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nodeplane::net::cni::request::{self, Env};
use nodeplane::net::cni::wire::{self, MAX_FRAME, WireRequest};
use nodeplane::net::cni::{Code, MAX_CONFIG_BYTES, Reply, SUPPORTED_VERSIONS};
use nodeplane::rpc::csi;
use nodeplane::rpc::csi::volume_capability::access_mode::Mode;
use nodeplane::rpc::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use serde_json::{Value, json};

// ----- shared helpers -----

/// The runner config for one target: `default` cases unless `PROPTEST_CASES` says otherwise;
/// no failure persistence file.
fn cases(default: u32) -> PtConfig {
    let n = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    PtConfig { cases: n, failure_persistence: None, max_shrink_iters: 256, ..PtConfig::default() }
}

/// Run `test` over `strategy`, printing cases and time; panic with proptest's report on failure.
fn fuzz<S: Strategy>(name: &str, cfg: PtConfig, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>)
where
    S::Value: std::fmt::Debug,
{
    let n = cfg.cases;
    let t = Instant::now();
    let seed = seed_for(name);
    let mut bytes = [0u8; 32];
    for (i, chunk) in bytes.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&seed.rotate_left(16 * i as u32).to_le_bytes());
    }
    let mut runner = TestRunner::new_with_rng(cfg, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes));
    if let Err(e) = runner.run(&strategy, test) {
        panic!("{name} (NODEPLANE_FUZZ_SEED={seed}): {e}");
    }
    eprintln!("fuzz {name}: {n} cases passed in {:.2} s", t.elapsed().as_secs_f64());
}

/// The seed of one target's run: fixed by default, so a CI run is reproducible and does not
/// fail on an input no earlier run saw; `NODEPLANE_FUZZ_SEED=N` replays a run (the number is
/// printed with every failure), `NODEPLANE_FUZZ_SEED=random` explores new inputs.
fn seed_for(name: &str) -> u64 {
    let base: u64 = match std::env::var("NODEPLANE_FUZZ_SEED").as_deref() {
        Ok("random") => {
            let mut b = [0u8; 8];
            std::fs::File::open("/dev/urandom")
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
                .expect("reading /dev/urandom");
            let s = u64::from_le_bytes(b);
            eprintln!("fuzz {name}: NODEPLANE_FUZZ_SEED={s}");
            return s;
        }
        Ok(v) => return v.parse().expect("NODEPLANE_FUZZ_SEED: a number or \"random\""),
        Err(_) => 0x6e70_f022,
    };
    // Each target its own stream.
    name.bytes().fold(base ^ 0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// At most 200 characters of `s`, for messages.
fn short(s: &str) -> String {
    if s.len() <= 200 {
        s.to_string()
    } else {
        format!("{}… ({} bytes)", s.chars().take(200).collect::<String>(), s.len())
    }
}

fn bin_dir() -> PathBuf {
    match std::env::var_os("NODEPLANE_TARGET") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_BIN_EXE_nodeplane-agent")).parent().unwrap().to_path_buf(),
    }
}
fn shim_bin() -> PathBuf {
    bin_dir().join("nodeplane-cni")
}
fn agent_bin() -> PathBuf {
    bin_dir().join("nodeplane-agent")
}

/// A temp dir removed on drop.
struct TempDir(PathBuf);
impl TempDir {
    fn new(name: &str) -> TempDir {
        let d = PathBuf::from("/tmp").join(format!("npfz-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

// ----- the CNI model: what each input must get -----

const COMMANDS: &[&str] = &["ADD", "DEL", "CHECK", "STATUS", "GC", "VERSION"];

fn min_version(cmd: &str) -> &'static str {
    match cmd {
        "CHECK" => "0.4.0",
        "STATUS" | "GC" => "1.1.0",
        _ => "0.3.0",
    }
}
fn version_lt(a: &str, b: &str) -> bool {
    let p = |s: &str| s.split('.').map(|x| x.parse::<u32>().unwrap()).collect::<Vec<_>>();
    p(a) < p(b)
}

/// CNI spec: alphanumerics first, then alphanumerics, '_', '.', '-' (our README: at most 192).
fn model_container_id(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 192
        && b[0].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'))
}

/// The kernel's `dev_valid_name`: 1..15 bytes, not "." or "..", no '/', ':' or whitespace,
/// where the kernel's `isspace` (lib/ctype.c, Latin-1) also counts 0xA0 as a space. We also
/// refuse the other control characters (0x01-0x1f, 0x7f), stricter than the kernel on purpose.
fn model_ifname(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() < 16
        && s != "."
        && s != ".."
        && b.iter().all(|&c| !matches!(c, b'/' | b':' | b' ' | 0xa0 | 0x7f) && c > 0x20)
}

/// CNI_ARGS: `K=V` pairs separated by ';' (empty pairs ignored), keys non-empty.
fn model_args(s: &str) -> bool {
    s.split(';').filter(|p| !p.is_empty()).all(|p| matches!(p.split_once('='), Some((k, _)) if !k.is_empty()))
}

/// One environment variable as generated: absent, or these bytes (maybe not UTF-8).
type EnvVal = Option<Vec<u8>>;

/// A generated invocation: the environment and a config built field by field, each field
/// valid or broken in a known way, or raw stdin.
#[derive(Debug, Clone)]
struct Invocation {
    command: EnvVal,
    container_id: EnvVal,
    ifname: EnvVal,
    netns: EnvVal,
    args: EnvVal,
    path: EnvVal,
    stdin: Stdin,
}

#[derive(Debug, Clone)]
enum Stdin {
    /// A config object; `faults` lists the codes each broken field must give.
    Conf(Value, Vec<u32>),
    /// Bytes that are not a JSON object (random bytes, truncations, other JSON): code 6.
    Undecodable(Vec<u8>),
}

/// How the env value reads for the process (std::env::var: not UTF-8 = absent) and for the
/// parser (empty = absent, except CNI_ARGS).
fn env_str(v: &EnvVal) -> Option<String> {
    v.as_ref().and_then(|b| String::from_utf8(b.clone()).ok())
}

impl Invocation {
    fn env(&self) -> Env {
        let mut e = Env::new();
        for (k, v) in self.pairs() {
            if let Some(s) = env_str(v) {
                e.insert(k.to_string(), s);
            }
        }
        e
    }
    fn pairs(&self) -> [(&'static str, &EnvVal); 6] {
        [
            ("CNI_COMMAND", &self.command),
            ("CNI_CONTAINERID", &self.container_id),
            ("CNI_IFNAME", &self.ifname),
            ("CNI_NETNS", &self.netns),
            ("CNI_ARGS", &self.args),
            ("CNI_PATH", &self.path),
        ]
    }
    fn stdin_bytes(&self) -> Vec<u8> {
        match &self.stdin {
            Stdin::Conf(v, _) => serde_json::to_vec(v).unwrap(),
            Stdin::Undecodable(b) => b.clone(),
        }
    }
    fn command(&self) -> Option<String> {
        env_str(&self.command).filter(|c| COMMANDS.contains(&c.as_str()))
    }

    /// The codes this invocation may get (empty: it must be accepted by the parser).
    /// A bad CNI_COMMAND decides alone (4); an undecodable config decides alone (6).
    fn expected(&self) -> BTreeSet<u32> {
        let Some(cmd) = self.command() else { return [4].into() };
        let faults = match &self.stdin {
            Stdin::Undecodable(_) => return [6].into(),
            Stdin::Conf(_, f) => f.clone(),
        };
        let mut out: BTreeSet<u32> = faults.into_iter().collect();
        if let Stdin::Conf(v, _) = &self.stdin
            && let Some(ver) = v.get("cniVersion").and_then(Value::as_str)
            && SUPPORTED_VERSIONS.contains(&ver)
            && version_lt(ver, min_version(&cmd))
        {
            out.insert(1);
        }
        let target = matches!(cmd.as_str(), "ADD" | "DEL" | "CHECK");
        let present = |v: &EnvVal| env_str(v).filter(|s| !s.is_empty());
        match present(&self.container_id) {
            Some(c) if !model_container_id(&c) => drop(out.insert(4)),
            None if target => drop(out.insert(4)),
            _ => {}
        }
        match present(&self.ifname) {
            Some(n) if !model_ifname(&n) => drop(out.insert(4)),
            None if target => drop(out.insert(4)),
            _ => {}
        }
        match present(&self.netns) {
            Some(n) if !n.starts_with('/') => drop(out.insert(4)),
            None if matches!(cmd.as_str(), "ADD" | "CHECK") => drop(out.insert(4)),
            _ => {}
        }
        if let Some(a) = env_str(&self.args)
            && !model_args(&a)
        {
            out.insert(4);
        }
        out
    }
}

/// Odd bytes: control characters, NBSP, invalid UTF-8, '/', ':', '=' and ';'. (No NUL: an
/// environment string cannot hold one.)
fn odd_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        prop_oneof![
            4 => prop::sample::select(b"abcXYZ019_.-".to_vec()),
            1 => prop::sample::select(vec![b'/', b':', b'=', b';', b' ', b'\t', b'\n', 0x7f, 0x01]),
            1 => prop::sample::select(vec![0xc2u8, 0xa0, 0x85, 0xff, 0xfe, 0xc3, 0xa9]),
        ],
        0..max,
    )
}

fn env_val(valid: BoxedStrategy<String>, long_len: usize) -> impl Strategy<Value = EnvVal> {
    prop_oneof![
        6 => valid.prop_map(|s| Some(s.into_bytes())),
        1 => Just(None),
        1 => Just(Some(Vec::new())),
        2 => odd_bytes(24).prop_map(Some),
        1 => Just(Some(vec![b'a'; long_len])),
    ]
}

fn command_val() -> impl Strategy<Value = EnvVal> {
    prop_oneof![
        12 => prop::sample::select(COMMANDS).prop_map(|c| Some(c.as_bytes().to_vec())),
        1 => Just(None),
        1 => prop::sample::select(vec!["add", "ADD ", "", "FROB", "DELETE", "ADD\n", "VERSIONS"]).prop_map(|c| Some(c.as_bytes().to_vec())),
        1 => odd_bytes(8).prop_map(Some),
    ]
}

/// A config field: Ok(value) or Err(code it must give), or absent (None) when allowed.
#[allow(clippy::type_complexity)] // proptest strategies of pairs
fn field(
    valid: BoxedStrategy<Value>,
    broken: BoxedStrategy<Value>,
    code: u32,
    absent: Option<u32>,
) -> BoxedStrategy<(Option<Value>, Option<u32>)> {
    let mut opts: Vec<(u32, BoxedStrategy<(Option<Value>, Option<u32>)>)> = vec![
        (8, valid.prop_map(|v| (Some(v), None)).boxed()),
        (1, broken.prop_map(move |v| (Some(v), Some(code))).boxed()),
    ];
    opts.push((1, Just((None, absent)).boxed()));
    prop::strategy::Union::new_weighted(opts).boxed()
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(|f| json!(f)),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(".{0,8}", inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn config(sock: String, pending: String) -> impl Strategy<Value = (Value, Vec<u32>)> {
    let version = prop_oneof![
        8 => prop::sample::select(SUPPORTED_VERSIONS).prop_map(|v| (Some(json!(v)), None)),
        1 => prop::sample::select(vec!["0.2.0", "9.9.9", "1.1", "", "1.1.0 ", "v1.0.0", "0.3.0.0"]).prop_map(|v| (Some(json!(v)), Some(1))),
        1 => prop_oneof![Just(json!(1.1)), Just(json!(null)), Just(json!(["1.1.0"]))].prop_map(|v| {
            // null counts as absent: "cniVersion is required" (7) either way.
            (Some(v), Some(7))
        }),
        1 => Just((None, Some(7))),
    ];
    let name = field(
        "[a-z0-9][a-z0-9_.-]{0,20}".prop_map(Value::String).boxed(),
        prop_oneof![
            "[-_. ][a-z]{0,5}".prop_map(Value::String),
            Just(json!("")),
            Just(json!("a b")),
            Just(json!("név")),
            Just(json!(7)),
            Just(json!({"n": 1})),
        ]
        .boxed(),
        7,
        Some(7),
    );
    let typ = field(
        Just(json!("nodeplane")).boxed(),
        prop_oneof![Just(json!("bridge")), Just(json!("Nodeplane")), Just(json!(1))].boxed(),
        7,
        Some(7),
    );
    let mtu = field(
        (68u32..=65535).prop_map(|m| json!(m)).boxed(),
        prop_oneof![
            (0u32..68).prop_map(|m| json!(m)),
            (65536u64..u64::MAX).prop_map(|m| json!(m)),
            (i64::MIN..0).prop_map(|m| json!(m)),
            Just(json!(1500.5)),
            Just(json!("1500")),
        ]
        .boxed(),
        7,
        None,
    );
    let dns = field(
        Just(json!({"nameservers": ["10.0.0.10", "fd00::a"], "search": ["svc.local"], "options": ["ndots:5"]})).boxed(),
        prop_oneof![
            Just(json!({"nameservers": ["not-an-ip"]})),
            Just(json!({"nameservers": "10.0.0.10"})),
            Just(json!({"search": [1]})),
            Just(json!({"domain": 5})),
            Just(json!("dns")),
        ]
        .boxed(),
        7,
        None,
    );
    let wait = field(
        Just(json!(0)).boxed(),
        prop_oneof![(301u64..100_000).prop_map(|n| json!(n)), Just(json!(-1)), Just(json!("0")), Just(json!(0.5))]
            .boxed(),
        7,
        // Absent would mean the default 10 s wait: never absent here.
        None,
    )
    .prop_map(|(v, c)| (Some(v.unwrap_or(json!(0))), c));
    let sock_f =
        field(Just(json!(sock)).boxed(), prop_oneof![Just(json!("run/cni.sock")), Just(json!(3))].boxed(), 7, None)
            .prop_map(move |(v, c)| (Some(v.unwrap_or(json!(sock.clone()))), c));
    let pend_f =
        field(Just(json!(pending)).boxed(), prop_oneof![Just(json!("pending")), Just(json!(["/x"]))].boxed(), 7, None)
            .prop_map(move |(v, c)| (Some(v.unwrap_or(json!(pending.clone()))), c));
    let prev = prop_oneof![
        6 => Just((Some(json!({"cniVersion": "1.1.0", "interfaces": [{"name": "eth0", "sandbox": "/x"}],
                               "ips": [{"address": "10.1.2.3/24", "interface": 0}]})), None)),
        1 => Just((None, None)),
        1 => prop_oneof![
            Just(json!("prev")),
            Just(json!({"ips": [{"address": "10.1.2.3/33"}]})),
            Just(json!({"ips": [{"address": "10.1.2.3/24", "interface": 4}]})),
            Just(json!({"interfaces": [{}]})),
            Just(json!({"routes": [{"dst": "nope"}]})),
        ]
        .prop_map(|v| (Some(v), Some(7))),
    ];
    let attachments = prop_oneof![
        6 => Just((Some(json!([{"containerID": "c1", "ifname": "eth0"}])), None)),
        1 => Just((None, None)),
        1 => prop_oneof![Just(json!({"c": 1})), Just(json!([{"containerID": "c1"}])), Just(json!([5]))].prop_map(|v| (Some(v), Some(7))),
    ];
    let extra = prop::collection::btree_map("[a-zA-Z/.]{1,10}", any_json(), 0..3);
    (version, name, typ, mtu, dns, wait, sock_f, pend_f, prev, attachments, extra, any::<bool>()).prop_map(
        |(ver, name, typ, mtu, dns, wait, sock, pend, prev, att, extra, legacy_key)| {
            let mut m = serde_json::Map::new();
            for (k, v) in extra {
                m.insert(k, v);
            }
            let mut faults = Vec::new();
            let mut put = |k: &str, (v, c): (Option<Value>, Option<u32>)| {
                m.remove(k);
                if let Some(v) = v {
                    m.insert(k.to_string(), v);
                }
                faults.extend(c);
            };
            put("cniVersion", ver);
            put("name", name);
            put("type", typ);
            put("mtu", mtu);
            put("dns", dns);
            put("agentWaitSeconds", wait);
            put("agentSocket", sock);
            put("pendingDeleteDir", pend);
            // prevResult and the GC list count only for the commands that read them: the
            // fault is recorded under a key and resolved per command below.
            let (pv, pc) = prev;
            if let Some(v) = pv {
                m.insert("prevResult".into(), v);
            }
            m.remove("cni.dev/valid-attachments");
            m.remove("cni.dev/attachments");
            let (av, ac) = att;
            if let Some(v) = av {
                m.insert(if legacy_key { "cni.dev/attachments" } else { "cni.dev/valid-attachments" }.into(), v);
            }
            // Markers, removed before use: 1000 + code for prevResult, 2000 + code for GC.
            faults.extend(pc.map(|c| 1000 + c));
            faults.extend(ac.map(|c| 2000 + c));
            (Value::Object(m), faults)
        },
    )
}

/// Resolve the per-command markers and missing-field rules: CHECK needs prevResult, GC needs
/// its attachment list; a broken prevResult counts for every command (it is always parsed).
fn resolve_faults(cmd: Option<&str>, conf: &Value, faults: &[u32]) -> Vec<u32> {
    let mut out = Vec::new();
    for &f in faults {
        match f {
            1000.. if f < 2000 => out.push(f - 1000),
            2000.. => {
                if cmd == Some("GC") {
                    out.push(f - 2000)
                }
            }
            _ => out.push(f),
        }
    }
    if cmd == Some("CHECK") && conf.get("prevResult").is_none() {
        out.push(7);
    }
    if cmd == Some("GC") && conf.get("cni.dev/valid-attachments").is_none() && conf.get("cni.dev/attachments").is_none()
    {
        out.push(7);
    }
    out
}

fn undecodable() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64),
        any_json().prop_filter("not an object", |v| !v.is_object()).prop_map(|v| serde_json::to_vec(&v).unwrap()),
        // A truncated object.
        (1usize..40).prop_map(|n| {
            let s = br#"{"cniVersion":"1.1.0","name":"nodeplane","type":"nodeplane"}"#;
            s[..n.min(s.len() - 1)].to_vec()
        }),
        // Deep nesting, as a whole and inside an otherwise valid object.
        (200usize..20_000).prop_map(|d| [vec![b'['; d], vec![b']'; d]].concat()),
        (200usize..20_000).prop_map(|d| {
            let mut v = br#"{"cniVersion":"1.1.0","name":"n","type":"nodeplane","x":"#.to_vec();
            v.extend(std::iter::repeat_n(b'{', 1).chain(std::iter::repeat_n(b'[', d)));
            v
        }),
        // Trailing garbage after a valid object, a second object, a UTF-8 BOM.
        Just(br#"{"cniVersion":"1.1.0","name":"n","type":"nodeplane"} x"#.to_vec()),
        Just(br#"{"cniVersion":"1.1.0"}{"name":"n"}"#.to_vec()),
        Just(b"\xef\xbb\xbf{\"cniVersion\":\"1.1.0\",\"name\":\"n\",\"type\":\"nodeplane\"}".to_vec()),
    ]
}

fn invocation(sock: String, pending: String) -> impl Strategy<Value = Invocation> {
    let stdin = prop_oneof![
        6 => config(sock, pending).prop_map(|(v, f)| Stdin::Conf(v, f)),
        1 => undecodable().prop_map(Stdin::Undecodable),
    ];
    (
        command_val(),
        env_val("[a-zA-Z0-9][a-zA-Z0-9_.-]{0,63}".boxed(), 193),
        env_val(
            prop_oneof![
                "[a-z][a-z0-9]{0,14}",
                Just("eth0".to_string()),
                Just("é1".to_string()),
                Just("a\u{a0}b".to_string()),
                Just("\u{e0}1".to_string())
            ]
            .boxed(),
            16,
        ),
        env_val(
            prop_oneof![Just("/proc/nonexistent/ns/net".to_string()), "/nonexistent-npfz/netns/[a-z0-9]{1,12}"].boxed(),
            4096,
        ),
        env_val("(K8S_POD_NAME=[a-z0-9-]{0,10};)?(K8S_POD_NAMESPACE=[a-z]{0,8};)?(IgnoreUnknown=1)?".boxed(), 60_000),
        env_val("/opt/cni/bin(:/usr/lib/cni)?".boxed(), 60_000),
        stdin,
    )
        .prop_map(|(command, container_id, ifname, netns, args, path, stdin)| {
            let mut inv = Invocation { command, container_id, ifname, netns, args, path, stdin };
            let cmd = inv.command();
            if let Stdin::Conf(v, f) = &inv.stdin {
                inv.stdin = Stdin::Conf(v.clone(), resolve_faults(cmd.as_deref(), v, f));
            }
            inv
        })
}

fn code_of(reply_stdout: &str) -> Result<(u32, String, String), String> {
    let v: Value =
        serde_json::from_str(reply_stdout.trim_end()).map_err(|e| format!("stdout is not one JSON document: {e}"))?;
    let code = v.get("code").and_then(Value::as_u64).ok_or("no numeric code")? as u32;
    let msg = v.get("msg").and_then(Value::as_str).ok_or("no msg")?.to_string();
    let ver = v.get("cniVersion").and_then(Value::as_str).ok_or("no cniVersion")?.to_string();
    Ok((code, msg, ver))
}

// ----- 1. the CNI parser, in process -----

#[test]
fn cni_parse_gives_the_right_code() {
    let sock = "/tmp/npfz-none/agent.sock".to_string();
    let pending = "/tmp/npfz-none/pending".to_string();
    fuzz("cni request::parse (structured)", cases(4000), invocation(sock, pending), |inv| {
        let env = inv.env();
        let stdin = inv.stdin_bytes();
        let want = inv.expected();
        match request::parse(&env, &stdin) {
            Ok(req) => {
                prop_assert!(want.is_empty(), "accepted, but it must get one of {want:?}");
                prop_assert_eq!(Some(req.command.as_str().to_string()), inv.command());
            }
            Err(e) => {
                prop_assert!(
                    want.contains(&(e.code as u32)),
                    "code {} ({}), want one of {want:?}",
                    e.code as u32,
                    e.msg
                );
                prop_assert!(!e.msg.trim().is_empty());
            }
        }
        // The version used for the error output is always one we support.
        prop_assert!(SUPPORTED_VERSIONS.contains(&request::sniff_version(&stdin).as_str()));
        Ok(())
    });
}

#[test]
fn cni_parse_random_input_never_panics() {
    let strategy = (
        prop::collection::btree_map(
            prop_oneof![Just("CNI_COMMAND".to_string()), Just("CNI_IFNAME".to_string()), ".{0,8}"],
            ".{0,40}",
            0..6,
        ),
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..300),
            any_json().prop_map(|v| serde_json::to_vec(&v).unwrap())
        ],
    );
    fuzz("cni request::parse (random)", cases(20_000), strategy, |(env, stdin)| {
        match request::parse(&env, &stdin) {
            Ok(_) => {}
            Err(e) => {
                prop_assert!(
                    matches!(e.code, Code::IncompatibleVersion | Code::InvalidEnv | Code::Decode | Code::InvalidConfig),
                    "{e:?}"
                );
                prop_assert!(!e.msg.is_empty());
                prop_assert!(e.to_json("1.1.0").get("code").is_some());
            }
        }
        Ok(())
    });
}

#[test]
fn cni_parse_limits() {
    // The 1 MiB limit, either side of it, and a config that is valid but for its size.
    let conf = br#"{"cniVersion":"1.1.0","name":"n","type":"nodeplane"}"#;
    let mut env = Env::new();
    for (k, v) in [("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "c"), ("CNI_IFNAME", "eth0"), ("CNI_NETNS", "/x")] {
        env.insert(k.into(), v.into());
    }
    let pad = |n: usize| {
        let mut v = conf[..conf.len() - 1].to_vec();
        v.extend(std::iter::repeat_n(b' ', n - conf.len()));
        v.push(b'}');
        v
    };
    assert!(request::parse(&env, &pad(MAX_CONFIG_BYTES)).is_ok());
    let e = request::parse(&env, &pad(MAX_CONFIG_BYTES + 1)).unwrap_err();
    assert_eq!(e.code, Code::Decode, "{e:?}");
    // serde_json's recursion limit turns deep nesting into a decode error, not a stack overflow.
    let deep = [vec![b'['; 600_000], vec![b']'; 600_000]].concat();
    assert_eq!(request::parse(&env, &deep[..MAX_CONFIG_BYTES]).unwrap_err().code, Code::Decode);
}

// ----- 2. the wire framing, in process -----

#[test]
fn wire_frames_are_bounded() {
    fuzz("wire decode_len", cases(20_000), any::<u32>(), |n| {
        let r = wire::decode_len(n.to_be_bytes());
        prop_assert_eq!(r.is_ok(), n as usize <= MAX_FRAME);
        if let Ok(l) = r {
            prop_assert_eq!(l, n as usize);
        }
        Ok(())
    });
    // The shim's exchange: a reply announcing more than MAX_FRAME is refused after reading the
    // 4-byte header only (nothing allocated, nothing more read); random replies never panic.
    let req_strategy = (
        prop::collection::btree_map(".{0,10}", ".{0,30}", 0..5),
        ".{0,200}",
        prop_oneof![
            (MAX_FRAME as u32 + 1..=u32::MAX).prop_map(|n| n.to_be_bytes().to_vec()),
            prop::collection::vec(any::<u8>(), 0..64),
            (".{0,40}", any::<i32>()).prop_map(|(s, c)| wire::encode(&Reply { exit_code: c, stdout: s }).unwrap()),
        ],
    );
    fuzz("wire exchange", cases(5000), req_strategy, |(env, stdin, reply)| {
        let req = WireRequest { env: env.clone(), stdin: stdin.clone() };
        // A real socket pair: the agent's end holds the reply, then EOF.
        let (mut shim, mut agent) = std::os::unix::net::UnixStream::pair().unwrap();
        agent.write_all(&reply).unwrap();
        agent.shutdown(std::net::Shutdown::Write).unwrap();
        let r = wire::exchange(&mut shim, &wire::encode(&req).unwrap(), None);
        shim.shutdown(std::net::Shutdown::Write).unwrap();
        let mut sent = Vec::new();
        agent.read_to_end(&mut sent).unwrap();
        // What was sent is one frame that decodes to the request.
        let len = wire::decode_len(sent[..4].try_into().unwrap()).unwrap();
        prop_assert_eq!(len, sent.len() - 4);
        let back: WireRequest = serde_json::from_slice(&sent[4..]).unwrap();
        prop_assert_eq!((back.env, back.stdin), (env, stdin));
        if reply.len() >= 4 && u32::from_be_bytes(reply[..4].try_into().unwrap()) as usize > MAX_FRAME {
            prop_assert!(r.is_err());
            let mut rest = Vec::new();
            shim.read_to_end(&mut rest).unwrap();
            prop_assert_eq!(rest.len(), reply.len() - 4, "read past the header of an oversized frame");
        }
        if let Ok(rep) = r {
            let body = &reply[4..];
            prop_assert_eq!(rep, serde_json::from_slice::<Reply>(body).unwrap());
        }
        Ok(())
    });
    // encode refuses a request larger than a frame.
    let big = WireRequest { env: Env::new(), stdin: "x".repeat(MAX_FRAME) };
    assert!(wire::encode(&big).is_err());
}

// ----- 3. the shim binary, as the runtime execs it -----

struct ShimRun {
    status: i32,
    stdout: String,
    took: Duration,
    /// Bytes of stdin the shim took before it exited (the pipe buffer included).
    fed: usize,
}

/// The shim runs with this address-space limit: an attempt to hold an oversized input (or
/// to allocate what an oversized frame header announces) fails, and the shim dies of it.
const SHIM_AS_LIMIT: u64 = 32 << 20;

/// Exec the shim with exactly `env` and `stdin`, under [`SHIM_AS_LIMIT`]; kill it and fail
/// after `bound` (a hang).
fn run_shim(env: &[(&str, OsString)], stdin: Vec<u8>, bound: Duration) -> Result<ShimRun, String> {
    let mut cmd = Command::new(shim_bin());
    cmd.env_clear().stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null());
    // SAFETY: only setrlimit (async-signal-safe) between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit { rlim_cur: SHIM_AS_LIMIT, rlim_max: SHIM_AS_LIMIT };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let t = Instant::now();
    let mut child = cmd.spawn().map_err(|e| format!("exec {}: {e}", shim_bin().display()))?;
    let mut input = child.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || {
        let mut fed = 0;
        for chunk in stdin.chunks(64 * 1024) {
            match input.write(chunk) {
                Ok(n) => {
                    fed += n;
                    if n < chunk.len() && input.write_all(&chunk[n..]).is_err() {
                        break;
                    }
                    fed += chunk.len() - n;
                }
                Err(_) => break,
            }
        }
        fed
    });
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = out.read_to_end(&mut s);
        s
    });
    let pid = child.id() as libc::pid_t;
    let status = loop {
        let mut st = 0;
        // SAFETY: `st` is a live c_int for the call to write.
        let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
        if r == pid {
            break st;
        }
        if t.elapsed() > bound {
            let _ = child.kill();
            // SAFETY: as above.
            unsafe { libc::waitpid(pid, &mut st, 0) };
            return Err(format!("the shim did not finish within {bound:?} (killed): a hang"));
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let took = t.elapsed();
    let fed = feeder.join().unwrap();
    let stdout = String::from_utf8(reader.join().unwrap()).map_err(|_| "stdout is not UTF-8".to_string())?;
    if !libc::WIFEXITED(status) {
        return Err(format!("the shim died by signal {} (a crash); stdout {stdout:?}", libc::WTERMSIG(status)));
    }
    std::mem::forget(child); // reaped above by waitpid
    Ok(ShimRun { status: libc::WEXITSTATUS(status), stdout, took, fed })
}

#[test]
fn shim_binary_gives_the_right_code() {
    let tmp = TempDir::new("shim");
    let sock = tmp.0.join("no-agent.sock");
    let pending = tmp.0.join("pending");
    let strategy = invocation(sock.display().to_string(), pending.display().to_string());
    fuzz("shim binary (env + stdin)", cases(250), strategy, |inv| {
        let mut env: Vec<(&str, OsString)> = vec![("NODEPLANE_CNI_SOCKET", sock.clone().into_os_string())];
        for (k, v) in inv.pairs() {
            if let Some(b) = v {
                env.push((k, OsString::from_vec(b.clone())));
            }
        }
        let run = run_shim(&env, inv.stdin_bytes(), Duration::from_secs(5)).map_err(TestCaseError::fail)?;
        prop_assert!(run.took < Duration::from_secs(3), "took {:?}", run.took);
        if inv.command().as_deref() == Some("VERSION") {
            prop_assert_eq!(run.status, 0, "VERSION: {}", run.stdout);
            let v: Value = serde_json::from_str(&run.stdout).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(v["supportedVersions"].as_array().map(Vec::len), Some(SUPPORTED_VERSIONS.len()));
            return Ok(());
        }
        let mut want = inv.expected();
        if want.is_empty() {
            // Valid: the agent is not there.
            match inv.command().as_deref() {
                Some("DEL") => {
                    prop_assert_eq!(
                        (run.status, run.stdout.as_str()),
                        (0, ""),
                        "DEL with no agent is queued and succeeds"
                    );
                    let cid = env_str(&inv.container_id).unwrap();
                    let ifn = env_str(&inv.ifname).unwrap();
                    let f = pending.join(nodeplane::net::pending_del::file_name(&cid, &ifn));
                    prop_assert!(f.exists(), "DEL not queued at {}", f.display());
                    let _ = fs::remove_file(f);
                    return Ok(());
                }
                Some("STATUS") => want.insert(50),
                _ => want.insert(11),
            };
        }
        prop_assert_eq!(run.status, 1, "stdout {}", run.stdout);
        let (code, msg, ver) =
            code_of(&run.stdout).map_err(|e| TestCaseError::fail(format!("{e}: {:?}", run.stdout)))?;
        prop_assert!(want.contains(&code), "code {code} ({msg}), want one of {want:?}");
        prop_assert!(!msg.trim().is_empty());
        prop_assert!(SUPPORTED_VERSIONS.contains(&ver.as_str()));
        Ok(())
    });
}

fn good_env(cmd: &str, sock: &Path) -> Vec<(&'static str, OsString)> {
    vec![
        ("CNI_COMMAND", cmd.into()),
        ("CNI_CONTAINERID", "c1".into()),
        ("CNI_IFNAME", "eth0".into()),
        // A namespace that exists (the shim's own): the shim opens it before it connects.
        ("CNI_NETNS", "/proc/self/ns/net".into()),
        ("NODEPLANE_CNI_SOCKET", sock.as_os_str().to_owned()),
    ]
}

#[test]
fn shim_refuses_oversized_stdin_early() {
    let tmp = TempDir::new("shim-big");
    let sock = tmp.0.join("no-agent.sock");
    let conf = json!({"cniVersion": "1.1.0", "name": "n", "type": "nodeplane", "agentWaitSeconds": 0,
                      "agentSocket": sock, "pad": ""});
    let mut stdin = serde_json::to_vec(&conf).unwrap();
    stdin.pop();
    stdin.extend(std::iter::repeat_n(b' ', 64 << 20));
    stdin.push(b'}');
    let run = run_shim(&good_env("ADD", &sock), stdin, Duration::from_secs(10)).unwrap();
    let (code, msg, _) = code_of(&run.stdout).unwrap();
    eprintln!(
        "shim with 64 MiB on stdin (address space limited to {} MiB): exit {}, code {code} in {:.3} s, took {} bytes of stdin",
        SHIM_AS_LIMIT >> 20,
        run.status,
        run.took.as_secs_f64(),
        run.fed
    );
    assert_eq!((run.status, code), (1, 6), "{msg}");
    assert!(msg.contains(&MAX_CONFIG_BYTES.to_string()), "{msg}");
    // Read at most the limit + 1 (plus what the pipe holds), quickly, in bounded memory.
    assert!(run.fed <= MAX_CONFIG_BYTES + 1 + (1 << 20), "the shim took {} bytes of stdin", run.fed);
    assert!(run.took < Duration::from_secs(2), "{:?}", run.took);
}

/// A tiny "agent" that answers every connection with `reply` (raw bytes) and closes.
fn fake_agent(sock: &Path, reply: Vec<u8>) -> std::thread::JoinHandle<()> {
    let l = UnixListener::bind(sock).unwrap();
    l.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            match l.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                    let mut h = [0u8; 4];
                    if s.read_exact(&mut h).is_ok() {
                        let mut body = vec![0u8; wire::decode_len(h).unwrap()];
                        let _ = s.read_exact(&mut body);
                    }
                    let _ = s.write_all(&reply);
                    return;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    })
}

#[test]
fn shim_survives_a_broken_agent() {
    let tmp = TempDir::new("shim-agent");
    let strategy = prop_oneof![
        // An oversized frame: refused from its header, never allocated.
        (MAX_FRAME as u32 + 1..=u32::MAX).prop_map(|n| n.to_be_bytes().to_vec()),
        // Garbage, short frames, a frame whose body is not a Reply.
        prop::collection::vec(any::<u8>(), 0..40),
        ".{0,30}".prop_map(|s| {
            let mut v = (s.len() as u32).to_be_bytes().to_vec();
            v.extend(s.as_bytes());
            v
        }),
    ];
    let n = std::sync::atomic::AtomicU32::new(0);
    fuzz("shim against a broken agent", cases(60), strategy, |reply| {
        let sock = tmp.0.join(format!("a{}.sock", n.fetch_add(1, std::sync::atomic::Ordering::SeqCst)));
        let agent = fake_agent(&sock, reply.clone());
        let conf = json!({"cniVersion": "1.0.0", "name": "n", "type": "nodeplane", "agentWaitSeconds": 0, "agentSocket": sock});
        let run = run_shim(&good_env("ADD", &sock), serde_json::to_vec(&conf).unwrap(), Duration::from_secs(5))
            .map_err(TestCaseError::fail)?;
        agent.join().unwrap();
        let _ = fs::remove_file(&sock);
        prop_assert!(run.took < Duration::from_secs(2), "{:?}", run.took);
        let (code, msg, ver) =
            code_of(&run.stdout).map_err(|e| TestCaseError::fail(format!("{e}: {:?}", run.stdout)))?;
        prop_assert_eq!((run.status, code), (1, 11), "{}", msg);
        prop_assert_eq!(ver, "1.0.0");
        Ok(())
    });
}

// ----- 4. CSI and device plugin validation, in process -----

fn capability() -> impl Strategy<Value = Option<csi::VolumeCapability>> {
    let mode = prop_oneof![(-2i32..9), any::<i32>()];
    let flags = prop::collection::vec(
        prop_oneof![
            prop::sample::select(vec![
                "ro",
                "rw",
                "noatime",
                "nodev",
                "sync",
                "discard",
                "bind",
                "remount",
                "x-mount.mkdir",
                "a,b",
                "",
                "a b",
                "nofail",
                "user"
            ])
            .prop_map(str::to_string),
            ".{0,6}",
            Just("o".repeat(300)),
        ],
        0..4,
    );
    let access = prop_oneof![
        Just(None),
        Just(Some(AccessType::Block(BlockVolume {}))),
        (
            prop::sample::select(vec!["", "ext4", "xfs", "btrfs", "EXT4", "ext4 "]),
            flags,
            prop::sample::select(vec!["", "1000", "0", "-1", "abc", "4294967296"])
        )
            .prop_map(|(f, fl, g)| Some(AccessType::Mount(MountVolume {
                fs_type: f.into(),
                mount_flags: fl,
                volume_mount_group: g.into()
            }))),
    ];
    prop::option::weighted(0.9, (prop::option::weighted(0.9, mode), access)).prop_map(|o| {
        o.map(|(m, a)| csi::VolumeCapability { access_mode: m.map(|mode| AccessMode { mode }), access_type: a })
    })
}

/// The model of `parse_capability`: the code it must answer (None: accepted). `None` inside
/// the outer Option: the mount flags alone decide (their grammar is the mount layer's).
fn model_capability(c: &Option<csi::VolumeCapability>) -> Option<Option<tonic::Code>> {
    use tonic::Code::{FailedPrecondition, InvalidArgument};
    let Some(c) = c else { return Some(Some(InvalidArgument)) };
    let Some(m) = &c.access_mode else { return Some(Some(InvalidArgument)) };
    let Some(t) = &c.access_type else { return Some(Some(InvalidArgument)) };
    match Mode::try_from(m.mode) {
        Ok(
            Mode::SingleNodeWriter
            | Mode::SingleNodeReaderOnly
            | Mode::SingleNodeSingleWriter
            | Mode::SingleNodeMultiWriter,
        ) => {}
        Ok(Mode::MultiNodeReaderOnly | Mode::MultiNodeSingleWriter | Mode::MultiNodeMultiWriter) => {
            return Some(Some(FailedPrecondition));
        }
        _ => return Some(Some(InvalidArgument)),
    }
    let AccessType::Mount(mv) = t else { return Some(None) };
    let known_good = |f: &str| matches!(f, "ro" | "rw" | "noatime" | "nodev" | "sync" | "discard");
    let known_bad = |f: &str| {
        f.is_empty()
            || f.len() > 256
            || f.contains([',', ' '])
            || f.starts_with("x-")
            || matches!(f, "bind" | "remount" | "nofail" | "user")
    };
    if mv.mount_flags.iter().any(|f| known_bad(f)) {
        return Some(Some(InvalidArgument));
    }
    let fs_ok = matches!(mv.fs_type.as_str(), "" | "ext4" | "xfs");
    let group_ok = mv.volume_mount_group.is_empty() || mv.volume_mount_group.parse::<u32>().is_ok();
    if !fs_ok || !group_ok {
        return Some(Some(InvalidArgument));
    }
    if mv.mount_flags.iter().all(|f| known_good(f)) { Some(None) } else { None }
}

#[test]
fn csi_capability_validation() {
    fuzz("csi parse_capability", cases(20_000), capability(), |c| {
        let got = nodeplane::storage::csi::node::parse_capability(c.as_ref()).err().map(|e| e.code);
        match model_capability(&c) {
            Some(want) => prop_assert_eq!(got, want),
            None => prop_assert!(matches!(got, None | Some(tonic::Code::InvalidArgument)), "{got:?}"),
        }
        Ok(())
    });
}

/// The model of a CSI path check: absolute, no NUL, no '.'/'..' segment, at most 4096 bytes,
/// strictly inside `root`, and no symbolic link on the way.
fn model_path(raw: &str, root: &Path, symlink: &Path) -> bool {
    raw.len() <= 4096
        && !raw.contains('\0')
        && raw.starts_with('/')
        && !raw.split('/').any(|s| s == "." || s == "..")
        && {
            let clean: PathBuf = Path::new(raw).components().collect();
            clean.starts_with(root) && clean != root && !clean.starts_with(symlink)
        }
        // A component the kernel can never create (NAME_MAX).
        && raw.split('/').all(|s| s.len() <= 255)
}

#[test]
fn csi_path_and_id_validation() {
    let tmp = TempDir::new("paths");
    let root = tmp.0.join("kubelet");
    fs::create_dir_all(root.join("pods/p")).unwrap();
    let link = root.join("evil");
    std::os::unix::fs::symlink("/etc", &link).unwrap();
    let r = root.display().to_string();
    let seg = prop_oneof![
        4 => "[a-z0-9~_-]{1,8}",
        1 => prop::sample::select(vec!["..", ".", "", "evil", "pods", "p", "a\0b", "kubelet", "\u{e9}"]).prop_map(str::to_string),
    ];
    let strategy = prop_oneof![
        4 => prop::collection::vec(seg.clone(), 0..6).prop_map(move |s| format!("{r}/{}", s.join("/"))),
        1 => prop::collection::vec(seg, 0..6).prop_map(|s| s.join("/")),
        1 => prop::sample::select(vec!["/", "/etc/passwd", "/tmp", "", "//", "/proc/self/root/etc"]).prop_map(str::to_string),
        1 => (256usize..400).prop_map({
            let r = root.display().to_string();
            move |n| format!("{r}/missing/{}/x", "a".repeat(n))
        }),
        1 => (4000usize..5000).prop_map({
            let r = root.display().to_string();
            move |n| format!("{r}/{}", "a".repeat(n - r.len()))
        }),
    ];
    fuzz("csi validate_path", cases(20_000), strategy, |raw| {
        let got = nodeplane::sys::mount::validate_path("target_path", &raw, &root);
        prop_assert_eq!(
            got.is_ok(),
            model_path(&raw, &root, &link),
            "{} -> {:?}",
            short(&raw),
            got.as_ref().map_err(|e| short(e))
        );
        if let Ok(p) = got {
            prop_assert!(p.starts_with(&root) && p != root);
        }
        Ok(())
    });
    let id = prop_oneof![
        ".{0,10}",
        "[a-z0-9._-]{0,140}",
        prop::sample::select(vec![".", "..", "a/b", "A", "a\0"]).prop_map(str::to_string)
    ];
    fuzz("volume validate_id", cases(20_000), id, |id| {
        let model = !id.is_empty()
            && id.len() <= 128
            && id != "."
            && id != ".."
            && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.'));
        prop_assert_eq!(nodeplane::storage::store::validate_id(&id).is_ok(), model);
        Ok(())
    });
}

/// A reference shell glob for one path component (`*`, `?`, `[set]`, `[a-z]`, `[!set]`, a
/// `]` first in a set is literal), by plain recursion.
fn ref_glob(p: &[char], n: &[char]) -> bool {
    match p.first() {
        None => n.is_empty(),
        Some('*') => (0..=n.len()).any(|i| ref_glob(&p[1..], &n[i..])),
        Some('?') => !n.is_empty() && ref_glob(&p[1..], &n[1..]),
        Some('[') => {
            let mut j = 1;
            let neg = p.get(j) == Some(&'!');
            if neg {
                j += 1;
            }
            let start = j;
            if p.get(j) == Some(&']') {
                j += 1;
            }
            while j < p.len() && p[j] != ']' {
                j += 1;
            }
            if j >= p.len() || n.is_empty() {
                return false;
            }
            let set = &p[start..j];
            let mut hit = false;
            let mut k = 0;
            while k < set.len() {
                if k + 2 < set.len() && set[k + 1] == '-' {
                    hit |= set[k] <= n[0] && n[0] <= set[k + 2];
                    k += 3;
                } else {
                    hit |= set[k] == n[0];
                    k += 1;
                }
            }
            hit != neg && ref_glob(&p[j + 1..], &n[1..])
        }
        Some(c) => n.first() == Some(c) && ref_glob(&p[1..], &n[1..]),
    }
}

#[test]
fn device_file_and_globs() {
    // Well-formed globs over a small alphabet: the matcher agrees with the reference.
    let glob = prop::collection::vec(
        prop_oneof![
            4 => prop::sample::select(vec!['a', 'b', '0', '1']).prop_map(|c| c.to_string()),
            2 => Just("*".to_string()),
            1 => Just("?".to_string()),
            1 => (prop::sample::select(vec!["", "!"]), prop::sample::select(vec!["ab", "0-1", "a-b0", "]a", "b"])).prop_map(|(n, s)| format!("[{n}{s}]")),
        ],
        0..6,
    )
    .prop_map(|v| v.concat());
    let name = "[ab01\\]]{0,8}";
    fuzz("deviceplugin glob_match", cases(20_000), (glob, name), |(g, n)| {
        let pc: Vec<char> = g.chars().collect();
        let nc: Vec<char> = n.chars().collect();
        prop_assert_eq!(nodeplane::devices::config::glob_match(&g, &n), Ok(ref_glob(&pc, &nc)), "{} vs {}", g, n);
        Ok(())
    });
    fuzz("deviceplugin glob_match (random)", cases(20_000), (".{0,12}", ".{0,12}"), |(g, n)| {
        let _ = nodeplane::devices::config::glob_match(&g, &n);
        Ok(())
    });
    // The device file: random and mutated entries; every accepted resource is valid.
    let entry = (
        prop_oneof![".{0,6}", "[a-z0-9-]{1,44}"],
        prop::collection::vec(
            prop_oneof![
                "/dev/[a-z*?\\[\\]!.]{1,8}",
                ".{0,8}",
                Just("/dev/../x".to_string()),
                Just("/dev/*/x".to_string())
            ],
            0..3,
        ),
        prop::option::of(prop_oneof![
            Just(json!(0)),
            Just(json!(1000)),
            Just(json!(1001)),
            Just(json!(-1)),
            Just(json!("2")),
            (1u32..2000).prop_map(|n| json!(n))
        ]),
        prop::option::of(prop_oneof![Just("rw".to_string()), Just(String::new()), "[rwmx]{0,4}"]),
        prop::option::of(prop::collection::btree_map("[A-Z0-9_a-]{0,6}", ".{0,4}", 0..3)),
        prop::option::of(any_json()),
    )
        .prop_map(|(name, devices, share, perm, env, extra)| {
            let mut e = json!({"name": name, "devices": devices});
            if let Some(s) = share {
                e["share"] = s;
            }
            if let Some(p) = perm {
                e["permissions"] = json!(p);
            }
            if let Some(v) = env {
                e["env"] = json!(v);
            }
            if let Some(x) = extra {
                e["mounts"] = x;
            }
            e
        });
    let file = prop_oneof![
        4 => prop::collection::vec(entry, 0..5).prop_map(|r| serde_json::to_vec(&json!({"resources": r})).unwrap()),
        1 => any_json().prop_map(|v| serde_json::to_vec(&v).unwrap()),
        1 => prop::collection::vec(any::<u8>(), 0..80),
    ];
    fuzz("deviceplugin config::parse", cases(10_000), file, |text| {
        if let Ok((ok, problems)) = nodeplane::devices::config::parse(&text) {
            let names: BTreeSet<&str> = ok.iter().map(|r| r.name.as_str()).collect();
            prop_assert_eq!(names.len(), ok.len(), "duplicate names accepted");
            for r in &ok {
                prop_assert!(!r.name.is_empty() && r.name.len() <= 40, "{:?}", r.name);
                prop_assert!(r.name.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-'));
                prop_assert!((1..=1000).contains(&r.share));
                prop_assert!(!r.permissions.is_empty() && r.permissions.chars().all(|c| "rwm".contains(c)));
                prop_assert!(!r.patterns.is_empty());
                for p in &r.patterns {
                    prop_assert!(
                        p.dir.is_absolute() && !p.dir.components().any(|c| c == std::path::Component::ParentDir)
                    );
                    prop_assert!(!p.glob.is_empty() && !p.glob.contains('/'));
                }
                for k in r.env.keys() {
                    prop_assert!(!k.is_empty() && !k.starts_with(|c: char| c.is_ascii_digit()));
                }
            }
            prop_assert!(problems.iter().all(|p| p.starts_with("resources[")));
        }
        Ok(())
    });
}

/// A resource over real character devices everyone can open (/dev/null, /dev/zero), shared.
fn dev_resource(share: u32) -> Arc<nodeplane::devices::config::Resource> {
    let text = json!({"resources": [{"name": "fz", "devices": ["/dev/null", "/dev/zero"], "share": share}]});
    let (mut ok, problems) = nodeplane::devices::config::parse(&serde_json::to_vec(&text).unwrap()).unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    Arc::new(ok.remove(0))
}

/// The device plugin's answers for an id list: Ok(distinct device nodes) or the code.
fn model_allocate(ids: &[String], share: u32) -> Result<usize, tonic::Code> {
    let mut nodes = BTreeSet::new();
    for id in ids {
        let ok = id.rsplit_once('-').is_some_and(|(stem, k)| {
            matches!(stem, "null" | "zero")
                && k.parse::<u32>().is_ok_and(|k| k < share && k.to_string() == id.rsplit_once('-').unwrap().1)
        });
        if !ok {
            return Err(tonic::Code::InvalidArgument);
        }
        nodes.insert(id.rsplit_once('-').unwrap().0.to_string());
    }
    Ok(nodes.len())
}

fn device_ids(share: u32) -> impl Strategy<Value = Vec<String>> {
    let id = prop_oneof![
        6 => (prop::sample::select(vec!["null", "zero"]), 0..share).prop_map(|(n, k)| format!("{n}-{k}")),
        1 => prop::sample::select(vec!["null", "null-", "-0", "", "full-0", "null-01", "null-+1", "null--1", "NULL-0", "null-0-0"]).prop_map(str::to_string),
        1 => Just(format!("null-{share}")),
        1 => ".{0,12}",
    ];
    prop::collection::vec(id, 0..12)
}

#[test]
fn device_plugin_validation_in_process() {
    let share = 3;
    let plugin = nodeplane::devices::deviceplugin::plugin::Plugin::new(dev_resource(share));
    assert_eq!(plugin.devices().len(), 2 * share as usize, "{:?}", plugin.devices());
    fuzz("deviceplugin allocate", cases(10_000), device_ids(share), |ids| {
        let got = plugin.allocate_one(&ids);
        match model_allocate(&ids, share) {
            Ok(n) => {
                let r = got.map_err(|e| TestCaseError::fail(format!("{ids:?}: {e:?}")))?;
                prop_assert_eq!(r.devices.len(), n);
                prop_assert_eq!(&r.envs["NODEPLANE_DEVICES_FZ"], &ids.join(","));
            }
            Err(c) => prop_assert_eq!(got.map(|_| ()).map_err(|e| e.code()), Err(c)),
        }
        Ok(())
    });
    let strategy = (device_ids(share), device_ids(share), prop_oneof![0usize..14, Just(usize::MAX / 2)]);
    fuzz("deviceplugin preferred", cases(10_000), strategy, |(available, must, size)| {
        let t = Instant::now();
        let got = plugin.preferred(&available, &must, size);
        prop_assert!(t.elapsed() < Duration::from_millis(200));
        let valid = must.len() <= size && must.iter().all(|m| available.contains(m)) && size <= available.len();
        match got {
            Ok(ids) => {
                prop_assert!(valid, "accepted {available:?} {must:?} {size}");
                prop_assert!(ids.len() <= size);
                prop_assert_eq!(&ids[..must.len()], &must[..]);
                prop_assert!(ids.iter().all(|i| available.contains(i)));
                let distinct: BTreeSet<&String> = available.iter().collect();
                let must_distinct: BTreeSet<&String> = must.iter().collect();
                // All it can give: `size`, unless the available list has too few distinct ids.
                prop_assert!(ids.len() == size || ids.len() >= distinct.len() + must.len() - must_distinct.len());
            }
            Err(e) => {
                prop_assert!(!valid, "refused a valid request: {e:?}");
                prop_assert_eq!(e.code(), tonic::Code::InvalidArgument);
            }
        }
        Ok(())
    });
}

/// The largest list kubelet can legitimately send: every ID of two nodes shared 1000 ways.
#[test]
fn device_plugin_large_lists_are_bounded() {
    let share = 1000;
    let plugin = nodeplane::devices::deviceplugin::plugin::Plugin::new(dev_resource(share));
    let all: Vec<String> = plugin.devices().into_iter().map(|d| d.id).collect();
    assert_eq!(all.len(), 2000);
    let t = Instant::now();
    let r = plugin.allocate_one(&all).unwrap();
    let alloc = t.elapsed();
    assert_eq!(r.devices.len(), 2);
    let t = Instant::now();
    let unknown: Vec<String> = (0..100_000).map(|i| format!("nope-{i}")).collect();
    let e = plugin.allocate_one(&unknown).unwrap_err();
    let refuse = t.elapsed();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    eprintln!("device plugin, 2000 IDs: Allocate {alloc:?}, 100000 unknown refused in {refuse:?}");
    assert!(alloc < Duration::from_millis(500), "Allocate of 2000 IDs took {alloc:?}");
    // GetPreferredAllocation of all 2000 (kubelet may ask for every device of the resource).
    // Run on a thread and waited for 2 s: when this was written it took 380 s (100 of 2000:
    // 4.7 s, 500: 56 s), and it runs on a tokio worker of the agent. A thread still running
    // when the test fails ends with the test process.
    let (tx, rx) = std::sync::mpsc::channel();
    let p = plugin.clone();
    std::thread::spawn(move || {
        let t = Instant::now();
        let n = p.preferred(&all, &[], all.len()).map(|v| v.len());
        let _ = tx.send((n, t.elapsed()));
    });
    match rx.recv_timeout(Duration::from_secs(2)) {
        Ok((n, took)) => {
            eprintln!("device plugin: GetPreferredAllocation of 2000 from 2000 IDs in {took:?}");
            assert_eq!(n.unwrap(), 2000);
        }
        Err(_) => panic!(
            "GetPreferredAllocation of 2000 from 2000 IDs (2 devices shared 1000 ways) did not finish within 2 s"
        ),
    }
}

// ----- 5. a real agent: its CNI socket, CSI Node service and device plugin (root) -----

fn require_root() {
    assert_eq!(
        nix::unistd::geteuid().as_raw(),
        0,
        "tests/fuzz_inputs.rs *_root tests need root (they run the agent in a network namespace, make device nodes, \
         and the agent binds loop devices and mounts). They do not skip."
    );
    for tool in ["unshare", "mkfs.ext4", "blkid", "losetup"] {
        let found = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"].iter().any(|d| Path::new(d).join(tool).is_file());
        assert!(found, "required tool {tool:?} is not installed (Debian: util-linux, e2fsprogs)");
    }
}

fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let unescape =
        |s: &str| s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\");
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(|m| PathBuf::from(unescape(m))))
        .filter(|m| m.starts_with(dir))
        .collect()
}

fn loops_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir("/sys/block").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Ok(b) = fs::read_to_string(e.path().join("loop/backing_file"))
            && Path::new(b.trim().trim_end_matches(" (deleted)")).starts_with(dir)
        {
            out.push(PathBuf::from(format!("/dev/{name}")));
        }
    }
    out
}

/// A running agent (CNI + CSI + device plugin `nodeplane.dev/fz` over `<dir>/dev/fz[0-9]*`,
/// shared 3 ways) in its sandbox. Dropping it kills the agent by PID, unmounts and detaches
/// what is left under the sandbox and removes it.
struct Agent {
    dir: PathBuf,
    child: Option<std::process::Child>,
}

impl Agent {
    fn start(name: &str) -> Agent {
        require_root();
        let dir = PathBuf::from("/tmp").join(format!("npfz-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("dev")).unwrap();
        let dir = dir.canonicalize().unwrap();
        let mut a = Agent { dir, child: None };
        for n in ["fz0", "fz1", "fz2"] {
            a.mknod(n);
        }
        let devices = json!({"resources": [{"name": "fz", "devices": [a.dir.join("dev/fz[0-9]*")], "share": 3, "preStart": true}]});
        fs::write(a.dir.join("devices.json"), serde_json::to_vec(&devices).unwrap()).unwrap();
        let cfg = json!({
            "nodeName": format!("fz-{name}"),
            "root": a.dir.join("root"),
            "shimSource": shim_bin(),
            "csi": {"capacityBytes": 1u64 << 30, "maxVolumes": 16},
            "devicePlugins": {"configFile": a.dir.join("devices.json"), "cdiDir": a.dir.join("cdi")},
        });
        fs::write(a.dir.join("agent.json"), serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
        let log = fs::File::create(a.dir.join("agent.log")).unwrap();
        let child = Command::new("unshare")
            .arg("--net")
            .arg("--")
            .arg(agent_bin())
            .arg("--config")
            .arg(a.dir.join("agent.json"))
            .env("RUST_LOG", "info")
            .env_remove("NODEPLANE_CRASH_AT")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting the agent");
        a.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        for sock in [a.reg_sock(), a.dp_sock(), a.cni_sock()] {
            while !sock.exists() {
                a.assert_alive();
                assert!(Instant::now() < deadline, "{} not there within 20 s:\n{}", sock.display(), a.log());
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        a
    }
    fn mknod(&self, n: &str) {
        let p = self.dir.join("dev").join(n);
        nix::sys::stat::mknod(
            &p,
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            nix::sys::stat::makedev(1, 3),
        )
        .unwrap_or_else(|e| panic!("mknod {}: {e}", p.display()));
    }
    fn kubelet(&self) -> PathBuf {
        self.dir.join("root/var/lib/kubelet")
    }
    fn reg_sock(&self) -> PathBuf {
        self.kubelet().join("plugins_registry/csi.nodeplane.dev-reg.sock")
    }
    fn csi_sock(&self) -> PathBuf {
        self.kubelet().join("plugins/csi.nodeplane.dev/csi.sock")
    }
    fn dp_sock(&self) -> PathBuf {
        self.kubelet().join("device-plugins/nodeplane-fz.sock")
    }
    fn cni_sock(&self) -> PathBuf {
        self.dir.join("root/run/nodeplane/cni.sock")
    }
    fn node_sock(&self) -> PathBuf {
        self.dir.join("root/run/nodeplane/node.sock")
    }
    fn log(&self) -> String {
        fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }
    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }
    fn rss_kib(&self) -> u64 {
        let s = fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        s.lines().find_map(|l| l.strip_prefix("VmRSS:")).unwrap().trim().trim_end_matches(" kB").trim().parse().unwrap()
    }
    fn assert_alive(&mut self) {
        if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
            panic!("the agent exited ({st}):\n{}", self.log());
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let mut ms = mounts_under(&self.dir);
        ms.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for m in ms {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
        for d in loops_under(&self.dir) {
            let _ = Command::new("losetup").arg("-d").arg(&d).status();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// One request on the agent's CNI socket: the raw bytes sent; what came back before the
/// agent closed (None: it closed without a reply).
fn cni_raw(sock: &Path, bytes: &[u8], bound: Duration) -> Result<Option<Reply>, String> {
    let mut s = std::os::unix::net::UnixStream::connect(sock).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(bound)).unwrap();
    s.set_write_timeout(Some(bound)).unwrap();
    let t = Instant::now();
    // The agent may close before taking everything (an oversized header): that is fine.
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut got = Vec::new();
    match s.read_to_end(&mut got) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => return Err(format!("no answer and no close within {bound:?} ({:?}): {e}", t.elapsed())),
    }
    if got.is_empty() {
        return Ok(None);
    }
    let len = wire::decode_len(got[..4].try_into().map_err(|_| "short reply header")?).map_err(|e| e.to_string())?;
    if got.len() != 4 + len {
        return Err(format!("reply frame of {} bytes announces {len}", got.len() - 4));
    }
    serde_json::from_slice(&got[4..]).map(Some).map_err(|e| format!("reply is not a Reply: {e}"))
}

fn agent_cni_socket(agent: &mut Agent) {
    let sock = agent.cni_sock();
    let pending = agent.dir.join("pending");
    let strategy = invocation(sock.display().to_string(), pending.display().to_string());
    fuzz("agent CNI socket (framed requests)", cases(200), strategy, |inv| {
        let env = inv.env();
        let stdin = String::from_utf8_lossy(&inv.stdin_bytes()).into_owned();
        let frame = wire::encode(&WireRequest { env: env.clone(), stdin: stdin.clone() }).unwrap();
        let reply = cni_raw(&sock, &frame, Duration::from_secs(5)).map_err(TestCaseError::fail)?;
        let reply =
            reply.ok_or_else(|| TestCaseError::fail("the agent closed a well-framed request without a reply"))?;
        let cmd = inv.command();
        if cmd.as_deref() == Some("VERSION") {
            prop_assert_eq!(reply.exit_code, 0, "{}", reply.stdout);
            return Ok(());
        }
        match request::parse(&env, stdin.as_bytes()) {
            Err(e) => {
                prop_assert_eq!(reply.exit_code, 1, "{}", reply.stdout);
                let (code, msg, _) = code_of(&reply.stdout).map_err(TestCaseError::fail)?;
                prop_assert_eq!(code, e.code as u32, "agent: {}; in process: {}", msg, e.msg);
            }
            Ok(req) => {
                // Valid, sent without the namespace's descriptor (a raw frame, no SCM_RIGHTS):
                // the agent never resolves the path itself.
                if reply.exit_code != 0 {
                    let (code, msg, _) = code_of(&reply.stdout).map_err(TestCaseError::fail)?;
                    prop_assert!(!msg.is_empty());
                    match req.command.as_str() {
                        "ADD" => prop_assert_eq!(code, 11, "{}", msg),
                        // No such attachment (3) or no descriptor to compare (11).
                        "CHECK" => prop_assert!(code == 3 || code == 11, "code {code}: {msg}"),
                        _ => prop_assert!(![5, 999].contains(&code), "code {code}: {msg}"),
                    }
                }
            }
        }
        Ok(())
    });
    // Frames the agent must drop without reading further or allocating what they announce.
    let rss0 = agent.rss_kib();
    let t = Instant::now();
    for n in [u32::MAX, MAX_FRAME as u32 + 1, 1 << 30] {
        let mut bytes = n.to_be_bytes().to_vec();
        bytes.extend(std::iter::repeat_n(b'x', 64 * 1024));
        let r = cni_raw(&sock, &bytes, Duration::from_secs(3)).unwrap();
        assert!(r.is_none(), "oversized frame of {n} bytes answered: {r:?}");
    }
    for garbage in [b"\x00\x00\x00\x05hello".to_vec(), b"\x00\x00\x00\x02{}".to_vec(), b"\x00\x00".to_vec(), Vec::new()]
    {
        let r = cni_raw(&sock, &garbage, Duration::from_secs(3)).unwrap();
        assert!(r.is_none(), "garbage {garbage:?} answered: {r:?}");
    }
    let rss1 = agent.rss_kib();
    eprintln!(
        "agent CNI socket: oversized and garbage frames dropped in {:?}; agent RSS {rss0} -> {rss1} KiB",
        t.elapsed()
    );
    assert!(rss1 < rss0 + 16 * 1024, "agent RSS grew from {rss0} to {rss1} KiB");
    agent.assert_alive();
}

#[derive(Debug, Clone)]
enum CsiCall {
    Stage { id: String, staging: String, cap: Option<csi::VolumeCapability> },
    Unstage { id: String, staging: String },
    Publish { id: String, staging: String, target: String, cap: Option<csi::VolumeCapability>, ro: bool },
    Unpublish { id: String, target: String },
    Stats { id: String, path: String },
    Expand { id: String, path: String, staging: String, range: Option<(i64, i64)>, cap: Option<csi::VolumeCapability> },
}

struct CsiPools {
    stagings: Vec<String>,
    targets: Vec<String>,
    bad: Vec<String>,
}

fn csi_pools(kubelet: &Path) -> CsiPools {
    let k = kubelet.display().to_string();
    let stagings = vec![
        format!("{k}/plugins/kubernetes.io/csi/pv/vol-a/globalmount"),
        format!("{k}/plugins/kubernetes.io/csi/pv/vol-a/other"),
    ];
    let targets = vec![
        format!("{k}/pods/p1/volumes/kubernetes.io~csi/vol-a/mount"),
        format!("{k}/pods/p2/volumes/kubernetes.io~csi/vol-a/mount"),
    ];
    for p in stagings.iter().chain(&targets) {
        fs::create_dir_all(Path::new(p).parent().unwrap()).unwrap();
    }
    std::os::unix::fs::symlink("/etc", kubelet.join("evil")).unwrap();
    let bad = vec![
        k.clone(),
        format!("{k}/"),
        format!("{k}/../../etc"),
        format!("{k}/./pods"),
        format!("{k}/evil/x"),
        format!("{k}/evil"),
        format!("{k}/a\0b"),
        format!("{k}/{}", "a".repeat(5000)),
        format!("{k}/plugins/kubernetes.io/csi/pv/{}/globalmount", "a".repeat(300)),
        format!("{k}/pods/p1/volumes/kubernetes.io~csi/{}/mount", "b".repeat(300)),
        "/etc".into(),
        "/tmp/npfz-elsewhere".into(),
        "relative/path".into(),
        String::new(),
        "/".into(),
    ];
    CsiPools { stagings, targets, bad }
}

fn csi_call(p: &CsiPools) -> impl Strategy<Value = CsiCall> + use<> {
    let id = prop_oneof![
        8 => Just("vol-a".to_string()),
        1 => Just("vol-missing".to_string()),
        1 => prop::sample::select(vec!["", "Vol-A", "../vol-a", "vol/a", "vol-a\0", "\u{e9}", ".", ".."]).prop_map(str::to_string),
        1 => Just("a".repeat(129)),
    ];
    let path = |good: Vec<String>, bad: Vec<String>| prop_oneof![6 => prop::sample::select(good), 1 => prop::sample::select(bad)];
    let st = path(p.stagings.clone(), p.bad.clone());
    let tg = path(p.targets.clone(), p.bad.clone());
    let any_path = path([p.stagings.clone(), p.targets.clone()].concat(), p.bad.clone());
    let opt_staging = prop_oneof![Just(String::new()), st.clone()];
    let range = prop::option::of((
        prop_oneof![Just(-1i64), 0i64..(2 << 30)],
        prop_oneof![Just(-1i64), Just(0i64), 0i64..(2 << 30)],
    ));
    let cap = capability().boxed();
    prop_oneof![
        3 => (id.clone(), st.clone(), cap.clone()).prop_map(|(id, staging, cap)| CsiCall::Stage { id, staging, cap }),
        2 => (id.clone(), st.clone()).prop_map(|(id, staging)| CsiCall::Unstage { id, staging }),
        3 => (id.clone(), st, tg.clone(), cap.clone(), any::<bool>())
            .prop_map(|(id, staging, target, cap, ro)| CsiCall::Publish { id, staging, target, cap, ro }),
        2 => (id.clone(), tg).prop_map(|(id, target)| CsiCall::Unpublish { id, target }),
        1 => (id.clone(), any_path.clone()).prop_map(|(id, path)| CsiCall::Stats { id, path }),
        1 => (id, any_path, opt_staging, range, prop::option::weighted(0.3, cap))
            .prop_map(|(id, path, staging, range, cap)| CsiCall::Expand { id, path, staging, range, cap: cap.flatten() }),
    ]
}

fn model_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id != "."
        && id != ".."
        && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.'))
}

async fn csi_send(
    node: &mut csi::node_client::NodeClient<tonic::transport::Channel>,
    c: &CsiCall,
) -> Result<(), tonic::Status> {
    match c.clone() {
        CsiCall::Stage { id, staging, cap } => node
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: id,
                staging_target_path: staging,
                volume_capability: cap,
                ..Default::default()
            })
            .await
            .map(|_| ()),
        CsiCall::Unstage { id, staging } => node
            .node_unstage_volume(csi::NodeUnstageVolumeRequest { volume_id: id, staging_target_path: staging })
            .await
            .map(|_| ()),
        CsiCall::Publish { id, staging, target, cap, ro } => node
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: id,
                staging_target_path: staging,
                target_path: target,
                volume_capability: cap,
                readonly: ro,
                ..Default::default()
            })
            .await
            .map(|_| ()),
        CsiCall::Unpublish { id, target } => node
            .node_unpublish_volume(csi::NodeUnpublishVolumeRequest { volume_id: id, target_path: target })
            .await
            .map(|_| ()),
        CsiCall::Stats { id, path } => node
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: id,
                volume_path: path,
                staging_target_path: String::new(),
            })
            .await
            .map(|_| ()),
        CsiCall::Expand { id, path, staging, range, cap } => node
            .node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: id,
                volume_path: path,
                staging_target_path: staging,
                capacity_range: range.map(|(r, l)| csi::CapacityRange { required_bytes: r, limit_bytes: l }),
                volume_capability: cap,
                ..Default::default()
            })
            .await
            .map(|_| ()),
    }
}

#[allow(clippy::await_holding_refcell_ref)] // one thread: block_on, one call at a time
fn agent_csi(agent: &mut Agent, rt: &tokio::runtime::Runtime) {
    use tonic::Code;
    let kubelet = agent.kubelet();
    let pools = csi_pools(&kubelet);
    let (mut node, mut vols) = rt.block_on(async {
        let ch = nodeplane::rpc::connect_unix(&agent.csi_sock()).await.expect("dialing csi.sock");
        let nch = nodeplane::rpc::connect_unix(&agent.node_sock()).await.expect("dialing node.sock");
        (csi::node_client::NodeClient::new(ch), nodeplane::rpc::node::node_volumes_client::NodeVolumesClient::new(nch))
    });
    rt.block_on(vols.create_volume(nodeplane::rpc::node::CreateVolumeRequest {
        id: "vol-a".into(),
        size_bytes: 32 << 20,
        fs_type: "ext4".into(),
        ..Default::default()
    }))
    .expect("creating vol-a");
    let symlink = kubelet.join("evil");
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let node_c = std::cell::RefCell::new(node.clone());
    let seen_c = std::cell::RefCell::new(&mut seen);
    fuzz("agent CSI Node requests", cases(300), csi_call(&pools), |call| {
        let t = Instant::now();
        let r = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(20), csi_send(&mut node_c.borrow_mut(), &call)).await
        });
        let r = r.map_err(|_| TestCaseError::fail("no answer within 20 s"))?;
        let took = t.elapsed();
        let code = r.as_ref().err().map(|s| s.code()).unwrap_or(Code::Ok);
        *seen_c.borrow_mut().entry(format!("{code:?}")).or_default() += 1;
        let msg = short(&r.as_ref().err().map(|s| s.message().to_string()).unwrap_or_default());
        let p = |s: &str| model_path(s, &kubelet, &symlink);
        let (id, paths_ok, cap, cap_required) = match &call {
            CsiCall::Stage { id, staging, cap } => (id, p(staging), cap.clone(), true),
            CsiCall::Unstage { id, staging } => (id, p(staging), None, false),
            CsiCall::Publish { id, staging, target, cap, .. } => (id, p(staging) && p(target), cap.clone(), true),
            CsiCall::Unpublish { id, target } => (id, p(target), None, false),
            CsiCall::Stats { id, path } => (id, p(path), None, false),
            CsiCall::Expand { id, path, staging, .. } => {
                (id, p(path) && (staging.is_empty() || p(staging)), None, false)
            }
        };
        prop_assert!(
            !matches!(
                code,
                Code::Unknown
                    | Code::Internal
                    | Code::Unavailable
                    | Code::Unimplemented
                    | Code::DataLoss
                    | Code::Aborted
            ),
            "{code:?}: {msg} (took {took:?})"
        );
        let cap_code = if cap_required { model_capability(&cap).flatten() } else { None };
        // The precedence of issue 17: a missing required field (volume id, the call's own
        // path, volume_capability) is INVALID_ARGUMENT; then a volume that does not exist
        // (unknown, or an id no volume can have) is NOT_FOUND before any other check.
        let required_empty = match &call {
            CsiCall::Stage { staging, .. } | CsiCall::Unstage { staging, .. } => staging.is_empty(),
            CsiCall::Publish { target, .. } | CsiCall::Unpublish { target, .. } => target.is_empty(),
            CsiCall::Stats { path, .. } | CsiCall::Expand { path, .. } => path.is_empty(),
        };
        if id.is_empty() || required_empty || (cap_required && cap.is_none()) {
            prop_assert_eq!(code, Code::InvalidArgument, "{}", msg);
            return Ok(());
        }
        if !model_id(id) || id == "vol-missing" {
            prop_assert_eq!(code, Code::NotFound, "{}", msg);
            return Ok(());
        }
        // Publishing without the staging path this plugin needs (STAGE_UNSTAGE_VOLUME) is
        // FAILED_PRECONDITION once target and capability are good (pinned by
        // tests/csi_root.rs, conformance_node_errors).
        if let CsiCall::Publish { staging, target, .. } = &call
            && staging.is_empty()
            && p(target)
            && model_capability(&cap) == Some(None)
        {
            prop_assert_eq!(code, Code::FailedPrecondition, "{}", msg);
            return Ok(());
        }
        match &call {
            // A known volume asked about where it is not published (any bad path included).
            CsiCall::Stats { path, .. } | CsiCall::Expand { path, .. } if !p(path) => {
                prop_assert_eq!(code, Code::NotFound, "{}", msg);
            }
            CsiCall::Expand { .. } if !paths_ok => {
                prop_assert!(code == Code::InvalidArgument || code == Code::NotFound, "{code:?}: {msg}");
            }
            _ if !paths_ok => {
                // Bad path: INVALID_ARGUMENT (or the capability's own refusal, when it is
                // checked first).
                prop_assert!(code == Code::InvalidArgument || Some(code) == cap_code, "{code:?}: {msg}");
            }
            _ => {
                if cap_required && let Some(Some(want)) = model_capability(&cap) {
                    prop_assert_eq!(code, want, "{}", msg);
                }
            }
        }
        Ok(())
    });
    eprintln!("agent CSI Node requests: answers by code {seen:?}");
    agent.assert_alive();
    // Undo whatever the valid requests did; then nothing of the sandbox may stay mounted or
    // attached, and the volume can be deleted.
    rt.block_on(async {
        for t in &pools.targets {
            let r = node
                .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                    volume_id: "vol-a".into(),
                    target_path: t.clone(),
                })
                .await;
            assert!(r.is_ok(), "unpublish {t}: {r:?}");
        }
        for s in &pools.stagings {
            let r = node
                .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                    volume_id: "vol-a".into(),
                    staging_target_path: s.clone(),
                })
                .await;
            assert!(r.is_ok(), "unstage {s}: {r:?}");
        }
        let r = vols.delete_volume(nodeplane::rpc::node::DeleteVolumeRequest { id: "vol-a".into() }).await;
        assert!(r.is_ok(), "delete vol-a: {r:?}\n{}", agent.log());
        // Still answering.
        let info = node.node_get_info(csi::NodeGetInfoRequest {}).await.expect("NodeGetInfo after the fuzzing");
        assert!(!info.into_inner().node_id.is_empty());
    });
    let m = mounts_under(&agent.dir);
    assert!(m.is_empty(), "leaked mounts: {m:?}");
    let l = loops_under(&agent.dir);
    assert!(l.is_empty(), "leaked loop devices: {l:?}");
}

#[derive(Debug, Clone)]
enum DpCall {
    Allocate(Vec<Vec<String>>),
    Preferred(Vec<(Vec<String>, Vec<String>, i32)>),
    PreStart(Vec<String>),
}

/// Device IDs of resource fz: fz0 and fz1 healthy, fz2 gone (unhealthy), share 3.
fn fz_ids() -> impl Strategy<Value = Vec<String>> {
    let id = prop_oneof![
        6 => (prop::sample::select(vec!["fz0", "fz1"]), 0..3u32).prop_map(|(n, k)| format!("{n}-{k}")),
        1 => (0..3u32).prop_map(|k| format!("fz2-{k}")),
        1 => prop::sample::select(vec!["fz0", "fz0-3", "fz0-01", "fz3-0", "", "fz0-", "-0", "FZ0-0", "fz0-0\0"]).prop_map(str::to_string),
        1 => ".{0,10}",
    ];
    prop::collection::vec(id, 0..10)
}

fn model_fz(ids: &[String]) -> Result<(), tonic::Code> {
    for id in ids {
        let Some((stem, k)) = id.rsplit_once('-') else { return Err(tonic::Code::InvalidArgument) };
        let ours = matches!(stem, "fz0" | "fz1" | "fz2") && matches!(k, "0" | "1" | "2");
        if !ours {
            return Err(tonic::Code::InvalidArgument);
        }
        if stem == "fz2" {
            return Err(tonic::Code::FailedPrecondition);
        }
    }
    Ok(())
}

fn agent_device_plugin(agent: &mut Agent, rt: &tokio::runtime::Runtime) {
    use nodeplane::rpc::deviceplugin as pb;
    let client = rt.block_on(async {
        let ch = nodeplane::rpc::connect_unix(&agent.dp_sock()).await.expect("dialing the device plugin socket");
        pb::device_plugin_client::DevicePluginClient::new(ch)
    });
    // fz2 goes away: its IDs stay known, unhealthy.
    fs::remove_file(agent.dir.join("dev/fz2")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = rt.block_on(client.clone().allocate(pb::AllocateRequest {
            container_requests: vec![pb::ContainerAllocateRequest { devices_ids: vec!["fz2-0".into()] }],
        }));
        if r.as_ref().err().map(|s| s.code()) == Some(tonic::Code::FailedPrecondition) {
            break;
        }
        assert!(Instant::now() < deadline, "fz2 not unhealthy within 10 s: {r:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let strategy = prop_oneof![
        2 => prop::collection::vec(fz_ids(), 0..3).prop_map(DpCall::Allocate),
        2 => prop::collection::vec((fz_ids(), fz_ids(), prop_oneof![-2i32..12, Just(i32::MIN), Just(i32::MAX)]), 0..3).prop_map(DpCall::Preferred),
        1 => fz_ids().prop_map(DpCall::PreStart),
    ];
    let c = std::cell::RefCell::new(client.clone());
    fuzz("agent device plugin requests", cases(300), strategy, |call| {
        let mut cl = c.borrow_mut();
        let t = Instant::now();
        let r = rt
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(5), async {
                    match &call {
                        DpCall::Allocate(reqs) => {
                            let container_requests = reqs
                                .iter()
                                .map(|ids| pb::ContainerAllocateRequest { devices_ids: ids.clone() })
                                .collect();
                            cl.allocate(pb::AllocateRequest { container_requests }).await.map(|r| Some(r.into_inner()))
                        }
                        DpCall::Preferred(reqs) => {
                            let container_requests = reqs
                                .iter()
                                .map(|(a, m, n)| pb::ContainerPreferredAllocationRequest {
                                    available_device_i_ds: a.clone(),
                                    must_include_device_i_ds: m.clone(),
                                    allocation_size: *n,
                                })
                                .collect();
                            cl.get_preferred_allocation(pb::PreferredAllocationRequest { container_requests })
                                .await
                                .map(|_| None)
                        }
                        DpCall::PreStart(ids) => cl
                            .pre_start_container(pb::PreStartContainerRequest { devices_ids: ids.clone() })
                            .await
                            .map(|_| None),
                    }
                })
                .await
            })
            .map_err(|_| TestCaseError::fail("no answer within 5 s"))?;
        prop_assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        let got = r.as_ref().map(|_| ()).map_err(|s| s.code());
        let want = match &call {
            DpCall::Allocate(reqs) => reqs.iter().try_for_each(|ids| model_fz(ids)),
            DpCall::PreStart(ids) => model_fz(ids),
            DpCall::Preferred(reqs) => reqs.iter().try_for_each(|(a, m, n)| {
                let ok = *n >= 0 && m.len() <= *n as usize && m.iter().all(|x| a.contains(x)) && *n as usize <= a.len();
                if ok { Ok(()) } else { Err(tonic::Code::InvalidArgument) }
            }),
        };
        prop_assert_eq!(got, want, "{:?}", r.as_ref().err());
        if let (DpCall::Allocate(reqs), Ok(Some(resp))) = (&call, &r) {
            prop_assert_eq!(resp.container_responses.len(), reqs.len());
        }
        Ok(())
    });
    // A huge, legal-looking list: answered (refused or not) quickly.
    let huge: Vec<String> = (0..100_000).map(|i| format!("fz{}-{}", i % 2, i % 3)).collect();
    let t = Instant::now();
    let r = rt.block_on(client.clone().allocate(pb::AllocateRequest {
        container_requests: vec![pb::ContainerAllocateRequest { devices_ids: huge }],
    }));
    eprintln!(
        "device plugin: Allocate of 100000 IDs answered {:?} in {:?}",
        r.as_ref().map(|_| "OK").map_err(|s| s.code()),
        t.elapsed()
    );
    assert!(r.is_ok(), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(3));
    agent.assert_alive();
    rt.block_on(client.clone().get_device_plugin_options(pb::Empty {}))
        .expect("GetDevicePluginOptions after the fuzzing");
}

#[test]
fn agent_requests_root() {
    let mut agent = Agent::start("agent");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    agent_cni_socket(&mut agent);
    agent_csi(&mut agent, &rt);
    agent_device_plugin(&mut agent, &rt);
    agent.assert_alive();
}

/// An oversized gRPC request (an 8 MiB volume id, an 8 MiB device ID list) is refused from its
/// length, quickly, with RESOURCE_EXHAUSTED (gRPC's code for "request message larger than
/// limit"), and the agent answers afterwards.
#[test]
fn agent_oversized_grpc_requests_root() {
    use nodeplane::rpc::deviceplugin as pb;
    let mut agent = Agent::start("big");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut results = Vec::new();
    rt.block_on(async {
        let ch = nodeplane::rpc::connect_unix(&agent.csi_sock()).await.unwrap();
        let mut node = csi::node_client::NodeClient::new(ch);
        let t = Instant::now();
        let r = node
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: "a".repeat(8 << 20),
                staging_target_path: agent.kubelet().join("x").display().to_string(),
                ..Default::default()
            })
            .await;
        results.push((
            "CSI NodeStageVolume, 8 MiB volume id",
            r.map(|_| ()).map_err(|s| (s.code(), s.message().to_string())),
            t.elapsed(),
        ));
        node.node_get_info(csi::NodeGetInfoRequest {}).await.expect("NodeGetInfo after the oversized request");
        let ch = nodeplane::rpc::connect_unix(&agent.dp_sock()).await.unwrap();
        let mut dp = pb::device_plugin_client::DevicePluginClient::new(ch);
        let t = Instant::now();
        let ids: Vec<String> = (0..1_000_000).map(|i| format!("fz0-{}", i % 3)).collect();
        let r = dp
            .allocate(pb::AllocateRequest {
                container_requests: vec![pb::ContainerAllocateRequest { devices_ids: ids }],
            })
            .await;
        results.push((
            "device plugin Allocate, 8 MiB of IDs",
            r.map(|_| ()).map_err(|s| (s.code(), s.message().to_string())),
            t.elapsed(),
        ));
        dp.get_device_plugin_options(pb::Empty {}).await.expect("GetDevicePluginOptions after the oversized request");
    });
    agent.assert_alive();
    for (what, r, took) in &results {
        eprintln!("{what}: {r:?} in {took:?}");
    }
    for (what, r, took) in results {
        assert!(took < Duration::from_secs(2), "{what}: took {took:?}");
        match r {
            Err((tonic::Code::ResourceExhausted, _)) => {}
            other => panic!("{what}: expected RESOURCE_EXHAUSTED, got {other:?}"),
        }
    }
}
