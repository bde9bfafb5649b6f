//! See `cache_sync::fuzz::outbox_row`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cache_sync::fuzz::outbox_row(data));
