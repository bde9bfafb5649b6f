//! See `cache_sync::fuzz::records`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cache_sync::fuzz::records(data));
