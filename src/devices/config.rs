//! The device file: which device classes the node offers, parsed entry by entry so one bad
//! entry is reported (naming it) and skipped while the rest keeps working.
//!
//! ```json
//! {"resources": [
//!   {"name": "kvm", "devices": ["/dev/kvm"], "share": 4, "permissions": "rw",
//!    "mounts": [{"hostPath": "/lib/x", "containerPath": "/lib/x", "readOnly": true}],
//!    "env": {"KVM": "1"}, "cdi": true, "preStart": false, "offer": "devicePlugin",
//!    "vendor": "acme", "model": "x1"}
//! ]}
//! ```
//!
//! `offer` says which kubelet allocator hands the resource's devices out: `"devicePlugin"`
//! (the default: a v1beta1 device plugin `nodeplane.dev/<name>`) or `"dra"` (devices of the
//! DRA driver `dra.nodeplane.dev`, see `devices::dra`). The rule for `"both"`: it is
//! refused at load, naming the entry, because two allocators counting the same device
//! nodes would hand one device to two pods without either knowing. Offer a device through
//! both by giving each allocator its own entry with disjoint patterns.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;

/// Resource names become `nodeplane.dev/<name>`: a DNS label, at most 40 characters here
/// (the socket name and CDI file name derive from it).
pub const MAX_NAME: usize = 40;
pub const MAX_SHARE: u32 = 1000;
/// The longest `vendor` / `model` (a DRA string attribute may hold 64 characters).
pub const MAX_ATTRIBUTE: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MountSpec {
    pub host_path: PathBuf,
    pub container_path: PathBuf,
    #[serde(default)]
    pub read_only: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Entry {
    name: String,
    devices: Vec<String>,
    #[serde(default = "one")]
    share: u32,
    permissions: Option<String>,
    #[serde(default)]
    mounts: Vec<MountSpec>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    cdi: bool,
    #[serde(default)]
    pre_start: bool,
    offer: Option<String>,
    vendor: Option<String>,
    model: Option<String>,
}

/// Which kubelet allocator offers a resource's devices (see the module comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Offer {
    #[default]
    DevicePlugin,
    Dra,
}

fn parse_offer(o: Option<&str>) -> Result<Offer, String> {
    match o {
        None | Some("devicePlugin") => Ok(Offer::DevicePlugin),
        Some("dra") => Ok(Offer::Dra),
        Some("both") => Err("offer \"both\" is refused: one device must never be handed out by the device plugin and by DRA at once; give each allocator its own entry with disjoint device patterns".into()),
        Some(o) => Err(format!("offer {o:?} is not \"devicePlugin\" or \"dra\"")),
    }
}

fn one() -> u32 {
    1
}

/// One device-node pattern: a directory and a glob for the names in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    pub dir: PathBuf,
    pub glob: String,
}

/// A valid resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    pub name: String,
    pub patterns: Vec<Pattern>,
    pub share: u32,
    pub permissions: String,
    pub mounts: Vec<MountSpec>,
    pub env: BTreeMap<String, String>,
    pub cdi: bool,
    pub pre_start: bool,
    pub offer: Offer,
    /// The DRA attributes `vendor` and `model` of every device of the resource (else read
    /// from sysfs where the device has PCI IDs).
    pub vendor: Option<String>,
    pub model: Option<String>,
}

impl Resource {
    pub fn resource_name(&self) -> String {
        format!("nodeplane.dev/{}", self.name)
    }
    pub fn socket_name(&self) -> String {
        format!("nodeplane-{}.sock", self.name)
    }
    /// The environment variable listing the allocated IDs.
    pub fn ids_env(&self) -> String {
        format!("NODEPLANE_DEVICES_{}", self.name.to_ascii_uppercase().replace('-', "_"))
    }
}

fn valid_name(n: &str) -> bool {
    let b = n.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_NAME
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

fn valid_env_name(n: &str) -> bool {
    let b = n.as_bytes();
    !b.is_empty() && !b[0].is_ascii_digit() && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_')
}

fn parse_pattern(p: &str) -> Result<Pattern, String> {
    let path = std::path::Path::new(p);
    if !path.is_absolute() {
        return Err(format!("device pattern {p:?} is not an absolute path"));
    }
    if p.split('/').any(|s| s == "..") {
        return Err(format!("device pattern {p:?} contains '..'"));
    }
    let (dir, glob) = p.rsplit_once('/').ok_or_else(|| format!("device pattern {p:?} has no file name"))?;
    if glob.is_empty() {
        return Err(format!("device pattern {p:?} ends with '/'"));
    }
    if dir.contains(['*', '?', '[']) {
        return Err(format!("device pattern {p:?}: wildcards are allowed in the last path component only"));
    }
    glob_match(glob, "").map_err(|e| format!("device pattern {p:?}: {e}"))?;
    Ok(Pattern { dir: PathBuf::from(if dir.is_empty() { "/" } else { dir }), glob: glob.to_string() })
}

fn check(e: Entry) -> Result<Resource, String> {
    if !valid_name(&e.name) {
        return Err(format!("name {:?} is not a DNS label of at most {MAX_NAME} characters (a-z, 0-9, '-')", e.name));
    }
    if e.cdi {
        // The name is the CDI class of the spec (nodeplane.dev/<name>); a runtime rejects
        // the whole spec file for a bad one, so the entry is refused here.
        crate::devices::cdi::check_class_name(&e.name).map_err(|m| {
            format!("{m}; with \"cdi\": true the name is the CDI class: rename the entry or set \"cdi\": false")
        })?;
    }
    let offer = parse_offer(e.offer.as_deref())?;
    if e.devices.is_empty() {
        return Err("devices must list at least one device node pattern".into());
    }
    let patterns = e.devices.iter().map(|p| parse_pattern(p)).collect::<Result<Vec<_>, _>>()?;
    if e.share == 0 || e.share > MAX_SHARE {
        return Err(format!("share {} is outside 1..={MAX_SHARE}", e.share));
    }
    let permissions = e.permissions.unwrap_or_else(|| "rw".to_string());
    if permissions.is_empty() || !permissions.chars().all(|c| matches!(c, 'r' | 'w' | 'm')) {
        return Err(format!("permissions {permissions:?} must be made of r, w, m"));
    }
    for m in &e.mounts {
        if !m.host_path.is_absolute() || !m.container_path.is_absolute() {
            return Err(format!(
                "mount {} -> {}: both paths must be absolute",
                m.host_path.display(),
                m.container_path.display()
            ));
        }
    }
    for k in e.env.keys() {
        if !valid_env_name(k) {
            return Err(format!("env name {k:?} is not a valid variable name"));
        }
    }
    for (what, v) in [("vendor", &e.vendor), ("model", &e.model)] {
        if let Some(v) = v
            && (v.is_empty() || v.len() > MAX_ATTRIBUTE || v.chars().any(|c| c.is_control()))
        {
            return Err(format!("{what} {v:?} must be 1 to {MAX_ATTRIBUTE} characters without control characters"));
        }
    }
    Ok(Resource {
        vendor: e.vendor,
        model: e.model,
        name: e.name,
        patterns,
        share: e.share,
        permissions,
        mounts: e.mounts,
        env: e.env,
        cdi: e.cdi,
        pre_start: e.pre_start,
        offer,
    })
}

/// Parse the device file. `Err` when the file as a whole is unusable (then the caller keeps
/// what it had); otherwise the valid resources and one message per rejected entry.
pub fn parse(text: &[u8]) -> Result<(Vec<Resource>, Vec<String>), String> {
    let v: serde_json::Value = serde_json::from_slice(text).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v.as_object().ok_or("the device file must be a JSON object")?;
    for k in obj.keys() {
        if k != "resources" {
            return Err(format!("unknown key {k:?} (expected \"resources\")"));
        }
    }
    let list = match obj.get("resources") {
        None => return Ok((Vec::new(), Vec::new())),
        Some(serde_json::Value::Array(a)) => a,
        Some(_) => return Err("\"resources\" must be a list".into()),
    };
    let mut ok: Vec<Resource> = Vec::new();
    let mut problems = Vec::new();
    for (i, raw) in list.iter().enumerate() {
        let label = match raw.get("name").and_then(|n| n.as_str()) {
            Some(n) => format!("resources[{i}] ({n:?})"),
            None => format!("resources[{i}]"),
        };
        match serde_json::from_value::<Entry>(raw.clone()).map_err(|e| e.to_string()).and_then(check) {
            Ok(r) if ok.iter().any(|o| o.name == r.name) => problems.push(format!("{label}: duplicate name")),
            Ok(r) => ok.push(r),
            Err(e) => problems.push(format!("{label}: {e}")),
        }
    }
    Ok((ok, problems))
}

/// Why the device file at a path could not be used (see [`load`]).
#[derive(Debug)]
pub enum LoadError {
    /// Reading the file failed (other than it being absent).
    Read(std::io::Error),
    /// The file as a whole is unusable ([`parse`]'s `Err`).
    Parse(String),
}

/// Read and [`parse`] the device file at `path`; an absent file offers no resources.
pub fn load(path: &std::path::Path) -> Result<(Vec<Resource>, Vec<String>), LoadError> {
    match std::fs::read(path) {
        Ok(b) => parse(&b).map_err(LoadError::Parse),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((Vec::new(), Vec::new())),
        Err(e) => Err(LoadError::Read(e)),
    }
}

/// Shell-style match of one path component: `*`, `?`, `[abc]`, `[a-z]`, `[!a-z]`, by the C
/// library's fnmatch(3) with no escapes (a backslash is itself). `Err` for a malformed
/// pattern (an unclosed `[`, which fnmatch would take literally).
pub fn glob_match(pattern: &str, name: &str) -> Result<bool, String> {
    let p: Vec<char> = pattern.chars().collect();
    // Validate brackets first, so a bad pattern fails even against the empty name.
    let mut i = 0;
    while i < p.len() {
        if p[i] == '[' {
            let close = p[i + 1..].iter().skip(1).position(|c| *c == ']').map(|x| x + i + 2);
            match close {
                Some(c) => i = c,
                None => return Err(format!("unclosed '[' in {pattern:?}")),
            }
        }
        i += 1;
    }
    // A NUL byte is in no file name.
    let (Ok(p), Ok(n)) = (std::ffi::CString::new(pattern), std::ffi::CString::new(name)) else { return Ok(false) };
    // SAFETY: two NUL-terminated strings that fnmatch only reads.
    Ok(unsafe { libc::fnmatch(p.as_ptr(), n.as_ptr(), libc::FNM_NOESCAPE) } == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        let m = |p: &str, n: &str| glob_match(p, n).unwrap();
        assert!(m("nvidia[0-9]*", "nvidia0"));
        assert!(m("nvidia[0-9]*", "nvidia12"));
        assert!(!m("nvidia[0-9]*", "nvidiactl"));
        assert!(m("kvm", "kvm"));
        assert!(!m("kvm", "kvm2"));
        assert!(m("tty?", "tty1"));
        assert!(!m("tty?", "tty"));
        assert!(m("*", "anything"));
        assert!(m("a*b*c", "axxbyyc"));
        assert!(!m("a*b*c", "axxbyy"));
        assert!(m("[!0-9]x", "ax"));
        assert!(!m("[!0-9]x", "1x"));
        assert!(m("[]]", "]"));
        assert!(glob_match("bad[", "x").is_err());
    }

    #[test]
    fn entries_are_checked_one_by_one() {
        let text = br#"{"resources": [
            {"name": "kvm", "devices": ["/dev/kvm"], "share": 2, "cdi": true},
            {"name": "Bad Name!", "devices": ["/dev/x"]},
            {"name": "rel", "devices": ["dev/x*"]},
            {"name": "deep", "devices": ["/dev/*/x"]},
            {"name": "perm", "devices": ["/dev/x"], "permissions": "rwx"},
            {"name": "kvm", "devices": ["/dev/kvm"]},
            {"name": "zero", "devices": ["/dev/x"], "share": 0},
            {"name": "extra", "devices": ["/dev/x"], "bogus": 1}
        ]}"#;
        let (ok, problems) = parse(text).unwrap();
        assert_eq!(ok.len(), 1);
        assert_eq!(ok[0].resource_name(), "nodeplane.dev/kvm");
        assert_eq!(ok[0].socket_name(), "nodeplane-kvm.sock");
        assert_eq!(ok[0].permissions, "rw");
        assert_eq!(ok[0].patterns, vec![Pattern { dir: "/dev".into(), glob: "kvm".into() }]);
        assert_eq!(problems.len(), 7, "{problems:#?}");
        assert!(problems[0].starts_with("resources[1] (\"Bad Name!\")"), "{}", problems[0]);
        assert!(problems[1].contains("not an absolute path"));
        assert!(problems[2].contains("last path component"));
        assert!(problems[4].contains("duplicate"));
        assert!(parse(b"[]").is_err());
        assert!(parse(b"{\"resources\": 3}").is_err());
        assert_eq!(parse(b"{}").unwrap().0.len(), 0);
    }

    #[test]
    fn offer_is_one_allocator_and_both_is_refused() {
        let text = br#"{"resources": [
            {"name": "a", "devices": ["/dev/a"]},
            {"name": "b", "devices": ["/dev/b"], "offer": "dra"},
            {"name": "c", "devices": ["/dev/c"], "offer": "devicePlugin"},
            {"name": "d", "devices": ["/dev/d"], "offer": "both"},
            {"name": "e", "devices": ["/dev/e"], "offer": "DRA"}
        ]}"#;
        let (ok, problems) = parse(text).unwrap();
        let offers: Vec<(&str, Offer)> = ok.iter().map(|r| (r.name.as_str(), r.offer)).collect();
        assert_eq!(offers, vec![("a", Offer::DevicePlugin), ("b", Offer::Dra), ("c", Offer::DevicePlugin)]);
        assert_eq!(problems.len(), 2, "{problems:#?}");
        assert!(problems[0].starts_with("resources[3] (\"d\"): offer \"both\" is refused"), "{}", problems[0]);
        assert!(problems[1].starts_with("resources[4] (\"e\")") && problems[1].contains("\"DRA\""), "{}", problems[1]);
    }
}
