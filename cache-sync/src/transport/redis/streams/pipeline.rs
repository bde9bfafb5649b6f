//! Pipelined publishing to one Redis server: publishes are queued in the
//! order they are handed over, and one task sends what is queued as one
//! non-atomic pipeline per round trip, waiting for its replies before it
//! sends the next, so the order of the queue is the order on the wire.
//!
//! On a Redis Cluster the transport does not pipeline (one call at a
//! time, as before): a pipeline's redirects and retries there are the
//! cluster connection's, and it does not promise their order.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use redis::aio::ConnectionManager;
use redis::{ErrorKind, RedisError, RedisResult, ServerErrorKind, Value};
use tokio::sync::{mpsc, oneshot};

use super::StreamKeys;
use crate::error::{Error, Result};
use crate::transport::redis::{STREAMS, map_err};
use crate::util::lock;

/// Publishes queued and not yet taken by the writer, at most: a full queue
/// makes a hand-over wait (a publisher's window is usually smaller).
const QUEUE: usize = 1024;
/// Publishes in one pipeline, at most.
const MAX_BATCH: usize = 256;
/// Payload bytes in one pipeline, at most (a larger single payload goes
/// alone): a pipeline's reply must come within the response timeout.
const MAX_PIPELINE_BYTES: usize = 4 << 20;

/// One publish waiting in the queue.
struct Job {
    keys: Arc<StreamKeys>,
    max_len: usize,
    tag: String,
    payload: Bytes,
    /// The entry id, or why not.
    reply: oneshot::Sender<RedisResult<String>>,
}

/// The queue to the writer task, which is started by the first publish on
/// that publish's runtime, and again by a later one should that runtime
/// have shut down (a transport can outlive the runtime it first
/// published on).
pub(super) struct Pipeline {
    conn: ConnectionManager,
    script: redis::Script,
    queue: Mutex<Option<mpsc::Sender<Job>>>,
}

impl Pipeline {
    pub(super) fn new(conn: ConnectionManager, script: redis::Script) -> Self {
        Self {
            conn,
            script,
            queue: Mutex::new(None),
        }
    }

    /// Queues a publish. Once this returns, its place on the wire is fixed
    /// after every publish queued before it; the receiver gets the entry id.
    /// Dropped before it returns, nothing was queued.
    pub(super) async fn hand_over(
        &self,
        keys: Arc<StreamKeys>,
        max_len: usize,
        tag: &str,
        payload: Bytes,
    ) -> Result<oneshot::Receiver<RedisResult<String>>> {
        let (reply, answer) = oneshot::channel();
        let mut job = Job {
            keys,
            max_len,
            tag: tag.to_owned(),
            payload,
            reply,
        };
        // Twice at most: a queue whose writer is gone (its runtime shut
        // down) is replaced once.
        for _ in 0..2 {
            let queue = self.queue();
            match queue.send(job).await {
                Ok(()) => return Ok(answer),
                Err(mpsc::error::SendError(back)) => {
                    job = back;
                    let mut current = lock(&self.queue);
                    if current.as_ref().is_some_and(|q| q.same_channel(&queue)) {
                        *current = None;
                    }
                }
            }
        }
        Err(Error::disconnected(
            STREAMS,
            "the publishing task could not be started",
        ))
    }

    /// The queue, with a writer reading it.
    fn queue(&self) -> mpsc::Sender<Job> {
        let mut current = lock(&self.queue);
        if let Some(queue) = current.as_ref().filter(|q| !q.is_closed()) {
            return queue.clone();
        }
        let (queue, jobs) = mpsc::channel(QUEUE);
        // Outside a runtime the receiver is dropped at once, and the send
        // fails as a disconnect.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(write(self.conn.clone(), self.script.clone(), jobs));
        }
        *current = Some(queue.clone());
        queue
    }
}

/// The writer: sends what is queued, in order, one pipeline at a time,
/// until every sender is gone.
async fn write(mut conn: ConnectionManager, script: redis::Script, mut jobs: mpsc::Receiver<Job>) {
    let mut batch = Vec::new();
    while let Some(first) = jobs.recv().await {
        let mut bytes = first.payload.len();
        batch.push(first);
        while batch.len() < MAX_BATCH && bytes < MAX_PIPELINE_BYTES {
            match jobs.try_recv() {
                Ok(job) => {
                    bytes = bytes.saturating_add(job.payload.len());
                    batch.push(job);
                }
                Err(_) => break,
            }
        }
        send(&mut conn, &script, &mut batch).await;
    }
}

/// Sends `batch` as one pipeline and answers each publish in it.
///
/// Each command's own error goes to its publish alone; a pipeline that
/// fails as a whole (a lost connection, a timeout) fails every publish in
/// it, though some may have reached the server: their numbers are used,
/// as for any failed publish. A script missing from the server's cache
/// (`NOSCRIPT`: a restarted or flushed server) is loaded, and the
/// publishes refused for it are sent again only when they are the end of
/// the pipeline: then nothing sent after them went through, and order
/// holds. Otherwise (the cache flushed in the middle of the pipeline)
/// they fail.
async fn send(conn: &mut ConnectionManager, script: &redis::Script, batch: &mut Vec<Job>) {
    let mut retried = false;
    while !batch.is_empty() {
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for job in batch.iter() {
            pipe.cmd("EVALSHA")
                .arg(script.get_hash())
                .arg(3)
                .arg(&job.keys.stream)
                .arg(&job.keys.counter)
                .arg(&job.keys.epoch)
                .arg(job.max_len)
                .arg(&job.tag)
                .arg(job.payload.as_ref());
        }
        let replies: Vec<Value> = match pipe.query_async::<Vec<Value>>(conn).await {
            Ok(replies) if replies.len() == batch.len() => replies,
            Ok(replies) => {
                let e = RedisError::from((
                    ErrorKind::Client,
                    "a pipeline's replies do not match its commands",
                    format!("{} for {}", replies.len(), batch.len()),
                ));
                return answer_all(batch, &e);
            }
            Err(e) => return answer_all(batch, &e),
        };
        let results: Vec<RedisResult<String>> = replies
            .into_iter()
            .map(|v| match v {
                Value::ServerError(e) => Err(RedisError::from(e)),
                v => redis::from_redis_value(v).map_err(RedisError::from),
            })
            .collect();
        let no_script = |r: &RedisResult<String>| {
            r.as_ref()
                .is_err_and(|e| e.kind() == ErrorKind::Server(ServerErrorKind::NoScript))
        };
        let first_missing = results.iter().position(no_script);
        let again_from = first_missing
            .filter(|&i| !retried && results[i..].iter().all(no_script))
            .unwrap_or(results.len());
        let again = batch.split_off(again_from);
        for (job, result) in batch.drain(..).zip(results) {
            let _ = job.reply.send(result);
        }
        *batch = again;
        if !batch.is_empty() {
            retried = true;
            if let Err(e) = script.prepare_invoke().load_async(conn).await {
                return answer_all(batch, &e);
            }
        }
    }
}

/// Fails every publish in `batch` with `e`.
fn answer_all(batch: &mut Vec<Job>, e: &RedisError) {
    for job in batch.drain(..) {
        let _ = job.reply.send(Err(e.clone()));
    }
}

/// The entry id a publish's answer carries, or its error as the
/// transport's.
pub(super) async fn acknowledged(answer: oneshot::Receiver<RedisResult<String>>) -> Result<String> {
    match answer.await {
        Ok(result) => result.map_err(|e| map_err(STREAMS, e)),
        // The writer ended with the publish taken (its runtime shut down):
        // whether it was sent is not known.
        Err(_) => Err(Error::disconnected(
            STREAMS,
            "the publishing task ended before the server answered",
        )),
    }
}
