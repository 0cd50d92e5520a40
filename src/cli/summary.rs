//! The human summaries of `nodeplane status` and `nodeplane doctor`, read from the JSON
//! documents of `document` (the JSON is the complete answer).

use serde_json::Value;
use std::fmt::Write;

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        v => v.to_string(),
    }
}

fn list(v: &Value) -> String {
    match v.as_array() {
        Some(a) if !a.is_empty() => a.iter().map(s).collect::<Vec<_>>().join(", "),
        _ => "-".into(),
    }
}

fn mib(v: &Value) -> String {
    format!("{} MiB", v.as_u64().unwrap_or(0) >> 20)
}

/// Rows as aligned columns.
fn table(out: &mut String, head: &[&str], rows: Vec<Vec<String>>) {
    let mut w: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.len());
        }
    }
    let line = |cells: Vec<String>| {
        let mut l = String::from("   ");
        for (i, c) in cells.iter().enumerate() {
            let _ = write!(l, " {:<width$}", c, width = w[i]);
        }
        l.trim_end().to_string() + "\n"
    };
    out.push_str(&line(head.iter().map(|h| h.to_string()).collect()));
    for r in rows {
        out.push_str(&line(r));
    }
}

/// The summary of `nodeplane status`, read from its JSON document (`document::status`).
pub fn status(d: &Value) -> String {
    let mut o = String::new();
    let _ =
        writeln!(o, "node {} ({} mode), agent {} pid {}", s(&d["node"]), s(&d["mode"]), s(&d["version"]), s(&d["pid"]));
    let conds: Vec<String> = d["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let state =
                if c["ready"] == true { "ready".to_string() } else { format!("NOT READY ({})", s(&c["detail"])) };
            format!("{} {state}", s(&c["name"]))
        })
        .collect();
    let _ = writeln!(o, "conditions: {}", if conds.is_empty() { "-".into() } else { conds.join("; ") });
    let k = &d["kernel"];
    if k.is_object() {
        let lacking: Vec<String> = k["features"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|f| f["state"] != "available")
            .map(|f| format!("{} {} ({})", s(&f["name"]), s(&f["state"]).to_uppercase(), s(&f["detail"])))
            .collect();
        let all = k["features"].as_array().map_or(0, |a| a.len());
        let _ = writeln!(
            o,
            "kernel: {}, {} of {all} features probed available{}",
            s(&k["release"]),
            all - lacking.len(),
            if lacking.is_empty() { String::new() } else { format!("; {}", lacking.join("; ")) }
        );
    }
    let c = &d["controller"];
    if c.is_object() {
        let last =
            c["lastMessageSecondsAgo"].as_f64().map(|t| format!("{t:.1}s ago")).unwrap_or_else(|| "never".into());
        let _ = writeln!(
            o,
            "controller: {} {}, last message {last}; blocks {}",
            s(&c["address"]),
            if c["connected"] == true { "connected" } else { "NOT CONNECTED" },
            list(&c["blocks"])
        );
        let w = &c["wireguard"];
        if w.is_object() {
            let peers = w["peers"].as_array().map(Vec::as_slice).unwrap_or_default();
            let shaken = peers.iter().filter(|p| p["lastHandshakeUnix"].as_i64().unwrap_or(0) > 0).count();
            let _ = writeln!(
                o,
                "encryption: {}, key {}, {} peer(s), {shaken} with a handshake{}",
                s(&c["encryption"]),
                s(&w["publicKey"]),
                peers.len(),
                match w["error"].as_str() {
                    Some(e) if !e.is_empty() => format!("; DEVICE ERROR: {e}"),
                    _ => String::new(),
                }
            );
        }
    }
    let n = &d["network"];
    let b = &n["bridge"];
    let _ = writeln!(
        o,
        "network: bridge {} {}{}",
        s(&b["name"]),
        if b["up"] == true {
            "up"
        } else if b["present"] == true {
            "DOWN"
        } else {
            "MISSING"
        },
        if n["ready"] == true { "" } else { ", not ready for ADD (no block yet)" }
    );
    for blk in n["blocks"].as_array().into_iter().flatten() {
        // An IPv6 /64 has 2^64 - 2 addresses: its use is the count of leases.
        let size: Option<u128> = blk["addresses"].as_str().and_then(|a| a.parse().ok());
        let of = match size {
            Some(n) if n < 1 << 32 => format!(" of {n}"),
            _ => String::new(),
        };
        let _ = writeln!(
            o,
            "    block {} gateway {}: {}{of} addresses leased",
            s(&blk["cidr"]),
            s(&blk["gateway"]),
            s(&blk["allocated"])
        );
    }
    let rows: Vec<Vec<String>> = n["attachments"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| {
            let mut problems = Vec::new();
            if a["state"] != "ready" {
                problems.push("ADD in progress");
            }
            if a["netnsPresent"] == false {
                problems.push("netns gone");
            }
            if a["hostIfPresent"] == false {
                problems.push("veth gone");
            } else if a["hostIfOnBridge"] == false {
                problems.push("veth off bridge");
            }
            // Runtimes' 64-hex ids are told apart by their first 12 characters; shorter
            // ids are shown whole.
            let cid = s(&a["containerId"]);
            let cid: String = if cid.chars().count() > 24 { cid.chars().take(12).collect() } else { cid };
            vec![
                format!("{cid}/{}", s(&a["ifname"])),
                if a["pod"] == "" { "-".into() } else { s(&a["pod"]) },
                list(&a["ips"]),
                s(&a["hostIf"]),
                if problems.is_empty() { "ok".into() } else { problems.join(", ") },
            ]
        })
        .collect();
    let _ = writeln!(o, "  {} attachments", rows.len());
    if !rows.is_empty() {
        table(&mut o, &["ATTACHMENT", "POD", "ADDRESSES", "HOST VETH", "STATE"], rows);
    }
    let stray = list(&n["unleasedHostVeths"]);
    if stray != "-" {
        let _ = writeln!(o, "  host veths without a lease: {stray} (nodeplane doctor)");
    }
    let st = &d["storage"];
    if st.is_object() {
        let vols = st["volumes"].as_array().cloned().unwrap_or_default();
        let _ = writeln!(
            o,
            "storage: {} volumes, {} of {} provisioned, {} available{}",
            vols.len(),
            mib(&st["provisionedBytes"]),
            mib(&st["capacityBytes"]),
            mib(&st["availableBytes"]),
            if st["ready"] == true { "" } else { " (recovery running)" }
        );
        let rows: Vec<Vec<String>> = vols
            .iter()
            .map(|v| {
                let loops: Vec<String> =
                    v["loopDevices"].as_array().into_iter().flatten().map(|l| s(&l["device"])).collect();
                let staged = match &v["staged"] {
                    Value::Null => "-".to_string(),
                    x => format!("{}{}", s(&x["state"]), if x["mounted"] == true { "" } else { " (not mounted)" }),
                };
                let published = v["published"].as_array().map(|p| p.len()).unwrap_or(0);
                vec![
                    s(&v["id"]),
                    mib(&v["sizeBytes"]),
                    if v["fsType"] == "" { "block".into() } else { s(&v["fsType"]) },
                    if v["backingFilePresent"] == true { "present".into() } else { "MISSING".into() },
                    if loops.is_empty() { "-".into() } else { loops.join(",") },
                    staged,
                    published.to_string(),
                ]
            })
            .collect();
        if !rows.is_empty() {
            table(&mut o, &["VOLUME", "SIZE", "FS", "FILE", "LOOP", "STAGED", "PUBLISHED"], rows);
        }
        for v in &vols {
            for p in v["published"].as_array().into_iter().flatten() {
                let _ = writeln!(
                    o,
                    "    {} published at {}{}{}",
                    s(&v["id"]),
                    s(&p["path"]),
                    if p["readOnly"] == true { " (read-only)" } else { "" },
                    if p["mounted"] == true { "" } else { " (NOT MOUNTED)" }
                );
            }
        }
    }
    if let Some(res) = d["devicePlugins"].as_array() {
        let _ = writeln!(o, "device plugins: {} resources", res.len());
        for r in res {
            let devs: Vec<String> = r["devices"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|x| format!("{} {}", s(&x["id"]), s(&x["health"])))
                .collect();
            let _ = writeln!(
                o,
                "    {}: {}",
                s(&r["resource"]),
                if devs.is_empty() { "no devices".into() } else { devs.join(", ") }
            );
        }
    }
    if d["services"].is_object() {
        let v = &d["services"];
        let ports = v["ports"].as_array().cloned().unwrap_or_default();
        let state = match v["idle"].as_str() {
            Some(why) => format!("NOT SERVED: {why}"),
            None if v["synced"] == true => format!("revision {}", v["revision"]),
            None => "waiting for the controller".into(),
        };
        let _ = writeln!(o, "services: {} ports, {state}", ports.len());
        for p in &ports {
            let ips: Vec<String> = [&p["clusterIPs"], &p["externalIPs"]]
                .iter()
                .flat_map(|a| a.as_array().cloned().unwrap_or_default())
                .map(|ip| s(&ip))
                .collect();
            let node_port =
                p["nodePort"].as_u64().filter(|n| *n > 0).map(|n| format!(" nodePort {n}")).unwrap_or_default();
            let _ = writeln!(
                o,
                "    {} {} port {}{node_port}: {} endpoints ({} usable, {} here)",
                s(&p["id"]),
                ips.join(","),
                p["port"],
                p["endpoints"],
                p["usable"],
                p["local"]
            );
        }
    }
    let plugins = d["kubelet"]["plugins"].as_array().cloned().unwrap_or_default();
    if !plugins.is_empty() {
        let _ = writeln!(o, "kubelet:");
        for p in &plugins {
            let what = match p["state"].as_str() {
                Some("registered") => format!("registered with kubelet at {}", utc(&p["registeredUnix"])),
                Some(st) => format!(
                    "NOT REGISTERED with kubelet ({st}{}) since {}{}",
                    p["error"].as_str().map(|e| format!(": {e}")).unwrap_or_default(),
                    utc(&p["sinceUnix"]),
                    if p["overdue"] == true { ", overdue" } else { "" }
                ),
                None => "unknown".into(),
            };
            let _ = writeln!(o, "    {} {}: {what}", s(&p["kind"]), s(&p["name"]));
        }
    }
    o
}

/// A Unix time (seconds) as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc(v: &Value) -> String {
    match v.as_f64().filter(|t| t.is_finite() && *t >= 0.0) {
        Some(t) => crate::util::utc_rfc3339(t as i64),
        None => "-".into(),
    }
}

/// The summary of `nodeplane doctor`, read from its JSON document (`document::doctor`).
pub fn doctor(d: &Value) -> String {
    let mut o = String::new();
    let findings = d["findings"].as_array().cloned().unwrap_or_default();
    let _ = writeln!(
        o,
        "node {}: {} findings{}",
        s(&d["node"]),
        findings.len(),
        if d["repair"] == true { " (repair asked for)" } else { "" }
    );
    for f in &findings {
        let _ = writeln!(o, "  {} {}: {}", s(&f["kind"]), s(&f["subject"]), s(&f["detail"]));
        if f["repair"].is_object() {
            let _ = writeln!(o, "      repair {}: {}", s(&f["repair"]["result"]), s(&f["repair"]["message"]));
        }
    }
    for e in d["errors"].as_array().into_iter().flatten() {
        let _ = writeln!(o, "  error: {}", s(e));
    }
    if !findings.is_empty() && d["repair"] != true {
        let _ = writeln!(o, "run `nodeplane doctor --repair` to remove what can be removed safely");
    }
    o
}
