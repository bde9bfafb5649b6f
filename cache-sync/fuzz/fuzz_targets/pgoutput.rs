//! See `cache_sync::fuzz::pgoutput`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cache_sync::fuzz::pgoutput(data));
