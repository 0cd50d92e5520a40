//! Container Device Interface specs: what a container needs to use a resource's devices
//! (device nodes, plus the resource's environment and mounts), as the runtime reads them
//! from the CDI directory. Shared by every kubelet API that hands out devices.
//!
//! The naming rules are the CDI specification's (and its reference library's): one invalid
//! name makes a runtime reject the whole spec file, so names are checked where they enter
//! (resource names at config load, device names at discovery) and every spec is validated
//! again before it is renamed into place.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The CDI version of the specs written.
pub const CDI_VERSION: &str = "0.6.0";
/// The vendor half of every kind this agent writes (`nodeplane.dev/<resource>`).
pub const VENDOR: &str = "nodeplane.dev";

/// Where the spec of resource `name` (its class) lives in the CDI directory.
pub fn spec_path(cdi_dir: &Path, name: &str) -> PathBuf {
    cdi_dir.join(format!("{VENDOR}-{name}.json"))
}

/// What every device of a resource gets in its spec.
pub struct Edits<'a> {
    pub permissions: &'a str,
    pub env: &'a BTreeMap<String, String>,
    /// (host path, container path, read-only)
    pub mounts: Vec<(&'a Path, &'a Path, bool)>,
}

/// Why a name is not a valid CDI vendor, class or device name.
fn check_name(what: &str, name: &str, first_digit_ok: bool, extra: &[char]) -> Result<(), String> {
    let mut chars = name.chars();
    let Some(first) = chars.next() else { return Err(format!("{what} name is empty")) };
    let ok_first = first.is_ascii_alphabetic() || (first_digit_ok && first.is_ascii_digit());
    if !ok_first {
        let want = if first_digit_ok { "a letter or digit" } else { "a letter" };
        return Err(format!("{what} name {name:?} must start with {want}"));
    }
    if !name.ends_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err(format!("{what} name {name:?} must end with a letter or digit"));
    }
    if let Some(bad) = name.chars().find(|c| !c.is_ascii_alphanumeric() && !extra.contains(c)) {
        return Err(format!("{what} name {name:?} contains {bad:?} (allowed: letters, digits, {})", quoted(extra)));
    }
    Ok(())
}

fn quoted(chars: &[char]) -> String {
    chars.iter().map(|c| format!("'{c}'")).collect::<Vec<_>>().join(", ")
}

/// A CDI class name (the part after `vendor/` in a kind): starts with a letter.
pub fn check_class_name(name: &str) -> Result<(), String> {
    check_name("CDI class", name, false, &['-', '_', '.'])
}

/// A CDI vendor name (`nodeplane.dev`).
pub fn check_vendor_name(name: &str) -> Result<(), String> {
    check_name("CDI vendor", name, false, &['-', '_', '.'])
}

/// A CDI device name: letters, digits, `-`, `_`, `.`, `:`; starts and ends with a letter or
/// digit (a leading digit is allowed since CDI 0.5.0).
pub fn check_device_name(name: &str) -> Result<(), String> {
    check_name("CDI device", name, true, &['-', '_', '.', ':'])
}

/// The device node edit of one device.
fn node_edit(path: &Path, permissions: &str) -> serde_json::Value {
    serde_json::json!({"path": path, "hostPath": path, "permissions": permissions})
}

/// A resource's environment as CDI `NAME=VALUE` entries.
fn env_list(res: &Edits<'_>) -> Vec<String> {
    res.env.iter().map(|(k, v)| format!("{k}={v}")).collect()
}

/// A resource's mounts as CDI bind mounts.
fn mount_list(res: &Edits<'_>) -> Vec<serde_json::Value> {
    res.mounts
        .iter()
        .map(|(host, container, read_only)| {
            serde_json::json!({
                "hostPath": host,
                "containerPath": container,
                "options": if *read_only { vec!["ro", "bind"] } else { vec!["rw", "bind"] },
            })
        })
        .collect()
}

/// The CDI spec of kind `kind` with one device per `(name, device node)`, the container edits
/// the resource adds (env, mounts) at the top level. `None` when there is no device: a CDI
/// file must list at least one, so then there is no file.
pub fn spec<'a>(
    kind: &str,
    res: &Edits<'_>,
    devices: impl IntoIterator<Item = (&'a str, &'a Path)>,
) -> Option<serde_json::Value> {
    let devices: Vec<serde_json::Value> = devices
        .into_iter()
        .map(|(name, path)| serde_json::json!({"name": name, "containerEdits": {"deviceNodes": [node_edit(path, res.permissions)]}}))
        .collect();
    if devices.is_empty() {
        return None;
    }
    Some(serde_json::json!({
        "cdiVersion": CDI_VERSION,
        "kind": kind,
        "devices": devices,
        "containerEdits": {"env": env_list(res), "mounts": mount_list(res)},
    }))
}

/// The CDI spec of kind `kind` whose devices may come from different resources: each
/// `(name, device node, its resource's edits)` carries its own device node, env and mounts.
/// `None` when there is no device.
pub fn spec_per_device<'a>(
    kind: &str,
    devices: impl IntoIterator<Item = (&'a str, &'a Path, &'a Edits<'a>)>,
) -> Option<serde_json::Value> {
    let devices: Vec<serde_json::Value> = devices
        .into_iter()
        .map(|(name, path, res)| {
            serde_json::json!({
                "name": name,
                "containerEdits": {
                    "deviceNodes": [node_edit(path, res.permissions)],
                    "env": env_list(res),
                    "mounts": mount_list(res),
                },
            })
        })
        .collect();
    if devices.is_empty() {
        return None;
    }
    Some(serde_json::json!({"cdiVersion": CDI_VERSION, "kind": kind, "devices": devices}))
}

/// Check a spec against the CDI rules a runtime applies when it loads the file: version,
/// kind, at least one device, device names (unique), non-empty device edits, device node
/// paths, types and permissions, env entries, mount paths.
pub fn validate(spec: &serde_json::Value) -> Result<(), String> {
    let version = spec["cdiVersion"].as_str().ok_or("cdiVersion is missing")?;
    const KNOWN: &[&str] = &["0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0"];
    if !KNOWN.contains(&version) {
        return Err(format!("cdiVersion {version:?} is not a CDI version"));
    }
    let kind = spec["kind"].as_str().ok_or("kind is missing")?;
    let (vendor, class) = kind.split_once('/').ok_or_else(|| format!("kind {kind:?} is not <vendor>/<class>"))?;
    check_vendor_name(vendor)?;
    check_class_name(class)?;
    check_edits(&spec["containerEdits"], "containerEdits")?;
    let devices = spec["devices"].as_array().ok_or("devices is missing")?;
    if devices.is_empty() {
        return Err("devices is empty (a CDI spec needs at least one device)".into());
    }
    let mut seen = std::collections::HashSet::new();
    for (i, d) in devices.iter().enumerate() {
        let name = d["name"].as_str().ok_or_else(|| format!("devices[{i}].name is missing"))?;
        check_device_name(name)?;
        if !seen.insert(name) {
            return Err(format!("device {name:?} is listed twice"));
        }
        let edits = &d["containerEdits"];
        if edits
            .as_object()
            .is_none_or(|o| o.values().all(|v| v.is_null() || v.as_array().is_some_and(|a| a.is_empty())))
        {
            return Err(format!("device {name:?} has no container edits"));
        }
        check_edits(edits, &format!("device {name:?}"))?;
    }
    Ok(())
}

fn check_edits(e: &serde_json::Value, at: &str) -> Result<(), String> {
    if e.is_null() {
        return Ok(());
    }
    for (i, env) in e["env"].as_array().into_iter().flatten().enumerate() {
        if !env.as_str().is_some_and(|s| s.contains('=')) {
            return Err(format!("{at}: env[{i}] is not NAME=VALUE"));
        }
    }
    for (i, n) in e["deviceNodes"].as_array().into_iter().flatten().enumerate() {
        if !n["path"].as_str().is_some_and(|p| p.starts_with('/')) {
            return Err(format!("{at}: deviceNodes[{i}].path is not an absolute path"));
        }
        if let Some(t) = n["type"].as_str()
            && !matches!(t, "" | "b" | "c" | "u" | "p")
        {
            return Err(format!("{at}: deviceNodes[{i}].type {t:?} is not b, c, u or p"));
        }
        if let Some(p) = n["permissions"].as_str()
            && !p.chars().all(|c| matches!(c, 'r' | 'w' | 'm'))
        {
            return Err(format!("{at}: deviceNodes[{i}].permissions {p:?} is not made of r, w, m"));
        }
    }
    for (i, m) in e["mounts"].as_array().into_iter().flatten().enumerate() {
        if m["hostPath"].as_str().is_none_or(str::is_empty) || m["containerPath"].as_str().is_none_or(str::is_empty) {
            return Err(format!("{at}: mounts[{i}] needs hostPath and containerPath"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_follow_the_cdi_rules() {
        assert!(check_class_name("kvm").is_ok());
        assert!(check_class_name("gpu-a_1.x").is_ok());
        assert!(check_class_name("3dfx").unwrap_err().contains("must start with a letter"));
        assert!(check_class_name("kvm-").is_err());
        assert!(check_device_name("0").is_ok());
        assert!(check_device_name("3dfx:1").is_ok());
        assert!(check_device_name("nvidia0_card-1.2").is_ok());
        assert!(check_device_name(r"testdev\x201").unwrap_err().contains("'\\\\'"));
        assert!(check_device_name("a b").is_err());
        assert!(check_device_name("a,b").is_err());
        assert!(check_device_name("").is_err());
        assert!(check_device_name("-a").is_err());
        assert!(check_device_name("a.").is_err());
        assert!(check_vendor_name(VENDOR).is_ok());
    }

    fn good() -> serde_json::Value {
        json!({
            "cdiVersion": CDI_VERSION,
            "kind": "nodeplane.dev/kvm",
            "devices": [{"name": "kvm", "containerEdits": {"deviceNodes": [{"path": "/dev/kvm", "permissions": "rw"}]}}],
            "containerEdits": {"env": ["A=1"], "mounts": [{"hostPath": "/x", "containerPath": "/y", "options": ["ro", "bind"]}]},
        })
    }

    #[test]
    #[allow(clippy::type_complexity)] // a table of named mutations
    fn validation_catches_what_a_runtime_rejects() {
        assert_eq!(validate(&good()), Ok(()));
        let broken: Vec<(&str, Box<dyn Fn(&mut serde_json::Value)>)> = vec![
            ("version", Box::new(|s| s["cdiVersion"] = json!("9.9.9"))),
            ("kind", Box::new(|s| s["kind"] = json!("nodeplane.dev/3d"))),
            ("kind form", Box::new(|s| s["kind"] = json!("kvm"))),
            ("no devices", Box::new(|s| s["devices"] = json!([]))),
            ("device name", Box::new(|s| s["devices"][0]["name"] = json!(r"kvm\x20"))),
            (
                "twice",
                Box::new(|s| {
                    let d = s["devices"][0].clone();
                    s["devices"].as_array_mut().unwrap().push(d)
                }),
            ),
            ("empty edits", Box::new(|s| s["devices"][0]["containerEdits"] = json!({}))),
            (
                "relative node",
                Box::new(|s| s["devices"][0]["containerEdits"]["deviceNodes"][0]["path"] = json!("dev/kvm")),
            ),
            ("node type", Box::new(|s| s["devices"][0]["containerEdits"]["deviceNodes"][0]["type"] = json!("x"))),
            (
                "permissions",
                Box::new(|s| s["devices"][0]["containerEdits"]["deviceNodes"][0]["permissions"] = json!("rwx")),
            ),
            ("env", Box::new(|s| s["containerEdits"]["env"] = json!(["A"]))),
            ("mount", Box::new(|s| s["containerEdits"]["mounts"][0]["hostPath"] = json!(""))),
        ];
        for (what, f) in broken {
            let mut s = good();
            f(&mut s);
            assert!(validate(&s).is_err(), "{what}: {s}");
        }
    }
}
