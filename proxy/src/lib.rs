//! The daemon: loads the kernel programs, attaches them to a cgroup, turns the configuration into
//! host sets and publishes them into the maps the kernel reads, and serves the admin interface.
//!
//! Pure logic (configuration, load assignment, discovery, health) lives in `proxy-core` and the
//! Consul discovery chain in `proxy-chain`, and the userspace proxy path in `proxy-relay`; this
//! crate wires them to the kernel and sockets. Its only `unsafe` code is in the `sys` module.

pub mod admin;
pub mod check;
pub mod cli;
pub mod daemon;
pub mod dataplane;
pub mod fd_store;
pub mod kernel_log;
pub mod logging;
pub mod notify;
pub mod passive;
pub mod privileges;
pub mod probe;
pub mod show;
mod socket_file;
pub mod status;
#[allow(
    unsafe_code,
    reason = "the daemon's system calls without a safe binding, each with its SAFETY note"
)]
mod sys;
pub mod traffic;

pub use sys::enter_netns;

/// What `proxy run`'s flags set over the file's fields: applied at the start and again to the
/// file every reload re-reads, so that the command line wins both times (a reload then refuses
/// only a change the file itself makes).
#[derive(Clone, Debug, Default)]
pub struct RunFlags {
    /// `--user`: the steady-state user, over the file's `user`.
    pub user: Option<String>,
    /// `--no-seccomp`: no seccomp filter, whatever the file's `seccomp` says.
    pub no_seccomp: bool,
}

impl RunFlags {
    /// Sets the flags' values over `config`'s.
    pub fn apply(&self, config: &mut proxy_core::config::Config) {
        if let Some(user) = &self.user {
            config.user = Some(user.clone());
        }
        config.seccomp &= !self.no_seccomp;
    }
}

/// Loads and validates a configuration file: everything, the xDS sections of EDS clusters
/// included, is checked by `Config::load`.
pub fn load_config(
    path: &std::path::Path,
) -> Result<proxy_core::config::Config, proxy_core::config::ConfigError> {
    proxy_core::config::Config::load(path)
}

/// `proxy --version`: the package version, the commit it was built from and the build profile.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("PROXY_COMMIT"),
    ", ",
    env!("PROXY_PROFILE"),
    " build)"
);

/// Exit status for a configuration that cannot be used: 64, `EX_USAGE` of sysexits.h.
pub const EXIT_BAD_CONFIG: u8 = 64;

#[cfg(test)]
mod house;
