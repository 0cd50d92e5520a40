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
    let reply =
        nodeplane_cni::shim::run_after_front(nodeplane_cni::shim::env_from_process(), &stdin, after_front(&front));
    let mut out = std::io::stdout().lock();
    if !reply.stdout.is_empty() {
        let _ = writeln!(out, "{}", reply.stdout);
    }
    let _ = out.flush();
    std::process::exit(reply.exit_code);
}

/// What the front had done with the agent, as the full shim takes it.
fn after_front(front: &nodeplane_cni_front::Handover) -> nodeplane_cni::shim::AfterFront {
    use nodeplane_cni::shim::AfterFront;
    use nodeplane_cni_front::Failure;
    let Some(failure) = front.failure else { return AfterFront::Nothing };
    match failure {
        Failure::Lost(errno) => {
            let error = match errno {
                Some(e) => std::io::Error::from_raw_os_error(e),
                // What `read_exact` says when the agent closes the connection first.
                None => std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "failed to fill whole buffer"),
            };
            let elapsed = front.started_ns.map(|t| monotonic_ns().saturating_sub(t)).unwrap_or(0);
            AfterFront::Lost { error, elapsed: std::time::Duration::from_nanos(elapsed) }
        }
        Failure::Answer(body) => AfterFront::Answer(Ok(body.to_vec())),
        Failure::OversizeAnswer(len) => AfterFront::Answer(Err(len)),
        Failure::NotAccepted => AfterFront::NotAccepted,
    }
}

/// CLOCK_MONOTONIC in nanoseconds (the front's clock).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime fills the timespec we own.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) } != 0 {
        return 0;
    }
    (ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64)
}
