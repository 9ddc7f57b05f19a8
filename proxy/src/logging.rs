//! The daemon's log output: `tracing` to stderr, behind a filter that the admin interface's
//! `/logging` changes at run time (tracing-subscriber's reload layer).

use tracing_subscriber::{EnvFilter, Registry, layer::SubscriberExt as _, reload};

/// The levels `/logging?level=` takes: Envoy's names (`warning`, `critical`), and `warn`.
pub const LEVELS: [&str; 8] = [
    "trace", "debug", "info", "warning", "warn", "error", "critical", "off",
];

/// A handle on the global log filter.
#[derive(Clone)]
pub struct LogControl {
    handle: reload::Handle<EnvFilter, Registry>,
}

/// A `/logging` change that was refused; the filter is left as it was.
#[derive(Debug, thiserror::Error)]
pub enum LevelError {
    /// Not one of [`LEVELS`].
    #[error("unknown log level {0:?}")]
    Unknown(String),
    /// The subscriber is gone (only in tests that dropped it).
    #[error("the log subscriber is gone: {0}")]
    Reload(#[from] reload::Error),
}

impl LogControl {
    /// A subscriber that writes to stderr through `filter` (tracing's EnvFilter syntax; `RUST_LOG`,
    /// when set, wins), and the handle that changes the filter. The caller installs the
    /// subscriber (`SubscriberInitExt::init`, which also routes `log` records through it).
    pub fn new(filter: &str) -> (Self, impl tracing::Subscriber + Send + Sync + 'static) {
        let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| filter.to_owned());
        let (layer, handle) = reload::Layer::new(EnvFilter::new(filter));
        let subscriber = tracing_subscriber::registry().with(layer).with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                // As `tracing_subscriber::fmt()` did: a failed write is reported on stderr.
                .log_internal_errors(true),
        );
        (Self { handle }, subscriber)
    }

    /// The filter in force, in EnvFilter syntax (`info`, `proxy=debug,warn`).
    pub fn current(&self) -> String {
        self.handle
            .with_current(ToString::to_string)
            .unwrap_or_else(|err| format!("({err})"))
    }

    /// Sets every target's level to `level` (one of [`LEVELS`]); returns the filter now in
    /// force. Module directives of the start-up filter are dropped, as Envoy's `?level=` sets
    /// every logger.
    pub fn set_level(&self, level: &str) -> Result<String, LevelError> {
        let directive = match level {
            "trace" | "debug" | "info" | "warn" | "error" | "off" => level,
            "warning" => "warn",
            // tracing has no level above error.
            "critical" => "error",
            other => return Err(LevelError::Unknown(other.to_owned())),
        };
        self.handle.reload(EnvFilter::new(directive))?;
        Ok(self.current())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_level_replaces_the_filter_and_a_bad_one_changes_nothing() {
        let (control, _subscriber) = LogControl::new("proxy=debug,info");
        if std::env::var_os("RUST_LOG").is_none() {
            assert_eq!(control.current(), "proxy=debug,info");
        }
        assert_eq!(control.set_level("warning").unwrap(), "warn");
        assert_eq!(control.set_level("critical").unwrap(), "error");
        let err = control.set_level("loud").unwrap_err();
        assert!(
            err.to_string().contains("unknown log level \"loud\""),
            "{err}"
        );
        assert_eq!(control.current(), "error");
    }
}
