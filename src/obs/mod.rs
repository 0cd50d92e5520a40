//! Observability, below the planes: the health endpoint and readiness conditions
//! (`health`), the Prometheus encoder and metric types (`metrics`), and the doctor's
//! findings (`doctor`). Planes and composition use these; nothing here imports a plane.

pub mod doctor;
pub mod health;
pub mod logging;
pub mod metrics;
