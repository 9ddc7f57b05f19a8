//! Not root after attaching (root): the daemon, started as root with `user: 65534:65534` (and
//! `seccomp` at its default, on), attaches and then runs as nobody under its seccomp filter. It
//! serves a kernel-path and a proxy-path service, applies a reload (and refuses one whose file
//! it cannot read, saying so), and hands over to a new daemon started as root (`--takeover`),
//! which hands over in turn to a daemon without `user` and with `seccomp: false` (root again,
//! and so are `/run/proxy` and the pins), which stops cleanly. A process with its steady-state
//! credentials (user, groups, capabilities, `no_new_privs`, seccomp filter: taken by the
//! daemon's own code, then checked against the daemon's `/proc` status) cannot signal a root
//! process, write another cgroup's `cgroup.procs` or `cgroup.kill`, read `/etc/shadow`, or
//! write root's files; the same probe with the credentials of a daemon without `user` and with
//! `seccomp: false` can, so each of these checks can fail.
//!
//! Each daemon runs in a mount namespace of its own with a private `/run/proxy` (a tmpfs), so
//! that handing that directory to nobody touches no other daemon on the host, and the first one
//! within the shipped unit's capability bounding set.
#![allow(unsafe_code, reason = "kill(2) of a test process by its PID")]

use std::{
    collections::BTreeMap,
    io::Write as _,
    net::SocketAddr,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Child, Command},
    time::Duration,
};

use integration_tests::kernel::{
    BannerServers, Daemon, InCgroup, LoopReport, Netns, PinDir, TempDir, TestCgroup, require_root,
    skip_without_dataplane, tcp_loop, unique,
};
use proxy::privileges::{Capability, Keep, RunAs, SteadyState};

const HOST: &str = "127.0.0.71:8071";
const DIRECT_VIP: &str = "127.77.7.1:80";
const PROXY_VIP: &str = "127.77.7.2:80";
/// Published by the reload only.
const LATER_VIP: &str = "127.77.7.3:80";
const NOBODY: u32 = 65534;

/// Runs the daemon in a mount namespace of its own whose `/run/proxy` is a fresh tmpfs, within
/// the capability bounding set of the shipped unit (`docs/deploy/proxy.service`), as systemd
/// would start it.
fn private_run() -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/deploy/proxy.service");
    let unit = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let set: Vec<String> = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("the unit sets CapabilityBoundingSet")
        .split_whitespace()
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    let script = format!(
        "mkdir -p -m 0700 /run/proxy && mount -t tmpfs -o mode=0700 proxy-test /run/proxy && exec setpriv --bounding-set -all,{} --inh-caps -all -- \"$0\" \"$@\"",
        set.join(",")
    );
    [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        &script,
    ]
    .map(str::to_owned)
    .to_vec()
}

/// A direct and a proxy-mode service of one host (and, with `later`, a second direct one),
/// run as nobody (the seccomp filter on, its default).
fn config(instance: &str, cgroup: &Path, later: bool) -> String {
    let host: SocketAddr = HOST.parse().unwrap();
    let mut text = format!(
        "instance: {instance}\ncgroup: {}\nuser: \"{NOBODY}:{NOBODY}\"\nadmin:\n  address: \"{{admin}}\"\nproxy:\n  listeners: [\"127.0.0.1:15071\"]\n  shutdown_timeout: 5s\nclusters:\n  - name: web\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\nservices:\n  - {{ name: direct, address: 127.77.7.1, port: 80, cluster: web }}\n  - {{ name: proxied, address: 127.77.7.2, port: 80, cluster: web, mode: proxy }}\n",
        cgroup.display(),
        host.ip(),
        host.port(),
    );
    if later {
        text.push_str("  - { name: later, address: 127.77.7.3, port: 80, cluster: web }\n");
    }
    text
}

/// `n` connects to `vip` from inside the cgroup; all must reach the host.
fn assert_serves(netns: &Netns, cgroup: &TestCgroup, vip: &str, n: u32) {
    let target: SocketAddr = vip.parse().unwrap();
    let client = InCgroup::spawn(Some(cgroup.path()), netns, move || {
        serde_json::to_string(&tcp_loop(target, n, Duration::from_secs(10))).unwrap()
    });
    let report = LoopReport::parse(&client.wait(Duration::from_secs(30)));
    assert_eq!(
        report.banners.get(HOST).copied(),
        Some(n),
        "{vip}: {report:?}"
    );
}

/// The fields of `/proc/<pid>/status` that make up a process's credentials.
const CREDENTIALS: [&str; 10] = [
    "Uid",
    "Gid",
    "Groups",
    "CapInh",
    "CapPrm",
    "CapEff",
    "CapBnd",
    "CapAmb",
    "NoNewPrivs",
    "Seccomp",
];

fn credentials(status: &str) -> BTreeMap<String, String> {
    status
        .lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(k, _)| CREDENTIALS.contains(k))
        .map(|(k, v)| {
            (
                k.to_owned(),
                v.split_whitespace().collect::<Vec<_>>().join(" "),
            )
        })
        .collect()
}

fn status_of(pid: u32) -> BTreeMap<String, String> {
    credentials(&std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status"))
}

/// What is tried with the daemon's credentials.
struct Targets {
    /// A root process (in `cgroup`).
    victim: u32,
    /// A cgroup the test made.
    cgroup: PathBuf,
    /// A root-owned file (mode 0644) and directory (mode 0755).
    file: PathBuf,
    dir: PathBuf,
}

/// Each attempt's outcome: `done`, or the error.
fn attempts(t: &Targets) -> Vec<(&'static str, String)> {
    let write = |path: &Path, what: &[u8]| {
        std::fs::OpenOptions::new()
            .write(true)
            .create(!path.exists())
            .truncate(false)
            .open(path)
            .and_then(|mut f| f.write_all(what))
    };
    let outcome = |r: std::io::Result<()>| r.map_or_else(|e| e.to_string(), |()| "done".into());
    // SAFETY: kill takes integers only.
    let killed = unsafe { libc::kill(t.victim as libc::pid_t, libc::SIGKILL) };
    let killed = if killed == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    };
    let victim = t.victim.to_string();
    vec![
        (
            "/etc/shadow",
            outcome(std::fs::read("/etc/shadow").map(drop)),
        ),
        ("root's file", outcome(write(&t.file, b"x"))),
        ("root's directory", outcome(write(&t.dir.join("new"), b"x"))),
        (
            "cgroup.procs",
            outcome(write(&t.cgroup.join("cgroup.procs"), victim.as_bytes())),
        ),
        (
            "cgroup.kill",
            outcome(write(&t.cgroup.join("cgroup.kill"), b"1")),
        ),
        ("kill", outcome(killed)),
    ]
}

/// In a forked child: takes `state` through the daemon's own code, checks that its credentials
/// are `expected` (when given), then tries `targets`. The result as JSON.
fn probe(
    netns: &Netns,
    state: SteadyState,
    expected: Option<BTreeMap<String, String>>,
    t: &Targets,
) -> String {
    InCgroup::spawn(None, netns, move || {
        if let Err(err) = proxy::privileges::enter(&state) {
            return format!("entering the steady state: {err}");
        }
        let mine = credentials(&std::fs::read_to_string("/proc/thread-self/status").unwrap());
        if let Some(expected) = expected.filter(|e| *e != mine) {
            return format!("credentials differ: the daemon's {expected:?}, the probe's {mine:?}");
        }
        serde_json::to_string(&attempts(t)).unwrap()
    })
    .wait(Duration::from_secs(20))
}

/// The steady state a daemon with these `/proc` credentials is in.
fn steady_state_of(creds: &BTreeMap<String, String>) -> SteadyState {
    let eff = u64::from_str_radix(&creds["CapEff"], 16).unwrap();
    let keep = (0..64)
        .filter(|n| eff & (1 << n) != 0)
        .map(|number| Keep {
            cap: Capability {
                number,
                name: "kept by the daemon",
            },
            why: "the daemon kept it",
        })
        .collect();
    let ids = |k: &str| creds[k].split(' ').next().unwrap().parse::<u32>().unwrap();
    let (uid, gid) = (ids("Uid"), ids("Gid"));
    SteadyState {
        keep,
        user: (uid != 0).then(|| RunAs {
            uid,
            gid,
            spec: format!("{uid}:{gid}"),
        }),
        seccomp: creds["Seccomp"] == "2",
        runtime_dir: None,
        control_dir: None,
        pin_dir: None,
        own_sockets: Vec::new(),
    }
}

/// A root `sleep` in its own test cgroup, and a root-owned file and directory.
fn targets(tmp: &TempDir, cgroup: &TestCgroup) -> (Child, Targets) {
    let victim = Command::new("sleep").arg("60").spawn().expect("sleep");
    std::fs::write(cgroup.path().join("cgroup.procs"), victim.id().to_string()).unwrap();
    let dir = tmp.0.join("root-only");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let file = dir.join("file");
    std::fs::write(&file, "root's\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let t = Targets {
        victim: victim.id(),
        cgroup: cgroup.path().to_owned(),
        file,
        dir,
    };
    (victim, t)
}

/// A reload re-reads the file as nobody and publishes the new service; one it cannot read is
/// refused, naming the file and the cause.
fn reloads(old: &Daemon, netns: &Netns, cgroup: &TestCgroup, instance: &str) {
    std::fs::write(
        &old.config,
        config(instance, cgroup.path(), true).replace("{admin}", &old.admin.to_string()),
    )
    .unwrap();
    old.signal(libc::SIGHUP);
    assert!(
        old.wait_log("configuration reloaded", Duration::from_secs(20)),
        "{}",
        old.log_text()
    );
    assert_serves(netns, cgroup, LATER_VIP, 10);
    std::fs::set_permissions(&old.config, std::fs::Permissions::from_mode(0o600)).unwrap();
    old.signal(libc::SIGHUP);
    assert!(
        old.wait_log("reload refused", Duration::from_secs(20)),
        "{}",
        old.log_text()
    );
    let log = old.log_text();
    let refusal = log.lines().find(|l| l.contains("reload refused")).unwrap();
    println!("{refusal}");
    assert!(
        refusal.contains("ermission denied") && refusal.contains("config.yaml"),
        "{refusal}"
    );
    std::fs::set_permissions(&old.config, std::fs::Permissions::from_mode(0o644)).unwrap();
}

/// A probe with the daemon's credentials (`creds`) can do none of [`attempts`]; the same probe
/// as root with the same capabilities does them all.
fn can_do_no_harm(netns: &Netns, creds: &BTreeMap<String, String>) {
    let tmp = TempDir::new();
    let other = TestCgroup::new();
    let (mut victim, t) = targets(&tmp, &other);
    let denied = probe(netns, steady_state_of(creds), Some(creds.clone()), &t);
    println!("as the daemon: {denied}");
    let denied: Vec<(String, String)> =
        serde_json::from_str(&denied).unwrap_or_else(|_| panic!("{denied}"));
    for (what, outcome) in &denied {
        assert!(
            outcome.contains("ermission denied") || outcome.contains("not permitted"),
            "{what}: {outcome}"
        );
    }
    assert!(
        victim.try_wait().unwrap().is_none(),
        "the root process lives on"
    );
    assert_eq!(std::fs::read_to_string(&t.file).unwrap(), "root's\n");
    // The same probe as a daemon without `user` and with `seccomp: false` (root with cap_bpf
    // only).
    let mut as_root = creds.clone();
    for k in ["Uid", "Gid"] {
        as_root.insert(k.to_owned(), "0 0 0 0".to_owned());
    }
    as_root.insert("Seccomp".to_owned(), "0".to_owned());
    let allowed = probe(netns, steady_state_of(&as_root), None, &t);
    println!("as root with the same capabilities: {allowed}");
    let allowed: Vec<(String, String)> =
        serde_json::from_str(&allowed).unwrap_or_else(|_| panic!("{allowed}"));
    assert!(allowed.iter().all(|(_, o)| o == "done"), "{allowed:?}");
    let _ = victim.kill();
    let _ = victim.wait();
}

/// Starts a daemon on `config` that takes over from `old` (in its mount namespace); `old`
/// exits 0, and the new one serves both services.
fn takes_over(old: &mut Daemon, netns: &Netns, cgroup: &TestCgroup, config: &str) -> Daemon {
    let ns = format!("--mount=/proc/{}/ns/mnt", old.pid().expect("running"));
    let new = Daemon::start_in_wrapped(netns, &["nsenter", &ns, "--"], config, &["--takeover"]);
    let status = old.wait_exit(Duration::from_secs(20));
    assert!(
        status.is_some_and(|s| s.success()),
        "the old daemon hands over and exits 0: {status:?}\n{}",
        old.log_text()
    );
    assert_serves(netns, cgroup, PROXY_VIP, 10);
    assert_serves(netns, cgroup, DIRECT_VIP, 10);
    let log = new.log_text();
    assert!(!log.contains("WARN") && !log.contains("ERROR"), "{log}");
    new
}

#[test]
fn as_nobody_under_seccomp_it_serves_reloads_hands_over_and_can_do_no_harm() {
    require_root();
    let name = "as_nobody_under_seccomp_it_serves_reloads_hands_over_and_can_do_no_harm";
    if skip_without_dataplane(name) {
        return;
    }
    let (netns, cgroup) = (Netns::new(), TestCgroup::new());
    let _servers = BannerServers::start(&netns, &[(HOST.parse().unwrap(), HOST, false)]);
    let instance = unique("np");
    let pins = PathBuf::from("/sys/fs/bpf").join(&instance);
    let _pin_guard = PinDir(pins.clone());
    let wrapper = private_run();
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let mut old = Daemon::start_in_wrapped(
        &netns,
        &wrapper,
        &config(&instance, cgroup.path(), false),
        &[],
    );
    let pid = old.pid().expect("running");
    let creds = status_of(pid);
    println!("the daemon's steady state: {creds:?}");
    let nobody = format!("{NOBODY} {NOBODY} {NOBODY} {NOBODY}");
    assert_eq!(creds["Uid"], nobody, "{creds:?}");
    assert_eq!(creds["Gid"], nobody, "{creds:?}");
    assert_eq!(creds["Groups"], "", "{creds:?}");
    assert_eq!(creds["Seccomp"], "2", "the filter is installed: {creds:?}");
    assert_serves(&netns, &cgroup, DIRECT_VIP, 10);
    assert_serves(&netns, &cgroup, PROXY_VIP, 10);
    assert!(old.stat("proxy.downstream_cx_total") >= 10);
    let owner = |p: &Path| std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(p).unwrap());
    assert_eq!(
        owner(&pins),
        NOBODY,
        "the pin directory is the steady-state user's"
    );

    reloads(&old, &netns, &cgroup, &instance);
    can_do_no_harm(&netns, &creds);

    // A new daemon, started as root, takes over (in the old one's mount namespace), and one
    // without `user` and with `seccomp: false` takes over from it in turn: root again.
    let mut new = takes_over(
        &mut old,
        &netns,
        &cgroup,
        &config(&instance, cgroup.path(), true),
    );
    assert_eq!(status_of(new.pid().unwrap())["Uid"], nobody);
    let as_root = config(&instance, cgroup.path(), true)
        .replace("user: \"65534:65534\"\n", "seccomp: false\n");
    let mut last = takes_over(&mut new, &netns, &cgroup, &as_root);
    let last_pid = last.pid().unwrap();
    assert_eq!(status_of(last_pid)["Uid"], "0 0 0 0");
    assert_eq!(status_of(last_pid)["Seccomp"], "0");
    let run = PathBuf::from(format!("/proc/{last_pid}/root/run/proxy"));
    assert_eq!((owner(&run), owner(&pins)), (0, 0), "root's again");
    assert!(last.terminate(), "a clean stop:\n{}", last.log_text());
    assert!(pins.exists(), "the stop leaves the data path serving");
    assert!(last.uninstall(), "proxy uninstall");
    assert!(!pins.exists(), "proxy uninstall unpins");
    for log in [old.log_text(), new.log_text(), last.log_text()] {
        assert!(!log.contains("(os error 1)"), "a refused call:\n{log}");
    }
}
