//! The relay: publishes committed outbox rows, in id order, and deletes
//! each once the transport has taken it. Here its handle, settings and
//! counters; its task is in `relay_pass.rs`.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::Outbox;
use super::database::{OutboxPool, Pool};
use super::relay_pass::{Store, run};
use crate::error::{Error, Result};
use crate::publish::Publisher;
use crate::util::lock;

/// Publishes the rows an [`Outbox`] wrote, once their transactions commit.
///
/// What it promises:
///
/// - **Order.** Per cache, rows are published in id order, which is commit
///   order (see [`Outbox`]), each through the relay's [`Publisher`] (its
///   sequence numbers, signing and size limit). A delayed second
///   invalidation ([`again_after`](super::OutboxBuilder::again_after)) is
///   published when due, after later rows.
/// - **At least once.** A row is deleted, in the transaction that read it,
///   only after the transport's publish call returned for it: Redis
///   Streams after `XADD` answered, NATS JetStream after the stream's
///   `PubAck`, RocketMQ after the broker's send result; the embedded
///   transport holds the record in memory at once. (Redis Pub/Sub has no
///   acknowledgement beyond the server taking the `PUBLISH`: it is lossy
///   anyway.) A crash between the publish and the commit publishes the
///   row again on restart; applying an event twice equals once.
/// - **One publisher at a time.** On PostgreSQL each pass is a transaction
///   that first takes a transaction-level advisory lock on the schema with
///   `pg_try_advisory_xact_lock`. On MySQL the relay takes `GET_LOCK` on a
///   connection of its own (out of the pool) and keeps it, and the lock,
///   for as long as that connection lives; any database error closes it.
///   A relay that does not get the lock waits for the next wake-up.
///   Several relays can run for availability, and never publish one row at
///   the same time. `FOR UPDATE SKIP LOCKED` was not used: it lets two
///   relays take different rows of one cache and publish them in either
///   order.
/// - **A replaced relay is fenced.** The lock lives as long as the
///   database session that took it. A session that dies while a publish is
///   slow (killed, `idle_in_transaction_session_timeout` or `wait_timeout`,
///   a network cut) releases it, and another relay can take over and
///   publish the same rows and newer ones before the first relay's slow
///   publish lands. So before each publish the relay asks the database
///   whether its session is still alive and (on MySQL) still holds the
///   lock (within 5 s, or the pass ends), and publishes nothing once it is
///   not; and each leader draws a term (on PostgreSQL each pass, from a
///   sequence; on MySQL each time it takes the lock, from a row raised in
///   a statement committed at once), and every event it sends carries it
///   (with a random number naming the outbox). A node
///   that has seen a higher term of this outbox for a cache applies an
///   event of a lower one as an invalidation of its keys: the one publish
///   that can be in flight when a session dies can never put an older row
///   over a newer one (see `docs/design.md`, "Relay leader").
/// - **Failures.** A publish that fails (the broker is down) ends the pass:
///   the rows published before it are deleted, the rest stay, and the
///   relay retries them after a backoff (100 ms doubling to 5 s), so order
///   holds and nothing is lost. A row that can never be published (it does
///   not decode, or an entry is over the publisher's size limit, or the
///   transport refuses its cache's name) is not retried for ever nor
///   dropped silently: a clear of its cache is published in its place
///   (invalidating what may be stale is always safe), logged at `error`,
///   counted in [`OutboxRelayStats::replaced_by_clear`], and the row
///   deleted. If even the clear is refused (a cache name the transport
///   cannot map, which no node can hold), the row is deleted and counted
///   the same way.
///
/// On PostgreSQL it wakes on `LISTEN`/`NOTIFY` (the outbox's insert trigger
/// notifies at commit) and polls every
/// [`poll_interval`](OutboxRelayBuilder::poll_interval) besides, for
/// notifications lost while its listener reconnects. MySQL has no
/// notifications: there it polls, every 100 ms by default, so a commit is
/// published within a poll interval plus the publish.
pub struct OutboxRelay {
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    task: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for OutboxRelay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxRelay")
            .field("schema", &self.shared.outbox.schema())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Configures an [`OutboxRelay`].
pub struct OutboxRelayBuilder {
    pool: Pool,
    publisher: Publisher,
    outbox: Outbox,
    poll_interval: Duration,
    batch_size: usize,
    freshness_interval: Duration,
    reports_for: Vec<String>,
}

impl fmt::Debug for OutboxRelayBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxRelayBuilder")
            .field("outbox", &self.outbox)
            .field("poll_interval", &self.poll_interval)
            .field("batch_size", &self.batch_size)
            .field("freshness_interval", &self.freshness_interval)
            .field("reports_for", &self.reports_for)
            .finish_non_exhaustive()
    }
}

/// The relay's counters, since it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct OutboxRelayStats {
    /// Rows published and deleted.
    pub published: u64,
    /// Passes that ended on a failed publish or a database error (each
    /// followed by a backoff and a retry of the same rows).
    pub publish_failures: u64,
    /// Rows that could never be published, replaced by a clear of their
    /// cache (or, when even that was refused, deleted) and logged.
    pub replaced_by_clear: u64,
    /// Rows in the outbox (due or not) when the relay last looked: after
    /// each pass it led (a relay that waits for the leader does not look).
    pub waiting: u64,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) published: AtomicU64,
    pub(super) publish_failures: AtomicU64,
    pub(super) replaced_by_clear: AtomicU64,
    pub(super) waiting: AtomicU64,
}

pub(super) struct Shared {
    pub(super) publisher: Publisher,
    pub(super) outbox: Outbox,
    /// Names this outbox in every fence its relays send.
    pub(super) scope: u64,
    pub(super) poll_interval: Duration,
    pub(super) batch_size: i64,
    pub(super) counters: Counters,
    /// Freshness reports, when asked for.
    pub(super) reports: Option<Reports>,
}

/// What an outbox relay's freshness reports need (see `relay_pass.rs`).
pub(super) struct Reports {
    pub(super) every: Duration,
    /// The caches reported for, sorted, each once.
    pub(super) caches: Vec<String>,
    /// The outbox (its database and schema, hashed): relays that stand in
    /// for one another report as one source.
    pub(super) source: u64,
    /// When the last report's mark was taken.
    pub(super) last: std::sync::Mutex<Option<tokio::time::Instant>>,
}

impl OutboxRelayBuilder {
    /// The outbox whose rows it publishes (its schema and row limit).
    /// Default [`Outbox::new`].
    pub fn outbox(mut self, outbox: Outbox) -> Self {
        self.outbox = outbox;
        self
    }

    /// How often it looks for rows without a notification: on PostgreSQL
    /// 1 s by default (notifications wake it sooner), on MySQL, which has
    /// none, 100 ms. 1 ms to 1 hour.
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll_interval = every;
        self
    }

    /// Rows read, published and deleted per pass (one transaction).
    /// Default 256; 1 to 100 000.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// How often the relay tells nodes how far behind the outbox it is
    /// (never by default; 10 ms to 1 h, with [`reports_for`](Self::reports_for)),
    /// so that a cache's freshness, and its
    /// [`max_staleness`](crate::SyncedCacheBuilder::max_staleness), hold
    /// against the database rather than the topic: a relay that stalls,
    /// falls behind, or is cut off from its database or its broker shows
    /// on every node as a freshness that ages (see
    /// [`SyncedCacheBuilder::relayed`](crate::SyncedCacheBuilder::relayed)).
    ///
    /// A report follows a pass that found fewer rows than a batch (the
    /// outbox drained): everything committed before the pass began is
    /// published then, except rows whose `not_before` had not come (held
    /// back on purpose, and not covered). Each report is two announcements
    /// per cache on the topic, the second carrying how long after the
    /// pass's start the first was acknowledged; while reports are on, the
    /// relay passes at least this often. A bound of `d` on the nodes needs
    /// reports well within `d`. Reports are in a wire format nodes older
    /// than this version do not read (they resync the cache on each):
    /// upgrade every node before turning them on.
    pub fn freshness_interval(mut self, every: Duration) -> Self {
        self.freshness_interval = every;
        self
    }

    /// The caches the relay's freshness reports are for: those whose
    /// changes go through this outbox. A relay cannot tell them from its
    /// rows (an idle outbox holds none).
    pub fn reports_for<I, S>(mut self, caches: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.reports_for = caches.into_iter().map(Into::into).collect();
        self
    }

    /// Checks the settings, reads the outbox's fencing scope, connects the
    /// listener and starts the relay's task on the current tokio runtime.
    /// [`Error::Config`] for a setting out of range or a publisher on
    /// another topic than the outbox's [`topic`](crate::outbox::OutboxBuilder::topic),
    /// [`Error::Database`]
    /// when the database cannot be reached or the outbox's schema lacks its
    /// second migration ([`Outbox::migrate`] adds it).
    pub async fn start(self) -> Result<OutboxRelay> {
        if self.poll_interval < Duration::from_millis(1)
            || self.poll_interval > Duration::from_secs(3600)
        {
            return Err(Error::Config(format!(
                "poll_interval must be between 1 ms and 1 h, not {:?}",
                self.poll_interval
            )));
        }
        let batch_size = match i64::try_from(self.batch_size) {
            Ok(n @ 1..=100_000) => n,
            _ => {
                return Err(Error::Config(format!(
                    "batch_size must be between 1 and 100000, not {}",
                    self.batch_size
                )));
            }
        };
        if let Some(topic) = self.outbox.topic()
            && topic != self.publisher.topic()
        {
            return Err(Error::Config(format!(
                "the relay's publisher publishes to topic {:?}, and its outbox's rows are for {topic:?}",
                self.publisher.topic(),
            )));
        }
        let schema = self.outbox.schema();
        let scope = match &self.pool {
            #[cfg(feature = "postgres-outbox")]
            Pool::Pg(pool) => super::pg::scope(pool, schema).await.map_err(|e| {
                Error::Database(
                    format!(
                        "reading the outbox's fencing scope from {schema}.relay: {e}; an outbox made \
                         by an earlier release needs its second migration: run Outbox::migrate, or \
                         migrations/0002_relay_fence.sql, on this schema"
                    )
                    .into(),
                )
            })?,
            #[cfg(feature = "mysql-outbox")]
            Pool::MySql(pool) => super::mysql::scope(pool, schema).await.map_err(|e| {
                Error::Database(
                    format!(
                        "reading the outbox's fencing scope from {schema}.relay: {e}; run \
                         Outbox::migrate, or migrations/mysql/0001_outbox.sql, on this database"
                    )
                    .into(),
                )
            })?,
        };
        let reports = if self.freshness_interval == Duration::MAX {
            None
        } else {
            crate::util::check_duration(
                "freshness_interval",
                self.freshness_interval,
                MIN_REPORT_INTERVAL,
                MAX_REPORT_INTERVAL,
            )?;
            let mut caches = self.reports_for;
            if caches.is_empty() {
                return Err(Error::Config(
                    "freshness_interval is set, and reports_for names no cache to report for"
                        .into(),
                ));
            }
            for cache in &caches {
                crate::transport::names::check(crate::transport::names::NameKind::Cache, cache)?;
            }
            caches.sort_unstable();
            caches.dedup();
            let source = match &self.pool {
                #[cfg(feature = "postgres-outbox")]
                Pool::Pg(pool) => source(&super::pg::database_name(pool).await?, schema),
                // A MySQL schema is a database, and server-wide: the
                // outbox's random scope tells two servers' apart.
                #[cfg(feature = "mysql-outbox")]
                Pool::MySql(_) => {
                    crate::util::source_hash(&["outbox", "mysql", schema, &scope.to_string()])
                }
            };
            Some(Reports {
                every: self.freshness_interval,
                caches,
                source,
                last: std::sync::Mutex::new(None),
            })
        };
        let store = Store::connect(self.pool).await?;
        let shared = Arc::new(Shared {
            publisher: self.publisher,
            outbox: self.outbox,
            scope: scope.cast_unsigned(),
            poll_interval: self.poll_interval,
            batch_size,
            counters: Counters::default(),
            reports,
        });
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(run(shared.clone(), store, stopped));
        Ok(OutboxRelay {
            shared,
            stop,
            task: std::sync::Mutex::new(Some(task)),
        })
    }
}

/// The freshness interval's range.
const MIN_REPORT_INTERVAL: Duration = Duration::from_millis(10);
const MAX_REPORT_INTERVAL: Duration = Duration::from_secs(3600);

#[cfg(feature = "postgres-outbox")]
/// An outbox's report source: its database and schema, hashed (FNV-1a),
/// and apart from any CDC relay's (whose source hashes a slot first).
fn source(database: &str, schema: &str) -> u64 {
    crate::util::source_hash(&["outbox", database, schema])
}

impl OutboxRelay {
    /// Configures a relay that reads `pool` (a `sqlx::PgPool` or
    /// `sqlx::MySqlPool`) and publishes through `publisher`.
    pub fn builder(pool: impl OutboxPool, publisher: Publisher) -> OutboxRelayBuilder {
        let pool = pool.pool();
        let poll_interval = match pool {
            #[cfg(feature = "postgres-outbox")]
            Pool::Pg(_) => Duration::from_secs(1),
            #[cfg(feature = "mysql-outbox")]
            Pool::MySql(_) => Duration::from_millis(100),
        };
        OutboxRelayBuilder {
            pool,
            publisher,
            outbox: Outbox::new(),
            poll_interval,
            batch_size: 256,
            freshness_interval: Duration::MAX,
            reports_for: Vec::new(),
        }
    }

    /// The counters so far.
    pub fn stats(&self) -> OutboxRelayStats {
        let c = &self.shared.counters;
        OutboxRelayStats {
            published: c.published.load(Ordering::Relaxed),
            publish_failures: c.publish_failures.load(Ordering::Relaxed),
            replaced_by_clear: c.replaced_by_clear.load(Ordering::Relaxed),
            waiting: c.waiting.load(Ordering::Relaxed),
        }
    }

    /// Stops the relay and waits for its task: a pass under way finishes
    /// first (its transaction commits what it published).
    pub async fn shutdown(&self) {
        let _ = self.stop.send(true);
        let task = lock(&self.task).take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

impl Drop for OutboxRelay {
    fn drop(&mut self) {
        // Stops at the end of the current pass; a row published but not yet
        // deleted would only be published again by the next relay.
        let _ = self.stop.send(true);
    }
}
