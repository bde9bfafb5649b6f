//! Where a node keeps its position between restarts of its consumer.
//!
//! Broadcast consumers own their progress (no broker-side group offsets), so
//! each node stores its own, as RocketMQ's broadcast mode does in
//! `offsets.json`.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::bus::Position;
use crate::error::{Error, Result};
use crate::lock;

/// Stores a node's position per topic.
///
/// The consumer saves periodically and on clean shutdown. After a crash the
/// position may be up to one interval old: the events since are delivered
/// again, which is harmless because applying an event is idempotent.
#[async_trait]
pub trait OffsetStore: Send + Sync + fmt::Debug + 'static {
    /// The stored position for `topic`, if any.
    async fn load(&self, topic: &str) -> Result<Option<Position>>;
    /// Replaces the stored position for `topic`.
    async fn save(&self, topic: &str, position: &Position) -> Result<()>;
}

/// Keeps positions in memory: they survive a consumer restart inside the
/// process, not a process restart. The default. Clones share positions.
#[derive(Debug, Clone, Default)]
pub struct MemoryOffsetStore {
    positions: Arc<Mutex<HashMap<String, Position>>>,
}

impl MemoryOffsetStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl OffsetStore for MemoryOffsetStore {
    async fn load(&self, topic: &str) -> Result<Option<Position>> {
        let positions = lock(&self.positions);
        Ok(positions.get(topic).cloned())
    }

    async fn save(&self, topic: &str, position: &Position) -> Result<()> {
        let mut positions = lock(&self.positions);
        positions.insert(topic.to_owned(), position.clone());
        Ok(())
    }
}

/// Keeps positions in `offsets.json` in a directory of the node's own,
/// written atomically (a temporary file, fsync, rename, fsync of the
/// directory), so a crash leaves either the old file or the new one.
///
/// ```json
/// {"offsetTable": {"cache-sync": {"embedded-9f3c…": 1042}}}
/// ```
#[derive(Debug, Clone)]
pub struct FileOffsetStore {
    dir: PathBuf,
    /// Serialises read-modify-write of the file across topics.
    lock: Arc<tokio::sync::Mutex<()>>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct OffsetsFile {
    #[serde(rename = "offsetTable")]
    offset_table: BTreeMap<String, Position>,
}

impl FileOffsetStore {
    /// Stores in `dir/offsets.json`; the directory is created on first save.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            lock: Arc::default(),
        }
    }

    /// The file positions are kept in.
    pub fn path(&self) -> PathBuf {
        self.dir.join("offsets.json")
    }

    fn read(path: &Path) -> Result<OffsetsFile> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                // Atomic writes cannot leave a torn file, so this is a hand edit or
                // another program's file: refuse loudly rather than start from scratch.
                Error::Config(format!(
                    "{} is not a valid offsets file: {e}",
                    path.display()
                ))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(OffsetsFile::default()),
            Err(e) => Err(Error::io(path.display(), e)),
        }
    }

    fn write(dir: &Path, file: &OffsetsFile) -> Result<()> {
        let io = |p: &Path| {
            let p = p.display().to_string();
            move |e| Error::io(&p, e)
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let tmp = dir.join("offsets.json.tmp");
        let target = dir.join("offsets.json");
        let json = serde_json::to_vec_pretty(file).map_err(|e| Error::Encode {
            what: "offsets",
            message: e.to_string(),
        })?;
        let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(&json).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        drop(f);
        std::fs::rename(&tmp, &target).map_err(io(&target))?;
        // Make the rename itself durable.
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io(dir))?;
        Ok(())
    }
}

#[async_trait]
impl OffsetStore for FileOffsetStore {
    async fn load(&self, topic: &str) -> Result<Option<Position>> {
        let _guard = self.lock.lock().await;
        let path = self.path();
        let file = tokio::task::spawn_blocking(move || Self::read(&path))
            .await
            .map_err(|e| Error::io("offsets.json", std::io::Error::other(e)))??;
        Ok(file.offset_table.get(topic).cloned())
    }

    async fn save(&self, topic: &str, position: &Position) -> Result<()> {
        let _guard = self.lock.lock().await;
        let (dir, topic, position) = (self.dir.clone(), topic.to_owned(), position.clone());
        tokio::task::spawn_blocking(move || {
            let mut file = Self::read(&dir.join("offsets.json"))?;
            file.offset_table.insert(topic, position);
            Self::write(&dir, &file)
        })
        .await
        .map_err(|e| Error::io("offsets.json", std::io::Error::other(e)))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::Offset;

    #[tokio::test]
    async fn file_store_round_trips_per_topic_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileOffsetStore::new(dir.path().join("node-1"));
        assert_eq!(store.load("t").await.unwrap(), None);
        let a = Position::single("q0", Offset::Seq(7));
        let b = Position::single("stream", Offset::Id("1700-3".into()));
        store.save("t", &a).await.unwrap();
        store.save("u", &b).await.unwrap();
        let reopened = FileOffsetStore::new(dir.path().join("node-1"));
        assert_eq!(reopened.load("t").await.unwrap(), Some(a));
        assert_eq!(reopened.load("u").await.unwrap(), Some(b));
        let text = std::fs::read_to_string(store.path()).unwrap();
        assert!(text.contains("\"offsetTable\""), "{text}");
        assert!(!dir.path().join("node-1/offsets.json.tmp").exists());
    }

    #[tokio::test]
    async fn corrupt_file_fails_loudly() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("offsets.json"), b"{not json").unwrap();
        let err = FileOffsetStore::new(dir.path())
            .load("t")
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("not a valid offsets file"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn memory_store_clones_share() {
        let store = MemoryOffsetStore::new();
        store
            .clone()
            .save("t", &Position::single("p", Offset::Seq(1)))
            .await
            .unwrap();
        assert!(store.load("t").await.unwrap().is_some());
    }
}
