//! The `admin` section: where the admin HTTP interface listens, a TCP address or a unix socket.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

/// The admin HTTP interface (`/ready`, `/stats`, `/config_dump`, `/server_info`, ...).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Admin {
    /// Listen address: `ip:port` (TCP), or `unix:/absolute/path` (a unix socket the daemon
    /// creates with mode 0600, so only its owner, root, reaches it). Default `127.0.0.1:15000`;
    /// anything but loopback exposes the daemon's state to the network, so it is the operator's
    /// explicit choice.
    #[serde(default = "super::defaults::admin_address")]
    pub address: AdminAddress,
}

impl Default for Admin {
    fn default() -> Self {
        Self {
            address: super::defaults::admin_address(),
        }
    }
}

/// Where the admin interface listens. Written `ip:port` or `unix:/absolute/path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdminAddress {
    /// A TCP listener.
    Tcp(SocketAddr),
    /// A unix stream socket at this absolute path.
    Unix(PathBuf),
}

/// The longest unix socket path the kernel takes: `sun_path` is 108 bytes with its NUL.
pub const MAX_UNIX_PATH: usize = 107;

/// The prefix that makes an admin address a unix socket path.
const UNIX_PREFIX: &str = "unix:";

/// An admin address that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AdminAddressError {
    /// Neither `ip:port` nor `unix:/path`.
    #[error(
        "{text:?} is not an admin address: write ip:port (e.g. 127.0.0.1:15000) or unix:/absolute/path"
    )]
    Syntax {
        /// What was written.
        text: String,
    },
    /// `unix:` followed by a path the daemon could not bind.
    #[error("unix socket path {path:?} {why}")]
    UnixPath {
        /// The path after `unix:`.
        path: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

impl AdminAddress {
    /// The TCP address, when the interface listens on TCP.
    pub fn tcp(&self) -> Option<SocketAddr> {
        match self {
            Self::Tcp(addr) => Some(*addr),
            Self::Unix(_) => None,
        }
    }

    /// The socket path, when the interface listens on a unix socket.
    pub fn unix(&self) -> Option<&Path> {
        match self {
            Self::Tcp(_) => None,
            Self::Unix(path) => Some(path),
        }
    }
}

impl std::str::FromStr for AdminAddress {
    type Err = AdminAddressError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let Some(path) = text.strip_prefix(UNIX_PREFIX) else {
            return text
                .parse()
                .map(Self::Tcp)
                .map_err(|_| AdminAddressError::Syntax {
                    text: text.to_owned(),
                });
        };
        let why = if !path.starts_with('/') {
            Some("is not absolute (the daemon's working directory is no place for it)")
        } else if path.ends_with('/') {
            Some("names a directory, not a socket file")
        } else if path.len() > MAX_UNIX_PATH {
            Some("is longer than the 107 bytes a unix socket address holds")
        } else if path.contains('\0') {
            Some("holds a NUL byte")
        } else {
            None
        };
        match why {
            Some(why) => Err(AdminAddressError::UnixPath {
                path: path.to_owned(),
                why,
            }),
            None => Ok(Self::Unix(PathBuf::from(path))),
        }
    }
}

impl std::fmt::Display for AdminAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcp(addr) => addr.fmt(f),
            Self::Unix(path) => write!(f, "{UNIX_PREFIX}{}", path.display()),
        }
    }
}

impl Serialize for AdminAddress {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for AdminAddress {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_and_unix_forms_parse_and_print_back() {
        for text in [
            "127.0.0.1:15000",
            "[::1]:9901",
            "unix:/run/proxy/admin.sock",
        ] {
            let addr: AdminAddress = text.parse().expect(text);
            assert_eq!(addr.to_string(), text);
        }
        let unix: AdminAddress = "unix:/run/proxy/admin.sock".parse().unwrap();
        assert_eq!(unix.unix(), Some(Path::new("/run/proxy/admin.sock")));
        assert_eq!(unix.tcp(), None);
    }

    #[test]
    fn unusable_addresses_say_why() {
        let long = format!("unix:/{}", "a".repeat(MAX_UNIX_PATH));
        for (text, want) in [
            ("localhost:15000", "write ip:port"),
            ("unix:", "is not absolute"),
            ("unix:run/admin.sock", "is not absolute"),
            ("unix:/run/proxy/", "names a directory"),
            (long.as_str(), "longer than the 107 bytes"),
            ("unix:/run/a\0b", "NUL byte"),
        ] {
            let err = text.parse::<AdminAddress>().expect_err(text).to_string();
            assert!(err.contains(want), "{text:?}: {err}");
        }
    }
}
