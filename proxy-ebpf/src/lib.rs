#![no_std]
// This file exists so that `proxy/build.rs` can name this crate as a build-dependency (cargo then
// rebuilds the daemon when the kernel programs change). The programs are in `main.rs`.
