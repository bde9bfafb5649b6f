//! See `cache_sync::fuzz::heartbeat`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cache_sync::fuzz::heartbeat(data));
