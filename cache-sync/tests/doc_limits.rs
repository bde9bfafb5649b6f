//! The defaults and limits that `docs/design.md`, `docs/transports.md` and
//! the API docs of the CDC relay and the auditor state, checked against the
//! constants in the code, in the style of `tests/layers.rs`: each row names
//! a constant, reads its value from the source, and requires the doc to say
//! it in the row's words. A changed constant fails here until its doc says
//! the new value.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

/// A constant's value: a count, or a duration in milliseconds.
type Value = u128;

/// Evaluates the right-hand side of a `const` the way the rows need:
/// integers (with `_`), `+`, `<<`, `*`, `-`, parentheses,
/// `Duration::from_secs`, `from_millis`, and other constants of the same
/// file or crate.
fn eval(expr: &str, known: &HashMap<String, String>, depth: u32) -> Value {
    assert!(
        depth < 8,
        "constants refer to each other too deeply: {expr}"
    );
    let expr = expr.trim();
    for (call, scale) in [
        ("Duration::from_secs(", 1000),
        ("Duration::from_millis(", 1),
    ] {
        if let Some(inner) = expr.strip_prefix(call).and_then(|e| e.strip_suffix(')')) {
            return eval(inner, known, depth + 1) * scale;
        }
    }
    if let Some(inner) = expr.strip_prefix('(').and_then(|e| e.strip_suffix(')')) {
        return eval(inner, known, depth + 1);
    }
    // The loosest-binding operator first, as Rust binds them: `<<`, then
    // `+` and `-`, then `*`.
    for (op, f) in [
        (" << ", (|a, b| a << b) as fn(Value, Value) -> Value),
        (" + ", |a, b| a + b),
        (" - ", |a, b| a - b),
        (" * ", |a, b| a * b),
    ] {
        if let Some((a, b)) = expr.rsplit_once(op) {
            return f(eval(a, known, depth + 1), eval(b, known, depth + 1));
        }
    }
    if let Ok(n) = expr.replace('_', "").parse() {
        return n;
    }
    let name = expr.rsplit("::").next().expect("a path has a last segment");
    let rhs = known
        .get(name)
        .unwrap_or_else(|| panic!("cannot evaluate {expr:?}"));
    eval(rhs, known, depth + 1)
}

/// The value of a name two constants of different values share.
const AMBIGUOUS: &str = "<two constants of this name>";

/// Every `const NAME: T = EXPR;` on one line in the crate's sources.
fn constants() -> HashMap<String, String> {
    fn walk(dir: &Path, out: &mut HashMap<String, String>) {
        for entry in fs::read_dir(dir).expect("src/ is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                for line in fs::read_to_string(&path).expect("a source file").lines() {
                    let line = line.trim_start();
                    let line = line
                        .strip_prefix("pub(crate) ")
                        .or_else(|| line.strip_prefix("pub(super) "))
                        .or_else(|| line.strip_prefix("pub "))
                        .unwrap_or(line);
                    let Some(rest) = line.strip_prefix("const ") else {
                        continue;
                    };
                    let (Some((name, _)), Some((_, rhs))) =
                        (rest.split_once(':'), rest.split_once(" = "))
                    else {
                        continue;
                    };
                    if let Some(rhs) = rhs.strip_suffix(';') {
                        // Two constants of one name that disagree make a row
                        // that names it ambiguous: it then fails, below.
                        let rhs = match out.get(name) {
                            Some(previous) if previous != rhs => AMBIGUOUS.to_owned(),
                            _ => rhs.to_owned(),
                        };
                        out.insert(name.to_owned(), rhs);
                    }
                }
            }
        }
    }
    let mut out = HashMap::new();
    walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut out);
    // Values the code computes from constants, which the docs state.
    out.insert(
        "DEFAULT_AUDIT_GRACE".to_owned(),
        "DEFAULT_REORDER_WINDOW + DEFAULT_ANNOUNCE_INTERVAL + AUDIT_MARGIN".to_owned(),
    );
    out
}

/// Whether `text` says `words` as a whole: not as the tail of a longer
/// number ("24 pending" inside "1,024 pending") nor the head of one.
fn states(text: &str, words: &str) -> bool {
    let number = |c: char| c.is_ascii_digit() || c == ',' || c == '.';
    text.match_indices(words).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + words.len()..].chars().next();
        let tail_of_a_number =
            words.starts_with(|c: char| c.is_ascii_digit()) && before.is_some_and(number);
        let head_of_a_number = words.ends_with(|c: char| c.is_ascii_digit())
            && after.is_some_and(|c| c.is_ascii_digit());
        !tail_of_a_number && !head_of_a_number
    })
}

// How a doc writes a value.
fn plain(v: Value) -> String {
    v.to_string()
}
/// Thousands separated by commas, as the docs write counts: `10,000`.
fn count(v: Value) -> String {
    let digits = v.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
fn kib(v: Value) -> String {
    assert_eq!(v % 1024, 0, "{v} is no whole KiB");
    format!("{} KiB", v / 1024)
}
fn mib(v: Value) -> String {
    assert_eq!(v % (1 << 20), 0, "{v} is no whole MiB");
    format!("{} MiB", v >> 20)
}
fn ms(v: Value) -> String {
    format!("{v} ms")
}
fn secs(v: Value) -> String {
    assert_eq!(v % 1000, 0, "{v} ms is no whole second");
    format!("{} s", v / 1000)
}
fn gib(v: Value) -> String {
    assert_eq!(v % (1 << 30), 0, "{v} is no whole GiB");
    format!("{} GiB", v >> 30)
}
fn mins(v: Value) -> String {
    assert_eq!(v % 60_000, 0, "{v} ms is no whole minute");
    format!("{} min", v / 60_000)
}
fn days(v: Value) -> String {
    assert_eq!(v % 86_400_000, 0, "{v} ms is no whole day");
    format!("{} days", v / 86_400_000)
}
fn hours(v: Value) -> String {
    assert_eq!(v % 3_600_000, 0, "{v} ms is no whole hour");
    format!("{} h", v / 3_600_000)
}
fn minutes_in_words(v: Value) -> String {
    assert_eq!(v % 60_000, 0, "{v} ms is no whole minute");
    format!("{} minutes", words(v / 60_000))
}
fn words(v: Value) -> String {
    let names = [
        "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    ];
    names
        .get(usize::try_from(v).unwrap_or(usize::MAX))
        .map_or_else(|| v.to_string(), |w| (*w).to_owned())
}

const DESIGN: &str = "docs/design.md";
const TRANSPORTS: &str = "docs/transports.md";
// API docs: the `///` and `//!` lines of a source file.
const RELAY: &str = "cache-sync/src/cdc/builder.rs";
const AUDIT: &str = "cache-sync/src/cache/audit/settings.rs";

/// (doc, constant, how the doc writes it, the words around it: `{}` is the
/// value).
type Row = (
    &'static str,
    &'static str,
    fn(Value) -> String,
    &'static str,
);

const ROWS: &[Row] = &[
    // The status server.
    (
        DESIGN,
        "MAX_CONNECTIONS",
        plain,
        "{} connections open at once",
    ),
    (
        DESIGN,
        "MAX_CONNECTION_AGE",
        secs,
        "each closed once {} old",
    ),
    (
        DESIGN,
        "HEADER_READ_TIMEOUT",
        secs,
        "{} to send a request's head",
    ),
    (
        DESIGN,
        "IDLE_TIMEOUT",
        secs,
        "{} without progress on a connection",
    ),
    (
        DESIGN,
        "SHUTDOWN_GRACE",
        secs,
        "{} for requests in flight at shutdown",
    ),
    // Acknowledgements.
    (DESIGN, "MAX_PENDING", count, "{} pending (the oldest goes)"),
    (
        DESIGN,
        "MAX_REQUEST_WAIT",
        secs,
        "kept for its `within_ms`, at most {}",
    ),
    (DESIGN, "MAX_FOLLOWS", plain, "{} follows, each for"),
    (
        DESIGN,
        "FOLLOW_FOR",
        secs,
        "each for {} after its last request",
    ),
    (DESIGN, "MAX_ANSWERS", count, "one per node, {} nodes"),
    (DESIGN, "MAX_NODE_ID_BYTES", kib, "node ids up to {}"),
    // Publishers and the outbox, on a node.
    (
        DESIGN,
        "MAX_TRACKED_PUBLISHERS",
        count,
        "{} (publisher, cache) pairs",
    ),
    (
        DESIGN,
        "MAX_PENDING_CHECKS",
        count,
        "one per (publisher, cache), {} in all",
    ),
    (
        DESIGN,
        "MAX_SCOPES_PER_CACHE",
        plain,
        "{} outboxes (scopes) per cache",
    ),
    (
        DESIGN,
        "LEADER_CHECK_TIMEOUT",
        secs,
        "{} for the database to answer before each publish",
    ),
    // Settings' ranges.
    (DESIGN, "MAX_EVENT_BYTES_CEILING", mib, "1 byte to {}"),
    (
        DESIGN,
        "MIN_ANNOUNCE_INTERVAL",
        ms,
        "| {} to 1 h, or `Duration::MAX` for none",
    ),
    (DESIGN, "MAX_TIMEOUT", hours, "(NATS 100 ms) to {}"),
    (
        DESIGN,
        "DEFAULT_FRESHNESS_INTERVAL",
        secs,
        "or `Duration::MAX` for none ({} by default); at most",
    ),
    (
        DESIGN,
        "MAX_TAILS_PENDING",
        plain,
        "at most {} tails asked for and not reached yet",
    ),
    (DESIGN, "MIN_TIMEOUT", ms, "| {} (NATS 100 ms) to"),
    (DESIGN, "MIN_INTERVAL", ms, "(NATS {}) to 1 h"),
    (
        DESIGN,
        "MIN_BACKLOG_BYTES",
        kib,
        "`max_backlog_bytes` | at least {}",
    ),
    (
        DESIGN,
        "DEFAULT_MAX_PIN_WAIT",
        secs,
        "`SyncedCacheBuilder::max_pin_wait`, {} by default",
    ),
    // The cluster view.
    (DESIGN, "MAX_MEMBERS", count, "{} live nodes"),
    (
        DESIGN,
        "MAX_MEMBER_BYTES",
        kib,
        "{} each and 128 MiB in all",
    ),
    (DESIGN, "MAX_TOTAL_BYTES", mib, "256 KiB each and {} in all"),
    (
        DESIGN,
        "GONE_KEPT",
        minutes_in_words,
        "gone nodes 10,000 for {}",
    ),
    (
        DESIGN,
        "MISSED_INTERVALS",
        words,
        "holds for {} of its sender's intervals",
    ),
    (
        DESIGN,
        "MAX_VERSION_AGE",
        hours,
        "(`sent_at_us - started_at_us`) and {}",
    ),
    (
        DESIGN,
        "MAX_STEPS",
        plain,
        "a staircase of {} points at most",
    ),
    // The cluster page.
    (DESIGN, "CACHES_PER_PAGE", plain, "caches {} a page"),
    (DESIGN, "NODES_PER_PAGE", plain, "nodes {} a page"),
    (
        DESIGN,
        "MAX_GRID_CACHES",
        plain,
        "a column per cache up to {} caches",
    ),
    (
        DESIGN,
        "MAX_LISTED",
        plain,
        "{} lagging caches listed per node",
    ),
    (DESIGN, "MAX_GONE_LISTED", plain, "{} gone nodes |"),
    // Transports.
    (
        TRANSPORTS,
        "HEARTBEAT_MAX_LEN",
        plain,
        "`XADD … MAXLEN ~ {}`",
    ),
    (
        TRANSPORTS,
        "HEARTBEAT_TTL",
        secs,
        "a `PEXPIRE` of {} on each publish",
    ),
    (TRANSPORTS, "ROUTE_WAIT", secs, "so the wait lasts up to {}"),
    // The CDC relay: its settings, in design.md's prose and limits table,
    // and in `CdcRelayBuilder`'s docs.
    (
        DESIGN,
        "DEFAULT_MAX_ROWS_PER_TRANSACTION",
        count,
        "Past `max_rows_per_transaction` ({}) row changes",
    ),
    (
        DESIGN,
        "DEFAULT_MAX_ROWS_PER_TRANSACTION",
        count,
        "`max_rows_per_transaction` at least 1 ({} by default)",
    ),
    (
        RELAY,
        "DEFAULT_MAX_ROWS_PER_TRANSACTION",
        count,
        "become one clear of it ({}; at least 1)",
    ),
    (
        DESIGN,
        "DEFAULT_MAX_ROW_BYTES",
        mib,
        "`max_row_bytes` ({}) is",
    ),
    (DESIGN, "MIN_ROW_BYTES", kib, "`max_row_bytes` {} to 1 GiB"),
    (DESIGN, "MAX_ROW_BYTES", gib, "`max_row_bytes` 1 KiB to {}"),
    (
        DESIGN,
        "DEFAULT_MAX_ROW_BYTES",
        mib,
        "to 1 GiB ({} by default)",
    ),
    (
        RELAY,
        "DEFAULT_MAX_ROW_BYTES",
        mib,
        "as the server sends it ({};",
    ),
    (RELAY, "MIN_ROW_BYTES", kib, "(8 MiB; {} to 1 GiB)"),
    (RELAY, "MAX_ROW_BYTES", gib, "(8 MiB; 1 KiB to {})"),
    (
        DESIGN,
        "DEFAULT_LAG_INTERVAL",
        secs,
        "Every `lag_interval` ({})",
    ),
    (DESIGN, "MIN_LAG_INTERVAL", ms, "`lag_interval` {} to 1 h"),
    (
        DESIGN,
        "MAX_LAG_INTERVAL",
        hours,
        "`lag_interval` 100 ms to {}",
    ),
    (
        DESIGN,
        "DEFAULT_LAG_INTERVAL",
        secs,
        "100 ms to 1 h ({} by default)",
    ),
    (RELAY, "DEFAULT_LAG_INTERVAL", secs, "lag is read ({};"),
    (
        RELAY,
        "MIN_LAG_INTERVAL",
        ms,
        "lag is read (5 s; {} to 1 h)",
    ),
    (
        RELAY,
        "MAX_LAG_INTERVAL",
        hours,
        "lag is read (5 s; 100 ms to {})",
    ),
    (
        RELAY,
        "MIN_REPORT_INTERVAL",
        ms,
        "(never by default; {} to 1 h,",
    ),
    (
        RELAY,
        "MAX_REPORT_INTERVAL",
        hours,
        "(never by default; 10 ms to {},",
    ),
    (
        DESIGN,
        "MIN_REPORT_INTERVAL",
        ms,
        "`freshness_interval` {} to 1 h",
    ),
    (
        DESIGN,
        "MAX_REPORT_INTERVAL",
        hours,
        "`freshness_interval` 10 ms to {}",
    ),
    (
        DESIGN,
        "DEFAULT_STANDBY_RETRY",
        secs,
        "every `standby_retry` ({})",
    ),
    (
        DESIGN,
        "MIN_STANDBY_RETRY",
        ms,
        "`standby_retry` {} to 1 min",
    ),
    (
        DESIGN,
        "MAX_STANDBY_RETRY",
        mins,
        "`standby_retry` 10 ms to {}",
    ),
    (
        DESIGN,
        "DEFAULT_STANDBY_RETRY",
        secs,
        "to 1 min ({} by default)",
    ),
    (
        RELAY,
        "DEFAULT_STANDBY_RETRY",
        secs,
        "the slot is free ({};",
    ),
    (RELAY, "MIN_STANDBY_RETRY", ms, "is free (1 s; {} to 1 min)"),
    (
        RELAY,
        "MAX_STANDBY_RETRY",
        mins,
        "is free (1 s; 10 ms to {})",
    ),
    (
        DESIGN,
        "DEFAULT_LAG_WARNING_BYTES",
        gib,
        "`lag_warning_bytes` ({})",
    ),
    (
        DESIGN,
        "DEFAULT_LAG_WARNING_BYTES",
        gib,
        "`lag_warning_bytes` any ({} by default)",
    ),
    (
        RELAY,
        "DEFAULT_LAG_WARNING_BYTES",
        gib,
        "many bytes behind ({})",
    ),
    // What a CDC session holds.
    (
        DESIGN,
        "MAX_BATCH_ROWS",
        count,
        "once it reaches {} row changes, 16 MiB or 1,000 transactions",
    ),
    (
        DESIGN,
        "MAX_BATCH_BYTES",
        mib,
        "5,000 row changes, {} or 1,000 transactions",
    ),
    (
        DESIGN,
        "MAX_BATCH_TRANSACTIONS",
        count,
        "16 MiB or {} transactions",
    ),
    (
        DESIGN,
        "MAX_TRANSACTION_BYTES",
        mib,
        "which holds at most {} of keys and values per cache",
    ),
    (
        DESIGN,
        "MAX_TRANSACTION_BYTES",
        mib,
        "or {} of keys and values, to one cache",
    ),
    (
        DESIGN,
        "READ_AHEAD",
        plain,
        "the replication client reads {} messages ahead",
    ),
    (
        DESIGN,
        "READ_AHEAD",
        plain,
        "at most {} messages ahead (at most {} × `max_row_bytes`)",
    ),
    (
        RELAY,
        "READ_AHEAD",
        plain,
        "reads up to {} messages ahead, so at most {} times this",
    ),
    (
        DESIGN,
        "MAX_COLUMNS",
        count,
        "columns in the CDC stream | {} (PostgreSQL's",
    ),
    (
        DESIGN,
        "SQL_TIMEOUT",
        secs,
        "| {} for each query the relay waits on",
    ),
    // The auditor: design.md and `Audit`'s docs.
    (
        DESIGN,
        "DEFAULT_AUDIT_RATE",
        plain,
        "`rate` at least 1 ({} keys a second by default)",
    ),
    (
        DESIGN,
        "MAX_AUDIT_BATCH",
        count,
        "`batch` 1 to {} (100 by default)",
    ),
    (
        DESIGN,
        "DEFAULT_AUDIT_BATCH",
        plain,
        "to 10,000 ({} by default)",
    ),
    (
        DESIGN,
        "MAX_TIMEOUT",
        hours,
        "`timeout` 1 ms to {} (5 s by default)",
    ),
    (
        DESIGN,
        "DEFAULT_AUDIT_TIMEOUT",
        secs,
        "`timeout` 1 ms to 1 h ({} by default)",
    ),
    (DESIGN, "MIN_AUDIT_WINDOW", mins, "`window` {} to 30 days"),
    (DESIGN, "MAX_AUDIT_WINDOW", days, "`window` 1 min to {}"),
    (
        DESIGN,
        "DEFAULT_AUDIT_WINDOW",
        hours,
        "to 30 days ({} by default)",
    ),
    (DESIGN, "WINDOW_BUCKETS", plain, "kept in {} buckets"),
    (
        DESIGN,
        "AUDIT_MARGIN",
        secs,
        "reorder window + announce interval + {}",
    ),
    (
        DESIGN,
        "DEFAULT_AUDIT_GRACE",
        secs,
        "(reorder window + announce interval + 2 s: {})",
    ),
    (
        AUDIT,
        "DEFAULT_AUDIT_RATE",
        plain,
        "Default {}; at least 1.",
    ),
    (
        AUDIT,
        "DEFAULT_AUDIT_BATCH",
        plain,
        "asks for. Default {}; 1 to",
    ),
    (AUDIT, "MAX_AUDIT_BATCH", count, "1 to {}. A read starts"),
    (
        AUDIT,
        "DEFAULT_AUDIT_TIMEOUT",
        secs,
        "counts as failed. Default {};",
    ),
    (AUDIT, "MAX_TIMEOUT", hours, "Default 5 s; 1 ms to {}."),
    (
        AUDIT,
        "DEFAULT_AUDIT_WINDOW",
        hours,
        "taken over. Default {};",
    ),
    (
        AUDIT,
        "MIN_AUDIT_WINDOW",
        mins,
        "Default 1 h; {} to 30 days",
    ),
    (AUDIT, "MAX_AUDIT_WINDOW", days, "1 min to {}. It is kept"),
    (AUDIT, "WINDOW_BUCKETS", plain, "It is kept in {} buckets"),
    (
        AUDIT,
        "DEFAULT_ANNOUNCE_INTERVAL",
        secs,
        "the default announce interval ({}) + 2 s",
    ),
    (AUDIT, "AUDIT_MARGIN", secs, "announce interval (1 s) + {},"),
    (
        AUDIT,
        "DEFAULT_AUDIT_GRACE",
        secs,
        "+ 2 s, {} with the defaults",
    ),
    (
        TRANSPORTS,
        "ROUTE_WAIT_WARN",
        secs,
        "logs a\nwarning past {}",
    ),
];

/// A source file's documentation: its `///` and `//!` lines, without the
/// markers (its code and plain comments state nothing to a reader of the
/// docs).
fn doc_comments(source: &str) -> String {
    source
        .lines()
        .filter_map(|line| {
            let line = line.trim_start();
            line.strip_prefix("///")
                .or_else(|| line.strip_prefix("//!"))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_docs_state_the_limits_the_code_has() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace");
    let known = constants();
    let mut wrong = Vec::new();
    for &(doc, name, render, words) in ROWS {
        let text = fs::read_to_string(root.join(doc)).expect("the doc is readable");
        let text = if doc.ends_with(".rs") {
            doc_comments(&text)
        } else {
            text
        };
        // Line breaks in the doc are spaces to a reader.
        let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
        let rhs = known
            .get(name)
            .unwrap_or_else(|| panic!("no constant {name} in cache-sync/src"));
        assert_ne!(
            rhs, AMBIGUOUS,
            "{name}: two constants of this name; rename one"
        );
        let value = eval(rhs, &known, 0);
        let expected = words.replace("{}", &render(value));
        let expected = expected.split_whitespace().collect::<Vec<_>>().join(" ");
        if !states(&flat, &expected) {
            wrong.push(format!(
                "{doc}: {name} = {rhs}, so it should say {expected:?}"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "docs that no longer state the code's limits:\n{}",
        wrong.join("\n")
    );
}

/// The checker itself: each way of writing a value, and a wrong value
/// caught.
#[test]
fn the_checker_reads_constants_and_renders_values() {
    let mut known = HashMap::new();
    known.insert("A".to_owned(), "10_000".to_owned());
    known.insert("B".to_owned(), "super::A".to_owned());
    assert_eq!(
        eval("Duration::from_secs(24 * 3600)", &known, 0),
        86_400_000
    );
    assert_eq!(eval("256 << 10", &known, 0), 262_144);
    assert_eq!(
        eval(
            "(u32::MAX - 1)".replace("u32::MAX", "4294967295").as_str(),
            &known,
            0
        ),
        4_294_967_294
    );
    assert_eq!(eval("B", &known, 0), 10_000);
    assert_eq!(count(1024), "1,024");
    assert_eq!(count(100_000), "100,000");
    assert_eq!(kib(262_144), "256 KiB");
    assert_eq!(minutes_in_words(300_000), "five minutes");
    assert_eq!(words(3), "three");
    assert_eq!(gib(1 << 30), "1 GiB");
    assert_eq!(mins(60_000), "1 min");
    assert_eq!(days(30 * 86_400_000), "30 days");
    known.insert("C".to_owned(), "Duration::from_secs(10)".to_owned());
    assert_eq!(eval("C + B + Duration::from_secs(2)", &known, 0), 22_000);
    // Only the docs of a source file count, never its code.
    assert_eq!(
        doc_comments("/// one\n    //! two\nconst X: u8 = 3; // three"),
        " one\n two"
    );
    // A value is matched whole, never as part of a longer number.
    assert!(states(
        "at most 1,024 pending (the oldest goes)",
        "1,024 pending"
    ));
    assert!(!states(
        "at most 1,024 pending (the oldest goes)",
        "24 pending"
    ));
    assert!(!states("64 connections", "4 connections"));
    assert!(!states("up to 256 KiB", "up to 25"));
    assert!(states("64 connections", "64 connections"));
}
