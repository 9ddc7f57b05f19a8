//! How the Consul agent is reached: its address and ACL token, from the cluster's config, else
//! from the `CONSUL_HTTP_*` environment variables, else Consul's defaults, as Consul's own API
//! client reads them.
//!
//! * address: `address`, else `CONSUL_HTTP_ADDR`, else `127.0.0.1:8500`. A `http://` or
//!   `https://` prefix sets the scheme (any other scheme is refused); `CONSUL_HTTP_SSL=true`
//!   asks for https too, and `http://` never turns it off again.
//! * token: `token` or `token_file` (not both), else `CONSUL_HTTP_TOKEN_FILE`, else
//!   `CONSUL_HTTP_TOKEN`, else none (Consul's anonymous token). A token file is read before
//!   every query, trimmed, so a rotated token applies without a restart; an empty
//!   `CONSUL_HTTP_TOKEN_FILE` falls back to `CONSUL_HTTP_TOKEN`, as in Consul.
//!
//! * TLS: https when the address says `https://`, `CONSUL_HTTP_SSL` is true, or the cluster
//!   has `tls`; then the cluster's `tls`, else `CONSUL_CACERT`, `CONSUL_CLIENT_CERT`,
//!   `CONSUL_CLIENT_KEY` and `CONSUL_TLS_SERVER_NAME` (a CA is required: no system store).
//!
//! The token is secret: it is never logged, never part of an error, and serializes redacted.

use std::{fmt, path::PathBuf};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{ConsulConfig, ConsulConfigError};
use crate::tls::{TlsError, TlsSettings};

/// Consul's default agent address.
const DEFAULT_ADDRESS: &str = "127.0.0.1:8500";

/// What every token serializes and prints as.
const REDACTED: &str = "<redacted>";

/// A Consul ACL token (`X-Consul-Token`). Debug, Display and Serialize never show it.
#[derive(Clone, PartialEq, Eq)]
pub struct ConsulToken(String);

impl ConsulToken {
    /// `text` when it can travel in a header: visible ASCII without spaces, not empty.
    pub fn new(text: &str) -> Option<Self> {
        let ok = !text.is_empty() && text.bytes().all(|b| b.is_ascii_graphic());
        ok.then(|| Self(text.to_owned()))
    }

    /// The secret itself, for the request header only.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ConsulToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for ConsulToken {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(REDACTED)
    }
}

impl<'de> Deserialize<'de> for ConsulToken {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::new(&text).ok_or_else(|| {
            serde::de::Error::custom(
                "the consul token must be non-empty visible ASCII without spaces (its value is \
                 not shown)",
            )
        })
    }
}

/// Serializes a cluster's raw `typed_config` (as `/config_dump` shows it) with a `token` key's
/// value replaced by `<redacted>`; everything else as given.
pub fn serialize_redacted<S: Serializer>(
    value: &serde_json::Value,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match value.get("token") {
        Some(_) => {
            let mut value = value.clone();
            value["token"] = serde_json::Value::from(REDACTED);
            value.serialize(serializer)
        }
        None => value.serialize(serializer),
    }
}

/// Where the token in use comes from; what log lines and errors name instead of the token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenOrigin {
    /// The cluster's `token`.
    Config,
    /// The cluster's `token_file`.
    ConfigFile(PathBuf),
    /// `CONSUL_HTTP_TOKEN`.
    Env,
    /// `CONSUL_HTTP_TOKEN_FILE`.
    EnvFile(PathBuf),
}

impl fmt::Display for TokenOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config => f.write_str("consul.token"),
            Self::ConfigFile(path) => write!(f, "consul.token_file {}", path.display()),
            Self::Env => f.write_str("CONSUL_HTTP_TOKEN"),
            Self::EnvFile(path) => write!(f, "CONSUL_HTTP_TOKEN_FILE {}", path.display()),
        }
    }
}

/// Why no token could be read for a query.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The token file cannot be read.
    #[error("cannot read the consul ACL token from {origin}: {source} (is the file there?)")]
    Read {
        /// Which file.
        origin: TokenOrigin,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file holds something a header cannot carry.
    #[error(
        "the consul ACL token in {origin} is not visible ASCII without spaces (its value is not \
         shown); is it the right file?"
    )]
    Invalid {
        /// Which file.
        origin: TokenOrigin,
    },
}

/// Where each query's token is taken from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum TokenSource {
    /// No token: Consul's anonymous token.
    None,
    /// A token fixed at start.
    Fixed(ConsulToken, TokenOrigin),
    /// A file read before every query; `fallback` when it is empty.
    File {
        path: PathBuf,
        origin: TokenOrigin,
        fallback: Option<ConsulToken>,
    },
}

/// The token of one query and where it came from.
pub(crate) type SentToken = Option<(ConsulToken, TokenOrigin)>;

impl TokenSource {
    /// The token to send now.
    pub(crate) fn read(&self) -> Result<SentToken, TokenError> {
        let (path, origin, fallback) = match self {
            Self::None => return Ok(None),
            Self::Fixed(token, origin) => return Ok(Some((token.clone(), origin.clone()))),
            Self::File {
                path,
                origin,
                fallback,
            } => (path, origin, fallback),
        };
        let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
            origin: origin.clone(),
            source,
        })?;
        let text = text.trim();
        if text.is_empty() {
            return Ok(fallback.clone().map(|token| (token, TokenOrigin::Env)));
        }
        let token = ConsulToken::new(text).ok_or_else(|| TokenError::Invalid {
            origin: origin.clone(),
        })?;
        Ok(Some((token, origin.clone())))
    }
}

/// The resolved way to the agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Access {
    /// `host:port`.
    pub(crate) authority: String,
    /// Where tokens come from.
    pub(crate) token: TokenSource,
    /// TLS settings when the agent speaks https.
    pub(crate) tls: Option<TlsSettings>,
}

/// Resolves `config` against the environment `env` (a variable set to "" counts as unset).
pub(crate) fn resolve(
    config: &ConsulConfig,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Access, ConsulConfigError> {
    let var = |name: &str| env(name).filter(|v| !v.is_empty());
    let (field, address) = match (&config.address, var("CONSUL_HTTP_ADDR")) {
        (Some(address), _) => ("consul.address", address.clone()),
        (None, Some(address)) => ("CONSUL_HTTP_ADDR", address),
        (None, None) => ("consul.address", DEFAULT_ADDRESS.to_owned()),
    };
    let ssl = match var("CONSUL_HTTP_SSL") {
        Some(value) => parse_bool(&value).ok_or(ConsulConfigError::SslEnv { value })?,
        None => false,
    };
    let (https, authority) = split_scheme(field, &address)?;
    check_authority(field, authority)?;
    let tls = if https || ssl || config.tls.is_some() {
        Some(tls_settings(config, &var)?)
    } else {
        None
    };
    Ok(Access {
        authority: authority.to_owned(),
        token: token_source(config, &var)?,
        tls,
    })
}

/// The cluster's `tls`, else the `CONSUL_*` TLS variables; checked.
fn tls_settings(
    config: &ConsulConfig,
    var: &dyn Fn(&str) -> Option<String>,
) -> Result<TlsSettings, ConsulConfigError> {
    let (field, settings) = if let Some(settings) = &config.tls {
        ("consul.tls", (**settings).clone())
    } else {
        let ca_file = var("CONSUL_CACERT").ok_or(ConsulConfigError::NoCa)?;
        let settings = TlsSettings {
            ca_file: PathBuf::from(ca_file),
            cert_file: var("CONSUL_CLIENT_CERT").map(PathBuf::from),
            key_file: var("CONSUL_CLIENT_KEY").map(PathBuf::from),
            server_name: var("CONSUL_TLS_SERVER_NAME"),
        };
        ("CONSUL_CACERT", settings)
    };
    match settings.validate() {
        Ok(()) => Ok(settings),
        Err(TlsError::ServerName { name }) => Err(ConsulConfigError::TlsServerName { name }),
        Err(_) => Err(ConsulConfigError::TlsPair { field }),
    }
}

fn token_source(
    config: &ConsulConfig,
    var: &dyn Fn(&str) -> Option<String>,
) -> Result<TokenSource, ConsulConfigError> {
    match (&config.token, &config.token_file) {
        (Some(_), Some(_)) => return Err(ConsulConfigError::TokenAndFile),
        (Some(token), None) => return Ok(TokenSource::Fixed(token.clone(), TokenOrigin::Config)),
        (None, Some(path)) => {
            return Ok(TokenSource::File {
                path: path.clone(),
                origin: TokenOrigin::ConfigFile(path.clone()),
                fallback: None,
            });
        }
        (None, None) => {}
    }
    let env_token = match var("CONSUL_HTTP_TOKEN") {
        Some(text) => Some(ConsulToken::new(&text).ok_or(ConsulConfigError::TokenEnv)?),
        None => None,
    };
    Ok(match (var("CONSUL_HTTP_TOKEN_FILE"), env_token) {
        (Some(path), fallback) => TokenSource::File {
            path: PathBuf::from(&path),
            origin: TokenOrigin::EnvFile(PathBuf::from(path)),
            fallback,
        },
        (None, Some(token)) => TokenSource::Fixed(token, TokenOrigin::Env),
        (None, None) => TokenSource::None,
    })
}

/// `(https, rest)` of an address with an optional `http://` or `https://` prefix.
fn split_scheme<'a>(
    field: &'static str,
    address: &'a str,
) -> Result<(bool, &'a str), ConsulConfigError> {
    match address.split_once("://") {
        None => Ok((false, address)),
        Some(("http", rest)) => Ok((false, rest)),
        Some(("https", rest)) => Ok((true, rest)),
        Some((scheme, _)) => Err(ConsulConfigError::Scheme {
            field,
            scheme: scheme.to_owned(),
        }),
    }
}

/// `host:port` with a non-empty host of URL-safe characters and a port above 0.
fn check_authority(field: &'static str, authority: &str) -> Result<(), ConsulConfigError> {
    let ok = authority.rsplit_once(':').is_some_and(|(host, port)| {
        let host_ok = !host.is_empty()
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._[]:%".contains(&b));
        host_ok && port.parse::<u16>().is_ok_and(|p| p != 0)
    });
    if ok {
        Ok(())
    } else {
        Err(ConsulConfigError::Address {
            field,
            address: authority.to_owned(),
        })
    }
}

/// Go's `strconv.ParseBool`, which Consul uses for `CONSUL_HTTP_SSL`.
fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}
