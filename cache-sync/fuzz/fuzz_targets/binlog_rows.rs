//! See `cache_sync::fuzz::binlog_rows`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cache_sync::fuzz::binlog_rows(data));
