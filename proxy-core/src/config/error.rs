//! Configuration errors, each naming the file, line, column and field.

use std::path::PathBuf;

use super::locate::{Locator, Position};

/// A configuration that cannot be used. Nothing is loaded or attached when this is returned.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{}: cannot read the config file: {source}", file.display())]
    Read {
        /// The file.
        file: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid YAML, or a field is unknown, missing or of the wrong type.
    #[error("{}:{}:{}: {field}: {message}", file.display(), at.line, at.column)]
    Invalid {
        /// The file.
        file: PathBuf,
        /// Where in the file.
        at: Position,
        /// Dotted path of the field, e.g. `clusters[0].load_assignment`.
        field: String,
        /// What is wrong.
        message: String,
    },
}

impl ConfigError {
    /// Converts a parse error, keeping serde_norway's position when it has one.
    pub(super) fn from_serde(
        file: &std::path::Path,
        text: &str,
        err: serde_path_to_error::Error<serde_norway::Error>,
    ) -> Self {
        let field = err.path().to_string();
        let inner = err.into_inner();
        let at = inner.location().map(|l| Position {
            line: l.line(),
            column: l.column(),
        });
        Self::from_parts(file, text, field, at, &inner.to_string())
    }

    /// Converts a JSON parse error ([`super::Config::parse_json`]) as [`Self::from_serde`] does.
    pub(super) fn from_serde_json(
        file: &std::path::Path,
        text: &str,
        err: serde_path_to_error::Error<serde_json::Error>,
    ) -> Self {
        let field = err.path().to_string();
        let inner = err.into_inner();
        let at = (inner.line() > 0).then(|| Position {
            line: inner.line(),
            column: inner.column(),
        });
        Self::from_parts(file, text, field, at, &inner.to_string())
    }

    /// An error at `field` (`.` for the whole document) with the parser's `message`.
    pub(super) fn from_parts(
        file: &std::path::Path,
        text: &str,
        field: String,
        at: Option<Position>,
        message: &str,
    ) -> Self {
        let at = at
            .or_else(|| Locator::new(text).find(&field))
            .unwrap_or_default();
        // Both parsers append " at line L column C" to their messages; the position is ours to
        // show.
        let mut message = message.to_owned();
        if let Some(cut) = message.find(" at line ") {
            message.truncate(cut);
        }
        // serde_norway also prefixes them with its own view of the path ("clusters[0]: ...");
        // ours is the precise one.
        if let Some((prefix, rest)) = message.split_once(": ")
            && !prefix.contains(char::is_whitespace)
        {
            message = rest.to_owned();
        }
        let field = if field == "." {
            "(document)".to_owned()
        } else {
            field
        };
        Self::Invalid {
            file: file.to_owned(),
            at,
            field,
            message,
        }
    }

    /// The field path of an `Invalid` error.
    pub fn field(&self) -> Option<&str> {
        match self {
            Self::Invalid { field, .. } => Some(field),
            Self::Read { .. } => None,
        }
    }

    /// The position of an `Invalid` error.
    pub fn position(&self) -> Option<Position> {
        match self {
            Self::Invalid { at, .. } => Some(*at),
            Self::Read { .. } => None,
        }
    }
}

/// A semantic error found after parsing: a field path and a message, located later.
#[derive(Debug)]
pub(super) struct Invalid {
    pub field: String,
    pub message: String,
}

impl Invalid {
    pub fn new(field: impl AsRef<str>, message: impl Into<String>) -> Self {
        Self {
            field: field.as_ref().to_owned(),
            message: message.into(),
        }
    }

    pub fn locate(self, file: &std::path::Path, text: &str) -> ConfigError {
        ConfigError::Invalid {
            file: file.to_owned(),
            at: Locator::new(text).find(&self.field).unwrap_or_default(),
            field: self.field,
            message: self.message,
        }
    }
}
