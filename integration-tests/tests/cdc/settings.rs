//! Settings out of range are refused at build time, each with its reason.

use super::*;

#[tokio::test]
async fn settings_out_of_range_are_refused() {
    let t = EmbeddedTransport::new();
    let url = "postgres://postgres@127.0.0.1:1/none";
    let table = || CdcTable::new(ITEMS, "items", |row| row.parse("id"));
    for builder in [
        CdcRelay::builder(url, Publisher::new(t.clone())),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .slot(""),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .slot("Upper"),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .slot("x".repeat(64)),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .slot("a.b"),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .publication(""),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .publication("a b"),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .publication("a\"b"),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .publication("\u{e9}"),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .publication("x".repeat(64)),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .max_rows_per_transaction(0),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .lag_interval(Duration::ZERO),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .lag_interval(Duration::MAX),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .freshness_interval(Duration::ZERO),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .freshness_interval(Duration::from_millis(9)),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .freshness_interval(Duration::from_secs(3601)),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .standby_retry(Duration::ZERO),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .standby_retry(Duration::MAX),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .max_row_bytes(1023),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .max_row_bytes(usize::MAX),
        CdcRelay::builder("mysql://x", Publisher::new(t.clone())).table(table()),
        CdcRelay::builder("postgres://h/db?sslmode=bogus", Publisher::new(t.clone()))
            .table(table()),
        CdcRelay::builder(url, Publisher::new(t.clone())).table(CdcTable::new(
            Table::<i64, String>::new("a\u{0}b"),
            "items",
            |r| r.parse("id"),
        )),
        CdcRelay::builder(url, Publisher::new(t.clone())).table(CdcTable::new(
            Table::<i64, String>::with_topic("items", "elsewhere"),
            "items",
            |r| r.parse("id"),
        )),
    ] {
        let err = builder.start().await.unwrap_err();
        assert!(err.is_config(), "{err}");
    }
    // A database that cannot be reached is a database error (and
    // `Duration::MAX`, never reporting, is a setting, not out of range).
    let err = CdcRelay::builder(url, Publisher::new(t.clone()))
        .table(table())
        .freshness_interval(Duration::MAX)
        .start()
        .await
        .unwrap_err();
    assert!(err.is_database(), "{err}");
}
