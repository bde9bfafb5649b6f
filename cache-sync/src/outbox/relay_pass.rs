//! The outbox relay's task: passes that each take the leader lock and a
//! fencing term, publish a batch of due rows in id order and delete them,
//! and the waits between passes.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::database::Pool;
use super::decode_row;
use super::relay::{Reports, Shared};
use crate::error::{Error, Result};
use crate::util::{Backoff, lock};
use crate::wire::{Fence, Watermark};

/// Backoff after a failed pass (broker or database down): doubling from
/// the first to the second, then staying there.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// How long the relay waits for the database to confirm, before each
/// publish, that its pass (and so its leader lock) is still alive. A
/// database that does not answer in time ends the pass, as an error would.
const LEADER_CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// How a pass ended.
enum Pass {
    /// Fewer rows than a batch were due: wait for a wake-up. Everything
    /// committed before `began` (not held back by `not_before`) is
    /// published; `term` is the pass's fencing term.
    Drained { began: Instant, term: u64 },
    /// A full batch: there may be more at once.
    More,
    /// Another relay holds the leader lock.
    NotLeader,
}

/// A relay's hold on its database between passes.
pub(super) enum Store {
    #[cfg(feature = "postgres-outbox")]
    Pg(super::pg::Store),
    #[cfg(feature = "mysql-outbox")]
    MySql(super::mysql::Store),
}

/// A pass that leads: it holds the leader lock.
enum Lease<'a> {
    #[cfg(feature = "postgres-outbox")]
    Pg(super::pg::Lease, std::marker::PhantomData<&'a ()>),
    #[cfg(feature = "mysql-outbox")]
    MySql(super::mysql::Lease<'a>),
}

impl Store {
    pub(super) async fn connect(pool: Pool) -> Result<Self> {
        Ok(match pool {
            #[cfg(feature = "postgres-outbox")]
            Pool::Pg(pool) => Self::Pg(super::pg::Store::connect(pool).await?),
            #[cfg(feature = "mysql-outbox")]
            Pool::MySql(pool) => Self::MySql(super::mysql::Store::new(pool)),
        })
    }

    async fn lead(&mut self, schema: &str) -> Result<Option<(Lease<'_>, i64)>> {
        Ok(match self {
            #[cfg(feature = "postgres-outbox")]
            Self::Pg(s) => s
                .lead(schema)
                .await?
                .map(|(l, t)| (Lease::Pg(l, std::marker::PhantomData), t)),
            #[cfg(feature = "mysql-outbox")]
            Self::MySql(s) => s.lead(schema).await?.map(|(l, t)| (Lease::MySql(l), t)),
        })
    }

    async fn waiting(&mut self, schema: &str) -> Result<i64> {
        match self {
            #[cfg(feature = "postgres-outbox")]
            Self::Pg(s) => s.waiting(schema).await,
            #[cfg(feature = "mysql-outbox")]
            Self::MySql(s) => s.waiting(schema).await,
        }
    }

    /// After a failed pass: whatever the pass held is let go.
    fn reset(&mut self) {
        match self {
            #[cfg(feature = "postgres-outbox")]
            // The pass's transaction rolled back when it was dropped.
            Self::Pg(_) => {}
            #[cfg(feature = "mysql-outbox")]
            Self::MySql(s) => s.reset(),
        }
    }

    /// On shutdown: a standby may take over at once.
    async fn close(&mut self) {
        match self {
            #[cfg(feature = "postgres-outbox")]
            Self::Pg(_) => {}
            #[cfg(feature = "mysql-outbox")]
            Self::MySql(s) => s.close().await,
        }
    }

    async fn wait(&mut self, schema: &str, every: Duration) {
        match self {
            #[cfg(feature = "postgres-outbox")]
            Self::Pg(s) => s.wait(schema, every).await,
            #[cfg(feature = "mysql-outbox")]
            Self::MySql(s) => {
                let _ = schema;
                s.wait(every).await;
            }
        }
    }
}

impl Lease<'_> {
    async fn rows(&mut self, schema: &str, limit: i64) -> Result<Vec<(i64, String, Vec<u8>)>> {
        match self {
            #[cfg(feature = "postgres-outbox")]
            Self::Pg(l, _) => l.rows(schema, limit).await,
            #[cfg(feature = "mysql-outbox")]
            Self::MySql(l) => l.rows(schema, limit).await,
        }
    }

    async fn alive(&mut self, schema: &str) -> sqlx::Result<bool> {
        match self {
            #[cfg(feature = "postgres-outbox")]
            Self::Pg(l, _) => l.alive(schema).await,
            #[cfg(feature = "mysql-outbox")]
            Self::MySql(l) => l.alive(schema).await,
        }
    }

    async fn finish(self, schema: &str, done: &[i64]) -> Result<()> {
        match self {
            #[cfg(feature = "postgres-outbox")]
            Self::Pg(l, _) => l.finish(schema, done).await,
            #[cfg(feature = "mysql-outbox")]
            Self::MySql(l) => l.finish(schema, done).await,
        }
    }
}

pub(super) async fn run(shared: Arc<Shared>, mut store: Store, mut stopped: watch::Receiver<bool>) {
    let mut backoff = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
    loop {
        if *stopped.borrow() {
            store.close().await;
            return;
        }
        let pause = match shared.pass(&mut store).await {
            Ok(Pass::More) => {
                backoff.reset();
                continue;
            }
            Ok(Pass::Drained { began, term }) => {
                backoff.reset();
                if let Some(reports) = &shared.reports {
                    // A shutdown does not wait for a slow broker's answer.
                    tokio::select! {
                        _ = stopped.changed() => {
                            store.close().await;
                            return;
                        }
                        () = report(&shared, reports, began, term) => {}
                    }
                }
                None
            }
            Ok(Pass::NotLeader) => {
                backoff.reset();
                None
            }
            Err(e) => {
                store.reset();
                shared
                    .counters
                    .publish_failures
                    .fetch_add(1, Ordering::Relaxed);
                let pause = backoff.fail();
                tracing::warn!(
                    schema = shared.outbox.schema(),
                    error = %e,
                    retry_in = ?pause,
                    "outbox relay: pass failed; retrying the same rows"
                );
                Some(pause)
            }
        };
        tokio::select! {
            _ = stopped.changed() => {
                store.close().await;
                return;
            }
            () = wait(&shared, &mut store, pause) => {}
        }
    }
}

/// Tells every cache the relay reports for that everything committed
/// before `began` is published, at most once per report interval: a pair
/// of reports under the pass's fencing term (later passes, of any relay of
/// the outbox, draw later terms, so a node refuses an older pair replayed),
/// the second carrying how long after `began` the first was acknowledged
/// for every cache. A pair, not one report that the next carries on: relays
/// standing in for one another may take turns pass by pass, and a node
/// pairs reports of one term only. A report that fails is logged and not
/// retried: the next follows within an interval.
async fn report(shared: &Shared, reports: &Reports, began: Instant, term: u64) {
    {
        let mut last = lock(&reports.last);
        if last.is_some_and(|at| began.saturating_duration_since(at) < reports.every) {
            return;
        }
        *last = Some(began);
    }
    // One cache after another: a relay reports for a few caches, and the
    // second report's duration covers them all.
    let send = async |number: u64, acked_after_us: Option<u64>| -> Result<()> {
        let mark = Watermark {
            source: reports.source,
            epoch: term,
            number,
            acked_after_us,
        };
        for cache in &reports.caches {
            shared.publisher.watermark(cache, mark).await?;
        }
        Ok(())
    };
    // Bounded: a broker that does not answer holds the relay's passes no
    // longer than an interval (at least a second).
    let limit = reports.every.max(Duration::from_secs(1));
    let pair = async {
        send(1, None).await?;
        let after = u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX);
        send(2, Some(after)).await
    };
    let sent = tokio::time::timeout(limit, pair).await;
    if !matches!(sent, Ok(Ok(()))) {
        let error = match sent {
            Ok(Err(e)) => e.to_string(),
            _ => format!("not acknowledged within {limit:?}"),
        };
        tracing::debug!(schema = shared.outbox.schema(), %error,
            "outbox relay: sending a freshness report failed");
    }
}

/// Until a notification for this schema, or the poll interval (or, after a
/// failure, the backoff) passes.
async fn wait(shared: &Shared, store: &mut Store, pause: Option<Duration>) {
    if let Some(pause) = pause {
        tokio::time::sleep(pause).await;
        return;
    }
    // With reports on, a pass at least every report interval: an idle
    // outbox is drained, and says so.
    let every = shared
        .reports
        .as_ref()
        .map_or(shared.poll_interval, |r| r.every.min(shared.poll_interval));
    store.wait(shared.outbox.schema(), every).await;
}

impl Shared {
    /// One pass: the leader lock and a fencing term, a batch of due rows
    /// in id order, each published while the leader is confirmed alive,
    /// and the published ones deleted.
    async fn pass(&self, store: &mut Store) -> Result<Pass> {
        let schema = self.outbox.schema();
        // Before the rows are read: a row committed before it is seen.
        let began = Instant::now();
        let Some((mut lease, term)) = store.lead(schema).await? else {
            return Ok(Pass::NotLeader);
        };
        let fence = Fence {
            scope: self.scope,
            term: term.cast_unsigned(),
        };
        let rows = lease.rows(schema, self.batch_size).await?;
        let full = i64::try_from(rows.len()).unwrap_or(i64::MAX) >= self.batch_size;
        let mut done = Vec::with_capacity(rows.len());
        let mut failure = None;
        for (id, cache, change) in rows {
            // The lock lives with the session: a session that died since
            // the last statement took the lock with it, and another relay
            // may be publishing these rows now. Only a leader the database
            // just answered for may publish; the fence covers the one
            // publish that can be in flight when the session dies.
            let alive = tokio::time::timeout(LEADER_CHECK_TIMEOUT, lease.alive(schema)).await;
            match alive {
                Ok(Ok(true)) => {}
                Ok(Ok(false)) => {
                    failure = Some(Error::Database(
                        "the relay's session no longer holds the leader lock; stopped publishing"
                            .into(),
                    ));
                    break;
                }
                Ok(Err(e)) => {
                    failure = Some(super::db(e));
                    break;
                }
                Err(_) => {
                    failure = Some(Error::Database(
                        format!(
                            "the database did not confirm the relay's pass within {LEADER_CHECK_TIMEOUT:?}; \
                             stopped publishing, as another relay may have taken over"
                        )
                        .into(),
                    ));
                    break;
                }
            }
            match self.publish_row(id, &cache, &change, fence).await {
                Ok(()) => done.push(id),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        lease.finish(schema, &done).await?;
        let published = u64::try_from(done.len()).unwrap_or(u64::MAX);
        self.counters
            .published
            .fetch_add(published, Ordering::Relaxed);
        let waiting = store.waiting(schema).await?;
        self.counters
            .waiting
            .store(u64::try_from(waiting).unwrap_or(0), Ordering::Relaxed);
        match failure {
            Some(e) => Err(e),
            None if full => Ok(Pass::More),
            None => Ok(Pass::Drained {
                began,
                term: fence.term,
            }),
        }
    }

    /// Publishes one row; `Ok` when it may be deleted.
    async fn publish_row(&self, id: i64, cache: &str, row: &[u8], fence: Fence) -> Result<()> {
        let why = match decode_row(row, self.outbox.max_event_bytes()) {
            Ok(change) => {
                let sent = match self.publisher.resplit(change) {
                    Ok(changes) => self
                        .publisher
                        .send_fenced(cache, changes, fence)
                        .await
                        .map(|_| ()),
                    Err(e) => Err(e),
                };
                match sent {
                    Ok(()) => return Ok(()),
                    Err(e) if never_publishable(&e) => e,
                    Err(e) => return Err(e),
                }
            }
            Err(e) => Error::Decode(e),
        };
        self.replace_by_clear(id, cache, &why, fence).await
    }

    async fn replace_by_clear(
        &self,
        id: i64,
        cache: &str,
        why: &Error,
        fence: Fence,
    ) -> Result<()> {
        let clear = vec![crate::wire::Change::Clear { version: None }];
        match self.publisher.send_fenced(cache, clear, fence).await {
            Ok(_) => tracing::error!(
                schema = self.outbox.schema(),
                id,
                cache,
                error = %why,
                "outbox relay: a row can never be published; published a clear of its cache instead"
            ),
            Err(e) if e.is_config() => tracing::error!(
                schema = self.outbox.schema(),
                id,
                cache,
                error = %why,
                clear_error = %e,
                "outbox relay: a row can never be published, nor a clear of its cache; row deleted"
            ),
            Err(e) => return Err(e),
        }
        self.counters
            .replaced_by_clear
            .fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Errors that retrying the same row cannot cure.
fn never_publishable(e: &Error) -> bool {
    matches!(
        e,
        Error::TooLarge { .. } | Error::Encode { .. } | Error::Config(_)
    )
}
