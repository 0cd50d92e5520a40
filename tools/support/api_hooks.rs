//! The real API server's own extension points, served by the test, for the few moments a
//! test must act *inside* one request of the controller:
//!
//! - [`AdmissionHook`]: a validating admission webhook (HTTPS). It allows everything, except
//!   that an armed request fails (the webhook answers 500: the API server refuses the write
//!   with its real `500 InternalError`, nothing stored) or first waits for an action of the
//!   test (a concurrent write by another client, which then makes the controller's write meet
//!   a real `409 Conflict`).
//! - [`AuditHook`]: an audit webhook in blocking mode (plain HTTP): the API server sends each
//!   event before it serves the request, so an action run for an armed event happens before
//!   that request is served (an etcd compaction between two pages of a list).

#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use serde_json::{Value, json};

use super::envtest::{pki, runtime};

/// Something the test does while the API server waits for the hook.
pub type Action = Box<dyn FnOnce() + Send>;

/// What the admission hook does with an armed request.
pub enum Verdict {
    /// Answer 500: the API server fails the request (failurePolicy Fail).
    Fail,
    /// Run the action, then allow the request.
    After(Action),
}

struct Armed {
    operation: String,
    resource: String,
    user: Option<String>,
    verdict: Verdict,
}

#[derive(Default)]
struct AdmissionState {
    armed: Mutex<Vec<Armed>>,
    /// (operation, resource, name) of every request seen, in order.
    seen: Mutex<Vec<(String, String, String)>>,
}

/// A validating admission webhook on 127.0.0.1 (see the module documentation).
pub struct AdmissionHook {
    port: u16,
    st: Arc<AdmissionState>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl AdmissionHook {
    pub fn start() -> AdmissionHook {
        let st = Arc::new(AdmissionState::default());
        let s = st.clone();
        let (port, stop) = serve(true, move |body| {
            let s = s.clone();
            async move { admit(&s, body).await }
        });
        AdmissionHook { port, st, stop }
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}/validate", self.port)
    }

    /// The next `operation` (CREATE, UPDATE, ...) on `resource` (plural), by `user` if given,
    /// gets `verdict`.
    pub fn arm(&self, operation: &str, resource: &str, user: Option<&str>, verdict: Verdict) {
        self.st.armed.lock().unwrap().push(Armed {
            operation: operation.into(),
            resource: resource.into(),
            user: user.map(str::to_string),
            verdict,
        });
    }

    /// Whether every armed request has come.
    pub fn spent(&self) -> bool {
        self.st.armed.lock().unwrap().is_empty()
    }

    /// Whether a request for an object of this name has been seen.
    pub fn saw(&self, name: &str) -> bool {
        self.st.seen.lock().unwrap().iter().any(|(_, _, n)| n == name)
    }
}

impl Drop for AdmissionHook {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn admit(st: &AdmissionState, body: Value) -> Response<Full<Bytes>> {
    let req = &body["request"];
    let s = |v: &Value| v.as_str().unwrap_or("").to_string();
    let (op, res, user) = (s(&req["operation"]), s(&req["resource"]["resource"]), s(&req["userInfo"]["username"]));
    st.seen.lock().unwrap().push((op.clone(), res.clone(), s(&req["name"])));
    let verdict = {
        let mut armed = st.armed.lock().unwrap();
        let i = armed
            .iter()
            .position(|a| a.operation == op && a.resource == res && a.user.as_ref().is_none_or(|u| *u == user));
        i.map(|i| armed.remove(i).verdict)
    };
    match verdict {
        Some(Verdict::Fail) => {
            return Response::builder().status(500).body(Full::new(Bytes::from("envtest: failed as armed"))).unwrap();
        }
        Some(Verdict::After(action)) => {
            tokio::task::spawn_blocking(action).await.expect("the hook's action panicked");
        }
        None => {}
    }
    let answer = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                        "response": {"uid": req["uid"], "allowed": true}});
    Response::new(Full::new(Bytes::from(answer.to_string())))
}

/// Which audit events an armed action waits for.
type Matcher = Box<dyn Fn(&Value) -> bool + Send>;

/// An audit webhook (see the module documentation).
pub struct AuditHook {
    port: u16,
    st: Arc<Mutex<Vec<(Matcher, Action)>>>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl AuditHook {
    pub fn start() -> AuditHook {
        let st: Arc<Mutex<Vec<(Matcher, Action)>>> = Arc::default();
        let s = st.clone();
        let (port, stop) = serve(false, move |body| {
            let s = s.clone();
            async move {
                for ev in body["items"].as_array().into_iter().flatten() {
                    let action = {
                        let mut armed = s.lock().unwrap();
                        armed.iter().position(|(matches, _)| matches(ev)).map(|i| armed.remove(i).1)
                    };
                    if let Some(action) = action {
                        tokio::task::spawn_blocking(action).await.expect("the hook's action panicked");
                    }
                }
                Response::new(Full::new(Bytes::new()))
            }
        });
        AuditHook { port, st, stop }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/audit", self.port)
    }

    /// The next audit event that `matches` runs `action` before the API server goes on.
    pub fn arm(&self, matches: impl Fn(&Value) -> bool + Send + 'static, action: Action) {
        self.st.lock().unwrap().push((Box::new(matches), action));
    }

    pub fn spent(&self) -> bool {
        self.st.lock().unwrap().is_empty()
    }
}

impl Drop for AuditHook {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// Serves POSTed JSON on a free loopback port (HTTPS with the envtest serving certificate,
/// or plain HTTP) until the returned sender says stop.
fn serve<F, Fut>(tls: bool, handle: F) -> (u16, tokio::sync::watch::Sender<bool>)
where
    F: Fn(Value) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let acceptor = tls.then(|| {
        let files = nodeplane::rpc::tls::ServerFiles {
            cert_file: pki().file("serving.crt"),
            key_file: pki().file("serving.key"),
            client_ca_file: None,
        };
        tokio_rustls::TlsAcceptor::from(nodeplane::rpc::tls::Acceptor::load(files).unwrap().http1_config())
    });
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let handle = Arc::new(handle);
    runtime().spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        loop {
            let conn = tokio::select! {
                c = listener.accept() => c,
                _ = stopped.wait_for(|s| *s) => return,
            };
            let Ok((sock, _)) = conn else { continue };
            let (handle, acceptor) = (handle.clone(), acceptor.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let handle = handle.clone();
                    async move {
                        let body = req.into_body().collect().await?.to_bytes();
                        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                        Ok::<_, hyper::Error>(handle(v).await)
                    }
                });
                let http = hyper::server::conn::http1::Builder::new();
                match acceptor {
                    Some(a) => {
                        if let Ok(tls) = a.accept(sock).await {
                            let _ = http.serve_connection(hyper_util::rt::TokioIo::new(tls), service).await;
                        }
                    }
                    None => {
                        let _ = http.serve_connection(hyper_util::rt::TokioIo::new(sock), service).await;
                    }
                }
            });
        }
    });
    (port, stop)
}
