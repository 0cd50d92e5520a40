//! `nodeplane-cni`: the CNI plugin binary the container runtime execs (installed as
//! `<cni-bin-dir>/nodeplane`). Forwards to the node agent; see `nodeplane_cni::shim`.

use std::io::Write;

fn main() {
    let stdin = match nodeplane_cni::shim::read_stdin(std::io::stdin().lock()) {
        Ok(b) => b,
        Err(e) => {
            let err = nodeplane_cni::cni::CniError::new(nodeplane_cni::cni::Code::Io, format!("reading stdin: {e}"));
            let reply = nodeplane_cni::cni::Reply::error(&err, nodeplane_cni::cni::LATEST_VERSION);
            println!("{}", reply.stdout);
            std::process::exit(reply.exit_code);
        }
    };
    let reply = nodeplane_cni::shim::run(nodeplane_cni::shim::env_from_process(), &stdin);
    let mut out = std::io::stdout().lock();
    if !reply.stdout.is_empty() {
        let _ = writeln!(out, "{}", reply.stdout);
    }
    let _ = out.flush();
    std::process::exit(reply.exit_code);
}
