//! The benchmark drivers of `scripts/bench-*`, linked as one binary.
//!
//!     benches TOOL [ARGS...]      TOOL: csi_bench, snapshot_bench, deviceplugin_bench,
//!                                 dra_bench, policy_bench, provision_load, register_load,
//!                                 scale_load, services_bench
//!
//! One binary, not nine: CI compiles these (the bench scripts run them, and
//! `integration/test_scale.py` runs scale_load), and every binary is linked with the release
//! profile's thin LTO over all of the dependencies, about 30 s each on two cores. Each tool
//! reads its arguments from `std::env::args()` as its own program did, so `benches TOOL ARGS`
//! runs itself again with `TOOL` as argv[0] and `ARGS` after it.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use nix::sys::stat::{Mode, SFlag, makedev, mknod};
use nodeplane::rpc::csi;
use nodeplane::rpc::csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode};

#[path = "csi_bench.rs"]
mod csi_bench;
#[path = "deviceplugin_bench.rs"]
mod deviceplugin_bench;
#[path = "dra_bench.rs"]
mod dra_bench;
#[path = "policy_bench.rs"]
mod policy_bench;
#[path = "provision_load.rs"]
mod provision_load;
#[path = "register_load.rs"]
mod register_load;
#[path = "scale_load.rs"]
mod scale_load;
#[path = "services_bench.rs"]
mod services_bench;
#[path = "snapshot_bench.rs"]
mod snapshot_bench;

/// Each tool by the name it answers to (its old program name).
const TOOLS: [(&str, fn()); 9] = [
    ("csi_bench", csi_bench::main),
    ("snapshot_bench", snapshot_bench::main),
    ("deviceplugin_bench", deviceplugin_bench::main),
    ("dra_bench", dra_bench::main),
    ("policy_bench", policy_bench::main),
    ("provision_load", provision_load::main),
    ("register_load", register_load::main),
    ("scale_load", scale_load::main),
    ("services_bench", services_bench::main),
];

/// The value at the rounded position `p * (n - 1)` of `v`, sorted here (NaN when `v` is
/// empty); `p` = 0.5 is the median (the upper one of an even count).
fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// Nearest rank: the smallest value of `sorted` with a share `q` of the values at or below it
/// (0 when empty).
fn pctl(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// `x` rounded to three decimals, as the JSON summaries print figures.
fn r3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// CPU time (ms) the process `pid` has used so far, all its threads, dead ones included
/// (`/proc/<pid>/stat`'s utime + stime: clock ticks, 10 ms apart).
fn process_cpu_ms(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(") ").map(|(_, r)| r).unwrap_or("");
    let f: Vec<u64> = rest.split(' ').skip(11).take(2).filter_map(|x| x.parse().ok()).collect();
    // SAFETY: sysconf takes and returns plain integers.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    f.iter().sum::<u64>() as f64 * 1000.0 / tick
}

/// `msg` with the bearer token `token`, as every call to the controller carries one.
fn bearer<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut().insert("authorization", format!("Bearer {token}").parse().expect("token is header text"));
    r
}

/// Runs `tool` (stdin empty) and returns its output, trimmed; panics when it fails.
fn run(tool: &str, args: &[&str]) -> String {
    let out = Command::new(tool).args(args).stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("{tool}: {e}"));
    // blkid exits 2 on a blank device: that is its answer, not a failure.
    let blank_probe = tool == "blkid" && out.status.code() == Some(2);
    if !(out.status.success() || blank_probe) {
        panic!("{tool} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A figure against its target, as printed; a miss does not fail the run.
fn verdict(ok: bool) -> &'static str {
    if ok { "PASS" } else { "MISS" }
}

/// A test device node at `p`: a character device with /dev/null's numbers.
fn mkdev(p: &Path) {
    mknod(p, SFlag::S_IFCHR, Mode::from_bits_truncate(0o666), makedev(1, 3)).expect("mknod");
}

/// The benchmarks' volumes: ext4, mounted, one node writing.
fn ext4_cap() -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: access_mode::Mode::SingleNodeWriter as i32 }),
        access_type: Some(AccessType::Mount(MountVolume { fs_type: "ext4".into(), ..Default::default() })),
    }
}

fn tool(name: &str) -> Option<fn()> {
    TOOLS.iter().find(|(n, _)| *n == name).map(|(_, main)| *main)
}

fn main() {
    let argv0 = std::env::args().next().unwrap_or_default();
    if let Some(main) = tool(argv0.rsplit('/').next().unwrap_or_default()) {
        return main();
    }
    let mut args = std::env::args_os().skip(1);
    let name = args.next().and_then(|t| t.into_string().ok()).unwrap_or_default();
    if tool(&name).is_none() {
        let names: Vec<&str> = TOOLS.iter().map(|(n, _)| *n).collect();
        eprintln!("usage: benches TOOL [ARGS...]; TOOL is one of {}", names.join(", "));
        std::process::exit(2);
    }
    let err = std::process::Command::new("/proc/self/exe").arg0(&name).args(args).exec();
    eprintln!("benches: running {name}: {err}");
    std::process::exit(1);
}
