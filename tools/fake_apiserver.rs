//! A fake Kubernetes API server as a process, for tests of binaries (controller, agent) that
//! talk to an apiserver through a kubeconfig.
//!
//! ```text
//! cargo run --release --example fake_apiserver -- \
//!     --kubeconfig /tmp/kc --token admin-token=admin \
//!     --review-token agent-token=system:serviceaccount:kube-system:agent,uid=1234,extra.authentication.kubernetes.io/node-name=n1,aud=nodeplane \
//!     --register nodeplane.io/v1/ipblocks/IpBlock/cluster
//! ```
//!
//! A controller in Kubernetes mode also needs its CRDs and Secrets (its token-signing keys):
//! `--register nodeplane.dev/v1alpha1/nodeplanenodes/NodeplaneNode/cluster` (likewise
//! `ipblocks/IPBlock`, `nodeplanevolumes/NodeplaneVolume`) and `--register core/v1/secrets/Secret/namespaced`.
//!
//! Prints `READY <url>` on stdout once it serves and the kubeconfig (using the first
//! `--token`) is written, then serves until SIGTERM, SIGINT or EOF on stdin (so a parent that
//! holds the stdin pipe takes it down when it dies; pass `--ignore-stdin` to run with stdin
//! at /dev/null). Nothing else is written to stdout. Semantics: see
//! `tools/support/fake_apiserver.rs`.

#[path = "support/fake_apiserver.rs"]
mod fake_apiserver;

use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Parser;
use fake_apiserver::{API_AUDIENCE, FakeApiServer, UserInfo};

#[derive(Parser, Debug)]
#[command(about = "In-process fake Kubernetes API server (plain HTTP on 127.0.0.1)")]
struct Args {
    /// Where to write a kubeconfig pointing at the server with the first --token.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,

    /// A bearer token for API access: TOKEN[=USERNAME] (username defaults to "admin",
    /// groups system:masters and system:authenticated). Repeatable.
    #[arg(long = "token", value_name = "TOKEN[=USERNAME]")]
    tokens: Vec<String>,

    /// A token with a full identity, for TokenReview (and for API access when it is valid for
    /// the apiserver audience): TOKEN=USERNAME[,uid=UID][,group=GROUP...][,extra.KEY=VALUE...]
    /// [,aud=AUDIENCE...]. Without aud= the token is valid for the apiserver audience only;
    /// aud=api names that audience. Repeatable.
    #[arg(long = "review-token", value_name = "SPEC")]
    review_tokens: Vec<String>,

    /// Serve another resource: GROUP/VERSION/PLURAL/Kind/(cluster|namespaced); the core group
    /// is empty ("/v1/configmaps/ConfigMap/namespaced"). Repeatable.
    #[arg(long = "register", value_name = "G/V/PLURAL/KIND/SCOPE")]
    registers: Vec<String>,

    /// Do not stop on EOF on stdin.
    #[arg(long)]
    ignore_stdin: bool,
}

fn parse_review_token(spec: &str) -> anyhow::Result<(String, UserInfo)> {
    let mut parts = spec.split(',');
    let head = parts.next().unwrap_or("");
    let Some((token, username)) = head.split_once('=') else {
        bail!("--review-token {spec:?}: expected TOKEN=USERNAME[,...]");
    };
    if token.is_empty() {
        bail!("--review-token {spec:?}: empty token");
    }
    let mut user = UserInfo::new(username);
    for part in parts {
        let Some((k, v)) = part.split_once('=') else {
            bail!("--review-token {spec:?}: {part:?} is not KEY=VALUE");
        };
        if let Some(extra) = k.strip_prefix("extra.") {
            user.extra.entry(extra.to_string()).or_default().push(v.to_string());
        } else {
            match k {
                "uid" => user.uid = v.to_string(),
                "group" | "groups" => user.groups.push(v.to_string()),
                "aud" | "audience" => {
                    user.audiences.push(if v == "api" { API_AUDIENCE.to_string() } else { v.to_string() })
                }
                _ => bail!("--review-token {spec:?}: unknown key {k:?} (uid, group, extra.KEY, aud)"),
            }
        }
    }
    Ok((token.to_string(), user))
}

fn parse_register(spec: &str) -> anyhow::Result<(String, String, String, String, bool)> {
    let parts: Vec<&str> = spec.split('/').collect();
    let [group, version, plural, kind, scope] = parts.as_slice() else {
        bail!("--register {spec:?}: expected GROUP/VERSION/PLURAL/Kind/(cluster|namespaced)");
    };
    let namespaced = match *scope {
        "namespaced" | "Namespaced" => true,
        "cluster" | "Cluster" => false,
        _ => bail!("--register {spec:?}: scope must be cluster or namespaced"),
    };
    if version.is_empty() || plural.is_empty() || kind.is_empty() {
        bail!("--register {spec:?}: empty version, plural or kind");
    }
    let group = if *group == "core" { "" } else { group };
    Ok((group.to_string(), version.to_string(), plural.to_string(), kind.to_string(), namespaced))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();

    let mut tokens = Vec::new();
    for t in &args.tokens {
        let (token, username) = t.split_once('=').unwrap_or((t.as_str(), "admin"));
        if token.is_empty() {
            bail!("--token {t:?}: empty token");
        }
        let mut user = UserInfo::new(username);
        user.groups = vec!["system:masters".into(), "system:authenticated".into()];
        tokens.push((token.to_string(), user));
    }
    let review: Vec<_> = args.review_tokens.iter().map(|s| parse_review_token(s)).collect::<Result<_, _>>()?;
    let registers: Vec<_> = args.registers.iter().map(|s| parse_register(s)).collect::<Result<_, _>>()?;
    if args.kubeconfig.is_some() && tokens.is_empty() {
        bail!("--kubeconfig needs at least one --token");
    }

    let server = FakeApiServer::start();
    for (token, user) in tokens.iter().chain(review.iter()) {
        server.add_token(token, user.clone());
    }
    for (g, v, p, k, namespaced) in &registers {
        server.register(g, v, p, k, *namespaced);
    }
    if let Some(path) = &args.kubeconfig {
        let text = server.kubeconfig_yaml(&tokens[0].0);
        std::fs::write(path, text).with_context(|| format!("writing kubeconfig {}", path.display()))?;
    }
    eprintln!(
        "fake apiserver: serving {} ({} tokens, {} extra resources)",
        server.url(),
        tokens.len() + review.len(),
        registers.len()
    );
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "READY {}", server.url())?;
        out.flush()?;
    }

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let (eof_tx, mut eof_rx) = tokio::sync::mpsc::channel::<()>(1);
        // With --ignore-stdin the sender stays here, so `recv` never completes.
        let _keep_open = if args.ignore_stdin {
            Some(eof_tx)
        } else {
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let mut stdin = std::io::stdin();
                while let Ok(n) = stdin.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                }
                let _ = eof_tx.blocking_send(());
            });
            None
        };
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = term.recv() => eprintln!("fake apiserver: SIGTERM"),
            _ = tokio::signal::ctrl_c() => eprintln!("fake apiserver: SIGINT"),
            _ = eof_rx.recv() => eprintln!("fake apiserver: stdin closed"),
        }
        anyhow::Ok(())
    })?;
    drop(server);
    Ok(())
}
