//! Root-only: device assignments survive an agent restart, a crash and an upgrade.
//!
//! Issue requirement: running pods' device assignments are untouched by an agent restart or
//! upgrade. Kubelet keeps its assignments (device ids) across a plugin restart and expects
//! the plugin to come back with the same ids; a container being created after the restart
//! asks Allocate for those ids, and the runtime resolves CDI names from the spec files. So
//! for each of SIGTERM + start ("restart"), SIGKILL + start ("crash") and a different copy
//! of the agent binary ("upgrade"), against the kubelet emulator
//! (`tools/support/kubelet_devices.rs`) with mknod'd device nodes:
//!
//! * the plugin registers again and lists exactly the same ids, all healthy;
//! * Allocate for the ids assigned before answers exactly what it answered before;
//! * the CDI spec file is never missing or different while the agent restarts (a reader
//!   polls it throughout) and is byte-identical afterwards.
//!
//! Sandbox: `/tmp/npdr-<pid>` (short: socket paths), removed on drop, the agent (in its own
//! network namespace, `unshare --net`) killed by PID on drop. Needs root; FAILS without it.

use crate::kubelet_emulator;

use std::collections::BTreeSet;
use std::fs::{self, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kubelet_emulator::{HEALTHY, KubeletEmulator, Resource};
use nix::sys::signal::{Signal, kill};
use nix::sys::stat::{Mode, SFlag, makedev, mknod};
use nix::unistd::Pid;
use serde_json::json;

const AGENT: &str = env!("CARGO_BIN_EXE_nodeplane-agent");
const RES: &str = "nodeplane.dev/rolldev";
const STARTUP: Duration = Duration::from_secs(20);

struct Sandbox {
    dir: PathBuf,
    agent: Option<Child>,
    kl: KubeletEmulator,
}

impl Sandbox {
    fn new() -> Sandbox {
        assert_eq!(
            nix::unistd::geteuid().as_raw(),
            0,
            "tests/deviceplugin_restart_root.rs needs root (network namespace, mknod). It does not skip."
        );
        let dir = PathBuf::from(format!("/tmp/npdr-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("dev")).unwrap();
        for i in 0..3 {
            let node = dir.join(format!("dev/rolldev{i}"));
            mknod(&node, SFlag::S_IFCHR, Mode::from_bits_truncate(0o666), makedev(1, 3))
                .unwrap_or_else(|e| panic!("mknod {}: {e}", node.display()));
        }
        let devices = json!({"resources": [{
            "name": "rolldev",
            "devices": [format!("{}/dev/rolldev*", dir.display())],
            "env": {"ROLLDEV": "1"},
            "cdi": true,
        }]});
        fs::write(dir.join("devices.json"), devices.to_string()).unwrap();
        let kl = KubeletEmulator::new(&dir.join("root/var/lib/kubelet"));
        let sb = Sandbox { dir, agent: None, kl };
        sb.write_config(Path::new(crate::shim()));
        sb
    }

    fn write_config(&self, shim: &Path) {
        let cfg = json!({
            "nodeName": "dp-rollout",
            "root": self.dir.join("root"),
            "shimSource": shim,
            "csi": {"enabled": false},
            "devicePlugins": {"configFile": self.dir.join("devices.json"), "cdiDir": self.dir.join("cdi")},
        });
        fs::write(self.dir.join("agent.json"), serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    }

    fn cdi_file(&self) -> PathBuf {
        self.dir.join("cdi/nodeplane.dev-rolldev.json")
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    fn start_agent(&mut self, binary: &Path) {
        assert!(self.agent.is_none(), "agent already running");
        let log = OpenOptions::new().create(true).append(true).open(self.dir.join("agent.log")).unwrap();
        let child = Command::new("unshare")
            .arg("--net")
            .arg("--")
            .arg(binary)
            .arg("--config")
            .arg(self.dir.join("agent.json"))
            .env_remove("NODEPLANE_CRASH_AT")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting the agent");
        self.agent = Some(child);
    }

    /// SIGTERM (must exit cleanly) or SIGKILL; returns when the agent is gone.
    async fn stop_agent(&mut self, sig: Signal) {
        let mut c = self.agent.take().expect("agent running");
        kill(Pid::from_raw(c.id() as i32), sig).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                if sig == Signal::SIGTERM {
                    assert!(st.success(), "agent exited with {st} on SIGTERM:\n{}", self.log());
                }
                return;
            }
            if Instant::now() >= deadline {
                let _ = c.kill();
                let _ = c.wait();
                panic!("agent did not exit on {sig} within 20 s:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn registered(&mut self, n: u32) -> Resource {
        let deadline = Instant::now() + STARTUP;
        loop {
            match self
                .kl
                .wait_for(RES, Duration::from_millis(200), |r| {
                    r.registrations >= n && r.messages_this_registration >= 1
                })
                .await
            {
                Ok(r) => return r,
                Err(state) => {
                    if let Some(st) = self.agent.as_mut().and_then(|c| c.try_wait().unwrap()) {
                        panic!("the agent exited ({st}):\n{state}\n{}", self.log());
                    }
                    assert!(
                        Instant::now() < deadline,
                        "registration #{n} of {RES}: not within {STARTUP:?}\n{state}\n{}",
                        self.log()
                    );
                }
            }
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if let Some(mut c) = self.agent.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn listed(r: &Resource) -> Vec<(String, String)> {
    let mut v: Vec<_> = r.devices.iter().map(|d| (d.id.clone(), d.health.clone())).collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_assignments_survive_restart_crash_and_upgrade() {
    let mut sb = Sandbox::new();
    sb.kl.start().await;
    sb.start_agent(Path::new(AGENT));
    let first = sb.registered(1).await;
    let devices = listed(&first);
    assert_eq!(
        devices.iter().map(|(id, _)| id.as_str()).collect::<BTreeSet<_>>(),
        BTreeSet::from(["rolldev0", "rolldev1", "rolldev2"]),
        "{devices:?}"
    );
    assert!(devices.iter().all(|(_, h)| h == HEALTHY), "{devices:?}");
    // Kubelet's assignment: container 0 got rolldev1, container 1 rolldev0 + rolldev2.
    let assigned = vec![vec!["rolldev1".to_string()], vec!["rolldev0".to_string(), "rolldev2".to_string()]];
    let answer = sb.kl.allocate(RES, assigned.clone()).await.unwrap_or_else(|e| panic!("Allocate: {e}\n{}", sb.log()));
    assert_eq!(answer.container_responses.len(), 2);
    let cdi =
        fs::read(sb.cdi_file()).unwrap_or_else(|e| panic!("CDI spec {}: {e}\n{}", sb.cdi_file().display(), sb.log()));

    // A reader that watches the CDI spec for the whole test.
    let stop = Arc::new(AtomicBool::new(false));
    let poller = {
        let (stop, path, want) = (stop.clone(), sb.cdi_file(), cdi.clone());
        std::thread::spawn(move || {
            let (mut polls, mut missing, mut different) = (0u64, 0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                match fs::read(&path) {
                    Ok(b) if b == want => {}
                    Ok(_) => different += 1,
                    Err(_) => missing += 1,
                }
                polls += 1;
                std::thread::sleep(Duration::from_micros(500));
            }
            (polls, missing, different)
        })
    };

    // The upgrade: another copy of the agent binary, with a shim that differs, side by side.
    let upgrade = sb.dir.join("upgrade");
    fs::create_dir_all(&upgrade).unwrap();
    fs::copy(AGENT, upgrade.join("nodeplane-agent")).unwrap();
    let mut shim = fs::read(crate::shim()).unwrap();
    shim.extend_from_slice(b"\0upgrade");
    fs::write(upgrade.join("nodeplane-cni"), shim).unwrap();

    let mut figures = Vec::new();
    for (round, (mode, sig)) in
        [("restart", Signal::SIGTERM), ("crash", Signal::SIGKILL), ("upgrade", Signal::SIGTERM)].into_iter().enumerate()
    {
        let t0 = Instant::now();
        sb.stop_agent(sig).await;
        let binary = if mode == "upgrade" {
            sb.write_config(&upgrade.join("nodeplane-cni"));
            upgrade.join("nodeplane-agent")
        } else {
            PathBuf::from(AGENT)
        };
        sb.start_agent(&binary);
        let r = sb.registered(round as u32 + 2).await;
        let took = t0.elapsed();
        assert_eq!(listed(&r), devices, "{mode}: the plugin came back with another list");
        assert_eq!(r.endpoint, first.endpoint, "{mode}: endpoint");
        assert!(r.streaming, "{mode}: ListAndWatch stream ended: {:?}", r.stream_end);
        let again = sb
            .kl
            .allocate(RES, assigned.clone())
            .await
            .unwrap_or_else(|e| panic!("{mode}: Allocate: {e}\n{}", sb.log()));
        assert_eq!(again, answer, "{mode}: Allocate for the assigned ids answers differently");
        assert_eq!(fs::read(sb.cdi_file()).unwrap(), cdi, "{mode}: CDI spec changed");
        figures.push((mode, took));
    }
    stop.store(true, Ordering::Relaxed);
    let (polls, missing, different) = poller.join().unwrap();
    for (mode, took) in &figures {
        println!("{mode:8}: stop + start + re-registration with the same list in {:.1} ms", took.as_secs_f64() * 1e3);
    }
    println!("CDI spec polled {polls} times: missing {missing}, different {different}");
    assert!(polls > 20, "the poller barely ran ({polls})");
    assert_eq!((missing, different), (0, 0), "the CDI spec was missing or different while the agent restarted");
    assert!(sb.kl.failures().is_empty(), "kubelet refused registrations:\n{}", sb.kl.describe());
    for (name, r) in sb.kl.resources() {
        assert!(r.protocol_errors.is_empty(), "{name}: protocol errors {:?}", r.protocol_errors);
    }
    sb.stop_agent(Signal::SIGTERM).await;
    sb.kl.stop().await;
}
