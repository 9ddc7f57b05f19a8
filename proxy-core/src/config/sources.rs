//! What the user writes for each discovery source: the settings `crate::discovery` runs with,
//! their serde forms and the checks that need nothing but the settings.

pub mod consul;
pub mod dns;
pub mod xds;
