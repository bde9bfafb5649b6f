//! See `cache_sync::fuzz::offsets`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cache_sync::fuzz::offsets(data));
