//! A CDI (Container Device Interface) spec validator (test code), written from the CDI
//! specification's rules, for the specs the agent writes.
//!
//! Included from a test crate with
//! `#[path = "../tools/support/cdi_validate.rs"] mod cdi_validate;`.
//!
//! [`validate`] takes the text of one spec file (JSON) and checks what a CDI runtime
//! library checks before it uses a spec (any failure makes the runtime drop the whole file,
//! so every device in it stops resolving):
//!
//! * `cdiVersion`: a known released version, `0.3.0` ..= `1.1.0`; features newer than the
//!   version declared are refused (device names starting with a digit need `0.5.0`,
//!   `annotations` `0.6.0`, `additionalGids` / `intelRdt` `0.7.0`, `netDevices` `1.1.0`);
//! * `kind`: `<vendor>/<class>`; each part non-empty, first character an ASCII letter, last
//!   an ASCII letter or digit, the others ASCII letters, digits, `-`, `_` or `.`;
//! * `devices`: at least one; each `name` non-empty, made of ASCII letters, digits, `-`,
//!   `_`, `.`, `:`, first and last an ASCII letter or digit; names unique in the spec; each
//!   device's `containerEdits` present and not empty;
//! * container edits (the spec's and each device's): `env` entries `NAME=value` (a
//!   non-empty name before the first `=`); `deviceNodes` with a non-empty absolute `path`,
//!   `type` one of `""`, `b`, `c`, `u`, `p`, `permissions` made of `r`, `w`, `m`; `mounts`
//!   with non-empty `hostPath` and absolute `containerPath`; `hooks` with a known
//!   `hookName` and a non-empty `path`;
//! * no unknown fields in the spec, a device, container edits, a device node, a mount or a
//!   hook (a typo'd field silently does nothing in a lenient runtime).
//!
//! The errors name what is wrong (the device, the field) in a short message.

#![allow(dead_code)]

use serde_json::{Map, Value};

/// Released CDI spec versions, oldest first.
pub const VERSIONS: &[&str] = &["0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0"];

fn version_index(v: &str) -> Option<usize> {
    VERSIONS.iter().position(|k| *k == v)
}

/// `Ok` when `spec_json` is a valid CDI spec; otherwise why not.
pub fn validate(spec_json: &str) -> Result<(), String> {
    let v: Value = serde_json::from_str(spec_json).map_err(|e| format!("not JSON: {e}"))?;
    let spec = v.as_object().ok_or("the spec is not a JSON object")?;
    known_fields("spec", spec, &["cdiVersion", "kind", "annotations", "devices", "containerEdits"])?;

    let version = spec.get("cdiVersion").and_then(Value::as_str).ok_or("cdiVersion missing or not a string")?;
    let vi = version_index(version)
        .ok_or_else(|| format!("cdiVersion {version:?} is not a known CDI version ({VERSIONS:?})"))?;
    let needs = |feature: &str, min: &str| -> Result<(), String> {
        if vi < version_index(min).expect("known version") {
            Err(format!("{feature} needs cdiVersion {min} or later, the spec says {version}"))
        } else {
            Ok(())
        }
    };

    let kind = spec.get("kind").and_then(Value::as_str).ok_or("kind missing or not a string")?;
    let (vendor, class) = kind.split_once('/').ok_or_else(|| format!("kind {kind:?} is not <vendor>/<class>"))?;
    vendor_or_class_name(vendor).map_err(|e| format!("kind {kind:?}: vendor: {e}"))?;
    vendor_or_class_name(class).map_err(|e| format!("kind {kind:?}: class: {e}"))?;

    if let Some(a) = spec.get("annotations") {
        needs("annotations", "0.6.0")?;
        annotations("spec annotations", a)?;
    }
    if let Some(e) = spec.get("containerEdits") {
        container_edits("spec containerEdits", e, &needs)?;
    }

    let devices = spec.get("devices").ok_or("devices missing")?;
    let devices = devices.as_array().ok_or("devices is not a list")?;
    if devices.is_empty() {
        return Err("devices is empty (a spec needs at least one device)".into());
    }
    let mut seen = std::collections::BTreeSet::new();
    for (i, d) in devices.iter().enumerate() {
        let d = d.as_object().ok_or_else(|| format!("devices[{i}] is not an object"))?;
        known_fields(&format!("devices[{i}]"), d, &["name", "annotations", "containerEdits"])?;
        let name = d
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("devices[{i}]: name missing or not a string"))?;
        device_name(name).map_err(|e| format!("devices[{i}]: {e}"))?;
        if name.as_bytes()[0].is_ascii_digit() {
            needs(&format!("device name {name:?} (starts with a digit)"), "0.5.0")?;
        }
        if !seen.insert(name) {
            return Err(format!("devices[{i}]: device name {name:?} is used twice"));
        }
        if let Some(a) = d.get("annotations") {
            needs("annotations", "0.6.0")?;
            annotations(&format!("device {name:?} annotations"), a)?;
        }
        let what = format!("device {name:?} containerEdits");
        let edits = d.get("containerEdits").ok_or_else(|| format!("{what}: missing"))?;
        if container_edits(&what, edits, &needs)? == 0 {
            return Err(format!("{what}: empty (a device must edit the container)"));
        }
    }
    Ok(())
}

fn known_fields(what: &str, o: &Map<String, Value>, known: &[&str]) -> Result<(), String> {
    for k in o.keys() {
        if !known.contains(&k.as_str()) {
            return Err(format!("{what}: unknown field {k:?}"));
        }
    }
    Ok(())
}

/// A vendor or class name of `kind`.
pub fn vendor_or_class_name(n: &str) -> Result<(), String> {
    let b = n.as_bytes();
    if b.is_empty() {
        return Err("empty name".into());
    }
    if !b[0].is_ascii_alphabetic() {
        return Err(format!("{n:?} must start with an ASCII letter"));
    }
    if !b[b.len() - 1].is_ascii_alphanumeric() {
        return Err(format!("{n:?} must end with an ASCII letter or digit"));
    }
    if let Some(c) = n.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))) {
        return Err(format!("{n:?} contains {c:?} (allowed: ASCII letters, digits, '-', '_', '.')"));
    }
    Ok(())
}

/// A device name.
pub fn device_name(n: &str) -> Result<(), String> {
    let b = n.as_bytes();
    if b.is_empty() {
        return Err("empty device name".into());
    }
    if !b[0].is_ascii_alphanumeric() {
        return Err(format!("device name {n:?} must start with an ASCII letter or digit"));
    }
    if !b[b.len() - 1].is_ascii_alphanumeric() {
        return Err(format!("device name {n:?} must end with an ASCII letter or digit"));
    }
    if let Some(c) = n.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))) {
        return Err(format!("device name {n:?} contains {c:?} (allowed: ASCII letters, digits, '-', '_', '.', ':')"));
    }
    Ok(())
}

fn annotations(what: &str, a: &Value) -> Result<(), String> {
    let o = a.as_object().ok_or_else(|| format!("{what}: not an object"))?;
    for (k, v) in o {
        if k.is_empty() {
            return Err(format!("{what}: empty key"));
        }
        if !v.is_string() {
            return Err(format!("{what}: {k:?} is not a string"));
        }
    }
    Ok(())
}

fn str_field<'a>(what: &str, o: &'a Map<String, Value>, k: &str) -> Result<Option<&'a str>, String> {
    match o.get(k) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(format!("{what}: {k} is not a string")),
    }
}

fn list<'a>(what: &str, o: &'a Map<String, Value>, k: &str) -> Result<&'a [Value], String> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(a)) => Ok(a),
        Some(_) => Err(format!("{what}: {k} is not a list")),
    }
}

/// Checks container edits; returns how many edits they make.
fn container_edits(what: &str, e: &Value, needs: &dyn Fn(&str, &str) -> Result<(), String>) -> Result<usize, String> {
    let o = e.as_object().ok_or_else(|| format!("{what}: not an object"))?;
    known_fields(what, o, &["env", "deviceNodes", "hooks", "mounts", "intelRdt", "additionalGids", "netDevices"])?;
    let mut n = 0;

    let env = list(what, o, "env")?;
    for (i, v) in env.iter().enumerate() {
        let s = v.as_str().ok_or_else(|| format!("{what}: env[{i}] is not a string"))?;
        match s.split_once('=') {
            Some((k, _)) if !k.is_empty() => {}
            _ => return Err(format!("{what}: env[{i}] {s:?} is not NAME=value")),
        }
    }
    n += env.len();

    let nodes = list(what, o, "deviceNodes")?;
    for (i, v) in nodes.iter().enumerate() {
        let w = format!("{what}: deviceNodes[{i}]");
        let d = v.as_object().ok_or_else(|| format!("{w}: not an object"))?;
        known_fields(&w, d, &["path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"])?;
        let path = str_field(&w, d, "path")?.unwrap_or("");
        if path.is_empty() {
            return Err(format!("{w}: path missing or empty"));
        }
        if !path.starts_with('/') {
            return Err(format!("{w}: path {path:?} is not absolute"));
        }
        if let Some(h) = str_field(&w, d, "hostPath")?
            && !h.is_empty()
            && !h.starts_with('/')
        {
            return Err(format!("{w}: hostPath {h:?} is not absolute"));
        }
        if let Some(t) = str_field(&w, d, "type")?
            && !matches!(t, "" | "b" | "c" | "u" | "p")
        {
            return Err(format!("{w}: type {t:?} is not one of \"\", b, c, u, p"));
        }
        if let Some(p) = str_field(&w, d, "permissions")?
            && let Some(c) = p.chars().find(|c| !matches!(c, 'r' | 'w' | 'm'))
        {
            return Err(format!("{w}: permissions {p:?} contains {c:?} (allowed: r, w, m)"));
        }
        for k in ["major", "minor", "fileMode", "uid", "gid"] {
            if let Some(x) = d.get(k) {
                let ok = if k == "major" || k == "minor" { x.is_i64() || x.is_u64() } else { x.is_u64() };
                if !ok {
                    return Err(format!("{w}: {k} is not an integer (non-negative for {k})"));
                }
            }
        }
    }
    n += nodes.len();

    let mounts = list(what, o, "mounts")?;
    for (i, v) in mounts.iter().enumerate() {
        let w = format!("{what}: mounts[{i}]");
        let m = v.as_object().ok_or_else(|| format!("{w}: not an object"))?;
        known_fields(&w, m, &["hostPath", "containerPath", "options", "type"])?;
        if str_field(&w, m, "hostPath")?.unwrap_or("").is_empty() {
            return Err(format!("{w}: hostPath missing or empty"));
        }
        let cp = str_field(&w, m, "containerPath")?.unwrap_or("");
        if cp.is_empty() {
            return Err(format!("{w}: containerPath missing or empty"));
        }
        if !cp.starts_with('/') {
            return Err(format!("{w}: containerPath {cp:?} is not absolute"));
        }
        for (j, opt) in list(&w, m, "options")?.iter().enumerate() {
            if !opt.is_string() {
                return Err(format!("{w}: options[{j}] is not a string"));
            }
        }
    }
    n += mounts.len();

    let hooks = list(what, o, "hooks")?;
    for (i, v) in hooks.iter().enumerate() {
        let w = format!("{what}: hooks[{i}]");
        let h = v.as_object().ok_or_else(|| format!("{w}: not an object"))?;
        known_fields(&w, h, &["hookName", "path", "args", "env", "timeout"])?;
        let name = str_field(&w, h, "hookName")?.unwrap_or("");
        if !matches!(
            name,
            "prestart" | "createRuntime" | "createContainer" | "startContainer" | "poststart" | "poststop"
        ) {
            return Err(format!("{w}: hookName {name:?} is not an OCI hook"));
        }
        if str_field(&w, h, "path")?.unwrap_or("").is_empty() {
            return Err(format!("{w}: path missing or empty"));
        }
    }
    n += hooks.len();

    if o.get("additionalGids").is_some_and(|g| !g.is_null()) {
        needs("additionalGids", "0.7.0")?;
        let g = list(what, o, "additionalGids")?;
        if g.iter().any(|x| !x.is_u64()) {
            return Err(format!("{what}: additionalGids must be numbers"));
        }
        n += g.len();
    }
    if o.get("intelRdt").is_some_and(|g| !g.is_null()) {
        needs("intelRdt", "0.7.0")?;
        n += 1;
    }
    if o.get("netDevices").is_some_and(|g| !g.is_null()) {
        needs("netDevices", "1.1.0")?;
        let nd = list(what, o, "netDevices")?;
        for (i, v) in nd.iter().enumerate() {
            let ok = v.get("hostInterfaceName").and_then(Value::as_str).is_some_and(|s| !s.is_empty())
                && v.get("name").and_then(Value::as_str).is_some_and(|s| !s.is_empty());
            if !ok {
                return Err(format!("{what}: netDevices[{i}] needs hostInterfaceName and name"));
            }
        }
        n += nd.len();
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::validate;
    use serde_json::{Value, json};

    /// A spec like the agent's: one device per node, env and a mount at the top.
    fn good() -> Value {
        json!({
            "cdiVersion": "0.6.0",
            "kind": "nodeplane.dev/testdev",
            "devices": [
                {"name": "testdev0", "containerEdits": {"deviceNodes": [{"path": "/dev/testdev0", "hostPath": "/dev/testdev0", "permissions": "rw"}]}},
                {"name": "testdev1", "containerEdits": {"deviceNodes": [{"path": "/dev/testdev1", "type": "c", "permissions": "rwm"}]}},
            ],
            "containerEdits": {
                "env": ["TESTDEV_MODE=fast"],
                "mounts": [{"hostPath": "/lib/x", "containerPath": "/usr/lib/x", "options": ["ro", "bind"]}],
            },
        })
    }

    fn check(v: &Value) -> Result<(), String> {
        validate(&v.to_string())
    }

    fn refused(v: Value, what: &str) {
        let r = check(&v);
        assert!(r.is_err(), "{what}: the validator accepted\n{v:#}");
    }

    #[test]
    fn accepts_valid_specs() {
        check(&good()).unwrap();
        for version in super::VERSIONS {
            let mut v = good();
            v["cdiVersion"] = json!(version);
            v["devices"][0]["name"] = json!("a");
            v.as_object_mut().unwrap().remove("annotations");
            check(&v).unwrap_or_else(|e| panic!("version {version}: {e}"));
        }
        let mut v = good();
        v["kind"] = json!("vendor.example.com/gpu_x-1.y");
        v["devices"][0]["name"] = json!("0:abc_d-e.f");
        v["devices"][1]["containerEdits"] = json!({"env": ["A="]});
        v["annotations"] = json!({"a": "b"});
        check(&v).unwrap();
        // No top-level edits is fine; a device with only a mount is fine.
        let mut v = good();
        v.as_object_mut().unwrap().remove("containerEdits");
        v["devices"][1]["containerEdits"] = json!({"mounts": [{"hostPath": "/a", "containerPath": "/b"}]});
        check(&v).unwrap();
        let mut v = good();
        v["devices"][0]["containerEdits"]["deviceNodes"][0]["type"] = json!("");
        v["devices"][0]["containerEdits"]["deviceNodes"][0]["major"] = json!(1);
        v["devices"][0]["containerEdits"]["deviceNodes"][0]["minor"] = json!(3);
        check(&v).unwrap();
    }

    #[test]
    fn refuses_invalid_specs() {
        refused(json!([]), "not an object");
        assert!(validate("{").is_err(), "not JSON");
        let mut v = good();
        v.as_object_mut().unwrap().remove("cdiVersion");
        refused(v, "no cdiVersion");
        for bad in ["0.2.0", "1.2.0", "0.6", "v0.6.0", ""] {
            let mut v = good();
            v["cdiVersion"] = json!(bad);
            refused(v, &format!("cdiVersion {bad:?}"));
        }
        let mut v = good();
        v["cdiVersion"] = json!(0.6);
        refused(v, "cdiVersion a number");
        for bad in [
            "nodeplane.dev/3dfx",
            "nodeplane.dev/",
            "/testdev",
            "testdev",
            "nodeplane.dev/test dev",
            "nodeplane.dev/testdev-",
            "nodeplane.dev/-testdev",
            "1nodeplane.dev/testdev",
            "nodeplane.dev/a/b",
            "nodeplane.dev/tést",
            "nodeplane.dev./x",
        ] {
            let mut v = good();
            v["kind"] = json!(bad);
            refused(v, &format!("kind {bad:?}"));
        }
        for bad in ["", "testdev\\x201", "test dev", "-a", "a-", "a/b", "a=b", "é", "a:"] {
            let mut v = good();
            v["devices"][0]["name"] = json!(bad);
            refused(v, &format!("device name {bad:?}"));
        }
        let mut v = good();
        v["cdiVersion"] = json!("0.4.0");
        v.as_object_mut().unwrap().remove("annotations");
        v["devices"][0]["name"] = json!("0abc");
        refused(v, "a digit-first device name before 0.5.0");
        let mut v = good();
        v["cdiVersion"] = json!("0.5.0");
        v["annotations"] = json!({"a": "b"});
        refused(v, "annotations before 0.6.0");
        let mut v = good();
        v["devices"][1]["name"] = json!("testdev0");
        refused(v, "duplicate device names");
        let mut v = good();
        v["devices"] = json!([]);
        refused(v, "no devices");
        let mut v = good();
        v.as_object_mut().unwrap().remove("devices");
        refused(v, "devices missing");
        let mut v = good();
        v["devices"][0].as_object_mut().unwrap().remove("containerEdits");
        refused(v, "a device without containerEdits");
        let mut v = good();
        v["devices"][0]["containerEdits"] = json!({});
        refused(v, "a device with empty containerEdits");
        let mut v = good();
        v["devices"][0]["containerEdits"] = json!({"env": [], "deviceNodes": []});
        refused(v, "a device with empty lists only");
        for (k, bad) in [
            ("path", json!("")),
            ("path", json!("dev/x")),
            ("type", json!("x")),
            ("permissions", json!("rwx")),
            ("hostPath", json!("rel")),
        ] {
            let mut v = good();
            v["devices"][0]["containerEdits"]["deviceNodes"][0][k] = bad.clone();
            refused(v, &format!("deviceNodes {k} {bad}"));
        }
        let mut v = good();
        v["devices"][0]["containerEdits"]["deviceNodes"][0].as_object_mut().unwrap().remove("path");
        refused(v, "a device node without a path");
        let mut v = good();
        v["containerEdits"]["env"] = json!(["NOEQUALS"]);
        refused(v, "env without '='");
        let mut v = good();
        v["containerEdits"]["env"] = json!(["=x"]);
        refused(v, "env with an empty name");
        let mut v = good();
        v["containerEdits"]["mounts"][0].as_object_mut().unwrap().remove("hostPath");
        refused(v, "a mount without hostPath");
        let mut v = good();
        v["containerEdits"]["mounts"][0].as_object_mut().unwrap().remove("containerPath");
        refused(v, "a mount without containerPath");
        let mut v = good();
        v["containerEdits"]["hooks"] = json!([{"hookName": "beforeAll", "path": "/bin/true"}]);
        refused(v, "an unknown hook");
        let mut v = good();
        v["devices"][0]["containerEdits"]["devicenodes"] = json!([]);
        refused(v, "an unknown field in containerEdits");
        let mut v = good();
        v["kinds"] = json!("x");
        refused(v, "an unknown top-level field");
        let mut v = good();
        v["devices"][0]["containerEdits"]["netDevices"] = json!([{"hostInterfaceName": "eth0", "name": "eth1"}]);
        refused(v, "netDevices before 1.1.0");
    }
}
