//! Keep in-process [`moka`] caches on many application nodes in step.
//!
//! An admin service publishes a change event to a topic; every node runs a
//! broadcasting consumer (every node gets every event) that invalidates or
//! refreshes its own caches; every node reports over HTTP what its caches
//! hold and which version they are at.
//!
//! The path of an event, module by module: [`Publisher`] (and
//! [`DictionaryPublisher`]) encode it → a [`Transport`](transport::Transport) carries it
//! ([`EmbeddedTransport`](transport::EmbeddedTransport) in-process by default) → the [`Node`]'s consumer decodes
//! and applies it → [`SyncedCache`] → [`Node::status_router`].
//!
//! ```no_run
//! use cache_sync::transport::EmbeddedTransport;
//! use cache_sync::{Node, Publisher, SyncedCache, Table};
//!
//! // Shared by both sides: the cache's name and its key and value types.
//! const COUNTRIES: Table<String, String> = Table::new("countries");
//!
//! # async fn run() -> cache_sync::Result<()> {
//! let transport = EmbeddedTransport::new();
//!
//! // On every application node:
//! let countries = SyncedCache::new(COUNTRIES, moka::future::Cache::new(10_000));
//! let node = Node::builder("node-1", transport.clone()).register(&countries).start().await?;
//! let name = countries.get_with("de".to_string(), || async { "Germany".to_string() }).await;
//! let status = node.serve_status("127.0.0.1:9464").await?; // GET /cache-sync/status
//!
//! // In the admin service:
//! let table = Publisher::new(transport).dictionary(COUNTRIES);
//! table.insert("de", "Deutschland").await?;
//! # Ok(()) }
//! ```
//!
//! # One vocabulary for writes
//!
//! Every type that writes uses moka's three verbs, and one suffix for the
//! forms that carry a version:
//!
//! | write | [`SyncedCache`] (this node) | [`Publisher`] (untyped, by name) | [`DictionaryPublisher`] (typed, automatic versions) | `Outbox` / `OutboxDictionary` (in a transaction) |
//! |---|---|---|---|---|
//! | a key's value | `insert` | `insert`, `insert_versioned` | `insert`, `insert_versioned`, `insert_many` | the publisher's, with the connection first |
//! | a key goes | `invalidate` | `invalidate`, `invalidate_versioned` | `invalidate`, `invalidate_versioned` | the same |
//! | every key goes | `invalidate_all` | `invalidate_all`, `invalidate_all_versioned` | `invalidate_all`, `invalidate_all_versioned`; `replace_all` (every key goes, then these) | the same |
//!
//! Arguments follow one rule. What a method keeps, it takes by value:
//! [`SyncedCache::insert`] stores its key and value, as moka's `insert`
//! does. What it only looks up or encodes, it borrows: a key or row in any
//! form its type borrows as (`"de"` for a `String` key), as moka's `get`
//! and `invalidate` take keys, and batches as pairs of references (a
//! `&HashMap<K, V>` iterates as one). The untyped [`Publisher`] takes any
//! serializable items, references included.
//!
//! On the wire an insert is a *refresh*: a node that receives one installs
//! the value unless it already reflects a newer version, and metrics and
//! logs call it that (`refreshes`).
//!
//! # Guarantees
//!
//! ## What a version is
//! A version is a `u64` attached to one entry of an event: the version of
//! that row. Larger means newer. [`DictionaryPublisher`] assigns
//! microsecond timestamps made strictly increasing, or takes the caller's
//! own (a database row version). Versions of different keys are never
//! compared with each other, except against the floor a versioned clear sets.
//!
//! - A refresh at version *v* is installed only if *v* is greater than every
//!   version the node has seen for that key; otherwise it is ignored and
//!   counted as `stale_ignored`.
//! - An invalidation always removes the entry (removal is never stale) and
//!   leaves a tombstone at its version, so a late, older refresh cannot bring
//!   the key back.
//! - A versioned clear removes everything and ignores later refreshes older
//!   than its version. [`DictionaryPublisher::replace_all`] sends one, then
//!   the new rows at the same version.
//! - Unversioned events are applied in delivery order.
//! - A value loaded with its row version
//!   ([`SyncedCache::get_with_versioned`]) is recorded at that version, as a
//!   refresh at it would be: a later refresh at or below it is ignored
//!   (`stale_ignored`), a newer one replaces it. If the node already knows a
//!   newer version of the key (a tombstone, a newer refresh or load, a
//!   versioned clear), the loaded value is not cached (`loads_stale`), and
//!   the caller gets the cached value if the cache holds one (a newer
//!   refresh may have installed it while the loader ran), else the loaded
//!   value; an equal version is cached.
//! - A forced-fresh read ([`SyncedCache::get_fresh`]) runs its versioned
//!   loader on every call, whatever the cache holds, and installs the row
//!   as a versioned load does. It returns the row read, or a value the node
//!   holds at a newer version; an older refresh delivered while the loader
//!   ran never stands in for the row (`fresh_reads` counts the calls).
//! - A value loaded without a version ([`SyncedCache::get_with`]) or
//!   inserted locally ([`SyncedCache::insert`]) leaves the key's version
//!   record as it was: a later refresh replaces it whenever that refresh is
//!   newer than every version the node has seen for the key, whichever row
//!   the loader read. A refresh delayed in transit past such a load can
//!   therefore put back an older row, until the newer row's own event
//!   arrives; `get_with_versioned` is the load that rules this out.
//!
//! Per-key versions live in a bounded table ([`SyncedCacheBuilder::max_tracked_keys`],
//! default 100 000 keys per cache). When a record is evicted, its version is
//! folded into a floor for every untracked key: a refresh at or below that
//! floor is applied as an invalidation, which is always safe, and a
//! versioned load below it is returned uncached, so eviction only costs an
//! extra load, never correctness.
//!
//! A cache's reported `version` is the highest entry version in the events
//! it has taken in: applied ones, and refreshes it ignored as stale too
//! (every node receives those alike). Versioned loads do not raise it.
//! The node's `position` means every event before it has been applied.
//!
//! ## Ordering
//! Events from one publisher to one cache carry consecutive sequence numbers
//! and are applied in transport order (the embedded transport and a single stream
//! are totally ordered). Events from different publishers are ordered by
//! their versions alone; give concurrent writers of one table the
//! database's versions.
//!
//! ## Loads
//! A read-through load ([`SyncedCache::get_with`], and its versioned and
//! fallible forms) never installs a value
//! read before a change that was applied while it ran: each load holds a
//! token, every write to its key (or a clear) invalidates the token, and the
//! install is atomic with the check (every write to a key holds that key's
//! write lock from its decision until moka has the change).
//! A superseded load is retried; concurrent loads of one key are coalesced.
//! Nor does it return such a value: after
//! [`max_load_retries`](SyncedCacheBuilder::max_load_retries) superseded
//! loads, one more runs with the key pinned: other tasks' writes to that key
//! wait for it, up to [`max_pin_wait`](SyncedCacheBuilder::max_pin_wait)
//! (1 s by default). The node's consumer does not wait: it parks its writes
//! to that key, applies them in order once the load is done or the bound
//! passed, and goes on with every other key and cache meanwhile, so a slow
//! database read holds up that one key only. A write that waited the whole
//! bound, or a clear, overtakes the pinned load, which then returns the
//! value now cached, or loads again.
//!
//! A loader that reads a lagging replica can still read the row as it was
//! before a change the node has already applied. A versioned load then
//! does not cache that row (its version is older than the key's record),
//! and returns the cached value instead if there is one.
//! For unversioned loads, [`PublisherBuilder::again_after`] sends each
//! change again, as an invalidation, once the replica's lag has passed; it
//! removes a row reloaded in between.
//!
//! ## What happens on loss
//! Zero tolerance: one possibly missed event is enough to act.
//! - The transport signals a loss ([`Delivery::Lost`](transport::Delivery::Lost)): history trimmed past
//!   the node, a stored position from a history that no longer exists, a
//!   reconnect on a lossy transport, a full local buffer. Every position
//!   names the history it belongs to (the embedded transport's instance, a Redis
//!   stream's epoch, a NATS stream's creation time, the RocketMQ message
//!   before each queue offset), so a broker that lost its data and grew a
//!   new history past a paused node's offset is caught, not resumed into.
//! - The consumer sees a gap in a publisher's sequence numbers. After a
//!   re-subscription, a publisher the node has not heard from yet whose
//!   first event is not its first counts as a gap too. So does a publisher
//!   the node has not heard from (one per request, a command-line tool)
//!   whose first message says its previous event was sent while the node
//!   held every event of the cache: each message carries how long ago, on
//!   the publisher's own clock, it sent its previous event, and the node
//!   compares that with its own receive time, never with another machine's
//!   clock. It allows its reorder window for the message's time in transit
//!   after it went live or registered the cache, but none after the cache
//!   was last emptied (a published or local clear, a resync): a clear does
//!   not stop the node listening, and an event that may have been sent
//!   after it counts as lost.
//! - A publisher announces the last sequence number it used (see
//!   [`PublisherBuilder::announce_interval`]), and the events up to it have
//!   not arrived within the node's [reorder
//!   window](NodeBuilder::reorder_window). This finds a loss of the last
//!   events before a quiet period, which no later event would reveal: the
//!   node resyncs that cache within the announce interval (1 s by default)
//!   plus its reorder window (10 s by default), plus the transport's
//!   latency. That bound holds as long as the publisher's process and the
//!   tokio runtime it published on keep running for one announce interval
//!   after its last publish (three intervals, for the repeats that cover a
//!   lost announcement), even if the `Publisher` itself is dropped, and the
//!   transport delivers one of the three announcements; a node that is
//!   re-subscribing after a transport error still resyncs on time. A node
//!   that never heard of the publisher (a one-shot publisher whose only
//!   event was lost) resyncs at the first announcement it receives, if it
//!   had been live and held the cache for longer than its reorder window
//!   when that event was sent, and has not emptied the cache since (which
//!   covers the event). It holds
//!   for every number announced: a newer announcement during a pending
//!   check gets a full reorder window of its own. With announcements off
//!   (`Duration::MAX`) there is no bound, and the loss is found at the
//!   publisher's next event for that cache.
//! - The consumer cannot re-subscribe from a known position.
//!
//! After a loss, the node cannot know the versions it missed. For one
//! [reorder window](NodeBuilder::reorder_window) it applies versioned
//! refreshes as invalidations, so an older refresh that another writer
//! published late cannot land on top of a missed newer change. At start, a
//! node instead replays that window of history where the transport keeps it.
//! Loads are not quarantined: they read the source of truth, which holds the
//! missed changes, and a versioned load records the version the node lacked.
//!
//! A publish that fails may or may not have reached the transport, so it
//! still uses up its sequence number: nodes see a gap and resync. That costs
//! reloads, but a change whose publish the caller did not retry is never
//! left stale.
//!
//! A gap in a publisher's numbers invalidates the one cache whose numbers
//! jumped (they run per publisher and cache); every other loss invalidates
//! every cache on the topic. Each is counted (`losses`, `publisher_gaps`,
//! each cache's `loss_resyncs`) and logged.
//!
//! An event numbered at or below one its publisher already sent for its
//! cache (a redelivery, a replay, or an event that took another queue when
//! a broker failed and arrived after later ones) may carry an older value
//! than the cache holds, or than a resync loaded since, and is counted
//! (`events_late`). Its refreshes are never installed: an unversioned one
//! is applied as an invalidation of its key; a versioned one is ignored as
//! stale (`stale_ignored`) if the node already has its version for the key
//! (the key's exact record is at or above it, or a versioned clear's floor
//! above it), and is applied as an invalidation of its key otherwise.
//!
//! ## Bad input
//! Garbage, truncated, oversized (over 1 MiB by default) or unknown-format
//! payloads, and keys or values that do not decode into the cache's types,
//! are counted, logged with a reason, and skipped; the consumer never panics.
//! Where such an event was meant for a cache the node holds (its transport
//! tag names it, or its header does, read from the front of an oversized
//! event), the cache is invalidated, since the event may have carried a
//! change. An event that names no cache (no tag, as on Redis Pub/Sub, and
//! a header this node cannot read, as from a publisher of a newer format)
//! may have changed any of them: every cache is invalidated, and the loss
//! counted with the reason `unreadable`. A refresh whose value does not
//! decode becomes an invalidation of its key: a failure is never silently
//! dropped.
//!
//! ## Signed events
//! With [`PublisherBuilder::signing`] and [`NodeBuilder::verify_signatures`],
//! every event carries an HMAC-SHA256 over its bytes and a key id, checked in
//! constant time before anything that can change a cache: before the size
//! limit, and before the transport's tag is used to pick a cache (a record
//! whose tag names no cache the node holds is skipped unread, which changes
//! nothing). Unsigned, forged, tampered,
//! oversized-and-unsigned and unknown-key events are rejected, counted and
//! logged, and change nothing (not even an invalidation, or forgeries could
//! flush caches at will). A
//! [`Keyring`] accepts several keys, so keys can rotate. A replayed signed
//! event is still authentic, and late on a node that received it before
//! (see above): a replayed versioned refresh is ignored as stale, while a
//! replayed unversioned refresh, invalidation or clear removes again what
//! it names, which costs reloads and installs nothing.
//!
//! Signatures cover events, not the broker's bookkeeping around them: a
//! party that can write to the broker directly (its own `XADD` to a Redis
//! stream with a wrong ordinal or epoch, a deleted stream or topic) can make
//! nodes see a loss and invalidate every cache, though never make them
//! apply a value. Keep broker credentials as close as the signing keys.
//!
//! ## Names and limits
//! Topic and cache names are 1 to 255 bytes of UTF-8 without control
//! characters; each transport maps them one-to-one onto its own resources
//! (see `docs/transports.md`), and refuses, when a node starts or a
//! publisher is built, a name it cannot map ([`Transport::check_topic`](transport::Transport::check_topic)).
//! Numbers from the wire and from configuration never wrap or panic:
//! `Duration::MAX` means "as long as the process runs" where a duration is
//! a window; settings out of range (a zero capacity, a transport timeout
//! over an hour) are refused with [`Error::Config`] when the builder
//! finishes, never clamped, except where a setter's docs name its ceiling
//! ([`SyncedCacheBuilder::max_tracked_keys`] counts values above 2³² − 2 as
//! that). An automatic row
//! version after `u64::MAX` is [`Error::VersionExhausted`].
//!
//! ## Heartbeats and the cluster view
//! Every node publishes a heartbeat every 2 s by default
//! ([`NodeBuilder::heartbeat_interval`]; `Duration::MAX` turns them off): its
//! id and start time, its position and readiness, and per cache its version
//! (and how long ago it rose, on its own clock), entries, resyncs,
//! quarantine and last latency. No key or value is in it.
//! - Heartbeats travel on the transport's heartbeat channel
//!   ([`Transport::publish_heartbeat`](transport::Transport::publish_heartbeat)),
//!   a resource apart from the change history: they never trim change
//!   events from a bounded history, take up offsets a node resumes from, or
//!   count as events (on RocketMQ they do take commit-log disk, which the
//!   broker shares among topics: see `docs/transports.md`). They may be
//!   lost; the next one says it all again.
//! - They are signed when the node verifies signatures, and a verifying party
//!   takes in only signed ones; refused ones are counted and change nothing.
//! - [`Node::cluster`] (and a [`Cluster`](cluster::Cluster) watcher, for parties that are not
//!   nodes) holds every live node's last heartbeat: a node is live until three
//!   of its own intervals pass without one, then listed as gone for five
//!   minutes. `GET /cache-sync/cluster` serves the [`ClusterView`](cluster::ClusterView) as JSON,
//!   `GET /cache-sync/` as a page for people, a page at a time. A view is
//!   bounded (10,000 nodes, 256 KiB each, 128 MiB in all: see [`Cluster`](cluster::Cluster));
//!   a heartbeat past a bound is dropped and counted. How long a node has
//!   been behind ([`NodeCacheView::behind_ms`](cluster::NodeCacheView::behind_ms)) is a lower bound timed on the
//!   observer's own clock, from when heartbeats arrive and how long ago each
//!   node says its version rose: a skewed clock on another machine changes
//!   nothing.
//! - [`Published::applied_by`] waits until every live node holding the cache
//!   answers that it applied the publish, or a timeout, and says which did,
//!   how long after the publish each answer arrived, and why not all if not
//!   ([`Acks::incomplete`](cluster::Acks::incomplete)); [`Cluster::applied_version`](cluster::Cluster::applied_version) does the same for a
//!   version (an outbox's). Each node answers as soon as it has applied the
//!   event, with a message of a few dozen bytes that only the asking party
//!   reads, so it completes about one transport round trip after the
//!   slowest node applies. A node judges from the publisher's sequence
//!   numbers it tracks (up to 100 000 publishers), so a publish stays
//!   acknowledged however many publishers came after it. Its set of nodes
//!   is what the heartbeats tell: a view that may not know every live node
//!   (settling, not reading the channel, or full to its bounds) never calls
//!   a publish complete.
//!
//! ## Auditing against the source of truth
//! A cache built with an [`Audit`] ([`SyncedCacheBuilder::audit`]) is
//! compared with the source of truth by the node that holds it, while the
//! node is ready, at most [`Audit::rate`] keys a second:
//! - An entry the node knows at a version below the source's row (or, where
//!   values are compared, with another value: equal means equal by
//!   `PartialEq` or encoded alike, so a NaN equals itself; see
//!   [`Audit::compare_values`]) is a suspect. A suspect whose
//!   key is written, or whose cache is cleared, before it is judged is
//!   explained and cleared.
//! - After the [grace window](Audit::grace), counted from when the
//!   suspect was found or the node was last not ready, it is read again.
//!   It is an inconsistency only if the node still holds the very same
//!   entry, the source still differs, and a marker the node publishes on
//!   the cache's route comes back through its own subscription (everything
//!   published there before it has then been delivered): a stalled link
//!   makes suspects wait, never inconsistencies. Each inconsistency is
//!   counted, logged with the key's trace, and repaired by removing the
//!   entry, unless the key was written meanwhile.
//! - A write that bypassed the publishers is found within a sweep of the
//!   cache (about 1.25 × entries ÷ rate, in whole batches, plus the time
//!   the source's reads take), the grace window, and a round (1.25 ×
//!   batch ÷ rate), plus the marker's round trip.
//! - An entry is judged by the version its value was installed at (by an
//!   event's refresh or a versioned load); one installed without a version
//!   is compared by value where values are compared, and otherwise not
//!   judged (`unverified`).
//! - A writer that publishes later than the grace window after it commits
//!   (an outbox relay far behind) is reported as inconsistent: raise the
//!   grace window above that delay.
//!
//! ## Probes
//! `GET /livez` answers 200 while the node's consume task runs (also while
//! its broker is down: a restart would not bring the broker back).
//! `GET /readyz` answers 200 when the node is consuming, has caught up with
//! its start replay, and holds no quarantined cache; 503 with the reasons
//! otherwise. `GET /healthz` is kept as it was: 200 while consuming.
//!
//! ## Lifecycle
//! A cache belongs to one node at a time. A node gives its caches back when
//! it shuts down, when its start fails, and when its last handle is
//! dropped; a node that has shut down refuses new work with
//! [`Error::Shutdown`].
//!
//! ## Redelivery
//! Positions are saved periodically and on shutdown through an
//! [`OffsetStore`](transport::OffsetStore); after a crash some events are applied again, in order,
//! to caches emptied at registration, as they were the first time. On
//! a running node an event delivered twice is late the second time, and
//! installs nothing: a versioned refresh then changes nothing, while an
//! unversioned refresh (whose value the node cannot tell from a newer
//! one), an invalidation or a clear removes again what it names, so the
//! next reads load it. Either way no older value than the first time is
//! left in the cache.
//!
//! # Features
//! The embedded transport needs no feature and no server. Broker transports come
//! behind cargo features:
//!
//! | feature | transports |
//! |---|---|
//! | `redis` | `RedisStreamsTransport` (durable, replayable; recommended) and `RedisPubSubTransport` (lowest latency, lossy) |
//! | `nats` | `NatsJetStreamTransport` (durable, replayable) |
//! | `rocketmq` | `RocketMqTransport` (durable, replayable; broker-side tag filtering, per-cache order) |
//! | `postgres-cdc` | not a transport: invalidation from PostgreSQL's own log (`CdcRelay`, `CdcTable`): every committed row change of the mapped tables, whoever wrote it, read from logical replication (`pgoutput`, through `pgwire-replication`) and published at its commit LSN as a refresh, an invalidation or a clear; at least once, one active relay per slot with standbys, a lost slot resynced |
//! | `mysql-cdc` | not a transport: invalidation from MySQL's or MariaDB's row binlog (`BinlogRelay`, with the same `CdcTable` mappings), read over the replication protocol through `mysql_async` and published at the binlog position's version; at least once, one active relay per name with standbys, a purged position resynced |
//! | `postgres` | not a transport: the transactional outbox on PostgreSQL 14+ (`Outbox`, `OutboxDictionary`, `OutboxRelay`, through `sqlx` 0.8): change events written in the caller's own transaction and published, in commit order per cache, once it commits, so a crash or a broker outage between commit and publish loses nothing; several relays may run, one publishes at a time, and nodes fence a relay replaced while it published, so its late events never land over its successor's |
//! | `mysql-outbox` | not a transport: the same transactional outbox on MariaDB (tested on 10.11) or MySQL 8 (untested) (on a `sqlx::MySqlPool`), with the same guarantees; its relay polls (MySQL has no `NOTIFY`) |
//!
//! The crate builds on its declared `rust-version` (1.89) with every feature
//! but `rocketmq`: the RocketMQ client 1.0 needs Rust 1.95.
#![cfg_attr(docsrs, feature(doc_cfg))]
// The RocketMQ client's futures nest deeper than the default limit allows
// when the compiler proves them `Send`.
#![recursion_limit = "256"]
#![warn(missing_docs)]
// Numbers come off the wire (sequence numbers, offsets, ordinals, lengths)
// and out of configuration (durations, capacities): every operation that
// could overflow says what happens at the edge (checked, saturating or
// wrapping). Tests may use plain arithmetic.
#![cfg_attr(not(test), warn(clippy::arithmetic_side_effects))]

mod cache;
#[cfg(any(feature = "postgres-cdc", feature = "mysql-cdc"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres-cdc", feature = "mysql-cdc"))))]
pub mod cdc;
pub mod cluster;
pub mod error;
#[cfg(any(test, feature = "_fuzz"))]
#[doc(hidden)]
pub mod fuzz;
mod node;
#[cfg(feature = "_outbox")]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres-outbox", feature = "mysql-outbox")))
)]
pub mod outbox;
mod publish;
pub mod status;
mod table;
pub mod transport;
mod util;
mod wire;

#[doc(inline)]
pub use cache::{Audit, SyncedCache, SyncedCacheBuilder};
#[doc(inline)]
pub use error::{Error, Result};
#[doc(inline)]
pub use node::{Node, NodeBuilder, StatusServer};
#[doc(inline)]
pub use publish::{DictionaryPublisher, Published, Publisher, PublisherBuilder};
#[doc(inline)]
pub use table::Table;
#[doc(inline)]
pub use wire::Keyring;

/// The README's examples are compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
