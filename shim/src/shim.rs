//! The CNI shim: what `nodeplane-cni` does between exec and exit.
//!
//! No async runtime: read stdin, validate, one blocking request to the agent, print the
//! reply. VERSION is answered here. When the agent cannot be reached, ADD/CHECK/GC fail
//! with "try again later" (11), STATUS with "not available" (50), and DEL is written to the
//! pending-delete queue (the agent drains it) and succeeds, so pod deletion never blocks.

use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::cni::request::{self, ENV_KEYS, Env};
use crate::cni::wire::{WireRequest, encode, exchange};
use crate::cni::{CniError, Code, Command, MAX_CONFIG_BYTES, Reply, version_result};

pub const DEFAULT_SOCKET: &str = "/run/nodeplane/cni.sock";
/// Environment override for the agent socket (tests, unusual layouts).
pub const SOCKET_ENV: &str = "NODEPLANE_CNI_SOCKET";

/// Collect the CNI_* variables from the process environment.
pub fn env_from_process() -> Env {
    ENV_KEYS.iter().filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v))).collect()
}

/// Read stdin up to the size limit (one byte more tells us it was too big).
pub fn read_stdin(mut input: impl Read) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    input.by_ref().take(MAX_CONFIG_BYTES as u64 + 1).read_to_end(&mut buf)?;
    Ok(buf)
}

fn timeout_for(cmd: Command) -> Duration {
    match cmd {
        Command::Add => Duration::from_secs(90),
        Command::Status => Duration::from_secs(10),
        _ => Duration::from_secs(60),
    }
}

/// How long the request may take to be sent, and a connection to be accepted.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long ADD, CHECK and GC wait for an agent that is not listening, unless the network
/// configuration says otherwise (`agentWaitSeconds`): long enough for an agent restart or
/// a rolling upgrade, short next to the runtime's own timeouts.
pub const DEFAULT_AGENT_WAIT: Duration = Duration::from_secs(10);

/// Connect, waiting up to `wait` while the socket is missing or refuses (the agent is
/// restarting). Other errors (permissions…) are returned at once.
///
/// The socket's timeouts (`read` for the answer, [`WRITE_TIMEOUT`] for the request and for a
/// connect the agent does not accept) are set before it connects: an accepting thread of the
/// agent wakes as the connection is made, and the request should be there when it reads.
fn connect_waiting(socket: &Path, wait: Duration, read: Duration) -> io::Result<UnixStream> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr};
    let addr = UnixAddr::new(socket).map_err(io::Error::from)?;
    let deadline = std::time::Instant::now() + wait;
    loop {
        let fd = nix::sys::socket::socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)
            .map_err(io::Error::from)?;
        let stream = UnixStream::from(fd);
        stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
        stream.set_read_timeout(Some(read))?;
        match nix::sys::socket::connect(std::os::fd::AsRawFd::as_raw_fd(&stream), &addr).map_err(io::Error::from) {
            Ok(()) => return Ok(stream),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the agent did not accept the connection on {} within {WRITE_TIMEOUT:?}", socket.display()),
                ));
            }
            Err(e)
                if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused)
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e),
        }
    }
}

fn call_agent(
    socket: &Path,
    wire: &WireRequest,
    netns: Option<std::os::fd::BorrowedFd<'_>>,
    cmd: Command,
    wait: Duration,
) -> io::Result<Reply> {
    // STATUS must answer now (the runtime asks whether ADD can work *now*); DEL is queued
    // durably when the agent is away, so it never waits either.
    let wait = if matches!(cmd, Command::Add | Command::Check | Command::Gc) { wait } else { Duration::ZERO };
    let frame = encode(wire)?;
    let deadline = std::time::Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut stream = connect_waiting(socket, left, timeout_for(cmd))?;
        match exchange(&mut stream, &frame, netns) {
            // The agent went away between accepting (or queueing) the connection and
            // answering: it is stopping or crashed. Ask the next one, within the same bound.
            // (An ADD the old agent finished but could not answer is refused by the new one
            // as already attached; the runtime then DELs and retries.)
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionReset | io::ErrorKind::UnexpectedEof | io::ErrorKind::BrokenPipe
                ) && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            other => return other,
        }
    }
}

/// Run one invocation. Returns what to print on stdout and the exit code.
pub fn run(env: Env, stdin: &[u8]) -> Reply {
    let version = request::sniff_version(stdin);
    let command = match request::parse_command(&env) {
        Ok(c) => c,
        Err(e) => return Reply::error(&e, &version),
    };
    if command == Command::Version {
        let requested = serde_json::from_slice::<serde_json::Value>(stdin)
            .ok()
            .and_then(|v| v.get("cniVersion").and_then(|x| x.as_str()).map(str::to_string));
        return Reply::ok(&version_result(requested.as_deref()));
    }
    let req = match request::parse(&env, stdin) {
        Ok(r) => r,
        Err(e) => return Reply::error(&e, &version),
    };
    let socket = req
        .conf
        .agent_socket
        .clone()
        .or_else(|| std::env::var_os(SOCKET_ENV).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET));
    // ADD and CHECK work in the pod's namespace: opened here, in the runtime's mount and PID
    // namespaces (where its path means what the runtime meant), and handed to the agent.
    let netns = match (command, req.netns.as_deref()) {
        (Command::Add | Command::Check, Some(path)) => match open_netns(path) {
            Ok(f) => Some(f),
            Err(e) => return Reply::error(&e, &version),
        },
        _ => None,
    };
    let wire = WireRequest { env, stdin: String::from_utf8_lossy(stdin).into_owned() };
    let wait = req.conf.agent_wait_seconds.map(Duration::from_secs).unwrap_or(DEFAULT_AGENT_WAIT);
    match call_agent(&socket, &wire, netns.as_ref().map(std::os::fd::AsFd::as_fd), command, wait) {
        Ok(reply) => reply,
        Err(e) => unreachable_reply(&req, &wire, &socket, &e, &version),
    }
}

/// Open `CNI_NETNS` and check that it is a network namespace (code 4 otherwise, with the
/// agent's words for it).
fn open_netns(path: &Path) -> Result<std::fs::File, CniError> {
    crate::nsfs::open_netns(path).map_err(|e| CniError::new(Code::InvalidEnv, format!("CNI_NETNS: {e}")))
}

fn unreachable_reply(
    req: &request::Request,
    wire: &WireRequest,
    socket: &Path,
    cause: &io::Error,
    version: &str,
) -> Reply {
    let why = format!("nodeplane agent at {} is not reachable: {cause}", socket.display());
    match req.command {
        Command::Del => {
            let dir =
                req.conf.pending_delete_dir.clone().unwrap_or_else(|| PathBuf::from(crate::pending_del::DEFAULT_DIR));
            match crate::pending_del::queue(&dir, req, wire) {
                Ok(_) => Reply::empty(),
                Err(e) => Reply::error(
                    &CniError::new(Code::Io, format!("{why}; queueing the delete in {} failed: {e}", dir.display())),
                    version,
                ),
            }
        }
        Command::Status => Reply::error(&CniError::new(Code::NotAvailable, why), version),
        _ => Reply::error(&CniError::new(Code::TryAgainLater, format!("{why}; try again later")), version),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(cmd: &str) -> Env {
        [("CNI_COMMAND", cmd), ("CNI_CONTAINERID", "c1"), ("CNI_IFNAME", "eth0"), ("CNI_NETNS", "/proc/self/ns/net")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn conf(dir: &Path, version: &str) -> Vec<u8> {
        serde_json::json!({
            "cniVersion": version, "name": "nodeplane", "type": "nodeplane",
            "agentSocket": dir.join("no-agent.sock"), "pendingDeleteDir": dir.join("pending"),
            "agentWaitSeconds": 0,
        })
        .to_string()
        .into_bytes()
    }

    fn code(reply: &Reply) -> u64 {
        serde_json::from_str::<serde_json::Value>(&reply.stdout).unwrap()["code"].as_u64().unwrap()
    }

    #[test]
    fn agent_unreachable() {
        let dir = std::env::temp_dir().join(format!("np-shim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let add = run(env("ADD"), &conf(&dir, "1.1.0"));
        assert_eq!((add.exit_code, code(&add)), (1, 11), "{}", add.stdout);
        let status = run(env("STATUS"), &conf(&dir, "1.1.0"));
        assert_eq!((status.exit_code, code(&status)), (1, 50), "{}", status.stdout);
        // DEL is queued durably and succeeds.
        let del = run(env("DEL"), &conf(&dir, "1.1.0"));
        assert_eq!(del, Reply::empty());
        let queued = dir.join("pending").join(crate::pending_del::file_name("c1", "eth0"));
        let rec: WireRequest = serde_json::from_slice(&std::fs::read(&queued).unwrap()).unwrap();
        assert_eq!(rec.env["CNI_COMMAND"], "DEL");
        assert!(request::parse(&rec.env, rec.stdin.as_bytes()).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn version_is_local_and_errors_are_json() {
        let mut e = Env::new();
        e.insert("CNI_COMMAND".into(), "VERSION".into());
        let v = run(e, br#"{"cniVersion":"0.4.0"}"#);
        let out: serde_json::Value = serde_json::from_str(&v.stdout).unwrap();
        assert_eq!(out["cniVersion"], "0.4.0");
        assert_eq!(out["supportedVersions"].as_array().unwrap().len(), crate::cni::SUPPORTED_VERSIONS.len());
        let bad = run(env("ADD"), b"{not json");
        assert_eq!((bad.exit_code, code(&bad)), (1, 6));
    }

    #[test]
    fn add_waits_for_a_restarting_agent_within_the_bound() {
        let dir = std::env::temp_dir().join(format!("np-shim-wait-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c: serde_json::Value = serde_json::from_slice(&conf(&dir, "1.1.0")).unwrap();
        c["agentWaitSeconds"] = 1.into();
        let stdin = c.to_string().into_bytes();
        // Nobody ever listens: ADD gives up after about the bound, with code 11.
        let t = std::time::Instant::now();
        let add = run(env("ADD"), &stdin);
        let took = t.elapsed();
        assert_eq!(code(&add), 11, "{}", add.stdout);
        assert!(took >= Duration::from_millis(950) && took < Duration::from_secs(3), "{took:?}");
        // STATUS does not wait.
        let t = std::time::Instant::now();
        let status = run(env("STATUS"), &stdin);
        assert_eq!(code(&status), 50);
        assert!(t.elapsed() < Duration::from_millis(500));
        // A malformed bound is an invalid configuration.
        c["agentWaitSeconds"] = 301.into();
        let bad = run(env("ADD"), c.to_string().as_bytes());
        assert_eq!(code(&bad), 7, "{}", bad.stdout);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
