//! Least privilege (root): once its data path is attached, every thread of the daemon holds only
//! the capabilities it still needs (`cap_bpf`), with empty bounding, inheritable and ambient
//! sets beyond that and `no_new_privs` set; it still publishes, routes and stops cleanly.
//!
//! The shipped systemd unit verifies, and its capability bounding set is enough.
//!
//! The daemon's own cgroup: a cgroup the daemon created is removed by `proxy uninstall`, even
//! when the run that created it was killed and a later run of the instance adopted it.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use integration_tests::kernel::{
    BannerServers, Daemon, InCgroup, LoopReport, Netns, PinDir, TempDir, TestCgroup, proxy_bin,
    require_root, skip_without_dataplane, tcp_loop, unique,
};
use proxy::privileges::{Capability, ThreadCaps};

const VIP: &str = "127.77.6.1:80";
const HOST: &str = "127.0.0.61:8061";

/// One direct service with splicing on (sockops and sk_msg attached), so that every kind of
/// program and map is in use.
fn config(instance: &str, cgroup: &Path) -> String {
    let host: SocketAddr = HOST.parse().unwrap();
    let vip: SocketAddr = VIP.parse().unwrap();
    format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nsplice: true\nclusters:\n  - name: web\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\nservices:\n  - name: web\n    address: \"{}\"\n    port: {}\n    cluster: web\n",
        cgroup.display(),
        host.ip(),
        host.port(),
        vip.ip(),
        vip.port()
    )
}

/// Every thread's capability sets, by thread id.
fn threads(pid: u32) -> Vec<(String, ThreadCaps)> {
    let dir = PathBuf::from(format!("/proc/{pid}/task"));
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("reading the daemon's threads") {
        let entry = entry.unwrap();
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
            continue; // the thread ended meanwhile
        };
        let caps = ThreadCaps::parse(&status).expect("a status file");
        found.push((entry.file_name().to_string_lossy().into_owned(), caps));
    }
    found
}

#[test]
fn every_thread_keeps_only_cap_bpf_after_attaching() {
    require_root();
    if skip_without_dataplane("every_thread_keeps_only_cap_bpf_after_attaching") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let _servers = BannerServers::start(&netns, &[(HOST.parse().unwrap(), HOST, false)]);
    let instance = unique("pv");
    let pins = PathBuf::from("/sys/fs/bpf").join(&instance);
    let _pin_guard = PinDir(pins.clone());
    let mut daemon = Daemon::start(&config(&instance, cgroup.path()));

    // What the kernel calls its BPF capability: cap_bpf from 5.8, cap_sys_admin before.
    let ours = ThreadCaps::current().expect("the test's own capabilities");
    let bpf = if ours.bounding & (1 << Capability::BPF.number) != 0 {
        Capability::BPF
    } else {
        Capability::SYS_ADMIN
    };
    let wanted = 1u64 << bpf.number;
    let threads = threads(daemon.pid().expect("running"));
    println!(
        "{} threads, each with effective {wanted:#x} ({bpf}) wanted",
        threads.len()
    );
    assert!(
        threads.len() > 1,
        "the runtime's threads must be checked too"
    );
    for (tid, caps) in &threads {
        assert_eq!(caps.effective, wanted, "thread {tid}: effective {caps:x?}");
        assert_eq!(caps.permitted, wanted, "thread {tid}: permitted {caps:x?}");
        assert_eq!(caps.bounding, wanted, "thread {tid}: bounding {caps:x?}");
        assert_eq!(caps.inheritable, 0, "thread {tid}: inheritable {caps:x?}");
        assert_eq!(caps.ambient, 0, "thread {tid}: ambient {caps:x?}");
        assert!(caps.no_new_privs, "thread {tid}: no_new_privs unset");
    }
    let log = daemon.log_text();
    assert!(
        log.contains("capabilities dropped"),
        "the drop is logged:\n{log}"
    );

    // Still the data path's owner: it published, and connects to the VIP reach the host.
    let vip: SocketAddr = VIP.parse().unwrap();
    let client = InCgroup::spawn(Some(cgroup.path()), &netns, move || {
        serde_json::to_string(&tcp_loop(vip, 20, Duration::from_secs(5))).unwrap()
    });
    let report = LoopReport::parse(&client.wait(Duration::from_secs(30)));
    assert_eq!(report.failed(), 0, "{report:?}");
    assert_eq!(report.banners.get(HOST).copied(), Some(20), "{report:?}");
    assert!(daemon.counter("connect_rewritten") >= 20);
    assert!(
        daemon.terminate(),
        "clean exit on SIGTERM:\n{}",
        daemon.log_text()
    );
    assert!(pins.exists(), "the stop leaves the data path serving");
    assert!(daemon.uninstall(), "proxy uninstall");
    assert!(!pins.exists(), "proxy uninstall unpins");
}

/// Removes a directory on drop (a cgroup the daemon should have removed).
struct RemoveDir(PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn the_cgroup_a_killed_run_created_goes_at_uninstall() {
    require_root();
    if skip_without_dataplane("the_cgroup_a_killed_run_created_goes_at_uninstall") {
        return;
    }
    let parent = TestCgroup::new();
    let cgroup = parent.path().join("made-by-the-daemon");
    let _cgroup_guard = RemoveDir(cgroup.clone());
    let instance = unique("cg");
    let pins = PathBuf::from("/sys/fs/bpf").join(&instance);
    let _pin_guard = PinDir(pins.clone());
    let config = config(&instance, &cgroup);

    let mut first = Daemon::start(&config);
    assert!(cgroup.is_dir(), "the daemon creates the cgroup it is given");
    first.kill9();
    assert!(cgroup.is_dir(), "kill -9 leaves the cgroup (and the pins)");
    let mut second = Daemon::start(&config);
    assert!(
        second.terminate(),
        "clean exit on SIGTERM:\n{}",
        second.log_text()
    );
    assert!(
        cgroup.is_dir(),
        "the stop leaves the data path, and its cgroup, in place"
    );
    assert!(second.uninstall(), "proxy uninstall");
    assert!(!pins.exists(), "proxy uninstall unpins");
    assert!(
        !cgroup.exists(),
        "the cgroup the killed run created outlived proxy uninstall"
    );

    // A cgroup the daemon did not create stays, however often it restarts.
    let given = TestCgroup::new();
    let config = self::config(&instance, given.path());
    let mut third = Daemon::start(&config);
    third.kill9();
    let mut fourth = Daemon::start(&config);
    assert!(fourth.stop());
    assert!(
        given.path().is_dir(),
        "a cgroup the daemon was given is not its to remove"
    );
}

/// The shipped systemd unit, `docs/deploy/proxy.service`.
fn unit() -> String {
    unit_file("proxy.service")
}

/// A unit file of `docs/deploy`.
fn unit_file(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../docs/deploy")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `systemd-analyze verify` accepts the units without an error or a warning (with their paths
/// pointed at the built binary and an example configuration): `proxy.service`, and the
/// takeover template `proxy@.service` as its instance `proxy@blue.service`; both keep the
/// proxy listener in a file-descriptor store.
#[test]
fn the_systemd_unit_verifies() {
    let Ok(found) = std::process::Command::new("systemd-analyze")
        .arg("--version")
        .output()
    else {
        println!("skipping: systemd-analyze is not installed, the unit is not verified");
        return;
    };
    assert!(found.status.success());
    let tmp = TempDir::new();
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/static.yaml");
    for (file, as_unit) in [
        ("proxy.service", "proxy.service"),
        ("proxy@.service", "proxy@blue.service"),
    ] {
        let text = unit_file(file);
        // The proxy listener outlives a restart in the store (docs/lifecycle.md).
        let store = text
            .lines()
            .find_map(|l| l.strip_prefix("FileDescriptorStoreMax="))
            .and_then(|n| n.parse::<u32>().ok());
        assert!(
            store.is_some_and(|n| n > 0),
            "{file}: FileDescriptorStoreMax"
        );
        let text = text
            .replace("/usr/local/bin/proxy", &proxy_bin().display().to_string())
            .replace("/etc/proxy/proxy.yaml", &example.display().to_string());
        let path = tmp.0.join(as_unit);
        std::fs::write(&path, text).unwrap();
        let out = std::process::Command::new("systemd-analyze")
            .arg("verify")
            .arg(&path)
            .output()
            .expect("running systemd-analyze verify");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{as_unit}: {stderr}");
        // Unknown keys and bad values are warnings with status 0: they count as failures here.
        let about_unit: Vec<&str> = stderr.lines().filter(|l| l.contains(as_unit)).collect();
        assert!(about_unit.is_empty(), "{as_unit}: {stderr}");
    }
}

/// The unit's capability bounding set is all the daemon needs: started as root within it (as
/// systemd would start it), the daemon attaches, drops to cap_bpf, serves and stops.
#[test]
fn the_units_capabilities_are_enough() {
    require_root();
    if skip_without_dataplane("the_units_capabilities_are_enough") {
        return;
    }
    let unit = unit();
    let set: Vec<String> = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("the unit sets CapabilityBoundingSet")
        .split_whitespace()
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    let bounding = format!("-all,{}", set.join(","));
    println!("bounding set {bounding}");
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let _servers = BannerServers::start(&netns, &[(HOST.parse().unwrap(), HOST, false)]);
    let instance = unique("su");
    let pins = PathBuf::from("/sys/fs/bpf").join(&instance);
    let _pin_guard = PinDir(pins.clone());
    let mut daemon = Daemon::start_wrapped(
        &[
            "setpriv",
            "--bounding-set",
            &bounding,
            "--inh-caps",
            "-all",
            "--",
        ],
        &config(&instance, cgroup.path()),
    );
    let vip: SocketAddr = VIP.parse().unwrap();
    let client = InCgroup::spawn(Some(cgroup.path()), &netns, move || {
        serde_json::to_string(&tcp_loop(vip, 10, Duration::from_secs(5))).unwrap()
    });
    let report = LoopReport::parse(&client.wait(Duration::from_secs(30)));
    assert_eq!(report.banners.get(HOST).copied(), Some(10), "{report:?}");
    assert!(
        daemon.log_text().contains("capabilities dropped"),
        "{}",
        daemon.log_text()
    );
    assert!(daemon.stop(), "stop and uninstall:\n{}", daemon.log_text());
}
