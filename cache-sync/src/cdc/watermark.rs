//! The relay's reports of its own lag (`wire::Watermark`), so that a
//! node's freshness holds against the database, not only the topic.
//!
//! Every `freshness_interval` the active relay notes the time on its own
//! monotonic clock and writes a logical message into the WAL
//! (`pg_logical_emit_message`, not transactional), naming a random token.
//! Any transaction visible before that moment has its commit record
//! before the message, so it reaches the relay's stream before the
//! message does. When the message arrives, it joins the batch being
//! gathered; once that batch (and every one before it, in commit order) is
//! published, the relay sends each mapped cache a numbered report:
//! everything the database made visible before its mark is published
//! before it. Once every cache's report is acknowledged the relay knows
//! how long after its mark that was, and the next report carries that
//! duration: a node takes it against its proof as of the earlier report,
//! which the earlier report's acknowledgement came after. A duration on
//! the relay's clock only: no clock of the database or of a node is read.
//!
//! A relay whose stream stalls, falls behind, or is cut off from the
//! database sends no report for as long as it lasts (or a large lag after
//! it), and the nodes' freshness ages. Its cost: one small WAL record per
//! interval on the database, and one announcement per mapped cache per
//! interval on the topic (linear in the nodes: each receives the relay's).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::relay::Inner;
use super::slot::db;
use super::stream::SQL_TIMEOUT;
use crate::util::{lock, random_u64};
use crate::wire::Watermark;

/// The logical message's prefix.
pub(super) const WATERMARK_PREFIX: &str = "cache-sync.cdc.watermark";

/// Marks written and not yet seen on the stream, kept at most. A stream
/// further behind than that many intervals keeps the oldest and the newest
/// and as even a spread between them as it can (see `Marks::note`), so it
/// still reports about every lag ÷ 16, each report as old as its mark.
const MAX_MARKS: usize = 16;

/// The marks this relay wrote, in order, each with its moment; and its
/// reports' numbering.
#[derive(Debug)]
pub(super) struct Marks {
    written: Mutex<VecDeque<(u64, Instant)>>,
    reports: Mutex<Reports>,
}

/// This relay's reports: their epoch, their numbers in it, and how long
/// after its mark the last one was acknowledged everywhere. The epoch is
/// the database's WAL position when the relay's session started: every
/// session of every relay of a group starts past the marks of the ones
/// before it, so a node refuses an older epoch's reports (a replay).
#[derive(Debug)]
struct Reports {
    epoch: u64,
    number: u64,
    acked_after_us: Option<u64>,
}

impl Marks {
    pub(super) fn new() -> Self {
        Marks {
            written: Mutex::default(),
            reports: Mutex::new(Reports {
                epoch: 0,
                number: 0,
                acked_after_us: None,
            }),
        }
    }

    /// Starts a new epoch of reports, if `epoch` is past the current one.
    fn new_epoch(&self, epoch: u64) {
        let mut r = lock(&self.reports);
        if epoch > r.epoch {
            *r = Reports {
                epoch,
                number: 0,
                acked_after_us: None,
            };
        }
    }

    /// Notes a new mark, now; returns its token.
    fn note(&self) -> (u64, Instant) {
        // Random, not counted: any role may write a logical message, and
        // one naming a token this relay is about to write, placed before
        // it in the WAL, would claim a moment the stream has not reached.
        let token = random_u64();
        let at = Instant::now();
        let mut marks = lock(&self.written);
        if marks.len() >= MAX_MARKS {
            // Forget the mark whose neighbours are closest together: the
            // oldest stays (the next the stream reaches), and the kept ones
            // thin out evenly over the lag. Dropping the oldest instead
            // left a stream more than 16 intervals behind reaching only
            // marks it no longer knew: no report at all until it caught up
            // (a node's age grew to 23 s under a write storm the relay
            // was 8.7 s behind).
            let forget = marks
                .make_contiguous()
                .windows(3)
                .enumerate()
                .min_by_key(|(_, w)| w[2].1.saturating_duration_since(w[0].1))
                .map_or(0, |(i, _)| i.saturating_add(1));
            marks.remove(forget);
        }
        marks.push_back((token, at));
        (token, at)
    }

    /// The moment of the mark a message on the stream carries, if it is
    /// one of this relay's for `slot`; the marks before it are dropped
    /// (they were written earlier, so their messages were passed).
    pub(super) fn seen(&self, slot: &str, content: &[u8]) -> Option<Instant> {
        let token = parse(content, slot)?;
        let mut marks = lock(&self.written);
        let i = marks.iter().position(|(t, _)| *t == token)?;
        let at = marks[i].1;
        marks.drain(..=i);
        Some(at)
    }
}

fn content(slot: &str, token: u64) -> String {
    format!("{slot}/{token:016x}")
}

fn parse(content: &[u8], slot: &str) -> Option<u64> {
    let text = std::str::from_utf8(content).ok()?;
    let (of, token) = text.split_once('/')?;
    if of != slot || token.len() != 16 {
        return None;
    }
    u64::from_str_radix(token, 16).ok()
}

/// A relay group's source, as nodes tell reports apart: its slot and
/// database, hashed (FNV-1a, fixed, so every relay of the group, in any
/// process or version, names it the same).
pub(super) fn source(slot: &str, database: &str) -> u64 {
    crate::util::source_hash(&[slot, database])
}

/// Writes a mark every `every` while the session streams; never returns
/// (the session drops it). A write that fails is logged: no report
/// follows, which the nodes see as a freshness that ages.
pub(super) async fn write_loop(inner: &Inner, every: Duration) {
    if every == Duration::MAX {
        return std::future::pending().await;
    }
    let slot = &inner.shared.slot;
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut epoch = false;
    // A run of marks that could not be written (see `noted`).
    let mut failing = false;
    loop {
        ticks.tick().await;
        if !epoch {
            // The session's epoch first: no mark of its own before it.
            let lsn = sqlx::query_scalar::<_, i64>(
                "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint",
            )
            .fetch_one(&inner.pool);
            match tokio::time::timeout(SQL_TIMEOUT, lsn).await {
                Ok(Ok(lsn)) => {
                    inner.marks.new_epoch(u64::try_from(lsn).unwrap_or(0));
                    epoch = true;
                }
                Ok(Err(e)) => {
                    tracing::debug!(slot = %slot, error = %db(e), "cdc relay: reading the WAL position for the reports' epoch failed");
                    continue;
                }
                Err(_) => {
                    tracing::debug!(slot = %slot, "cdc relay: reading the WAL position for the reports' epoch timed out");
                    continue;
                }
            }
        }
        let (token, _) = inner.marks.note();
        let write = sqlx::query("SELECT pg_logical_emit_message(false, $1, $2)")
            .bind(WATERMARK_PREFIX)
            .bind(content(slot, token))
            .execute(&inner.pool);
        let failed = match tokio::time::timeout(SQL_TIMEOUT, write).await {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(refusal(&e).unwrap_or_else(|| db(e).to_string())),
            Err(_) => Some(format!("no answer within {SQL_TIMEOUT:?}")),
        };
        failing = noted(inner, failing, failed);
    }
}

/// Counts a mark that could not be written, logging the first of a run
/// as a warning (every node's freshness of the mapped caches ages from
/// now on, which an operator must hear of once, not every interval) and
/// the run's end at `info`; returns whether a run goes on.
fn noted(inner: &Inner, failing: bool, failed: Option<String>) -> bool {
    let slot = &inner.shared.slot;
    match failed {
        Some(error) => {
            inner.shared.mark_failures.fetch_add(1, Ordering::Relaxed);
            if failing {
                tracing::debug!(slot = %slot, %error, "cdc relay: writing a freshness mark failed again");
            } else {
                tracing::warn!(slot = %slot, %error,
                    "cdc relay: writing a freshness mark failed; no report follows until one is written, so the mapped caches' freshness ages on every node");
            }
            true
        }
        None => {
            if failing {
                tracing::info!(slot = %slot, "cdc relay: freshness marks are written again");
            }
            false
        }
    }
}

/// What to do about a mark the database refused for want of a
/// privilege: the relay's role must be able to run the function.
fn refusal(e: &sqlx::Error) -> Option<String> {
    let code = e.as_database_error()?.code()?;
    // 42501: insufficient_privilege.
    (code == "42501").then(|| {
        format!(
            "{e}: the relay's role may not run pg_logical_emit_message; \
             GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) to it"
        )
    })
}

/// Reports to every mapped cache that everything visible before `at` is
/// published. A report that fails is logged and not retried: the next
/// one follows within an interval (and carries no acknowledgement time,
/// as this one did not reach every cache).
pub(super) async fn report(inner: &Inner, at: Instant) {
    let mark = {
        let mut r = lock(&inner.marks.reports);
        r.number = r.number.saturating_add(1);
        Watermark {
            source: inner.source,
            epoch: r.epoch,
            number: r.number,
            acked_after_us: r.acked_after_us.take(),
        }
    };
    let mut caches: Vec<&str> = inner.tables.iter().map(|t| t.cache.as_str()).collect();
    caches.sort_unstable();
    caches.dedup();
    let sent = futures_util::future::join_all(
        caches
            .iter()
            .map(|cache| inner.publisher.watermark(cache, mark)),
    )
    .await;
    // Measured once every cache's report is acknowledged: what the next
    // report says of this one.
    let acked_after_us = u64::try_from(at.elapsed().as_micros()).unwrap_or(u64::MAX);
    let mut everywhere = true;
    for (cache, result) in caches.iter().zip(sent) {
        if let Err(e) = result {
            everywhere = false;
            tracing::debug!(slot = %inner.shared.slot, cache, error = %e, "cdc relay: sending a freshness report failed");
        }
    }
    if everywhere {
        lock(&inner.marks.reports).acked_after_us = Some(acked_after_us);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The source is what relays of a group, across releases, agree on:
    /// the same FNV-1a of slot, a zero byte and database as before it
    /// moved into `util`.
    #[test]
    fn a_groups_source_is_unchanged() {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in "slot".bytes().chain([0]).chain("db".bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        assert_eq!(source("slot", "db"), h);
        assert_ne!(source("slot", "db"), source("slotd", "b"));
    }

    /// Marks written every 100 ms for 10 s, none seen: the oldest and the
    /// newest are kept, and those between spread over the span.
    #[tokio::test(start_paused = true)]
    async fn marks_far_behind_thin_out_evenly() {
        let marks = Marks::new();
        let mut all = Vec::new();
        for _ in 0..100 {
            all.push(marks.note());
            tokio::time::advance(Duration::from_millis(100)).await;
        }
        let kept: Vec<(u64, Instant)> = lock(&marks.written).iter().copied().collect();
        assert_eq!(kept.len(), MAX_MARKS);
        assert_eq!(kept[0], all[0], "the oldest stays");
        assert_eq!(kept[MAX_MARKS - 1], all[99], "the newest is kept");
        let span = all[99].1 - all[0].1;
        let even = span / u32::try_from(MAX_MARKS - 1).unwrap();
        for pair in kept.windows(2) {
            let gap = pair[1].1 - pair[0].1;
            assert!(gap <= even * 2, "a gap of {gap:?} against {even:?} each");
        }
        // The stream reaching them finds each, in order.
        for (token, at) in kept {
            assert_eq!(marks.seen("s", content("s", token).as_bytes()), Some(at));
        }
    }

    #[test]
    fn a_mark_is_seen_once_in_order_and_only_for_its_slot() {
        let marks = Marks::new();
        let (a, at_a) = marks.note();
        let (b, at_b) = marks.note();
        assert_eq!(parse(content("s", a).as_bytes(), "s"), Some(a));
        assert_eq!(marks.seen("s", content("t", a).as_bytes()), None);
        for bad in ["", "s", "s/", "s/zz", "s/00000000000000001", "s/1"] {
            assert_eq!(marks.seen("s", bad.as_bytes()), None, "{bad:?}");
        }
        assert_eq!(marks.seen("s", b"\xff\xfe/0000000000000001"), None);
        // The later one first: the earlier is passed with it.
        assert_eq!(marks.seen("s", content("s", b).as_bytes()), Some(at_b));
        assert_eq!(marks.seen("s", content("s", a).as_bytes()), None);
        assert!(at_a <= at_b);
        // A token never written is nobody's.
        assert_eq!(marks.seen("s", content("s", a ^ 1).as_bytes()), None);
    }

    #[test]
    fn marks_are_bounded_and_keep_the_oldest_and_the_newest() {
        let marks = Marks::new();
        let tokens: Vec<u64> = (0..MAX_MARKS + 4).map(|_| marks.note().0).collect();
        assert_eq!(lock(&marks.written).len(), MAX_MARKS);
        assert!(
            marks
                .seen("s", content("s", tokens[0]).as_bytes())
                .is_some()
        );
        let last = *tokens.last().unwrap();
        assert!(marks.seen("s", content("s", last).as_bytes()).is_some());
    }

    #[test]
    fn a_source_names_its_slot_and_database() {
        assert_eq!(source("cache_sync", "app"), source("cache_sync", "app"));
        assert_ne!(source("cache_sync", "app"), source("cache_sync", "app2"));
        assert_ne!(source("ab", "c"), source("a", "bc"));
        // Fixed across builds and processes: the value itself.
        assert_eq!(source("", ""), 0xaf63_bd4c_8601_b7df);
    }
}
