//! Where a node keeps its position between restarts of its consumer.
//!
//! Broadcast consumers own their progress (no broker-side group offsets), so
//! each node stores its own, as RocketMQ's broadcast mode does in
//! `offsets.json`.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::transport::Position;
use crate::util::lock;

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
/// Each save reads the file, replaces one topic's position and writes it
/// back, holding an exclusive lock on `offsets.lock` in the same directory
/// (`flock`), so stores that share a directory, in one process or several,
/// never interleave their writes or lose each other's topics. Temporary
/// files carry the process id and a counter, and leftovers of a crashed
/// writer are removed by the next save.
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

    /// A read or save that never ran to its end on the blocking pool: a
    /// panic there is passed on, as if it had run here; the runtime
    /// shutting down before it ran is an I/O error on the file.
    fn not_run(&self, e: tokio::task::JoinError) -> Error {
        match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => Error::io(self.path(), std::io::Error::other(e)),
        }
    }

    fn read(path: &Path) -> Result<OffsetsFile> {
        match std::fs::read(path) {
            Ok(bytes) => parse(&bytes, path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(OffsetsFile::default()),
            Err(e) => Err(Error::io(path, e)),
        }
    }

    /// Read-modify-write of one topic, under the directory's lock.
    fn save_blocking(dir: &Path, topic: String, position: Position) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(io_at(dir))?;
        let lock_path = dir.join("offsets.lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_at(&lock_path))?;
        // Released when `lock` is closed, on every path out of here.
        lock.lock().map_err(io_at(&lock_path))?;
        Self::remove_leftovers(dir);
        let mut file = Self::read(&dir.join("offsets.json"))?;
        file.offset_table.insert(topic, position);
        Self::write(dir, &file)
    }

    /// Temporary files of writers that crashed before their rename. Only
    /// called under the lock, when no writer can be mid-write.
    fn remove_leftovers(dir: &Path) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("offsets.json.") && name.ends_with(".tmp") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    fn write(dir: &Path, file: &OffsetsFile) -> Result<()> {
        let io = io_at;
        static WRITES: AtomicU64 = AtomicU64::new(0);
        let n = WRITES.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!("offsets.json.{}.{n}.tmp", std::process::id()));
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

fn parse(bytes: &[u8], path: &Path) -> Result<OffsetsFile> {
    serde_json::from_slice(bytes).map_err(|e| {
        // Atomic writes cannot leave a torn file, so this is a hand edit or
        // another program's file: refuse loudly rather than start from scratch.
        Error::Config(format!(
            "{} is not a valid offsets file: {e}",
            path.display()
        ))
    })
}

/// The `offsets` fuzz target, `offsets.json` parsing: what parses is
/// written back (as the store writes it) and parses to the same positions.
#[cfg(any(test, feature = "_fuzz"))]
pub(crate) fn fuzz(data: &[u8]) {
    let path = Path::new("offsets.json");
    let Ok(file) = parse(data, path) else {
        return;
    };
    let json = serde_json::to_vec_pretty(&file).expect("positions serialize");
    let again = parse(&json, path).expect("what the store writes, it reads");
    assert_eq!(again.offset_table, file.offset_table);
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> Error + use<> {
    let path = path.to_owned();
    move |e| Error::io(path, e)
}

#[async_trait]
impl OffsetStore for FileOffsetStore {
    async fn load(&self, topic: &str) -> Result<Option<Position>> {
        let _guard = self.lock.lock().await;
        let path = self.path();
        let file = tokio::task::spawn_blocking(move || Self::read(&path))
            .await
            .map_err(|e| self.not_run(e))??;
        Ok(file.offset_table.get(topic).cloned())
    }

    async fn save(&self, topic: &str, position: &Position) -> Result<()> {
        let _guard = self.lock.lock().await;
        let (dir, topic, position) = (self.dir.clone(), topic.to_owned(), position.clone());
        tokio::task::spawn_blocking(move || Self::save_blocking(&dir, topic, position))
            .await
            .map_err(|e| self.not_run(e))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::Offset;

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

    /// Regression: two stores on one directory (two nodes given the same
    /// data dir, in one process or two) shared a fixed temporary file name,
    /// so their writes interleaved: a rename failed, or a torn or lost
    /// update left a file the next start refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_stores_on_one_directory_never_corrupt_or_lose_each_others_topics() {
        let dir = tempfile::tempdir().unwrap();
        let mut tasks = Vec::new();
        for topic in ["a", "b", "c"] {
            let store = FileOffsetStore::new(dir.path());
            tasks.push(tokio::spawn(async move {
                for i in 0..100u64 {
                    store
                        .save(topic, &Position::single("q0", Offset::Seq(i)))
                        .await
                        .unwrap();
                    assert_eq!(
                        store.load(topic).await.unwrap(),
                        Some(Position::single("q0", Offset::Seq(i))),
                        "{topic} lost its own write"
                    );
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let store = FileOffsetStore::new(dir.path());
        for topic in ["a", "b", "c"] {
            assert_eq!(
                store.load(topic).await.unwrap(),
                Some(Position::single("q0", Offset::Seq(99)))
            );
        }
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
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
