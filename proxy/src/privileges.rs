//! Least privilege. Loading and attaching the kernel programs, creating the cgroup and mounting
//! bpffs need root's capabilities; what the daemon does afterwards (parse configuration,
//! discovery answers, HTTP, PROXY headers and admin requests, and write maps) needs almost none.
//! Once the data path is attached, [`drop_to`] shrinks the process to the capabilities
//! [`needed`] lists, empties the bounding and ambient sets, and sets `no_new_privs`.
//!
//! Capabilities belong to each thread, so this must run while the process has one thread: the
//! daemon attaches and drops on its main thread before it starts the runtime, and every thread
//! started afterwards inherits the reduced sets.

use std::fmt;

use proxy_core::config::Config;
use tracing::{info, warn};

use crate::sys::caps;

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

/// Reduces the calling thread (the only one) to `keep`: the bounding set loses everything else
/// (so no `execve`, even of a set-user-ID root program, regains it), the ambient and
/// inheritable sets are emptied, effective and permitted become `keep`, and `no_new_privs` is
/// set. Returns the sets afterwards, which it checks.
pub fn drop_to(keep: &[Keep]) -> Result<ThreadCaps, PrivilegeError> {
    let before = ThreadCaps::current()?;
    if before.threads != 1 {
        return Err(PrivilegeError::Threads(before.threads));
    }
    let wanted = keep.iter().fold(0, |m, k| m | k.cap.bit()) & before.permitted;
    let call = |what| move |source| PrivilegeError::Call { what, source };
    if before.effective & Capability::SETPCAP.bit() != 0 {
        for number in 0..64 {
            let bit = 1u64 << number;
            if before.bounding & bit == 0 || wanted & bit != 0 {
                continue;
            }
            caps::drop_bounding(number).map_err(call("shrinking the bounding set"))?;
        }
    } else if before.bounding & !wanted != 0 {
        warn!(
            bounding = format_args!("{:#x}", before.bounding),
            "without cap_setpcap the bounding set cannot be shrunk; set it where the daemon is started (CapabilityBoundingSet=)"
        );
    }
    match caps::clear_ambient() {
        Ok(()) => {}
        // A kernel without ambient capabilities (before 4.3) has nothing to clear.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
        Err(e) => return Err(call("clearing the ambient set")(e)),
    }
    caps::set(wanted).map_err(call("capset"))?;
    caps::set_no_new_privs().map_err(call("setting no_new_privs"))?;
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
    let kept: Vec<_> = keep
        .iter()
        .filter(|k| wanted & k.cap.bit() != 0)
        .map(|k| k.cap.name)
        .collect();
    info!(kept = %kept.join(","), "capabilities dropped; no_new_privs set");
    Ok(after)
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
