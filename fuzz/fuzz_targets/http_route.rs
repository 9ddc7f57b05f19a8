//! libFuzzer entry point of [`proxy_fuzz::http_route`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _accepted = proxy_fuzz::http_route(data);
});
