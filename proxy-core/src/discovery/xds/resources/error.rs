//! Why a CDS or LDS response is NACKed.

use thiserror::Error;

use crate::discovery::xds::cds::ResourceError;

/// Why a CDS or LDS response is NACKed; the message is the NACK's `error_detail`.
#[derive(Debug, Error)]
pub enum ResponseError {
    /// One resource is refused.
    #[error(transparent)]
    Resource(#[from] ResourceError),
    /// A resource of another type than the response's.
    #[error("{found} does not match the message-wide type URL {expected} (resource {index})")]
    TypeUrl {
        /// The response's type URL.
        expected: String,
        /// The resource's.
        found: String,
        /// Its index in the response.
        index: usize,
    },
    /// A resource that does not decode as its type.
    #[error("unable to unpack resource {index} as {type_url}")]
    Decode {
        /// The type URL.
        type_url: String,
        /// Its index in the response.
        index: usize,
        /// The decoder's error.
        #[source]
        source: prost::DecodeError,
    },
    /// One name twice in one response.
    #[error("duplicate {kind} {name} found")]
    Duplicate {
        /// `cluster` or `listener`.
        kind: &'static str,
        /// The name.
        name: String,
    },
    /// A delta resource whose name is not its message's.
    #[error("{kind} resource {name:?} holds a {kind} named {inner:?}; the names must match")]
    NameMismatch {
        /// `cluster` or `listener`.
        kind: &'static str,
        /// The resource's name.
        name: String,
        /// The message's name.
        inner: String,
    },
    /// A name the configuration file defines too.
    #[error(
        "{kind} {name:?} is defined both in {} ({field}) and by xDS; a name may come from one source only, rename one of them",
        crate::desired::Source::File
    )]
    Clash {
        /// `cluster`, `listener` or `config entry`.
        kind: &'static str,
        /// The name.
        name: String,
        /// Where the file defines it.
        field: &'static str,
    },
}
