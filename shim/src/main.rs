//! `nodeplane-cni`: the CNI plugin binary the container runtime execs (installed as
//! `<cni-bin-dir>/nodeplane`). Forwards to the node agent; see `nodeplane_cni::shim`.
//!
//! Built by scripts/build-shim, the binary starts at the front (`nodeplane_cni_front`),
//! which serves the usual request before the C library starts; `main` runs only when the
//! front handed over, with what it had done.

use std::io::Write;

fn main() {
    // Keeps the entry point linked (the linker is told to start there).
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    std::hint::black_box(nodeplane_cni_front::entry_address());
    let front = nodeplane_cni_front::handover();
    let stdin = match front.stdin {
        Some(Ok(bytes)) => Ok(bytes.to_vec()),
        Some(Err(errno)) => Err(std::io::Error::from_raw_os_error(errno)),
        None => nodeplane_cni::shim::read_stdin(std::io::stdin().lock()),
    };
    let stdin = match stdin {
        Ok(b) => b,
        Err(e) => {
            let err = nodeplane_cni::cni::CniError::new(nodeplane_cni::cni::Code::Io, format!("reading stdin: {e}"));
            let reply = nodeplane_cni::cni::Reply::error(&err, nodeplane_cni::cni::LATEST_VERSION);
            println!("{}", reply.stdout);
            std::process::exit(reply.exit_code);
        }
    };
    let agent_failed = front.agent_errno.map(std::io::Error::from_raw_os_error);
    let reply = nodeplane_cni::shim::run_after_front(nodeplane_cni::shim::env_from_process(), &stdin, agent_failed);
    let mut out = std::io::stdout().lock();
    if !reply.stdout.is_empty() {
        let _ = writeln!(out, "{}", reply.stdout);
    }
    let _ = out.flush();
    std::process::exit(reply.exit_code);
}
