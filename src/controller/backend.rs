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

pub trait Backend: Send + Sync + 'static {
    /// Every node record and the registry revision last committed.
    fn load_nodes(&self) -> Result<(Vec<NodeRecord>, u64), String>;
    /// Commit node changes (one atomic step where the backend can; see the implementation
    /// for what a crash in the middle leaves) and the new registry revision.
    fn commit_nodes(&self, changes: &[Change<NodeRecord>], revision: u64) -> Result<(), String>;
    /// Blocks the backend holds for no node (a change that may still be in flight): the
    /// registry must not hand them out. Valid after `load_nodes`.
    fn reserved_blocks(&self) -> Vec<String> {
        Vec::new()
    }
    fn load_volumes(&self) -> Result<Vec<VolumeRecord>, String>;
    fn commit_volumes(&self, changes: &[Change<VolumeRecord>]) -> Result<(), String>;
    /// For logs.
    fn describe(&self) -> String;
}

const NODES: TableDefinition<&str, &[u8]> = TableDefinition::new("nodes");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("volumes");

/// The embedded store: one redb file; every commit is one fsync'd write transaction, so a
/// `kill -9` at any instant leaves either the old or the new state.
pub struct RedbBackend {
    db: Database,
    path: std::path::PathBuf,
}

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

impl RedbBackend {
    pub fn open(path: &Path) -> Result<Arc<Self>, String> {
        let db = Database::create(path).map_err(|x| format!("{}: {x}", path.display()))?;
        // Make sure the tables exist.
        let w = db.begin_write().map_err(e)?;
        w.open_table(NODES).map_err(e)?;
        w.open_table(META).map_err(e)?;
        w.open_table(VOLUMES).map_err(e)?;
        w.commit().map_err(e)?;
        Ok(Arc::new(RedbBackend { db, path: path.to_path_buf() }))
    }

    fn load_table<T: serde::de::DeserializeOwned>(&self, table: TableDefinition<&str, &[u8]>, what: &str) -> Result<Vec<T>, String> {
        let r = self.db.begin_read().map_err(e)?;
        let t = r.open_table(table).map_err(e)?;
        let mut out = Vec::new();
        for item in t.iter().map_err(e)? {
            let (k, v) = item.map_err(e)?;
            out.push(serde_json::from_slice(v.value()).map_err(|x| format!("{what} record {:?}: {x}", k.value()))?);
        }
        Ok(out)
    }

    fn commit_table<T: serde::Serialize>(
        &self,
        table: TableDefinition<&str, &[u8]>,
        changes: &[Change<T>],
        revision: Option<u64>,
    ) -> Result<(), String> {
        let w = self.db.begin_write().map_err(e)?;
        {
            let mut t = w.open_table(table).map_err(e)?;
            for (key, rec) in changes {
                match rec {
                    Some(r) => {
                        let body = serde_json::to_vec(r).map_err(e)?;
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
    fn load_nodes(&self) -> Result<(Vec<NodeRecord>, u64), String> {
        let nodes = self.load_table(NODES, "node")?;
        let r = self.db.begin_read().map_err(e)?;
        let m = r.open_table(META).map_err(e)?;
        let revision = m.get("revision").map_err(e)?.map(|v| v.value()).unwrap_or(0);
        Ok((nodes, revision))
    }

    fn commit_nodes(&self, changes: &[Change<NodeRecord>], revision: u64) -> Result<(), String> {
        self.commit_table(NODES, changes, Some(revision))
    }

    fn load_volumes(&self) -> Result<Vec<VolumeRecord>, String> {
        self.load_table(VOLUMES, "volume")
    }

    fn commit_volumes(&self, changes: &[Change<VolumeRecord>]) -> Result<(), String> {
        self.commit_table(VOLUMES, changes, None)
    }

    fn describe(&self) -> String {
        format!("embedded database {}", self.path.display())
    }
}
