//! The `admin` section: where the admin HTTP interface listens (a read-only TCP address or a
//! unix socket), and the control socket that serves what changes the daemon's state.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use super::error::Invalid;

/// The directory of the default control socket (the takeover socket's too).
pub const RUNTIME_DIR: &str = "/run/proxy";

/// The admin HTTP interface (`/ready`, `/stats`, `/config_dump`, `/server_info`, ...).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Admin {
    /// Listen address: `ip:port` (TCP), or `unix:/absolute/path` (a unix socket the daemon
    /// creates with mode 0600, so only its owner, root, reaches it). Default `127.0.0.1:15000`.
    /// Any local user can connect to a TCP port, so on TCP the admin interface serves only the
    /// read-only pages (unless `allow_tcp_mutations`) and only requests whose `Host` names it.
    /// A non-loopback address shows the daemon's state to the network and is refused unless
    /// `allow_non_loopback` says it is meant.
    #[serde(default = "super::defaults::admin_address")]
    pub address: AdminAddress,
    /// The control socket: a unix socket of mode 0600 (root's), always served, on which the
    /// admin interface answers everything, including what changes the daemon's state
    /// (`/reload`, `POST /logging`, `/healthcheck/fail`, `/healthcheck/ok`). `proxy reload` and
    /// `proxy status` use it. An absolute path; default `/run/proxy/<instance>.admin` (the
    /// directory is created with mode 0700 when missing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_socket: Option<PathBuf>,
    /// Serve the endpoints that change the daemon's state on a TCP `address` too. Default
    /// false: there they are answered 403 (any local user, or a web page a local browser
    /// shows, can reach a loopback port), and served on the control socket only.
    #[serde(default)]
    pub allow_tcp_mutations: bool,
    /// Accept a TCP `address` that is not loopback (e.g. `0.0.0.0:15000`). Default false: such
    /// an address is refused by `proxy check` and at start.
    #[serde(default)]
    pub allow_non_loopback: bool,
}

impl Default for Admin {
    fn default() -> Self {
        Self {
            address: super::defaults::admin_address(),
            control_socket: None,
            allow_tcp_mutations: false,
            allow_non_loopback: false,
        }
    }
}

impl Admin {
    /// The control socket's path: `control_socket`, or `/run/proxy/<instance>.admin`.
    pub fn control_path(&self, instance: &str) -> PathBuf {
        self.control_socket
            .clone()
            .unwrap_or_else(|| Path::new(RUNTIME_DIR).join(format!("{instance}.admin")))
    }

    /// Whether state-changing endpoints are served on `address`: always on a unix socket
    /// (mode 0600), on TCP only when `allow_tcp_mutations`.
    pub fn address_mutates(&self) -> bool {
        self.address.unix().is_some() || self.allow_tcp_mutations
    }

    /// The checks of the section: a loopback TCP address unless allowed otherwise, a usable
    /// control socket path that is not `address`'s.
    pub(super) fn validate(&self) -> Result<(), Invalid> {
        if let Some(tcp) = self.address.tcp()
            && !tcp.ip().to_canonical().is_loopback()
            && !self.allow_non_loopback
        {
            return Err(Invalid::new(
                "admin.address",
                format!(
                    "{tcp} is not a loopback address: the admin interface would show the daemon's state (config_dump, stats) to the network; listen on 127.0.0.1 or [::1], or set admin.allow_non_loopback: true if that is meant"
                ),
            ));
        }
        let Some(control) = &self.control_socket else {
            return Ok(());
        };
        if let Some(why) = control
            .to_str()
            .map_or(Some("is not UTF-8"), unix_path_problem)
        {
            return Err(Invalid::new(
                "admin.control_socket",
                format!("socket path {} {why}", control.display()),
            ));
        }
        if self.address.unix() == Some(control.as_path()) {
            return Err(Invalid::new(
                "admin.control_socket",
                format!(
                    "{} is admin.address as well: the control socket needs a path of its own",
                    control.display()
                ),
            ));
        }
        Ok(())
    }
}

/// What makes `path` unusable as a unix socket path, if anything.
fn unix_path_problem(path: &str) -> Option<&'static str> {
    if !path.starts_with('/') {
        Some("is not absolute (the daemon's working directory is no place for it)")
    } else if path.ends_with('/') {
        Some("names a directory, not a socket file")
    } else if path.len() > MAX_UNIX_PATH {
        Some("is longer than the 107 bytes a unix socket address holds")
    } else if path.contains('\0') {
        Some("holds a NUL byte")
    } else {
        None
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
        match unix_path_problem(path) {
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

    /// `text` as a whole configuration: the field, line and column of its refusal.
    fn refusal(text: &str) -> (String, usize, usize, String) {
        match crate::config::Config::parse(text, Path::new("t.yaml")) {
            Err(crate::config::ConfigError::Invalid {
                at, field, message, ..
            }) => (field, at.line, at.column, message),
            other => panic!("{text:?}: not refused as invalid: {other:?}"),
        }
    }

    #[test]
    fn a_non_loopback_address_is_refused_unless_allowed() {
        for addr in ["0.0.0.0:15000", "[::]:15000", "192.0.2.1:15000"] {
            let text = format!("instance: x\nadmin:\n  address: \"{addr}\"\n");
            let (field, line, column, message) = refusal(&text);
            assert_eq!(
                (field.as_str(), line, column),
                ("admin.address", 3, 3),
                "{addr}"
            );
            assert!(message.contains("is not a loopback address"), "{message}");
            assert!(
                message.contains("admin.allow_non_loopback: true"),
                "{message}"
            );
            let allowed = format!("{text}  allow_non_loopback: true\n");
            crate::config::Config::parse(&allowed, Path::new("t.yaml")).expect(addr);
        }
        for addr in [
            "127.0.0.1:15000",
            "127.1.2.3:1",
            "[::1]:15000",
            "[::ffff:127.0.0.1]:1",
        ] {
            let text = format!("admin:\n  address: \"{addr}\"\n");
            crate::config::Config::parse(&text, Path::new("t.yaml")).expect(addr);
        }
    }

    #[test]
    fn the_control_socket_defaults_to_the_instance_and_a_bad_one_is_located() {
        let admin = Admin::default();
        assert!(
            !admin.allow_tcp_mutations,
            "mutations on TCP are off by default"
        );
        assert!(!admin.address_mutates());
        assert_eq!(
            admin.control_path("edge"),
            Path::new("/run/proxy/edge.admin")
        );
        let unix = Admin {
            address: "unix:/run/a.sock".parse().unwrap(),
            ..Admin::default()
        };
        assert!(unix.address_mutates(), "a 0600 socket serves everything");
        for (value, want) in [
            ("run/x.admin", "is not absolute"),
            ("/run/", "names a directory"),
            ("/run/a.sock", "is admin.address as well"),
        ] {
            let text =
                format!("admin:\n  address: unix:/run/a.sock\n  control_socket: \"{value}\"\n");
            let (field, line, _, message) = refusal(&text);
            assert_eq!(
                (field.as_str(), line),
                ("admin.control_socket", 3),
                "{value}"
            );
            assert!(message.contains(want), "{value}: {message}");
        }
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
