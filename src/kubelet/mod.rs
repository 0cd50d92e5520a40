//! kubelet's view of the plugins this agent serves: for the CSI driver (plugin registration,
//! `NotifyRegistrationStatus`) and each device plugin resource (`Register`'s answer), whether
//! kubelet registered it, when, and if not, why. Serving a socket proves nothing: kubelet
//! may look elsewhere (another `--root-dir`), refuse the plugin, or not be running. Status
//! (`nodeplane status`), readiness (`/readyz`), metrics and a warning read this book.
//!
//! Readiness: a plugin kubelet *refused* fails its condition at once. One that kubelet has not
//! registered within the grace period (30 s by default) is logged as a warning, shown in
//! status and metrics, and fails readiness only when the agent is told kubelet must be there
//! (`requireKubeletRegistration`, set by the DaemonSet manifests; local clusters and tests run
//! agents without a kubelet).

pub mod registration;

use crate::rpc::node as api;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Default for `kubeletRegistrationGraceSeconds`.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Csi,
    DevicePlugin,
    Dra,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Csi => "csi",
            Kind::DevicePlugin => "deviceplugin",
            Kind::Dra => "dra",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Served; kubelet has not answered yet.
    Waiting,
    Registered,
    /// kubelet answered no, with its message.
    Refused(String),
    /// We could not reach kubelet (device plugins dial it), with why.
    Unreachable(String),
}

impl State {
    pub fn name(&self) -> &'static str {
        match self {
            State::Waiting => "waiting",
            State::Registered => "registered",
            State::Refused(_) => "refused",
            State::Unreachable(_) => "unreachable",
        }
    }
    pub fn error(&self) -> Option<&str> {
        match self {
            State::Refused(e) | State::Unreachable(e) => Some(e),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
struct Entry {
    kind: Kind,
    /// The socket kubelet is expected to dial (CSI: the registration socket) or that we
    /// dial (device plugins: kubelet.sock).
    socket: PathBuf,
    state: State,
    /// When the current state began.
    since: SystemTime,
    /// Since when kubelet should have registered the plugin (served, or kubelet came back).
    waiting_since: Instant,
    registered_at: Option<SystemTime>,
    registrations: u64,
    warned: bool,
}

/// The book, shared by the CSI registration server, the device plugin manager, readiness,
/// status and metrics.
#[derive(Clone)]
pub struct Registrations {
    inner: Arc<Mutex<BTreeMap<String, Entry>>>,
    pub grace: Duration,
    pub required: bool,
}

fn unix(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

impl Registrations {
    pub fn new(grace: Duration, required: bool) -> Self {
        Registrations { inner: Arc::default(), grace, required }
    }

    fn with<R>(&self, f: impl FnOnce(&mut BTreeMap<String, Entry>) -> R) -> R {
        f(&mut self.inner.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// `name` is served at `socket` and waits for kubelet (again).
    pub fn served(&self, kind: Kind, name: &str, socket: PathBuf) {
        self.with(|m| {
            let registrations = m.get(name).map_or(0, |e| e.registrations);
            m.insert(
                name.to_string(),
                Entry {
                    kind,
                    socket,
                    state: State::Waiting,
                    since: SystemTime::now(),
                    waiting_since: Instant::now(),
                    registered_at: None,
                    registrations,
                    warned: false,
                },
            );
        });
    }

    /// `name` waits for kubelet again (the kubelet it was registered with restarted).
    pub fn waiting(&self, name: &str) {
        self.with(|m| {
            if let Some(e) = m.get_mut(name) {
                e.state = State::Waiting;
                e.since = SystemTime::now();
                e.waiting_since = Instant::now();
                e.warned = false;
            }
        });
    }

    fn set(&self, name: &str, state: State) {
        self.with(|m| {
            let Some(e) = m.get_mut(name) else { return };
            if state == State::Registered {
                e.registrations += 1;
                e.registered_at = Some(SystemTime::now());
                e.warned = false;
            }
            if e.state != state {
                e.since = SystemTime::now();
            }
            e.state = state;
        });
    }

    pub fn registered(&self, name: &str) {
        self.set(name, State::Registered);
    }

    pub fn refused(&self, name: &str, error: impl Into<String>) {
        self.set(name, State::Refused(error.into()));
    }

    /// kubelet could not be reached on a registration attempt; replaces any earlier state
    /// (the device plugin manager only attempts plugins that are not registered with the
    /// kubelet behind the current socket).
    pub fn unreachable(&self, name: &str, error: impl Into<String>) {
        self.set(name, State::Unreachable(error.into()));
    }

    /// `name` is no longer served.
    pub fn withdrawn(&self, name: &str) {
        self.with(|m| m.remove(name));
    }

    /// How often kubelet has registered `name` since it was first served (0 when unknown).
    pub fn registrations(&self, name: &str) -> u64 {
        self.with(|m| m.get(name).map_or(0, |e| e.registrations))
    }

    pub fn state(&self, name: &str) -> Option<State> {
        self.with(|m| m.get(name).map(|e| e.state.clone()))
    }

    /// Warn once for every plugin kubelet has not registered within the grace period.
    pub fn warn_overdue(&self) {
        let grace = self.grace;
        self.with(|m| {
            for (name, e) in m.iter_mut() {
                if e.state != State::Registered && !e.warned && e.waiting_since.elapsed() >= grace {
                    e.warned = true;
                    tracing::warn!(
                        plugin = %name,
                        kind = e.kind.as_str(),
                        socket = %e.socket.display(),
                        state = e.state.name(),
                        error = e.state.error().unwrap_or(""),
                        grace_s = grace.as_secs_f64(),
                        "kubelet has not registered a plugin this agent serves (is kubeletDir / devicePluginDir the directory kubelet uses?)"
                    );
                }
            }
        });
    }

    /// The readiness verdict for the plugins of `kind`: refused fails; not registered past
    /// the grace period fails when registration is required.
    pub fn condition(&self, kind: Kind) -> Result<(), String> {
        let (grace, required) = (self.grace, self.required);
        self.with(|m| {
            let mut problems = Vec::new();
            for (name, e) in m.iter().filter(|(_, e)| e.kind == kind) {
                match &e.state {
                    State::Registered => {}
                    State::Refused(why) => problems.push(format!("kubelet refused {name}: {why}")),
                    other if required && e.waiting_since.elapsed() >= grace => problems.push(format!(
                        "kubelet has not registered {name} within {} s ({}{})",
                        grace.as_secs(),
                        other.name(),
                        other.error().map(|e| format!(": {e}")).unwrap_or_default()
                    )),
                    _ => {}
                }
            }
            if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) }
        })
    }

    /// For `nodeplane status` (`kubelet.plugins`).
    pub fn report(&self) -> api::KubeletStatus {
        self.with(|m| api::KubeletStatus {
            grace_seconds: self.grace.as_secs_f64(),
            required: self.required,
            plugins: m
                .iter()
                .map(|(name, e)| api::KubeletPlugin {
                    name: name.clone(),
                    kind: match e.kind {
                        Kind::Csi => api::PluginKind::Csi,
                        Kind::DevicePlugin => api::PluginKind::DevicePlugin,
                        Kind::Dra => api::PluginKind::Dra,
                    } as i32,
                    socket: e.socket.display().to_string(),
                    state: match e.state {
                        State::Waiting => api::RegistrationState::Waiting,
                        State::Registered => api::RegistrationState::Registered,
                        State::Refused(_) => api::RegistrationState::Refused,
                        State::Unreachable(_) => api::RegistrationState::Unreachable,
                    } as i32,
                    error: e.state.error().map(str::to_string),
                    since_unix: unix(e.since),
                    registered_unix: e.registered_at.map(unix),
                    registrations: e.registrations,
                    overdue: e.state != State::Registered && e.waiting_since.elapsed() >= self.grace,
                })
                .collect(),
        })
    }

    /// `(kind, name, registered?)` of every plugin, for the metrics.
    pub fn rows(&self) -> Vec<(Kind, String, bool)> {
        self.with(|m| m.iter().map(|(n, e)| (e.kind, n.clone(), e.state == State::Registered)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_and_conditions() {
        let r = Registrations::new(Duration::from_millis(0), false);
        r.served(Kind::Csi, "csi.x", "/r/x-reg.sock".into());
        r.served(Kind::DevicePlugin, "x/gpu", "/d/kubelet.sock".into());
        assert_eq!(r.state("csi.x"), Some(State::Waiting));
        // Not required: waiting past the grace is not a readiness failure.
        assert_eq!(r.condition(Kind::Csi), Ok(()));
        r.refused("csi.x", "no supported version");
        assert_eq!(r.condition(Kind::Csi), Err("kubelet refused csi.x: no supported version".into()));
        assert_eq!(r.condition(Kind::DevicePlugin), Ok(()));
        r.registered("csi.x");
        assert_eq!(r.condition(Kind::Csi), Ok(()));
        let st = r.report();
        assert_eq!(st.plugins[0].state(), api::RegistrationState::Registered);
        assert_eq!(st.plugins[0].registrations, 1);
        assert!(st.plugins[0].registered_unix.unwrap() > 0.0);

        let req = Registrations::new(Duration::from_millis(0), true);
        req.served(Kind::DevicePlugin, "x/gpu", "/d/kubelet.sock".into());
        req.unreachable("x/gpu", "/d/kubelet.sock does not exist");
        let e = req.condition(Kind::DevicePlugin).unwrap_err();
        assert!(
            e.contains("has not registered x/gpu") && e.contains("unreachable: /d/kubelet.sock does not exist"),
            "{e}"
        );
        req.registered("x/gpu");
        assert_eq!(req.condition(Kind::DevicePlugin), Ok(()));
        req.waiting("x/gpu");
        assert_eq!(req.state("x/gpu"), Some(State::Waiting));
        assert!(req.condition(Kind::DevicePlugin).is_err());
        req.withdrawn("x/gpu");
        assert_eq!(req.condition(Kind::DevicePlugin), Ok(()));
        assert!(req.rows().is_empty());
    }

    #[test]
    fn grace_period_is_respected() {
        let r = Registrations::new(Duration::from_secs(3600), true);
        r.served(Kind::Csi, "csi.x", "/r/x-reg.sock".into());
        assert_eq!(r.condition(Kind::Csi), Ok(()));
        assert!(!r.report().plugins[0].overdue);
    }
}
