//! libFuzzer entry point of [`proxy_fuzz::xds_cla`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _accepted = proxy_fuzz::xds_cla(data);
});
