//! The relay's publishing task: what the stream gathered, checked visible
//! and published, while the stream goes on reading.
//!
//! A session hands its committed batches over in commit order, as jobs,
//! and confirms the slot's position as jobs land. The work is pipelined in
//! two stages, each a job at a time: the visibility check of the next job
//! runs while the one before is published, and the stream gathers the one
//! after. So the relay waits for no round trip in series with its reading:
//! under a storm the batches grow while a job is under way (a job is
//! handed over as soon as there is room), and a quiet stream publishes
//! each commit at once. Jobs are published one after another, so each
//! cache's changes reach the wire in commit order; within a job the caches
//! are published at once, each by its own publish (the publisher keeps
//! one cache's numbers in order).
//!
//! Bounded: the hand-over channel holds one job, each stage one more, and
//! the channel between them one: at most four jobs of at most
//! `MAX_BATCH_BYTES` each, beside the batch the stream gathers.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use pgwire_replication::Lsn;
use tokio::sync::{mpsc, watch};

use super::relay::Inner;
use super::slot;
use super::state;
use super::stream::SQL_TIMEOUT;
use crate::error::{Error, Result};
use crate::wire::Change;

/// Committed work handed over by the stream.
pub(super) struct Job {
    pub(super) publishes: Vec<(String, Vec<Change>)>,
    /// Its transactions, for the visibility check.
    pub(super) xids: Vec<u32>,
    /// The LSN of the newest resync message in it.
    pub(super) resync: Option<u64>,
    /// A freshness mark it holds: reported once it is published.
    pub(super) watermark: Option<tokio::time::Instant>,
    /// The end of its last commit: confirmed once it is published.
    pub(super) end: Option<Lsn>,
    pub(super) transactions: u64,
    pub(super) rows: u64,
}

/// What the task has published, for the stream to confirm.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Progress {
    /// Jobs published, counted from the session's start.
    pub(super) jobs: u64,
    /// The end of the newest commit published.
    pub(super) end: Option<Lsn>,
    /// Resync messages at or below this LSN were applied.
    pub(super) done: u64,
}

/// The task's ends, for the stream.
pub(super) struct Handle {
    pub(super) jobs: mpsc::Sender<Job>,
    pub(super) progress: watch::Receiver<Progress>,
    pub(super) task: Task,
}

/// The task, aborted if the session is dropped (a stop whose grace ran
/// out): a dropped session's jobs are streamed again by the next one.
pub(super) struct Task(pub(super) tokio::task::JoinHandle<Result<()>>);

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Task {
    /// Waits for the task to end (its jobs published, once the stream let
    /// go of the channel), with its error if it failed.
    pub(super) async fn finish(&mut self) -> Result<()> {
        match (&mut self.0).await {
            Ok(result) => result,
            Err(e) => Err(crate::cdc::slot::db(format!(
                "the relay's publishing task ended: {e}"
            ))),
        }
    }
}

/// Starts the task for one session. `done`: resync messages at or below
/// it were applied before the session started.
pub(super) fn start(inner: Arc<Inner>, done: u64) -> Handle {
    let (jobs, rx) = mpsc::channel(1);
    let (progress, progress_rx) = watch::channel(Progress {
        done,
        ..Progress::default()
    });
    let task = tokio::spawn(run(inner, rx, progress));
    Handle {
        jobs,
        progress: progress_rx,
        task: Task(task),
    }
}

async fn run(
    inner: Arc<Inner>,
    mut jobs: mpsc::Receiver<Job>,
    progress: watch::Sender<Progress>,
) -> Result<()> {
    let (visible_tx, mut visible) = mpsc::channel::<Job>(1);
    let inner = &*inner;
    let check = async move {
        while let Some(job) = jobs.recv().await {
            check_visible(inner, &job).await?;
            if visible_tx.send(job).await.is_err() {
                break;
            }
        }
        // Dropping `visible_tx` here ends the publishing stage once it has
        // published what was checked.
        Ok::<(), Error>(())
    };
    let publish = async {
        while let Some(job) = visible.recv().await {
            publish_job(inner, job, &progress).await?;
        }
        Ok(())
    };
    tokio::try_join!(check, publish).map(|_| ())
}

/// Nothing is published before its transactions are visible: see
/// `slot::wait_visible` and `slot::wait_committed_visible`.
async fn check_visible(inner: &Inner, job: &Job) -> Result<()> {
    if !job.publishes.is_empty() {
        tokio::time::timeout(SQL_TIMEOUT, slot::wait_visible(&inner.pool, &job.xids))
            .await
            .map_err(|_| slot::db("the visibility check timed out"))??;
    }
    if job.resync.is_some() {
        tokio::time::timeout(SQL_TIMEOUT, slot::wait_committed_visible(&inner.pool))
            .await
            .map_err(|_| slot::db("the visibility check timed out"))??;
    }
    Ok(())
}

async fn publish_job(inner: &Inner, job: Job, progress: &watch::Sender<Progress>) -> Result<()> {
    // Every cache's publish is awaited, failed or not, before the error
    // ends the session: none is cut off half sent.
    let results =
        futures_util::future::join_all(job.publishes.into_iter().map(
            |(cache, changes)| async move {
                super::batch::publish(&inner.publisher, &cache, changes).await
            },
        ))
        .await;
    for result in results {
        result?;
    }
    let mut done = None;
    if let Some(at) = job.resync {
        // Recorded before the position is confirmed: a server crash that
        // forgets the confirmation streams the message again, and this
        // says it was applied. Failing to record it costs a second clear
        // at worst.
        let marked = tokio::time::timeout(
            SQL_TIMEOUT,
            state::mark_done(&inner.pool, &inner.publication, &inner.shared.slot, at),
        )
        .await;
        if !matches!(marked, Ok(Ok(()))) {
            tracing::warn!(slot = %inner.shared.slot, "cdc relay: recording a resync as applied failed; a server crash may apply it again");
        }
        done = Some(at);
        // Counted once published: a session that fails before leaves it
        // to the next, which publishes (and counts) it.
        inner.shared.resyncs.fetch_add(1, Ordering::Relaxed);
    }
    if let Some(at) = job.watermark {
        // After the job, and every job before it: all that the mark
        // vouches for is published.
        super::watermark::report(inner, at).await;
    }
    inner
        .shared
        .transactions
        .fetch_add(job.transactions, Ordering::Relaxed);
    inner.shared.rows.fetch_add(job.rows, Ordering::Relaxed);
    progress.send_modify(|p| {
        p.jobs = p.jobs.saturating_add(1);
        if job.end.is_some() {
            p.end = p.end.max(job.end);
        }
        if let Some(at) = done {
            p.done = p.done.max(at);
        }
    });
    Ok(())
}
