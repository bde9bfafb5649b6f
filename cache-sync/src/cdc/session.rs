//! The relay's task: replication sessions, one after another, each
//! streaming the slot, mapping its changes and publishing them.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pgwire_replication::ReplicationClient;
use tokio::sync::watch;

use super::batch::Batch;
use super::publishing;
use super::relay::Inner;
use super::slot::{self, SlotState, db};
use super::state;
use super::stream::Stream;
use super::upkeep::{check_publication, drop_slot};
use crate::error::Result;
use crate::util::Backoff;

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// How a session ended without an error.
pub(super) enum Ended {
    /// Another relay streams the slot (or, `foreign`, another client).
    Standby { pid: i32, foreign: Option<String> },
    /// The server ended the stream.
    Closed,
    /// The relay was told to stop, and closed the stream.
    Stopped,
    /// The publication was dropped under the stream (see `run`).
    PublicationGone(String),
    /// The publishing task ended: its error says why.
    Publishing,
}

/// How long a stopping session waits for the client to report its last
/// confirmed position to the server (it does so every 200 ms), so the
/// next relay does not publish it again.
const FEEDBACK_GRACE: Duration = Duration::from_secs(1);

/// How long a stopping relay waits for its session to close the stream
/// (a publish under way finishes first) before dropping it.
const STOP_GRACE: Duration = Duration::from_secs(5);

pub(super) async fn run(inner: Arc<Inner>, mut stop: watch::Receiver<bool>) {
    let mut backoff = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
    let mut standby_of: Option<i32> = None;
    // A client that is not a relay held the slot: what it confirmed never
    // reached nodes, so a resync is owed once the slot is free again.
    let after_foreign = AtomicBool::new(false);
    loop {
        if *stop.borrow() {
            break;
        }
        let mut session = std::pin::pin!(session(
            Arc::clone(&inner),
            standby_of.is_some(),
            &after_foreign,
            stop.clone()
        ));
        let ended = tokio::select! {
            ended = &mut session => ended,
            _ = stop.changed() => {
                // The session sees the stop too, at its next read, and
                // closes the stream, so the slot is free for the next relay
                // when `shutdown` returns.
                let _ = tokio::time::timeout(STOP_GRACE, &mut session).await;
                break;
            }
        };
        inner.shared.active.store(false, Ordering::Relaxed);
        let wait = match ended {
            Ok(Ended::Standby { pid, foreign }) => {
                if let Some(client) = foreign {
                    if !after_foreign.load(Ordering::Relaxed) || standby_of != Some(pid) {
                        tracing::error!(slot = %inner.shared.slot, pid, client, "cdc relay: the slot is read by a client that is not a cache-sync relay: the changes it confirms never reach nodes; every mapped cache is resynced once the relay has the slot back");
                    }
                    after_foreign.store(true, Ordering::Relaxed);
                } else if standby_of.is_none() {
                    tracing::info!(slot = %inner.shared.slot, pid, "cdc relay: standby, another session streams the slot");
                }
                standby_of = Some(pid);
                backoff.reset();
                inner.standby_retry
            }
            Ok(Ended::Closed) => {
                standby_of = None;
                backoff.fail()
            }
            Ok(Ended::Stopped) => break,
            Ok(Ended::Publishing) => unreachable!("a session returns the publishing task's error"),
            Ok(Ended::PublicationGone(why)) => {
                // pgoutput reads the publication as the catalog was at each
                // change: past the drop, this slot's stream fails for ever,
                // whatever is created since. Only a new slot goes on, and
                // what the old one could not stream is resynced.
                standby_of = None;
                inner.shared.failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(slot = %inner.shared.slot, error = %why, "cdc relay: the publication was dropped under the stream, which cannot go past the drop; creating the publication again, and the slot anew with a resync");
                check_publication(&inner).await;
                drop_slot(&inner).await;
                backoff.fail()
            }
            Err(e) => {
                standby_of = None;
                inner.shared.failures.fetch_add(1, Ordering::Relaxed);
                let wait = backoff.fail();
                tracing::warn!(slot = %inner.shared.slot, error = %e, retry_in = ?wait, "cdc relay: session failed; starting again from the confirmed position");
                wait
            }
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            _ = stop.changed() => break,
        }
    }
}

/// One replication session: from taking the slot to losing it.
async fn session(
    owned: Arc<Inner>,
    was_standby: bool,
    after_foreign: &AtomicBool,
    mut stop: watch::Receiver<bool>,
) -> Result<Ended> {
    let inner = &*owned;
    let slot = &inner.shared.slot;
    match slot::slot_state(&inner.pool, slot).await? {
        SlotState::Active { pid, foreign } => return Ok(Ended::Standby { pid, foreign }),
        SlotState::Missing => {
            tracing::warn!(slot = %slot, "cdc relay: the slot is gone (dropped?); creating it again and clearing every mapped cache");
            // A slot streams through the publication: put it back first
            // if it went too.
            check_publication(inner).await;
            slot::create_slot(&inner.pool, &inner.publication, slot, false).await?;
        }
        SlotState::Lost => {
            tracing::warn!(slot = %slot, "cdc relay: the server invalidated the slot (max_slot_wal_keep_size); creating it again and clearing every mapped cache");
            check_publication(inner).await;
            slot::create_slot(&inner.pool, &inner.publication, slot, true).await?;
        }
        SlotState::Idle => {
            if after_foreign.load(Ordering::Relaxed) {
                // Owed now the other client let go: the message lands after
                // whatever it confirmed.
                state::owe(&inner.pool, &inner.publication, slot, None).await?;
                after_foreign.store(false, Ordering::Relaxed);
            }
        }
    }
    // A debt a relay left when it died (after creating the slot, say).
    state::settle(&inner.pool, &inner.publication, slot).await?;
    // Resyncs this slot already applied: streamed again after a server
    // crash forgot the slot's confirmed position, they are not applied
    // twice.
    let done = state::done(&inner.pool, &inner.publication, slot).await?;
    let mut client = ReplicationClient::connect(inner.config.clone())
        .await
        .map_err(db)?;
    if let Err(e) = client.wait_started().await {
        // Most often another relay took the slot between the check and
        // the start: that is standing by, not a failure.
        if let Ok(SlotState::Active { pid, foreign }) = slot::slot_state(&inner.pool, slot).await {
            return Ok(Ended::Standby { pid, foreign });
        }
        return Err(db(e));
    }
    inner.shared.active.store(true, Ordering::Relaxed);
    if was_standby {
        inner.shared.takeovers.fetch_add(1, Ordering::Relaxed);
        tracing::info!(slot = %slot, "cdc relay: took over the slot");
    } else {
        tracing::info!(slot = %slot, "cdc relay: streaming the slot");
    }
    let publishing::Handle {
        jobs,
        progress,
        mut task,
    } = publishing::start(Arc::clone(&owned), done);
    let mut stream = Stream {
        inner,
        relations: HashMap::new(),
        mapped: HashMap::new(),
        batch: Batch::default(),
        open: None,
        last_commit: 0,
        pending_end: None,
        committed: false,
        open_batch: Batch::default(),
        resync_at: None,
        done,
        last_confirmed: None,
        jobs: Some(jobs),
        progress,
        handed: 0,
        in_flight: VecDeque::new(),
        batch_oldest: 0,
        watermark: None,
    };
    // Marks are written only while this relay streams the slot: a
    // standby's would reach the active relay's stream as nobody's.
    let mut result = tokio::select! {
        result = stream.pump(&mut client, &mut stop) => result,
        () = super::watermark::write_loop(inner, inner.freshness_interval) => {
            unreachable!("the marks are written until the session ends")
        }
    };
    // What was handed over is published (or the task fails), and
    // confirmed: a stop hands its last position over to the next relay,
    // and a session that fails for another reason does not leave a
    // publish half done for the next one to race with.
    stream.jobs = None;
    let finished = task.finish().await;
    if let Err(e) = finished {
        if matches!(result, Ok(Ended::Publishing | Ended::Stopped)) {
            result = Err(e);
        } else {
            tracing::debug!(slot = %slot, error = %e, "cdc relay: the publishing task failed too");
        }
    } else if matches!(result, Ok(Ended::Publishing)) {
        result = Err(db("the relay's publishing task ended"));
    }
    stream.progressed(&client);
    let last_confirmed = stream.last_confirmed;
    // What it held is given up: the next session receives it again.
    inner
        .shared
        .oldest_pending_commit
        .store(0, Ordering::Relaxed);
    if matches!(result, Ok(Ended::Stopped)) {
        // The client reports the confirmed position every 200 ms, and not
        // on its way out: wait for the last one to be sent, or the next
        // relay would publish it all again (and apply a resync twice).
        if let Some(lsn) = last_confirmed {
            let metrics = client.metrics();
            let _ = tokio::time::timeout(FEEDBACK_GRACE, async {
                while metrics.last_applied_lsn() < lsn {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await;
        }
        // CopyDone, and the worker's end: the connection is closed when
        // this returns.
        let _ = tokio::time::timeout(STOP_GRACE, client.shutdown()).await;
    } else {
        client.stop();
    }
    result
}
