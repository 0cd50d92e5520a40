//! The CNI contract: commands, versions, error codes, request parsing and results.

pub mod request;
pub mod result;
pub mod wire;

use serde_json::json;

/// Every result version this plugin can produce, oldest first.
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
pub const LATEST_VERSION: &str = "1.1.0";
/// The plugin `type` this binary answers to.
pub const PLUGIN_TYPE: &str = "nodeplane";
/// The network name the agent writes into its conflist.
pub const NETWORK_NAME: &str = "nodeplane";
/// Largest network configuration accepted on stdin.
pub const MAX_CONFIG_BYTES: usize = 1 << 20;

/// CNI commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Command {
    Add,
    Del,
    Check,
    Status,
    Gc,
    Version,
}

impl Command {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "ADD" => Command::Add,
            "DEL" => Command::Del,
            "CHECK" => Command::Check,
            "STATUS" => Command::Status,
            "GC" => Command::Gc,
            "VERSION" => Command::Version,
            _ => return None,
        })
    }
    pub fn as_str(&self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Status => "STATUS",
            Command::Gc => "GC",
            Command::Version => "VERSION",
        }
    }
    /// The first spec version that defines this command.
    pub fn min_version(&self) -> &'static str {
        match self {
            Command::Check => "0.4.0",
            Command::Status | Command::Gc => "1.1.0",
            _ => "0.3.0",
        }
    }
}

/// The spec's well-known error codes (plus the conventional 999 for internal errors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Code {
    IncompatibleVersion = 1,
    UnsupportedField = 2,
    UnknownContainer = 3,
    InvalidEnv = 4,
    Io = 5,
    Decode = 6,
    InvalidConfig = 7,
    TryAgainLater = 11,
    NotAvailable = 50,
    NotAvailablePodsAffected = 51,
    /// An interface or attachment of that name already exists (plugin-specific range).
    AlreadyExists = 100,
    Internal = 999,
}

/// A CNI error: the code, a one-line message naming the field or object, optional details.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg}")]
pub struct CniError {
    pub code: Code,
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub fn new(code: Code, msg: impl Into<String>) -> Self {
        CniError { code, msg: msg.into(), details: String::new() }
    }
    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }
    /// The error JSON the spec wants on stdout.
    pub fn to_json(&self, cni_version: &str) -> serde_json::Value {
        let mut v = json!({ "cniVersion": cni_version, "code": self.code as u32, "msg": self.msg });
        if !self.details.is_empty() {
            v["details"] = json!(self.details);
        }
        v
    }
}

/// Compare two dotted versions numerically.
pub fn version_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    let parse = |s: &str| -> Vec<u32> { s.split('.').map(|p| p.parse().unwrap_or(0)).collect() };
    parse(a).cmp(&parse(b))
}

/// The VERSION answer.
pub fn version_result(requested: Option<&str>) -> serde_json::Value {
    let v = requested.filter(|v| SUPPORTED_VERSIONS.contains(v)).unwrap_or(LATEST_VERSION);
    json!({ "cniVersion": v, "supportedVersions": SUPPORTED_VERSIONS })
}

/// What the plugin prints and how it exits.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Reply {
    pub exit_code: i32,
    pub stdout: String,
}

impl Reply {
    pub fn ok(value: &serde_json::Value) -> Self {
        Reply { exit_code: 0, stdout: value.to_string() }
    }
    /// Success with no output (DEL, CHECK, GC, STATUS).
    pub fn empty() -> Self {
        Reply { exit_code: 0, stdout: String::new() }
    }
    pub fn error(e: &CniError, cni_version: &str) -> Self {
        Reply { exit_code: 1, stdout: e.to_json(cni_version).to_string() }
    }
}
