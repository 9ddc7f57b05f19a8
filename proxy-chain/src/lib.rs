//! Consul's discovery chain: config entries, validation and compilation.
#![forbid(unsafe_code)]
