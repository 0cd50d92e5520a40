//! Health endpoint for probes: liveness (`/healthz`) and readiness (`/readyz`) over
//! HTTP/1.1, plain or (given a [`TlsSource`]) over TLS, shared by the agent and the controller.
//!
//! Readiness is the conjunction of named conditions that the process's parts register and
//! set (`cni`, `csi`, …). `/readyz` answers 200 `ok` when every condition holds, else 503
//! with one `<name>: <detail>` line per condition that does not; `/readyz?verbose` lists
//! every condition as `[+]name ok` / `[-]name failed: detail` (the kube-apiserver layout).
//! `/healthz` answers 200 whenever the process's runtime gets to answer at all.
//! `/metrics` answers the Prometheus text format (0.0.4) when the process set a metrics
//! source ([`Health::with_metrics`]); it is collected on a blocking thread (collectors may
//! read files), and 404 without a source.
//!
//! The server runs on the caller's tokio runtime (so liveness means that runtime answers),
//! one task per connection; a client that does not send its request headers in time is
//! dropped, connections are capped, and a connection lives at most a bounded time.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::server::conn::http1;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};

/// A client must send its request headers within this time (also bounds idle keep-alive).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// No connection lives longer than this, whatever the client does.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// Connections served at once; more are closed at accept (probes need a handful).
const MAX_CONNECTIONS: usize = 128;
/// On shutdown, open connections get this long to finish their current request.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug)]
struct Entry {
    name: String,
    ready: bool,
    detail: String,
}

/// The TLS config to accept the next connection with (read per connection, so a reloaded
/// certificate is used from the next handshake on).
pub type TlsSource = Arc<dyn Fn() -> Arc<rustls::ServerConfig> + Send + Sync>;

/// A TLS handshake must complete within this time.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Renders the process's metrics in the Prometheus text format.
pub type MetricsSource = Arc<dyn Fn() -> String + Send + Sync>;

/// The process's readiness conditions (cheap to clone; clones share the state) and its
/// metrics source, if any.
#[derive(Clone, Default)]
pub struct Health {
    conditions: Arc<Mutex<Vec<Entry>>>,
    metrics: Option<MetricsSource>,
}

/// A handle on one named readiness condition.
#[derive(Clone)]
pub struct Condition {
    conditions: Arc<Mutex<Vec<Entry>>>,
    index: usize,
}

impl Health {
    pub fn new() -> Self {
        Self::default()
    }

    /// Serve `/metrics` from `source` (set it before the endpoint is served: clones made
    /// earlier do not see it).
    pub fn with_metrics(mut self, source: MetricsSource) -> Self {
        self.metrics = Some(source);
        self
    }

    /// Register a named readiness condition, initially not ready with detail "starting".
    /// Registering a name again returns a handle on the same condition (its state kept).
    pub fn condition(&self, name: &str) -> Condition {
        let mut list = self.conditions.lock().unwrap();
        let index = match list.iter().position(|e| e.name == name) {
            Some(i) => i,
            None => {
                list.push(Entry { name: name.to_string(), ready: false, detail: "starting".into() });
                list.len() - 1
            }
        };
        Condition { conditions: self.conditions.clone(), index }
    }

    /// Every condition holds (true when there are none).
    pub fn is_ready(&self) -> bool {
        self.conditions.lock().unwrap().iter().all(|e| e.ready)
    }

    /// `(name, ready, detail)` of every condition, in registration order.
    pub fn snapshot(&self) -> Vec<(String, bool, String)> {
        self.conditions.lock().unwrap().iter().map(|e| (e.name.clone(), e.ready, e.detail.clone())).collect()
    }
}

impl Condition {
    /// Set the condition; transitions are logged. The detail is one line (line breaks
    /// become spaces) so the `/readyz` body stays one line per condition.
    pub fn set(&self, ready: bool, detail: impl Into<String>) {
        let detail: String = detail.into().chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
        let mut list = self.conditions.lock().unwrap();
        let e = &mut list[self.index];
        // Transitions at info: the parts log their own failures; this is the probe's view.
        if e.ready != ready {
            if ready {
                tracing::info!(condition = %e.name, "readiness condition met");
            } else {
                tracing::info!(condition = %e.name, detail = %detail, "readiness condition not met");
            }
        } else if !ready && e.detail != detail {
            tracing::info!(condition = %e.name, detail = %detail, "readiness condition still not met");
        }
        e.ready = ready;
        e.detail = detail;
    }

    pub fn is_ready(&self) -> bool {
        self.conditions.lock().unwrap()[self.index].ready
    }
}

/// Parse a listen address: an IP literal with a port (`127.0.0.1:9640`, `[::]:9640`).
pub fn parse_address(addr: &str) -> Result<SocketAddr, String> {
    addr.trim()
        .parse::<SocketAddr>()
        .map_err(|_| format!("{addr:?} is not IP:port (for example 127.0.0.1:9640 or [::1]:9640)"))
}

/// Bind (std, non-blocking, SO_REUSEADDR) so a bad address is a startup error, not a task error.
pub fn bind(addr: &str) -> std::io::Result<std::net::TcpListener> {
    use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, SockaddrStorage, sockopt};
    let sa = parse_address(addr).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let family = if sa.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    let ctx =
        |what: &str, e: nix::Error| std::io::Error::new(std::io::Error::from(e).kind(), format!("{what} {sa}: {e}"));
    let fd: OwnedFd = socket::socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK, None)
        .map_err(|e| ctx("socket for", e))?;
    socket::setsockopt(&fd, sockopt::ReuseAddr, &true).map_err(|e| ctx("SO_REUSEADDR on", e))?;
    socket::bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrStorage::from(sa)).map_err(|e| ctx("binding", e))?;
    socket::listen(&fd, socket::Backlog::new(128).expect("valid backlog")).map_err(|e| ctx("listening on", e))?;
    Ok(std::net::TcpListener::from(fd))
}

/// Serve HTTP/1.1 (over TLS with `tls`) until `shutdown` resolves. The port is closed
/// before this returns.
pub async fn serve(
    listener: std::net::TcpListener,
    health: Health,
    tls: Option<TlsSource>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let local = listener.local_addr()?;
    let paths = if health.metrics.is_some() { "/healthz, /readyz, /metrics" } else { "/healthz, /readyz" };
    let scheme = if tls.is_some() { "https" } else { "http" };
    tracing::info!(address = %local, paths, scheme, "health endpoint served");
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        tracing::debug!(%peer, "health endpoint: too many connections; closing");
                        continue;
                    };
                    let health = health.clone();
                    let stop = stop_rx.clone();
                    let _ = stream.set_nodelay(true);
                    let tls = tls.as_ref().map(|source| tokio_rustls::TlsAcceptor::from(source()));
                    conns.spawn(async move {
                        match tls {
                            None => serve_connection(stream, health, stop).await,
                            // The handshake is part of the connection's task: a silent client
                            // holds a slot for at most HANDSHAKE_TIMEOUT.
                            Some(tls) => match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(stream)).await {
                                Ok(Ok(s)) => serve_connection(s, health, stop).await,
                                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "health endpoint: TLS handshake failed (plain HTTP is not served)"),
                                Err(_) => tracing::debug!(%peer, "health endpoint: TLS handshake not completed in time"),
                            },
                        }
                        drop(slot);
                    });
                }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "health endpoint: accept");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    if tokio::time::timeout(SHUTDOWN_GRACE, async { while conns.join_next().await.is_some() {} }).await.is_err() {
        conns.abort_all();
    }
    tracing::info!(address = %local, "health endpoint stopped");
    Ok(())
}

async fn serve_connection<S>(stream: S, health: Health, mut stop: tokio::sync::watch::Receiver<bool>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let health = health.clone();
        async move { Ok::<_, Infallible>(respond(&health, req.method(), req.uri()).await) }
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(16 * 1024)
        .serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    let lifetime = tokio::time::sleep(CONNECTION_LIFETIME);
    tokio::pin!(lifetime);
    let mut stopping = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "health endpoint connection");
                }
                return;
            }
            _ = stop.wait_for(|s| *s), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = &mut lifetime => return,
        }
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    typed(status, body, "text/plain; charset=utf-8")
}

fn typed(status: StatusCode, body: String, content_type: &'static str) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// Does the query string carry `key` (as `key`, `key=…`)?
fn has_query_key(query: Option<&str>, key: &str) -> bool {
    query.is_some_and(|q| q.split('&').any(|kv| kv.split('=').next() == Some(key)))
}

enum Route {
    Healthz,
    Readyz,
    Metrics(MetricsSource),
}

/// The router: one arm per path.
async fn respond(health: &Health, method: &Method, uri: &hyper::Uri) -> Response<Full<Bytes>> {
    let route = match (uri.path(), &health.metrics) {
        ("/healthz", _) => Route::Healthz,
        ("/readyz", _) => Route::Readyz,
        ("/metrics", Some(source)) => Route::Metrics(source.clone()),
        _ => return text(StatusCode::NOT_FOUND, "not found\n".into()),
    };
    // HEAD is answered like GET (hyper leaves the body out).
    if method != Method::GET && method != Method::HEAD {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n".into());
        r.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    match route {
        Route::Healthz => text(StatusCode::OK, "ok\n".into()),
        Route::Readyz => readyz(health, uri.query()),
        Route::Metrics(source) => metrics(source).await,
    }
}

/// Collect on a blocking thread: collectors take locks and may read small files.
async fn metrics(source: MetricsSource) -> Response<Full<Bytes>> {
    match tokio::task::spawn_blocking(move || source()).await {
        Ok(body) => typed(StatusCode::OK, body, crate::obs::metrics::CONTENT_TYPE),
        Err(e) => {
            tracing::error!(error = %e, "collecting metrics failed");
            text(StatusCode::INTERNAL_SERVER_ERROR, "collecting metrics failed\n".into())
        }
    }
}

fn readyz(health: &Health, query: Option<&str>) -> Response<Full<Bytes>> {
    let conditions = health.snapshot();
    let ready = conditions.iter().all(|(_, r, _)| *r);
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let mut body = String::new();
    if has_query_key(query, "verbose") {
        for (name, ok, detail) in &conditions {
            if *ok {
                body += &format!("[+]{name} ok\n");
            } else {
                body += &format!("[-]{name} failed: {detail}\n");
            }
        }
        body += if ready { "readyz check passed\n" } else { "readyz check failed\n" };
    } else if ready {
        body += "ok\n";
    } else {
        for (name, _, detail) in conditions.iter().filter(|(_, ok, _)| !ok) {
            body += &format!("{name}: {detail}\n");
        }
    }
    text(status, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    struct Reply {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    }

    impl Reply {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
        }
    }

    /// One request over a fresh std TCP connection (off the runtime's workers).
    async fn call(addr: SocketAddr, method: &str, target: &str) -> Reply {
        let raw = format!("{method} {target} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
        tokio::task::spawn_blocking(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s.write_all(raw.as_bytes()).unwrap();
            let mut out = Vec::new();
            s.read_to_end(&mut out).unwrap();
            let text = String::from_utf8(out).unwrap();
            let (head, body) = text.split_once("\r\n\r\n").expect("a complete response");
            let mut lines = head.split("\r\n");
            let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
            let headers = lines
                .map(|l| {
                    let (k, v) = l.split_once(':').unwrap();
                    (k.trim().to_string(), v.trim().to_string())
                })
                .collect();
            Reply { status, headers, body: body.to_string() }
        })
        .await
        .unwrap()
    }

    async fn start(
        health: &Health,
    ) -> (SocketAddr, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<std::io::Result<()>>) {
        let l = bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(l, health.clone(), None, async move {
            let _ = rx.await;
        }));
        (addr, tx, task)
    }

    #[test]
    fn conditions_and_readiness() {
        let h = Health::new();
        assert!(h.is_ready(), "no conditions: ready");
        let a = h.condition("a");
        assert!(!h.is_ready());
        assert_eq!(h.snapshot(), vec![("a".to_string(), false, "starting".to_string())]);
        a.set(true, "");
        assert!(h.is_ready() && a.is_ready());
        let again = h.condition("a");
        assert!(again.is_ready(), "same name, same condition");
        let b = h.condition("b");
        assert!(!h.is_ready());
        b.set(false, "line one\nline two");
        assert_eq!(h.snapshot()[1].2, "line one line two");
        b.set(true, "fine");
        assert!(h.is_ready());
    }

    #[test]
    fn addresses() {
        assert!(parse_address("127.0.0.1:9640").is_ok());
        assert!(parse_address("[::1]:9640").is_ok());
        for bad in ["", "127.0.0.1", "localhost:9640", ":9640", "1.2.3.4:99999"] {
            assert!(parse_address(bad).is_err(), "{bad}");
            assert_eq!(bind(bad).unwrap_err().kind(), std::io::ErrorKind::InvalidInput, "{bad}");
        }
        // An address this host does not have: a bind error at once, not later.
        assert!(bind("192.0.2.1:9640").is_err());
        // SO_REUSEADDR does not allow two listeners on one port.
        let l = bind("127.0.0.1:0").unwrap();
        assert!(bind(&l.local_addr().unwrap().to_string()).is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ready_switches_with_conditions() {
        let h = Health::new();
        let cni = h.condition("cni");
        let csi = h.condition("csi");
        let (addr, stop, task) = start(&h).await;

        let r = call(addr, "GET", "/healthz").await;
        assert_eq!((r.status, r.body.as_str()), (200, "ok\n"), "liveness does not depend on readiness");
        assert_eq!(r.header("content-type"), Some("text/plain; charset=utf-8"));

        let r = call(addr, "GET", "/readyz").await;
        assert_eq!(r.status, 503);
        assert_eq!(r.body, "cni: starting\ncsi: starting\n");

        cni.set(false, "no pod CIDR block yet");
        csi.set(true, "");
        let r = call(addr, "GET", "/readyz").await;
        assert_eq!((r.status, r.body.as_str()), (503, "cni: no pod CIDR block yet\n"));

        cni.set(true, "");
        let r = call(addr, "GET", "/readyz").await;
        assert_eq!((r.status, r.body.as_str()), (200, "ok\n"));

        csi.set(false, "registration socket gone");
        let r = call(addr, "GET", "/readyz").await;
        assert_eq!((r.status, r.body.as_str()), (503, "csi: registration socket gone\n"));

        let _ = stop.send(());
        task.await.unwrap().unwrap();
        assert!(std::net::TcpStream::connect(addr).is_err(), "port closed after shutdown");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn verbose_lists_every_condition() {
        let h = Health::new();
        h.condition("cni").set(true, "");
        h.condition("deviceplugins").set(false, "waiting for nodeplane-gpu.sock");
        let (addr, _stop, _task) = start(&h).await;
        let r = call(addr, "GET", "/readyz?verbose").await;
        assert_eq!(r.status, 503);
        assert_eq!(r.body, "[+]cni ok\n[-]deviceplugins failed: waiting for nodeplane-gpu.sock\nreadyz check failed\n");
        h.condition("deviceplugins").set(true, "");
        let r = call(addr, "GET", "/readyz?foo=1&verbose=true").await;
        assert_eq!(r.status, 200);
        assert_eq!(r.body, "[+]cni ok\n[+]deviceplugins ok\nreadyz check passed\n");
        // Any other query is the short form.
        let r = call(addr, "GET", "/readyz?verbosely").await;
        assert_eq!((r.status, r.body.as_str()), (200, "ok\n"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn not_found_and_method_not_allowed() {
        let h = Health::new();
        let (addr, _stop, _task) = start(&h).await;
        for path in ["/", "/metrics", "/healthz/extra", "/readyzz"] {
            assert_eq!(call(addr, "GET", path).await.status, 404, "{path}");
        }
        for (m, p) in [("POST", "/healthz"), ("PUT", "/readyz"), ("DELETE", "/readyz?verbose")] {
            let r = call(addr, m, p).await;
            assert_eq!(r.status, 405, "{m} {p}");
            assert_eq!(r.header("allow"), Some("GET, HEAD"));
        }
        let r = call(addr, "HEAD", "/healthz").await;
        assert_eq!(r.status, 200);
        assert_eq!(r.body, "", "HEAD has no body");
        assert_eq!(r.header("content-length"), Some("3"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn metrics_from_the_source() {
        let registry = crate::obs::metrics::Registry::new();
        let c = crate::obs::metrics::Counters::<[(&str, &str); 1]>::default();
        registry.register("t", "Test counter.", c.clone());
        let r2 = registry.clone();
        let h = Health::new().with_metrics(Arc::new(move || r2.render()));
        h.condition("cni").set(false, "not yet");
        let (addr, _stop, _task) = start(&h).await;
        let r = call(addr, "GET", "/metrics").await;
        assert_eq!(r.status, 200, "answered whatever the readiness");
        assert_eq!(r.header("content-type"), Some("text/plain; version=0.0.4; charset=utf-8"));
        assert_eq!(r.body, "", "nothing counted yet");
        c.get_or_create(&[("k", "a\"b")]).inc();
        let r = call(addr, "GET", "/metrics?x=1").await;
        assert_eq!(r.body, "# HELP t_total Test counter.\n# TYPE t_total counter\nt_total{k=\"a\\\"b\"} 1\n");
        let r = call(addr, "HEAD", "/metrics").await;
        assert_eq!((r.status, r.body.as_str()), (200, ""));
        assert_eq!(call(addr, "POST", "/metrics").await.status, 405);
        // The other paths are unchanged.
        assert_eq!(call(addr, "GET", "/healthz").await.body, "ok\n");
        assert_eq!(call(addr, "GET", "/readyz").await.status, 503);

        // A source that panics: 500, and the server goes on.
        let broken = Health::new().with_metrics(Arc::new(|| panic!("collector bug")));
        let (addr, _stop2, _task2) = start(&broken).await;
        assert_eq!(call(addr, "GET", "/metrics").await.status, 500);
        assert_eq!(call(addr, "GET", "/healthz").await.status, 200);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_client_does_not_block_others() {
        let h = Health::new();
        let (addr, stop, task) = start(&h).await;
        // Half a request line, never finished; and a connection that sends nothing.
        let mut stalled = std::net::TcpStream::connect(addr).unwrap();
        stalled.write_all(b"GET /heal").unwrap();
        let _silent = std::net::TcpStream::connect(addr).unwrap();
        let started = std::time::Instant::now();
        let r = call(addr, "GET", "/healthz").await;
        assert_eq!(r.status, 200);
        assert!(started.elapsed() < Duration::from_secs(2), "answered while others stall");
        // Shutdown does not wait for the stalled clients beyond the grace period.
        let _ = stop.send(());
        tokio::time::timeout(SHUTDOWN_GRACE + Duration::from_secs(3), task)
            .await
            .expect("stopped in time")
            .unwrap()
            .unwrap();
    }
}
