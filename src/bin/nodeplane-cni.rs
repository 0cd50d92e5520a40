//! `nodeplane-cni`: the CNI plugin binary the container runtime execs (installed as
//! `<cni-bin-dir>/nodeplane`). Forwards to the node agent; see `nodeplane::net::shim`.

use std::io::Write;

fn main() {
    let stdin = match nodeplane::net::shim::read_stdin(std::io::stdin().lock()) {
        Ok(b) => b,
        Err(e) => {
            let err = nodeplane::net::cni::CniError::new(nodeplane::net::cni::Code::Io, format!("reading stdin: {e}"));
            let reply = nodeplane::net::cni::Reply::error(&err, nodeplane::net::cni::LATEST_VERSION);
            println!("{}", reply.stdout);
            std::process::exit(reply.exit_code);
        }
    };
    let reply = nodeplane::net::shim::run(nodeplane::net::shim::env_from_process(), &stdin);
    let mut out = std::io::stdout().lock();
    if !reply.stdout.is_empty() {
        let _ = writeln!(out, "{}", reply.stdout);
    }
    let _ = out.flush();
    std::process::exit(reply.exit_code);
}
