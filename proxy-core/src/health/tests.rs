//! Unit tests of the health module that span several files (paused tokio time, scripted checkers).

mod config;
mod locality;
mod matrix;
mod outlier;
mod probe;
mod state;
pub(crate) mod support;
