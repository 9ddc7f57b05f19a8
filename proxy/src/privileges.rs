//! Least privilege. Loading and attaching the kernel programs, creating the cgroup and mounting
//! bpffs need root's capabilities; what the daemon does afterwards (parse configuration,
//! discovery answers, HTTP, PROXY headers and admin requests, and write maps) needs almost none.
//! Once the data path is attached, [`enter`] makes the process what [`SteadyState`] says: the
//! capabilities [`needed`] lists and no others (bounding and ambient sets emptied,
//! `no_new_privs` set), the configured user (`user`), and the seccomp filter (`seccomp`).
//!
//! Capabilities and credentials belong to each thread, and a seccomp filter too, so this must
//! run while the process has one thread: the daemon attaches and drops on its main thread
//! before it starts the runtime, and every thread started afterwards inherits the result.

mod dirs;
mod seccomp;
mod syscalls;
mod user;

use std::{fmt, path::Path};

use proxy_core::config::Config;
use tracing::{info, warn};

pub use self::user::{RunAs, UserError, resolve as resolve_user};
use crate::sys::caps;

/// The runtime directory: the takeover socket and the default admin control socket are
/// created in it after the drop, so it belongs to the steady-state user.
const RUNTIME_DIR: &str = "/run/proxy";

/// One Linux capability (linux/capability.h numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capability {
    /// Its number: bit `number` of the kernel's sets.
    pub number: u32,
    /// Its name, as capabilities(7) spells it.
    pub name: &'static str,
}

impl Capability {
    pub const SETPCAP: Self = Self::new(8, "cap_setpcap");
    pub const NET_BIND_SERVICE: Self = Self::new(10, "cap_net_bind_service");
    pub const NET_ADMIN: Self = Self::new(12, "cap_net_admin");
    pub const SYS_ADMIN: Self = Self::new(21, "cap_sys_admin");
    pub const BPF: Self = Self::new(39, "cap_bpf");

    const fn new(number: u32, name: &'static str) -> Self {
        Self { number, name }
    }

    const fn bit(self) -> u64 {
        1 << self.number
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// A capability the daemon keeps, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keep {
    pub cap: Capability,
    pub why: &'static str,
}

/// The capability sets and flags of the calling thread, from `/proc/thread-self/status`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadCaps {
    pub effective: u64,
    pub permitted: u64,
    pub inheritable: u64,
    pub bounding: u64,
    pub ambient: u64,
    pub no_new_privs: bool,
    /// Threads of the whole process.
    pub threads: u64,
}

impl ThreadCaps {
    /// Reads the calling thread's sets.
    pub fn current() -> Result<Self, PrivilegeError> {
        let text = std::fs::read_to_string("/proc/thread-self/status")
            .map_err(|e| PrivilegeError::Read(e.to_string()))?;
        Self::parse(&text).map_err(PrivilegeError::Read)
    }

    /// Parses a `/proc/<pid>/task/<tid>/status` file.
    pub fn parse(status: &str) -> Result<Self, String> {
        let field = |name: &str| {
            status
                .lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
                .ok_or_else(|| format!("no {name} line in the status file"))
        };
        let hex = |name: &str| {
            let text = field(name)?;
            u64::from_str_radix(text, 16).map_err(|e| format!("{name} {text:?}: {e}"))
        };
        let dec = |name: &str| {
            let text = field(name)?;
            text.parse::<u64>()
                .map_err(|e| format!("{name} {text:?}: {e}"))
        };
        Ok(Self {
            effective: hex("CapEff")?,
            permitted: hex("CapPrm")?,
            inheritable: hex("CapInh")?,
            bounding: hex("CapBnd")?,
            // Before Linux 4.3 there is no ambient set.
            ambient: hex("CapAmb").unwrap_or(0),
            no_new_privs: dec("NoNewPrivs")? == 1,
            threads: dec("Threads")?,
        })
    }

    fn has(&self, cap: Capability) -> bool {
        self.permitted & cap.bit() != 0
    }
}

/// Why the daemon could not drop its privileges; it does not run on with them.
#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    #[error("reading this thread's capabilities: {0}")]
    Read(String),
    #[error(
        "dropping capabilities needs a single-threaded process (capabilities are per thread), and this one has {0} threads"
    )]
    Threads(u64),
    #[error("{what}: {source}")]
    Call {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("after dropping, the thread still has {what} {found:#x} (wanted {wanted:#x})")]
    Verify {
        what: &'static str,
        found: u64,
        wanted: u64,
    },
    #[error(transparent)]
    User(#[from] UserError),
    #[error("handing {} to the steady-state user (needs cap_chown): {source}", path.display())]
    RuntimeDir {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Filter(#[from] seccomp::FilterError),
}

/// What the daemon keeps once its data path is attached, given what it was started with
/// (`have`) and its configuration.
pub fn needed(config: &Config, have: &ThreadCaps) -> Vec<Keep> {
    let mut keep = Vec::new();
    // Before Linux 6.5 every bpf(2) command, map reads and updates included, needs CAP_BPF (or
    // CAP_SYS_ADMIN before 5.8, which has no CAP_BPF) while unprivileged BPF is disabled.
    let bpf_why = "bpf(2) on the attached maps: publishing host sets, reading counters and the passive signal";
    if have.has(Capability::BPF) {
        keep.push(Keep {
            cap: Capability::BPF,
            why: bpf_why,
        });
    } else if have.has(Capability::SYS_ADMIN) {
        keep.push(Keep {
            cap: Capability::SYS_ADMIN,
            why: "this kernel or this start has no cap_bpf: bpf(2) on the attached maps and links",
        });
    }
    // A unix socket admin address needs no port.
    let mut ports: Vec<u16> = config
        .admin
        .address
        .tcp()
        .map(|a| a.port())
        .into_iter()
        .collect();
    ports.extend(
        config
            .proxy
            .listeners
            .iter()
            .map(std::net::SocketAddr::port),
    );
    if ports.iter().any(|p| *p != 0 && *p < 1024) {
        keep.push(Keep {
            cap: Capability::NET_BIND_SERVICE,
            why: "the admin address or a proxy listener is on a port below 1024",
        });
    }
    keep
}

/// What the daemon becomes once its data path is attached.
#[derive(Clone, Debug)]
pub struct SteadyState {
    /// The capabilities it keeps.
    pub keep: Vec<Keep>,
    /// The user it runs as; `None`: it stays root.
    pub user: Option<RunAs>,
    /// Whether it installs the seccomp filter.
    pub seccomp: bool,
    /// The runtime directory, `/run/proxy`, where the takeover socket (and by default the
    /// admin control socket) is created after the drop: it becomes the steady-state user's.
    pub runtime_dir: Option<std::path::PathBuf>,
    /// The directory of the admin control socket, when it is elsewhere: created for the
    /// steady-state user when missing.
    pub control_dir: Option<std::path::PathBuf>,
    /// The instance's pin directory: the steady-state user unpins what an earlier version left
    /// there (after the first publish) and what a failed start created.
    pub pin_dir: Option<std::path::PathBuf>,
    /// The instance's admin control socket and takeover socket: one an earlier daemon of the
    /// instance left (killed, or under a unit whose `RuntimeDirectory=` systemd handed back to
    /// root at this start) becomes the steady-state user's, which probes and replaces it.
    pub own_sockets: Vec<std::path::PathBuf>,
}

impl SteadyState {
    /// The steady state `config` asks for, from the capabilities the daemon has now (`have`).
    /// Resolves `config.user` (reading /etc/passwd and /etc/group when it names one).
    pub fn of(config: &Config, have: &ThreadCaps) -> Result<Self, PrivilegeError> {
        let user = config.user.as_deref().map(user::resolve).transpose()?;
        Ok(Self {
            keep: needed(config, have),
            user: user.filter(|u| u.uid != 0 || u.gid != 0),
            seccomp: config.seccomp,
            runtime_dir: Some(RUNTIME_DIR.into()),
            control_dir: config
                .admin
                .control_path(&config.instance)
                .parent()
                .filter(|d| *d != Path::new(RUNTIME_DIR))
                .map(Path::to_path_buf),
            pin_dir: Some(Path::new(&config.bpffs).join(&config.instance)),
            own_sockets: vec![
                config.admin.control_path(&config.instance),
                crate::daemon::takeover::socket_path(Path::new(&config.bpffs), &config.instance),
            ],
        })
    }
}

/// The uid `config.user` names, the user a daemon of this configuration runs as once attached;
/// `None` without one, or when it does not resolve (the start reports that by name).
pub fn configured_uid(config: &Config) -> Option<u32> {
    config
        .user
        .as_deref()
        .and_then(|spec| user::resolve(spec).ok())
        .map(|u| u.uid)
}

/// Makes the calling thread (the only one) what `state` says. The bounding set loses every
/// capability but the kept ones (so no `execve`, even of a set-user-ID root program, regains
/// one), the ambient and inheritable sets are emptied; then it becomes `state.user` keeping
/// its permitted set (`PR_SET_KEEPCAPS`), its effective and permitted sets become the kept
/// capabilities, `no_new_privs` is set, and the seccomp filter installed. Returns the sets
/// afterwards, which it checks.
pub fn enter(state: &SteadyState) -> Result<ThreadCaps, PrivilegeError> {
    let before = ThreadCaps::current()?;
    if before.threads != 1 {
        return Err(PrivilegeError::Threads(before.threads));
    }
    let wanted = state.keep.iter().fold(0, |m, k| m | k.cap.bit()) & before.permitted;
    shrink_bounding(&before, wanted)?;
    match caps::clear_ambient() {
        Ok(()) => {}
        // A kernel without ambient capabilities (before 4.3) has nothing to clear.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
        Err(e) => return Err(call("clearing the ambient set")(e)),
    }
    prepare_dirs(state)?;
    if let Some(user) = &state.user {
        become_user(user)?;
    }
    caps::set(wanted).map_err(call("capset"))?;
    caps::set_no_new_privs().map_err(call("setting no_new_privs"))?;
    let after = verify(wanted, state.user.as_ref())?;
    let kept: Vec<_> = state
        .keep
        .iter()
        .filter(|k| wanted & k.cap.bit() != 0)
        .map(|k| k.cap.name)
        .collect();
    let user = state
        .user
        .as_ref()
        .map_or_else(|| "root (no user configured)".to_owned(), RunAs::to_string);
    info!(kept = %kept.join(","), %user, "capabilities dropped; no_new_privs set");
    if state.seccomp {
        install_seccomp()?;
    }
    Ok(after)
}

/// Gives the directories the steady state writes (its sockets', its pins') to its user (to
/// root too, for a directory a daemon of another user left).
fn prepare_dirs(state: &SteadyState) -> Result<(), PrivilegeError> {
    let (uid, gid) = state.user.as_ref().map_or((0, 0), |u| (u.uid, u.gid));
    if crate::sys::effective_uid() != 0 {
        return Ok(());
    }
    // The sockets first: once their directory is the user's (mode 0700), root without
    // cap_dac_override (the units' bounding set) can no longer look inside it.
    for socket in &state.own_sockets {
        dirs::own_socket(socket, uid, gid)?;
    }
    for dir in [&state.runtime_dir, &state.pin_dir].into_iter().flatten() {
        dirs::own_dir(dir, uid, gid, true)?;
    }
    if let Some(dir) = &state.control_dir {
        dirs::own_dir(dir, uid, gid, false)?;
    }
    Ok(())
}

fn call(what: &'static str) -> impl Fn(std::io::Error) -> PrivilegeError {
    move |source| PrivilegeError::Call { what, source }
}

/// Drops from the bounding set every capability not in `wanted` (needs `cap_setpcap`, else a
/// warning: the set is then whatever the daemon was started with).
fn shrink_bounding(before: &ThreadCaps, wanted: u64) -> Result<(), PrivilegeError> {
    if before.effective & Capability::SETPCAP.bit() == 0 {
        if before.bounding & !wanted != 0 {
            warn!(
                bounding = format_args!("{:#x}", before.bounding),
                "without cap_setpcap the bounding set cannot be shrunk; set it where the daemon is started (CapabilityBoundingSet=)"
            );
        }
        return Ok(());
    }
    for number in 0..64 {
        let bit = 1u64 << number;
        if before.bounding & bit == 0 || wanted & bit != 0 {
            continue;
        }
        caps::drop_bounding(number).map_err(call("shrinking the bounding set"))?;
    }
    Ok(())
}

/// Switches to `user`, keeping the permitted set.
fn become_user(user: &RunAs) -> Result<(), PrivilegeError> {
    caps::set_keep_caps(true).map_err(call("setting PR_SET_KEEPCAPS"))?;
    caps::switch_user(user.uid, user.gid).map_err(call(
        "switching to the steady-state user (setgroups, setresgid, setresuid; does the daemon have cap_setuid and cap_setgid?)",
    ))?;
    caps::set_keep_caps(false).map_err(call("clearing PR_SET_KEEPCAPS"))
}

/// Checks the calling thread's sets and user ids after the drop.
fn verify(wanted: u64, user: Option<&RunAs>) -> Result<ThreadCaps, PrivilegeError> {
    let after = ThreadCaps::current()?;
    let check = |what, found: u64, wanted: u64| {
        if found == wanted {
            Ok(())
        } else {
            Err(PrivilegeError::Verify {
                what,
                found,
                wanted,
            })
        }
    };
    check("effective set", after.effective, wanted)?;
    check("permitted set", after.permitted, wanted)?;
    check("inheritable set", after.inheritable, 0)?;
    check("ambient set", after.ambient, 0)?;
    check("no_new_privs", u64::from(after.no_new_privs), 1)?;
    if let Some(user) = user {
        let (uids, gids) = caps::ids();
        for (what, found, wanted) in [("user id", uids, user.uid), ("group id", gids, user.gid)] {
            for id in found {
                check(what, u64::from(id), u64::from(wanted))?;
            }
        }
    }
    Ok(after)
}

/// Installs the steady state's seccomp filter on the calling thread (threads started later
/// inherit it). On an architecture whose call numbers the filter does not know, a warning and
/// no filter.
fn install_seccomp() -> Result<(), PrivilegeError> {
    let Some(arch) = seccomp::Arch::native() else {
        warn!(
            arch = std::env::consts::ARCH,
            "seccomp: the filter knows the system calls of x86_64 and aarch64 only; running without it"
        );
        return Ok(());
    };
    let allowed = seccomp::allowed();
    let program = seccomp::program(arch, &allowed, std::process::id())?;
    crate::sys::seccomp::install(&program).map_err(call("installing the seccomp filter"))?;
    info!(
        arch = arch.name,
        calls = allowed.len(),
        "seccomp filter installed: any other system call fails with EPERM"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const STATUS: &str = "Name:\tproxy\nThreads:\t1\nCapInh:\t0000000000000000\nCapPrm:\t000001ffffffffff\nCapEff:\t000001ffffffffff\nCapBnd:\t000001ffffffffff\nCapAmb:\t0000000000000000\nNoNewPrivs:\t0\n";

    #[test]
    fn reads_the_status_file() {
        let caps = ThreadCaps::parse(STATUS).expect("parses");
        assert_eq!(caps.effective, 0x1ff_ffff_ffff);
        assert_eq!(caps.bounding, 0x1ff_ffff_ffff);
        assert_eq!(caps.ambient, 0);
        assert!(!caps.no_new_privs);
        assert_eq!(caps.threads, 1);
        let err = ThreadCaps::parse("Name:\tx\n").unwrap_err();
        assert!(err.contains("CapEff"), "{err}");
        let err = ThreadCaps::parse(&STATUS.replace("000001ffffffffff\nCapEff", "zz\nCapEff"))
            .unwrap_err();
        assert!(err.contains("CapPrm \"zz\""), "{err}");
    }

    fn config(extra: &str) -> Config {
        let yaml = format!(
            "{extra}clusters:\n  - name: c\n    load_assignment: {{ endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 1 }} }} }} }} ] }} ] }}\nservices:\n  - {{ name: a, address: 127.77.0.1, port: 80, cluster: c }}\n"
        );
        Config::parse(&yaml, Path::new("t.yaml")).expect("valid config")
    }

    fn names(keep: &[Keep]) -> Vec<&'static str> {
        keep.iter().map(|k| k.cap.name).collect()
    }

    #[test]
    fn keeps_bpf_and_a_low_port_only() {
        let root = ThreadCaps::parse(STATUS).unwrap();
        assert_eq!(names(&needed(&config(""), &root)), ["cap_bpf"]);
        let low = config("admin: { address: \"127.0.0.1:901\" }\n");
        assert_eq!(
            names(&needed(&low, &root)),
            ["cap_bpf", "cap_net_bind_service"]
        );
        let unix = config("admin: { address: \"unix:/run/proxy/admin.sock\" }\n");
        assert_eq!(names(&needed(&unix, &root)), ["cap_bpf"]);
        let listener = config("proxy: { listeners: [\"127.0.0.1:80\"] }\n");
        assert_eq!(
            names(&needed(&listener, &root)),
            ["cap_bpf", "cap_net_bind_service"]
        );
    }

    #[test]
    fn a_kernel_without_cap_bpf_keeps_sys_admin() {
        // Linux 5.4: capabilities up to 37 (cap_audit_read).
        let old = ThreadCaps {
            permitted: (1 << 38) - 1,
            ..ThreadCaps::parse(STATUS).unwrap()
        };
        assert_eq!(names(&needed(&config(""), &old)), ["cap_sys_admin"]);
    }
}
