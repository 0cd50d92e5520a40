//! What `nodeplane doctor` reports: one finding per orphan, from any plane (network,
//! storage), and what a repair did about it.

/// One thing `nodeplane doctor` found: what kind of orphan, which object, why, and (when a
/// repair was asked for) what was done about it.
#[derive(Debug, Clone)]
pub struct Finding {
    pub kind: &'static str,
    pub subject: String,
    pub detail: String,
    /// `None`: no repair asked for, or this kind is never repaired automatically.
    pub repair: Option<Repair>,
}

#[derive(Debug, Clone)]
pub enum Repair {
    Done(String),
    Failed(String),
    /// Left alone on purpose (the message says why and what the operator can do).
    Skipped(String),
}

impl Finding {
    pub fn new(kind: &'static str, subject: impl Into<String>, detail: impl Into<String>) -> Self {
        Finding { kind, subject: subject.into(), detail: detail.into(), repair: None }
    }
}
