//! Unit tests of the xDS source: the host mapping, validation, config, the state machine, and
//! ACK/NACK sequences against an in-process tonic xDS server on 127.0.0.1.

mod ads;
mod breakers;
mod config;
mod fixtures;
mod hcm;
mod json;
mod lease;
mod locality;
mod mapping;
mod protocol;
mod resources;
mod rest;
mod server;
mod state;
mod streams;
mod tls;
