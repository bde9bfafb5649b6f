//! A session's hand-off to its publishing task: the bounds of a batch,
//! handing committed work over, confirming what was published, and the
//! oldest commit still pending (the lag in seconds).

use std::sync::atomic::Ordering;

use pgwire_replication::{Lsn, ReplicationClient};
use tokio::sync::mpsc;

use super::publishing::Job;
use super::stream::Stream;

/// Row changes, bytes of keys and values, and transactions gathered into
/// one publish at most (more wait for the next).
const MAX_BATCH_ROWS: u64 = 5_000;
const MAX_BATCH_BYTES: usize = 16 << 20;
const MAX_BATCH_TRANSACTIONS: u64 = 1_000;

impl Stream<'_> {
    pub(super) fn mark_committed(&mut self) {
        self.committed = true;
    }

    /// The batch is as large as one publish may be.
    pub(super) fn full(&self) -> bool {
        self.batch.rows >= MAX_BATCH_ROWS
            || self.batch.bytes >= MAX_BATCH_BYTES
            || self.batch.transactions >= MAX_BATCH_TRANSACTIONS
    }

    /// Hands the committed batch over to the publishing task if it has
    /// room: `Some(false)` if it has none, `None` if it ended.
    pub(super) fn hand_off(&mut self) -> Option<bool> {
        let permit = match self.jobs.as_ref()?.try_reserve() {
            Ok(permit) => permit,
            Err(mpsc::error::TrySendError::Full(())) => return Some(false),
            Err(mpsc::error::TrySendError::Closed(())) => return None,
        };
        let transactions = self.batch.transactions;
        let rows = self.batch.rows;
        let xids = std::mem::take(&mut self.batch.xids);
        permit.send(Job {
            publishes: self.batch.take(),
            xids,
            resync: self.resync_at.take(),
            watermark: self.watermark.take(),
            end: self.pending_end.take(),
            transactions,
            rows,
        });
        self.committed = false;
        self.handed = self.handed.saturating_add(1);
        self.in_flight.push_back(self.batch_oldest);
        self.batch_oldest = self.open.as_ref().map_or(0, |o| o.commit_time);
        self.show_oldest();
        Some(true)
    }

    /// Confirms what the publishing task published.
    pub(super) fn progressed(&mut self, client: &ReplicationClient) {
        let p = *self.progress.borrow_and_update();
        let waiting = self.handed.saturating_sub(p.jobs);
        while u64::try_from(self.in_flight.len()).unwrap_or(u64::MAX) > waiting {
            self.in_flight.pop_front();
        }
        if let Some(end) = p.end {
            self.confirm(client, end);
        }
        self.done = self.done.max(p.done);
        self.show_oldest();
    }

    /// Hands the committed batch over and waits until everything handed
    /// over is published and confirmed: `false` if the task ended first.
    pub(super) async fn drain(&mut self, client: &ReplicationClient) -> bool {
        loop {
            if self.committed && self.hand_off().is_none() {
                return false;
            }
            if !self.committed && self.in_flight.is_empty() {
                return true;
            }
            if self.progress.changed().await.is_err() {
                return false;
            }
            self.progressed(client);
        }
    }

    /// The commit time of the oldest change not yet published, for the
    /// relay's lag in seconds (0: none).
    pub(super) fn show_oldest(&self) {
        let oldest = self
            .in_flight
            .iter()
            .copied()
            .find(|&t| t != 0)
            .unwrap_or(self.batch_oldest);
        self.inner
            .shared
            .oldest_pending_commit
            .store(oldest, Ordering::Relaxed);
    }

    pub(super) fn confirm(&mut self, client: &ReplicationClient, lsn: Lsn) {
        client.update_applied_lsn(lsn);
        self.last_confirmed = Some(self.last_confirmed.map_or(lsn, |l| l.max(lsn)));
        self.inner
            .shared
            .confirmed
            .fetch_max(lsn.as_u64(), Ordering::Relaxed);
    }
}
