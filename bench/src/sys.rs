//! Process and machine accounting for the benchmarks: CPU time per process from
//! `/proc/PID/task/*/schedstat`, machine-wide busy time from `/proc/stat`, RSS, rusage of a
//! reaped child, and the facts every run records (kernel, conntrack, nat tables, BPF programs).
//! Every system call the harness makes through libc is here (the crate denies unsafe code
//! elsewhere), each with its `SAFETY:` note.

use std::{
    fs,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

/// Nanoseconds on CPU of every thread of `pid` (first field of each task's schedstat).
/// A process that is gone counts 0.
pub fn schedstat_ns(pid: u32) -> u64 {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// `pid` and all its descendants (nginx workers, haproxy and envoy children).
pub fn tree(pid: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    if let Ok(dir) = fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let Ok(p) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = fs::read_to_string(format!("/proc/{p}/stat")) else {
                continue;
            };
            // The command name may hold spaces: fields start after the last ')'.
            let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
            if let Some(ppid) = rest.split_whitespace().nth(1).and_then(|f| f.parse().ok()) {
                parents.push((p, ppid));
            }
        }
    }
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let cur = out[i];
        out.extend(parents.iter().filter(|(_, pp)| *pp == cur).map(|(p, _)| *p));
        i += 1;
    }
    out
}

/// CPU nanoseconds of a set of process trees.
pub fn cpu_ns(roots: &[u32]) -> u64 {
    roots.iter().flat_map(|r| tree(*r)).map(schedstat_ns).sum()
}

/// Resident set size in KiB of a process tree (VmRSS summed).
pub fn rss_kib(root: u32) -> u64 {
    tree(root)
        .into_iter()
        .filter_map(|p| fs::read_to_string(format!("/proc/{p}/status")).ok())
        .filter_map(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))?
                .split_whitespace()
                .nth(1)?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Jiffies over all CPUs from the `cpu` line of /proc/stat.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct CpuJiffies {
    /// Everything but idle and iowait (steal included: it is time the CPUs were not ours).
    busy: u64,
    /// Time a virtual CPU wanted to run and the hypervisor ran something else.
    steal: u64,
}

fn proc_stat() -> CpuJiffies {
    parse_proc_stat(&fs::read_to_string("/proc/stat").unwrap_or_default())
}

fn parse_proc_stat(text: &str) -> CpuJiffies {
    let fields: Vec<u64> = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some("cpu"))
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal (guest and guest_nice are within user)
    let busy = fields
        .iter()
        .take(8)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, v)| v)
        .sum();
    CpuJiffies {
        busy,
        steal: fields.get(7).copied().unwrap_or(0),
    }
}

/// Jiffies per second (USER_HZ).
fn user_hz() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as f64 } else { 100.0 }
}

/// Machine-wide busy and stolen time, read at two points.
#[derive(Clone, Copy)]
pub struct BusyMark {
    at_start: CpuJiffies,
    at: Instant,
}

/// What a [`BusyMark`] saw since it was taken.
#[expect(
    clippy::struct_field_names,
    reason = "`_s` is the unit (seconds) of each field, as in the report's columns"
)]
pub struct Busy {
    /// CPU seconds the whole machine was busy (steal included).
    pub busy_s: f64,
    /// CPU seconds the hypervisor kept this machine's CPUs from running.
    pub steal_s: f64,
    pub wall_s: f64,
}

impl BusyMark {
    pub fn now() -> Self {
        Self {
            at_start: proc_stat(),
            at: Instant::now(),
        }
    }

    pub fn since(&self) -> Busy {
        let now = proc_stat();
        let hz = user_hz();
        Busy {
            busy_s: now.busy.saturating_sub(self.at_start.busy) as f64 / hz,
            steal_s: now.steal.saturating_sub(self.at_start.steal) as f64 / hz,
            wall_s: self.at.elapsed().as_secs_f64(),
        }
    }
}

/// Cores busy outside `ours` (process trees we started) over `window`.
pub fn other_load(ours: &[u32], window: Duration) -> f64 {
    let mark = BusyMark::now();
    let ours_before = cpu_ns(ours);
    thread::sleep(window);
    let ours_cpu = cpu_ns(ours).saturating_sub(ours_before) as f64 / 1e9;
    let b = mark.since();
    ((b.busy_s - ours_cpu) / b.wall_s).max(0.0)
}

/// A child's exit and its CPU time (user + system of all its threads, from wait4's rusage:
/// an exited process has no schedstat left to read).
pub struct Reaped {
    pub success: bool,
    pub cpu_s: f64,
    pub stdout: String,
    /// How it ended ("exit status 1", "killed by signal 9") and its stderr if that was piped:
    /// what a failed client said, for the sample's error.
    pub failure: String,
}

/// Waits for `child` with wait4 and collects its stdout and stderr (where piped) and rusage.
pub fn reap(mut child: Child, what: &str, limit: Duration) -> anyhow::Result<Reaped> {
    fn drain(pipe: Option<impl std::io::Read + Send + 'static>) -> thread::JoinHandle<String> {
        thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_string(&mut s);
            }
            s
        })
    }
    let reader = drain(child.stdout.take());
    let err_reader = drain(child.stderr.take());
    let pid = child.id() as libc::pid_t;
    let deadline = Instant::now() + limit;
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value; wait4 fills it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: pid is our own unreaped child; status and usage are valid for writes.
        let r = unsafe { libc::wait4(pid, &raw mut status, libc::WNOHANG, &raw mut usage) };
        if r == pid {
            break;
        }
        if r < 0 {
            bail!("waiting for {what}: {}", std::io::Error::last_os_error());
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            // SAFETY: as above, blocking this time.
            unsafe { libc::wait4(pid, &raw mut status, 0, &raw mut usage) };
            bail!("{what} did not finish within {limit:?}; killed it");
        }
        thread::sleep(Duration::from_millis(5));
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    let stdout = reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    let success = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    let ended = if libc::WIFSIGNALED(status) {
        format!("killed by signal {}", libc::WTERMSIG(status))
    } else {
        format!("exit status {}", libc::WEXITSTATUS(status))
    };
    // The first 2,000 characters: the error, not a whole backtrace.
    let stderr = stderr.trim();
    let failure = match stderr.char_indices().nth(2000) {
        _ if stderr.is_empty() => ended,
        Some((i, _)) => format!("{ended}: {} [...]", &stderr[..i]),
        None => format!("{ended}: {stderr}"),
    };
    Ok(Reaped {
        success,
        cpu_s: tv(usage.ru_utime) + tv(usage.ru_stime),
        stdout,
        failure,
    })
}

/// Runs a command to completion, returning stdout; fails with its stderr.
pub fn sh(cmd: &mut Command, what: &str) -> anyhow::Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Sends SIGTERM, waits up to 3 s, then SIGKILL; reaps the child.
pub fn stop(child: &mut Child) {
    let pid = child.id() as libc::pid_t;
    // SAFETY: pid is our own child, not yet reaped.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Raises RLIMIT_NOFILE (inherited by everything we start): 10,000 idle connections through a
/// proxy need 20,000 descriptors in it.
/// Returns the soft limit in force afterwards (the hard limit when it cannot be raised: a
/// container may deny CAP_SYS_RESOURCE even to root).
pub fn raise_nofile(want: u64) -> u64 {
    let lim = libc::rlimit {
        rlim_cur: want,
        rlim_max: want,
    };
    // SAFETY: lim is a valid rlimit; failure leaves the limit as it was.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const lim) } == 0 {
        return want;
    }
    // SAFETY: an all-zero rlimit is valid; getrlimit fills it.
    let mut cur: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: cur is valid for writes.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut cur) };
    let soft = libc::rlimit {
        rlim_cur: cur.rlim_max,
        rlim_max: cur.rlim_max,
    };
    // SAFETY: as above; raising the soft limit to the hard one needs no privilege.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const soft) };
    crate::util::detail(format!(
        "RLIMIT_NOFILE cannot go to {want}; using the hard limit {}",
        cur.rlim_max
    ));
    cur.rlim_max
}

/// Runs the benchmark (and everything it starts) at high priority.
pub fn raise_priority() {
    // SAFETY: setpriority on our own process has no memory-safety preconditions.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, -10) };
}

/// Facts recorded with every run.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Facts {
    pub kernel: String,
    /// CPU model, CPU count, cpuidle driver and clocksource: figures from different machines
    /// are not comparable, and idle exits shape the latency rows. Absent in older results.
    #[serde(default)]
    pub machine: Option<String>,
    pub conntrack_count: Option<u64>,
    pub nft_tables: Vec<String>,
    pub bpf_prog_ids: Vec<u64>,
}

pub fn facts() -> Facts {
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_owned();
    let conntrack_count = fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_count")
        .ok()
        .and_then(|s| s.trim().parse().ok());
    Facts {
        kernel,
        machine: Some(machine()),
        conntrack_count,
        nft_tables: nft_tables(),
        bpf_prog_ids: bpf_prog_ids(),
    }
}

/// "AMD EPYC, 2 CPUs, cpuidle haltpoll, clocksource tsc"; "unknown" for what cannot be read.
fn machine() -> String {
    let read = |path: &str| {
        fs::read_to_string(path)
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "unknown".to_owned())
    };
    let model = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| cpu_model(&info))
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let driver = read(CPUIDLE_DRIVER);
    // A guest's haltpoll driver polls this long before it halts the vCPU to the host; at 0
    // every idle halts, and the wake-up waits on the host's scheduler (counted as steal).
    let poll = fs::read_to_string(HALT_POLL_NS)
        .ok()
        .filter(|_| driver == "haltpoll")
        .map(|ns| format!(" (guest_halt_poll_ns {})", ns.trim()))
        .unwrap_or_default();
    format!(
        "{model}, {cpus} CPUs, cpuidle {driver}{poll}, clocksource {}",
        read("/sys/devices/system/clocksource/clocksource0/current_clocksource"),
    )
}

/// The cpuidle driver in use ("haltpoll" in a KVM guest that has it).
const CPUIDLE_DRIVER: &str = "/sys/devices/system/cpu/cpuidle/current_driver";

/// Where a KVM guest's haltpoll cpuidle driver keeps its poll time.
pub const HALT_POLL_NS: &str = "/sys/module/haltpoll/parameters/guest_halt_poll_ns";

/// `--halt-poll-ns`: the haltpoll poll time set for the run, and the value that was there,
/// written back on drop (also when the run fails or is interrupted).
pub struct HaltPoll {
    path: std::path::PathBuf,
    before: String,
}

impl HaltPoll {
    /// Sets the poll time of this machine's haltpoll driver; an error if the machine's cpuidle
    /// driver is another (bare metal, or a guest without haltpoll) or the value is refused.
    pub fn set(ns: u64) -> anyhow::Result<Self> {
        let driver = fs::read_to_string(CPUIDLE_DRIVER)
            .map_or_else(|_| "none".to_owned(), |d| d.trim().to_owned());
        if driver != "haltpoll" {
            bail!(
                "--halt-poll-ns: this machine's cpuidle driver is {driver}, not haltpoll (the \
                 driver of a KVM guest); there is no poll time to set"
            );
        }
        Self::set_at(std::path::Path::new(HALT_POLL_NS), ns)
    }

    /// `set` on the parameter file at `path`.
    fn set_at(path: &std::path::Path, ns: u64) -> anyhow::Result<Self> {
        let before = fs::read_to_string(path)
            .with_context(|| format!("--halt-poll-ns: reading {}", path.display()))?
            .trim()
            .to_owned();
        fs::write(path, ns.to_string())
            .with_context(|| format!("--halt-poll-ns: writing {ns} to {}", path.display()))?;
        Ok(Self {
            path: path.to_owned(),
            before,
        })
    }

    /// The value the run found and puts back.
    pub fn before(&self) -> &str {
        &self.before
    }
}

impl Drop for HaltPoll {
    fn drop(&mut self) {
        if let Err(e) = fs::write(&self.path, &self.before) {
            eprintln!(
                "could not put {} back to {}: {e}; write it by hand",
                self.path.display(),
                self.before
            );
        }
    }
}

/// The first `model name` of /proc/cpuinfo.
fn cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo.lines().find_map(|l| {
        let (key, value) = l.split_once(':')?;
        (key.trim() == "model name").then(|| value.trim().to_owned())
    })
}

/// `nft list tables` as lines ("table ip nat").
pub fn nft_tables() -> Vec<String> {
    sh(
        Command::new("nft").args(["list", "tables"]),
        "nft list tables",
    )
    .map(|s| s.lines().map(str::to_owned).collect())
    .unwrap_or_default()
}

fn bpf_prog_ids() -> Vec<u64> {
    let Ok(out) = sh(
        Command::new("bpftool").args(["prog", "show", "-j"]),
        "bpftool",
    ) else {
        return Vec::new();
    };
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    v.as_array()
        .map(|a| a.iter().filter_map(|p| p["id"].as_u64()).collect())
        .unwrap_or_default()
}

/// SO_LINGER {on, 0}: close sends RST and leaves no TIME_WAIT (connect-rate loops would
/// otherwise run out of ports).
pub fn linger_zero(s: &std::net::TcpStream) {
    use std::os::fd::AsRawFd as _;
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: the fd is open for the lifetime of `s`; `l` is a valid linger of the given size.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const l).cast(),
            size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether we run as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Moves the calling thread (only it) into the network namespace of `file`, an open
/// `/run/netns` entry.
pub fn enter_netns(file: &fs::File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: `file` is an open namespace file for the duration of the call; CLONE_NEWNET moves
    // only the calling thread.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// SIGINT/SIGTERM only set a flag: the benchmark stops between measurements and its drops
/// remove what it set up.
pub fn catch_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

pub fn interrupted() -> bool {
    INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed)
}

/// The soft RLIMIT_NOFILE in force (inherited by everything we start).
pub fn nofile() -> u64 {
    // SAFETY: an all-zero rlimit is valid; getrlimit fills it.
    let mut cur: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: cur is valid for writes.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut cur) };
    cur.rlim_cur
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_busy_counts_steal_and_leaves_out_idle_and_iowait() {
        let text = "cpu  100 2 30 5000 7 1 9 40 0 0\ncpu0 50 1 15 2500 3 0 4 20 0 0\nintr 1\n";
        let j = parse_proc_stat(text);
        assert_eq!(j.busy, 100 + 2 + 30 + 1 + 9 + 40);
        assert_eq!(j.steal, 40);
        // A kernel without a steal column (or an unreadable file) reads as none.
        assert_eq!(parse_proc_stat("cpu  1 2 3 4\n").steal, 0);
        assert_eq!(parse_proc_stat(""), CpuJiffies::default());
    }

    #[test]
    fn the_cpu_model_is_the_first_model_name() {
        let info = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n\n\
                    processor\t: 1\nmodel name\t: Other\n";
        assert_eq!(cpu_model(info).as_deref(), Some("AMD EPYC"));
        assert_eq!(cpu_model("processor\t: 0\n"), None);
    }

    #[test]
    fn the_halt_poll_time_is_set_for_the_run_and_put_back() {
        let dir = std::env::temp_dir().join(format!("halt-poll-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let file = dir.join("guest_halt_poll_ns");
        fs::write(&file, "0\n").unwrap();
        {
            let guard = HaltPoll::set_at(&file, 200_000).unwrap();
            assert_eq!(guard.before(), "0");
            assert_eq!(fs::read_to_string(&file).unwrap(), "200000");
        }
        assert_eq!(fs::read_to_string(&file).unwrap(), "0");
        // A missing parameter is an error that names it, and nothing is written.
        let missing = dir.join("absent");
        let err = HaltPoll::set_at(&missing, 1).err().unwrap();
        assert!(format!("{err:#}").contains("absent"), "{err:#}");
        assert!(!missing.exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn results_from_before_the_machine_was_recorded_still_load() {
        let old =
            r#"{"kernel": "6.18", "conntrack_count": 1, "nft_tables": [], "bpf_prog_ids": []}"#;
        let facts: Facts = serde_json::from_str(old).unwrap();
        assert_eq!(facts.machine, None);
    }
}
