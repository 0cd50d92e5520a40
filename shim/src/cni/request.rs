//! Parsing and validating a CNI invocation: environment plus network configuration.
//!
//! Used by the shim (to fail fast and to find the agent) and by the agent (which never
//! trusts what reaches its socket). Every error names the field at fault.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::Value;

use super::result::{Dns, ResultModel};
use super::{CniError, Code, Command, LATEST_VERSION, MAX_CONFIG_BYTES, PLUGIN_TYPE, SUPPORTED_VERSIONS, version_cmp};

/// The CNI_* environment as received.
pub type Env = BTreeMap<String, String>;

/// The env keys the shim forwards.
pub const ENV_KEYS: &[&str] = &["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS", "CNI_PATH"];

/// One attachment named in a GC request.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AttachmentRef {
    pub container_id: String,
    pub ifname: String,
}

/// The nodeplane entry of a network configuration.
#[derive(Debug, Clone, Default)]
pub struct NetConf {
    pub cni_version: String,
    pub name: String,
    pub mtu: Option<u32>,
    pub dns: Option<Dns>,
    pub prev_result: Option<ResultModel>,
    /// The raw prevResult, for passing through unchanged fields.
    pub prev_result_raw: Option<Value>,
    pub agent_socket: Option<PathBuf>,
    pub pending_delete_dir: Option<PathBuf>,
    /// How long the shim waits for an agent that is not listening (restarting, upgrading)
    /// before ADD, CHECK or GC answer "try again later" (`agentWaitSeconds`, 0..=300).
    pub agent_wait_seconds: Option<u64>,
    pub valid_attachments: Option<Vec<AttachmentRef>>,
}

/// A validated invocation.
#[derive(Debug, Clone)]
pub struct Request {
    pub command: Command,
    pub container_id: String,
    pub netns: Option<PathBuf>,
    pub ifname: String,
    /// CNI_ARGS as key/value pairs (K8S_POD_NAME, K8S_POD_NAMESPACE, …).
    pub args: BTreeMap<String, String>,
    pub conf: NetConf,
}

impl Request {
    pub fn pod_name(&self) -> &str {
        self.args.get("K8S_POD_NAME").map(String::as_str).unwrap_or("")
    }
    pub fn pod_namespace(&self) -> &str {
        self.args.get("K8S_POD_NAMESPACE").map(String::as_str).unwrap_or("")
    }
}

fn invalid_env(msg: impl Into<String>) -> CniError {
    CniError::new(Code::InvalidEnv, msg)
}
fn invalid_conf(msg: impl Into<String>) -> CniError {
    CniError::new(Code::InvalidConfig, msg)
}

/// Parse only the command (needed to choose how to fail).
pub fn parse_command(env: &Env) -> Result<Command, CniError> {
    let raw = env.get("CNI_COMMAND").ok_or_else(|| invalid_env("CNI_COMMAND is not set"))?;
    Command::parse(raw)
        .ok_or_else(|| invalid_env(format!("CNI_COMMAND {raw:?} is not one of ADD, DEL, CHECK, STATUS, GC, VERSION")))
}

/// Best-effort cniVersion for error output, from a config that may be invalid.
pub fn sniff_version(stdin: &[u8]) -> String {
    serde_json::from_slice::<Value>(stdin)
        .ok()
        .and_then(|v| v.get("cniVersion").and_then(Value::as_str).map(str::to_string))
        .filter(|v| SUPPORTED_VERSIONS.contains(&v.as_str()))
        .unwrap_or_else(|| LATEST_VERSION.to_string())
}

/// A container id: non-empty, alphanumerics first, then alphanumerics, `_`, `.`, `-`.
pub fn valid_container_id(id: &str) -> bool {
    let mut chars = id.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphanumeric())
        && id.len() <= 192
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// An interface name the kernel accepts: 1..=15 bytes, not `.`/`..`, no `/`, `:` or spaces.
/// (The kernel's `isspace` is Latin-1: byte 0xA0, as in U+00A0 or "à", is a space too.)
pub fn valid_ifname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 15
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b > 0x20 && b != 0x7f && b != 0xa0 && b != b'/' && b != b':')
}

fn parse_args(raw: &str) -> Result<BTreeMap<String, String>, CniError> {
    let mut out = BTreeMap::new();
    for pair in raw.split(';').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').ok_or_else(|| invalid_env(format!("CNI_ARGS: {pair:?} is not KEY=VALUE")))?;
        if k.is_empty() {
            return Err(invalid_env(format!("CNI_ARGS: {pair:?} has an empty key")));
        }
        out.insert(k.to_string(), v.to_string());
    }
    Ok(out)
}

fn opt_string(obj: &serde_json::Map<String, Value>, key: &str) -> Result<Option<String>, CniError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(invalid_conf(format!("{key} must be a string"))),
    }
}

fn parse_attachments(v: &Value, key: &str) -> Result<Vec<AttachmentRef>, CniError> {
    let items = v.as_array().ok_or_else(|| invalid_conf(format!("{key} must be a list")))?;
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let cid = item.get("containerID").and_then(Value::as_str);
            let ifname = item.get("ifname").and_then(Value::as_str);
            match (cid, ifname) {
                (Some(c), Some(n)) => Ok(AttachmentRef { container_id: c.into(), ifname: n.into() }),
                _ => Err(invalid_conf(format!("{key}[{i}] must have string fields containerID and ifname"))),
            }
        })
        .collect()
}

/// Parse and validate the network configuration for `command`.
pub fn parse_netconf(stdin: &[u8], command: Command) -> Result<NetConf, CniError> {
    if stdin.len() > MAX_CONFIG_BYTES {
        return Err(CniError::new(
            Code::Decode,
            format!("network configuration is {} bytes; the limit is {MAX_CONFIG_BYTES}", stdin.len()),
        ));
    }
    let value: Value = serde_json::from_slice(stdin)
        .map_err(|e| CniError::new(Code::Decode, format!("failed to decode network configuration: {e}")))?;
    let obj =
        value.as_object().ok_or_else(|| CniError::new(Code::Decode, "network configuration must be a JSON object"))?;

    let cni_version = match obj.get("cniVersion") {
        Some(Value::String(s)) => s.clone(),
        None => return Err(invalid_conf("cniVersion is required")),
        Some(_) => return Err(invalid_conf("cniVersion must be a string")),
    };
    if !SUPPORTED_VERSIONS.contains(&cni_version.as_str()) {
        return Err(CniError::new(Code::IncompatibleVersion, format!("cniVersion {cni_version:?} is not supported"))
            .with_details(format!("supported versions: {}", SUPPORTED_VERSIONS.join(", "))));
    }
    if version_cmp(&cni_version, command.min_version()).is_lt() {
        return Err(CniError::new(
            Code::IncompatibleVersion,
            format!(
                "{} needs cniVersion {} or later; the configuration says {cni_version}",
                command.as_str(),
                command.min_version()
            ),
        ));
    }

    let name = opt_string(obj, "name")?.ok_or_else(|| invalid_conf("name is required"))?;
    let name_ok = name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if !name_ok {
        return Err(invalid_conf(format!(
            "name {name:?} must start with a letter or digit and hold only letters, digits, '_', '.', '-'"
        )));
    }
    match opt_string(obj, "type")? {
        Some(t) if t == PLUGIN_TYPE => {}
        Some(t) => return Err(invalid_conf(format!("type is {t:?}; this plugin is {PLUGIN_TYPE:?}"))),
        None => return Err(invalid_conf("type is required")),
    }

    let mtu = match obj.get("mtu") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(m) if (68..=65535).contains(&m) => Some(m as u32),
            _ => return Err(invalid_conf(format!("mtu must be an integer from 68 to 65535, got {v}"))),
        },
    };
    let dns = match obj.get("dns") {
        None | Some(Value::Null) => None,
        Some(v) => Some(Dns::from_json(v, "dns").map_err(invalid_conf)?),
    };
    let path_field = |key: &str| -> Result<Option<PathBuf>, CniError> {
        match opt_string(obj, key)? {
            None => Ok(None),
            Some(p) if p.starts_with('/') => Ok(Some(PathBuf::from(p))),
            Some(p) => Err(invalid_conf(format!("{key} must be an absolute path, got {p:?}"))),
        }
    };
    let agent_socket = path_field("agentSocket")?;
    let pending_delete_dir = path_field("pendingDeleteDir")?;
    let agent_wait_seconds = match obj.get("agentWaitSeconds") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n) if n <= 300 => Some(n),
            _ => return Err(invalid_conf(format!("agentWaitSeconds must be an integer from 0 to 300, got {v}"))),
        },
    };

    let prev_result_raw = match obj.get("prevResult") {
        None | Some(Value::Null) => None,
        Some(v) if v.is_object() => Some(v.clone()),
        Some(_) => return Err(invalid_conf("prevResult must be an object")),
    };
    let prev_result = match &prev_result_raw {
        Some(v) => Some(ResultModel::parse(v).map_err(|e| invalid_conf(format!("prevResult: {e}")))?),
        None => None,
    };
    if command == Command::Check && prev_result.is_none() {
        return Err(invalid_conf("prevResult is required for CHECK"));
    }

    let valid_attachments = if command == Command::Gc {
        let (key, v) = ["cni.dev/valid-attachments", "cni.dev/attachments"]
            .iter()
            .find_map(|k| obj.get(*k).map(|v| (*k, v)))
            .ok_or_else(|| invalid_conf("GC needs cni.dev/valid-attachments"))?;
        Some(parse_attachments(v, key)?)
    } else {
        None
    };

    Ok(NetConf {
        cni_version,
        name,
        mtu,
        dns,
        prev_result,
        prev_result_raw,
        agent_socket,
        pending_delete_dir,
        agent_wait_seconds,
        valid_attachments,
    })
}

/// Validate a whole invocation.
pub fn parse(env: &Env, stdin: &[u8]) -> Result<Request, CniError> {
    let command = parse_command(env)?;
    let conf = parse_netconf(stdin, command)?;
    let needs_target = matches!(command, Command::Add | Command::Del | Command::Check);
    let get = |k: &str| env.get(k).filter(|v| !v.is_empty()).cloned();

    let container_id = match get("CNI_CONTAINERID") {
        Some(id) if valid_container_id(&id) => id,
        Some(id) => {
            return Err(invalid_env(format!(
                "CNI_CONTAINERID {id:?} is invalid: use letters, digits, '_', '.', '-' (max 192), starting with a letter or digit"
            )));
        }
        None if needs_target => return Err(invalid_env("CNI_CONTAINERID is not set")),
        None => String::new(),
    };
    let ifname = match get("CNI_IFNAME") {
        Some(n) if valid_ifname(&n) => n,
        Some(n) => {
            return Err(invalid_env(format!(
                "CNI_IFNAME {n:?} is not a valid interface name (1-15 bytes, no '/', ':' or spaces)"
            )));
        }
        None if needs_target => return Err(invalid_env("CNI_IFNAME is not set")),
        None => String::new(),
    };
    let netns = match get("CNI_NETNS") {
        Some(p) if p.starts_with('/') => Some(PathBuf::from(p)),
        Some(p) => return Err(invalid_env(format!("CNI_NETNS {p:?} must be an absolute path"))),
        None if matches!(command, Command::Add | Command::Check) => {
            return Err(invalid_env(format!("CNI_NETNS is not set (required for {})", command.as_str())));
        }
        None => None,
    };
    let args = match env.get("CNI_ARGS") {
        Some(raw) => parse_args(raw)?,
        None => BTreeMap::new(),
    };
    Ok(Request { command, container_id, netns, ifname, args, conf })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(cmd: &str) -> Env {
        let mut e = Env::new();
        e.insert("CNI_COMMAND".into(), cmd.into());
        e.insert("CNI_CONTAINERID".into(), "abc123".into());
        e.insert("CNI_NETNS".into(), "/var/run/netns/x".into());
        e.insert("CNI_IFNAME".into(), "eth0".into());
        e
    }
    const CONF: &[u8] = br#"{"cniVersion":"1.1.0","name":"nodeplane","type":"nodeplane","mtu":1400}"#;

    #[test]
    fn parses_valid_add() {
        let r = parse(&env("ADD"), CONF).unwrap();
        assert_eq!(r.command, Command::Add);
        assert_eq!(r.conf.mtu, Some(1400));
        assert_eq!(r.ifname, "eth0");
    }

    #[test]
    fn error_codes() {
        let code = |e: &Env, s: &[u8]| parse(e, s).unwrap_err().code;
        assert_eq!(code(&env("ADD"), b"{nope"), Code::Decode);
        assert_eq!(code(&env("ADD"), b"[1]"), Code::Decode);
        assert_eq!(
            code(&env("ADD"), br#"{"cniVersion":"9.9.9","name":"n","type":"nodeplane"}"#),
            Code::IncompatibleVersion
        );
        assert_eq!(
            code(&env("CHECK"), br#"{"cniVersion":"0.3.1","name":"n","type":"nodeplane"}"#),
            Code::IncompatibleVersion
        );
        assert_eq!(code(&env("ADD"), br#"{"cniVersion":"1.0.0","name":"n","type":"bridge"}"#), Code::InvalidConfig);
        assert_eq!(
            code(&env("ADD"), br#"{"cniVersion":"1.0.0","name":"n","type":"nodeplane","mtu":7}"#),
            Code::InvalidConfig
        );
        assert_eq!(code(&env("CHECK"), CONF), Code::InvalidConfig, "CHECK without prevResult");
        assert_eq!(code(&env("GC"), CONF), Code::InvalidConfig, "GC without attachments");
        let mut e = env("ADD");
        e.remove("CNI_NETNS");
        assert_eq!(code(&e, CONF), Code::InvalidEnv);
        let mut e = env("ADD");
        e.insert("CNI_IFNAME".into(), "a/b".into());
        assert_eq!(code(&e, CONF), Code::InvalidEnv);
        let mut e = env("ADD");
        e.insert("CNI_IFNAME".into(), "sixteen-chars-xx".into());
        assert_eq!(code(&e, CONF), Code::InvalidEnv);
        let mut e = env("ADD");
        e.insert("CNI_CONTAINERID".into(), "-bad".into());
        assert_eq!(code(&e, CONF), Code::InvalidEnv);
        assert_eq!(code(&env("FROB"), CONF), Code::InvalidEnv);
        let big = vec![b' '; MAX_CONFIG_BYTES + 1];
        assert_eq!(code(&env("ADD"), &big), Code::Decode);
    }

    #[test]
    fn del_without_netns_is_fine() {
        let mut e = env("DEL");
        e.remove("CNI_NETNS");
        assert!(parse(&e, CONF).unwrap().netns.is_none());
    }

    #[test]
    fn gc_attachments_and_legacy_key() {
        let conf = br#"{"cniVersion":"1.1.0","name":"n","type":"nodeplane","cni.dev/attachments":[{"containerID":"a","ifname":"eth0"}]}"#;
        let r = parse(&env("GC"), conf).unwrap();
        assert_eq!(r.conf.valid_attachments.unwrap().len(), 1);
    }

    #[test]
    fn cni_args() {
        let mut e = env("ADD");
        e.insert("CNI_ARGS".into(), "IgnoreUnknown=1;K8S_POD_NAME=web;K8S_POD_NAMESPACE=default".into());
        let r = parse(&e, CONF).unwrap();
        assert_eq!(r.pod_name(), "web");
        e.insert("CNI_ARGS".into(), "novalue".into());
        assert_eq!(parse(&e, CONF).unwrap_err().code, Code::InvalidEnv);
    }
}
