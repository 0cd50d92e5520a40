//! kubelet plugin registration (`pluginregistration.v1.Registration`), for any plugin kind
//! kubelet discovers through `<kubelet>/plugins_registry/`: the CSI driver today, a DRA
//! driver next. The plugin serves its registration socket there; kubelet dials it, asks
//! `GetInfo` (type, name, endpoint, versions) and answers with `NotifyRegistrationStatus`,
//! which goes into the registration book.

use std::path::PathBuf;

use tonic::{Request, Response, Status};

use super::{Kind, Registrations};
use crate::rpc::pluginregistration as reg;

/// What one plugin tells kubelet about itself.
#[derive(Clone)]
pub struct PluginInfo {
    /// The book's kind for this plugin.
    pub kind: Kind,
    /// kubelet's plugin type: `CSIPlugin` or `DRAPlugin`.
    pub plugin_type: &'static str,
    /// Driver name.
    pub name: String,
    /// The plugin's own service socket (absolute).
    pub endpoint: PathBuf,
    /// Versions of the plugin's service API it speaks.
    pub versions: Vec<String>,
}

impl PluginInfo {
    fn label(&self) -> &'static str {
        match self.plugin_type {
            "CSIPlugin" => "CSI",
            "DRAPlugin" => "DRA",
            other => other,
        }
    }
}

/// The registration service of one plugin; kubelet's answer goes into `book`.
#[derive(Clone)]
pub struct Registration {
    pub info: PluginInfo,
    pub book: Registrations,
}

#[tonic::async_trait]
impl reg::registration_server::Registration for Registration {
    async fn get_info(&self, _: Request<reg::InfoRequest>) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(reg::PluginInfo {
            r#type: self.info.plugin_type.into(),
            name: self.info.name.clone(),
            endpoint: self.info.endpoint.to_string_lossy().into_owned(),
            supported_versions: self.info.versions.clone(),
        }))
    }

    async fn notify_registration_status(
        &self,
        r: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let r = r.into_inner();
        let (name, label) = (&self.info.name, self.info.label());
        if r.plugin_registered {
            tracing::info!(driver = %name, "kubelet registered the {label} plugin");
            self.book.registered(name);
        } else {
            tracing::error!(driver = %name, error = %r.error, "kubelet refused the {label} plugin registration");
            let why = if r.error.is_empty() { "kubelet gave no reason".to_string() } else { r.error };
            self.book.refused(name, why);
        }
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

/// Bind `socket` and serve the plugin's registration there until `shutdown` resolves;
/// the book learns the socket is offered. The caller removes the socket (first, before
/// its own service goes) and tells the book the plugin is withdrawn.
pub fn serve(
    socket: &std::path::Path,
    registration: Registration,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>, String> {
    let listener =
        crate::sys::fs::bind_unix_socket(socket).map_err(|e| format!("binding {}: {e}", socket.display()))?;
    let (book, kind, name) = (registration.book.clone(), registration.info.kind, registration.info.name.clone());
    let server = tonic::transport::Server::builder()
        .layer(crate::rpc::response_layer())
        .add_service(reg::registration_server::RegistrationServer::new(registration))
        .serve_with_incoming_shutdown(crate::rpc::authority::incoming(listener), shutdown);
    let task = tokio::spawn(server);
    book.served(kind, &name, socket.to_path_buf());
    tracing::info!(socket = %socket.display(), "kubelet registration socket served");
    Ok(task)
}
