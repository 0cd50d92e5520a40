//! Where the controller's durable state lives: the node registry's records and the volume
//! book's records, behind one small interface.
//!
//! Two implementations: the embedded redb database (local mode, a single controller process
//! with a data dir) and the Kubernetes API (`super::kube`, in-cluster: the controller can be
//! rescheduled anywhere and finds its state again). Both commit before returning: the
//! registry and the book tell nobody about a change the backend has not made durable.

use std::path::Path;
use std::sync::Arc;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::records::{NodeRecord, VolumeRecord};

/// A change to one record: `Some` creates or replaces, `None` deletes.
pub type Change<T> = (String, Option<T>);

/// Why a backend call failed, by what a caller can do about it. Each variant carries the
/// whole message (what failed and why) and prints exactly that.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// Another writer changed the state since this controller read it (a second controller):
    /// nothing was overwritten; this controller must re-read the state before writing again.
    #[error("{0}")]
    Conflict(String),
    /// This controller is not (or may no longer be) the leader: the call was refused before
    /// it reached the state.
    #[error("{0}")]
    NotLeader(String),
    /// The state could not be reached, or the outcome of a write is unknown (API unreachable,
    /// a timeout, a server error): transient, a retry may succeed.
    #[error("{0}")]
    Unavailable(String),
    /// The API refused the request (a client error other than a conflict): nothing was
    /// written, and retrying the same request will not help.
    #[error("{0}")]
    Refused(String),
    /// Stored data is invalid: a record that does not parse or does not match its key, a
    /// block held twice, a record that cannot be encoded.
    #[error("{0}")]
    Corrupt(String),
    /// The local database failed (open, read, write, commit).
    #[error("{0}")]
    Io(String),
}

pub trait Backend: Send + Sync + 'static {
    /// Every node record and the registry revision last committed.
    fn load_nodes(&self) -> Result<(Vec<NodeRecord>, u64), BackendError>;
    /// Commit node changes (one atomic step where the backend can; see the implementation
    /// for what a crash in the middle leaves) and the new registry revision.
    fn commit_nodes(&self, changes: &[Change<NodeRecord>], revision: u64) -> Result<(), BackendError>;
    /// Blocks the backend holds for no node (a change that may still be in flight): the
    /// registry must not hand them out. Valid after `load_nodes`.
    fn reserved_blocks(&self) -> Vec<String> {
        Vec::new()
    }
    fn load_volumes(&self) -> Result<Vec<VolumeRecord>, BackendError>;
    fn commit_volumes(&self, changes: &[Change<VolumeRecord>]) -> Result<(), BackendError>;
    /// The identity of the store the volume records live in: the same for as long as the
    /// records are kept, a new one when they are lost and the store is made again. Nodes
    /// reclaim orphans only of the store they were made under.
    fn volume_store_id(&self) -> Result<String, BackendError>;
    /// For logs.
    fn describe(&self) -> String;
}

const NODES: TableDefinition<&str, &[u8]> = TableDefinition::new("nodes");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("volumes");
/// The key in `META` of the database's random identity ([`Backend::volume_store_id`]).
const STORE_ID: &str = "store-id";

/// The embedded store: one redb file; every commit is one fsync'd write transaction, so a
/// `kill -9` at any instant leaves either the old or the new state.
pub struct RedbBackend {
    db: Database,
    path: std::path::PathBuf,
}

/// A database error: local I/O.
fn e(x: impl std::fmt::Display) -> BackendError {
    BackendError::Io(x.to_string())
}

impl RedbBackend {
    pub fn open(path: &Path) -> Result<Arc<Self>, BackendError> {
        let db = Database::create(path).map_err(|x| BackendError::Io(format!("{}: {x}", path.display())))?;
        // Make sure the tables exist.
        let w = db.begin_write().map_err(e)?;
        w.open_table(NODES).map_err(e)?;
        {
            let mut meta = w.open_table(META).map_err(e)?;
            // The store's identity, made with the database.
            if meta.get(STORE_ID).map_err(e)?.is_none() {
                meta.insert(STORE_ID, super::records::random_epoch()).map_err(e)?;
            }
        }
        w.open_table(VOLUMES).map_err(e)?;
        w.commit().map_err(e)?;
        Ok(Arc::new(RedbBackend { db, path: path.to_path_buf() }))
    }

    fn load_table<T: serde::de::DeserializeOwned>(
        &self,
        table: TableDefinition<&str, &[u8]>,
        what: &str,
    ) -> Result<Vec<T>, BackendError> {
        let r = self.db.begin_read().map_err(e)?;
        let t = r.open_table(table).map_err(e)?;
        let mut out = Vec::new();
        for item in t.iter().map_err(e)? {
            let (k, v) = item.map_err(e)?;
            out.push(
                serde_json::from_slice(v.value())
                    .map_err(|x| BackendError::Corrupt(format!("{what} record {:?}: {x}", k.value())))?,
            );
        }
        Ok(out)
    }

    fn commit_table<T: serde::Serialize>(
        &self,
        table: TableDefinition<&str, &[u8]>,
        changes: &[Change<T>],
        revision: Option<u64>,
    ) -> Result<(), BackendError> {
        let w = self.db.begin_write().map_err(e)?;
        {
            let mut t = w.open_table(table).map_err(e)?;
            for (key, rec) in changes {
                match rec {
                    Some(r) => {
                        let body = serde_json::to_vec(r).map_err(|x| BackendError::Corrupt(x.to_string()))?;
                        t.insert(key.as_str(), body.as_slice()).map_err(e)?;
                    }
                    None => {
                        t.remove(key.as_str()).map_err(e)?;
                    }
                }
            }
            if let Some(rev) = revision {
                w.open_table(META).map_err(e)?.insert("revision", rev).map_err(e)?;
            }
        }
        w.commit().map_err(e)
    }
}

impl Backend for RedbBackend {
    fn load_nodes(&self) -> Result<(Vec<NodeRecord>, u64), BackendError> {
        let nodes = self.load_table(NODES, "node")?;
        let r = self.db.begin_read().map_err(e)?;
        let m = r.open_table(META).map_err(e)?;
        let revision = m.get("revision").map_err(e)?.map(|v| v.value()).unwrap_or(0);
        Ok((nodes, revision))
    }

    fn commit_nodes(&self, changes: &[Change<NodeRecord>], revision: u64) -> Result<(), BackendError> {
        self.commit_table(NODES, changes, Some(revision))
    }

    fn load_volumes(&self) -> Result<Vec<VolumeRecord>, BackendError> {
        self.load_table(VOLUMES, "volume")
    }

    fn commit_volumes(&self, changes: &[Change<VolumeRecord>]) -> Result<(), BackendError> {
        self.commit_table(VOLUMES, changes, None)
    }

    fn volume_store_id(&self) -> Result<String, BackendError> {
        let r = self.db.begin_read().map_err(e)?;
        let id = r.open_table(META).map_err(e)?.get(STORE_ID).map_err(e)?.map(|v| v.value());
        let id = id.ok_or_else(|| BackendError::Corrupt(format!("{}: no {STORE_ID}", self.path.display())))?;
        Ok(format!("redb-{id:016x}"))
    }

    fn describe(&self) -> String {
        format!("embedded database {}", self.path.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_that_does_not_parse_is_corrupt_and_keeps_its_message() {
        let dir = crate::util::TestDir::new("backend-corrupt");
        let db = RedbBackend::open(&dir.0.join("db.redb")).unwrap();
        let w = db.db.begin_write().unwrap();
        w.open_table(NODES).unwrap().insert("node-a", b"not json".as_slice()).unwrap();
        w.commit().unwrap();
        let e = db.load_nodes().unwrap_err();
        assert!(matches!(e, BackendError::Corrupt(_)), "{e:?}");
        assert!(e.to_string().starts_with("node record \"node-a\": "), "{e}");
    }

    #[test]
    fn the_store_id_stays_with_the_database_and_a_new_one_gets_another() {
        let dir = crate::util::TestDir::new("backend-store-id");
        let path = dir.0.join("db.redb");
        let first = RedbBackend::open(&path).unwrap().volume_store_id().unwrap();
        assert!(first.starts_with("redb-") && first.len() == 21, "{first}");
        assert_eq!(RedbBackend::open(&path).unwrap().volume_store_id().unwrap(), first);
        std::fs::remove_file(&path).unwrap();
        assert_ne!(RedbBackend::open(&path).unwrap().volume_store_id().unwrap(), first);
    }
}
