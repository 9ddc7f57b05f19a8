//! The daemon's log output: `tracing` to stderr, as text or as JSON lines, behind a filter that
//! the admin interface's `/logging` changes at run time (tracing-subscriber's reload layer).

use tracing_subscriber::{
    EnvFilter, Layer, Registry,
    fmt::MakeWriter,
    layer::{Layered, SubscriberExt as _},
    reload,
};

/// The registry behind the reloadable filter: what the output layer sits on.
type Filtered = Layered<reload::Layer<EnvFilter, Registry>, Registry>;

/// The levels `/logging?level=` takes: Envoy's names (`warning`, `critical`), and `warn`.
pub const LEVELS: [&str; 8] = [
    "trace", "debug", "info", "warning", "warn", "error", "critical", "off",
];

/// How each log record is written (`--log-format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per record: time, level, target, message and fields.
    #[default]
    Text,
    /// One JSON object per line, as tracing-subscriber's JSON formatter writes it:
    /// `timestamp`, `level`, `fields` (with `message`), `target`, and `span`/`spans` inside a
    /// span.
    Json,
}

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
    /// A subscriber that writes to stderr in `format` through `filter` (tracing's EnvFilter
    /// syntax; `RUST_LOG`, when set, wins), and the handle that changes the filter. The caller
    /// installs the subscriber (`SubscriberInitExt::init`, which also routes `log` records
    /// through it).
    pub fn new(
        filter: &str,
        format: LogFormat,
    ) -> (
        Self,
        impl tracing::Subscriber + Send + Sync + 'static + use<>,
    ) {
        let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| filter.to_owned());
        Self::with_writer(&filter, format, std::io::stderr)
    }

    /// As [`LogControl::new`], writing to `writer` and ignoring `RUST_LOG`.
    pub fn with_writer<W>(
        filter: &str,
        format: LogFormat,
        writer: W,
    ) -> (
        Self,
        impl tracing::Subscriber + Send + Sync + 'static + use<W>,
    )
    where
        W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
    {
        let (layer, handle) = reload::Layer::new(EnvFilter::new(filter));
        // As `tracing_subscriber::fmt()` did: a failed write is reported on stderr.
        let output: Box<dyn Layer<Filtered> + Send + Sync> = match format {
            LogFormat::Text => tracing_subscriber::fmt::layer()
                .with_writer(writer)
                .log_internal_errors(true)
                .boxed(),
            LogFormat::Json => tracing_subscriber::fmt::layer()
                .json()
                .with_writer(writer)
                .log_internal_errors(true)
                .boxed(),
        };
        let subscriber = tracing_subscriber::registry().with(layer).with(output);
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
        let (control, _subscriber) = LogControl::new("proxy=debug,info", LogFormat::Text);
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

    /// A writer into a shared buffer, for reading what the subscriber wrote.
    #[derive(Clone, Default)]
    struct Buffer(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'w> tracing_subscriber::fmt::MakeWriter<'w> for Buffer {
        type Writer = Self;
        fn make_writer(&'w self) -> Self {
            self.clone()
        }
    }

    #[test]
    fn json_writes_one_object_per_line_and_follows_level_changes() {
        let buffer = Buffer::default();
        let (control, subscriber) =
            LogControl::with_writer("info", LogFormat::Json, buffer.clone());
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(target: "proxy::test", answer = 42, "first");
            tracing::debug!(target: "proxy::test", "hidden at info");
            control.set_level("debug").unwrap();
            tracing::debug!(target: "proxy::test", vip = "127.77.0.1:80", "second");
            control.set_level("error").unwrap();
            tracing::warn!(target: "proxy::test", "hidden at error");
        });
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|line| {
                serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
            })
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        for (line, level, message) in [(&lines[0], "INFO", "first"), (&lines[1], "DEBUG", "second")]
        {
            assert!(line["timestamp"].is_string(), "{line}");
            assert_eq!(line["level"], level, "{line}");
            assert_eq!(line["target"], "proxy::test", "{line}");
            assert_eq!(line["fields"]["message"], message, "{line}");
        }
        assert_eq!(lines[0]["fields"]["answer"], 42);
        assert_eq!(lines[1]["fields"]["vip"], "127.77.0.1:80");
    }

    #[test]
    fn text_is_not_json() {
        let buffer = Buffer::default();
        let (_control, subscriber) =
            LogControl::with_writer("info", LogFormat::Text, buffer.clone());
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(target: "proxy::test", answer = 42, "plain");
        });
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        let line = text.lines().next().expect("one line");
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_err(),
            "{line}"
        );
        // Colours or not, the level, message and field are there.
        for part in ["INFO", "proxy::test", "plain", "answer", "42"] {
            assert!(line.contains(part), "{part}: {line}");
        }
    }
}
