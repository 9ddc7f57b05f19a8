//! The kernel's log records (`kernel_log`), as root: at `warn`, a connect refused because its
//! service has no routable host shows up in the daemon's log with the VIP and the reason; at the
//! default (`off`) nothing does. And what `off` costs: the connect and sendmsg programs the
//! kernel runs at `off` have no instruction that touches the log buffer, while at `warn` they
//! do; so the records' code is gone from the fast path, not merely skipped.

use std::{net::SocketAddr, os::fd::AsFd as _, path::Path, time::Duration};

use integration_tests::{
    features::refused_errno,
    kernel::{
        BannerServers, Daemon, InProcess, Netns, Probe, TestCgroup, require_root,
        skip_without_dataplane, unique, xlated,
    },
};
use proxy_common::abi::{maps, programs};
use proxy_core::config::KernelLogLevel;

/// A service whose only cluster has no host: every connect to it is refused.
fn config(cgroup: &Path, vip: SocketAddr, kernel_log: Option<&str>) -> String {
    let level = kernel_log.map_or(String::new(), |l| format!("kernel_log: {l}\n"));
    format!(
        "instance: {instance}\ncgroup: {cgroup}\n{level}admin:\n  address: \"{{admin}}\"\nclusters:\n  - name: empty\n    load_assignment:\n      endpoints:\n        - lb_endpoints: []\nservices:\n  - name: empty\n    address: \"{ip}\"\n    port: {port}\n    cluster: empty\n",
        instance = unique("tl"),
        cgroup = cgroup.display(),
        ip = vip.ip(),
        port = vip.port(),
    )
}

/// The kernel's record of a refused connect to `vip`, as the daemon's text log shows it.
fn record(vip: SocketAddr) -> String {
    format!(
        "{} port {}: connect refused: no routable host",
        vip.ip(),
        vip.port()
    )
}

/// Refuses `count` connects to `vip` from the cgroup, then gives the daemon's reader a moment.
fn refuse(netns: &Netns, cgroup: &TestCgroup, daemon: &Daemon, vip: SocketAddr, count: u32) {
    let probe = Probe::run(netns, Some(cgroup.path()), vip, count, false);
    assert_eq!(probe.errors.get(refused_errno()), Some(&count), "{probe:?}");
    assert_eq!(daemon.counter("connect_no_host"), u64::from(count));
}

#[test]
fn at_warn_a_refused_connect_is_logged_with_the_vip_and_the_reason() {
    require_root();
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = "127.77.0.9:80".parse().unwrap();
    // Were a connect not refused, it would reach this and not the kernel's refusal.
    let _servers = BannerServers::start(&netns, &[(vip, "vip-itself", false)]);
    let daemon = Daemon::start(&config(cgroup.path(), vip, Some("warn")));
    refuse(&netns, &cgroup, &daemon, vip, 3);
    let want = record(vip);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let log = daemon.log_text();
        let lines: Vec<&str> = log.lines().filter(|l| l.contains(&want)).collect();
        if lines.len() == 3 {
            println!("{}", lines[0]);
            // The daemon tags them as the kernel's, at the record's level.
            for line in lines {
                assert!(line.contains("WARN") && line.contains("kernel"), "{line}");
            }
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "expected 3 records {want:?} in the daemon's log:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn by_default_nothing_is_logged() {
    require_root();
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let vip: SocketAddr = "127.77.0.9:80".parse().unwrap();
    let _servers = BannerServers::start(&netns, &[(vip, "vip-itself", false)]);
    let daemon = Daemon::start(&config(cgroup.path(), vip, None));
    refuse(&netns, &cgroup, &daemon, vip, 3);
    // The reader does not exist at off; the wait only gives a wrong one time to write.
    std::thread::sleep(Duration::from_millis(500));
    let log = daemon.log_text();
    assert!(!log.contains(&record(vip)), "{log}");
    assert!(!log.contains("kernel:"), "{log}");
}

/// The instructions the kernel runs for `program` at `level`: their count, and how many of them
/// load the log buffer.
fn log_buffer_loads(cgroup: &TestCgroup, program: &str, level: KernelLogLevel) -> (usize, usize) {
    // Shut down (unpinned, detached) on drop, also when an assertion below fails.
    let dp = InProcess::open_logging(cgroup, level);
    // The variant the data path attached: ROUND_ROBIN's where the kernel has it (5.12).
    let program = match programs::round_robin_variant(program) {
        Some(variant) if dp.round_robin() => variant,
        _ => program,
    };
    let info = dp
        .program_info(program)
        .unwrap_or_else(|| panic!("{program} is not loaded"));
    let logs = info
        .map_ids()
        .expect("map ids")
        .expect("the kernel reports map ids")
        .into_iter()
        .find(|id| {
            aya::maps::MapInfo::from_id(*id).is_ok_and(|m| m.name_as_str() == Some(maps::LOGS))
        })
        .expect("the program uses the log buffer (its code refers to it before the verifier)");
    let fd = info.fd().expect("program fd");
    let len = info
        .size_translated()
        .expect("the kernel reports the program's size");
    let insns = xlated::instructions(fd.as_fd(), len).expect("reading the instructions");
    let loads = xlated::map_ids(&insns)
        .iter()
        .filter(|id| **id == logs)
        .count();
    drop(dp);
    (insns.len(), loads)
}

#[test]
fn off_leaves_no_log_code_in_the_connect_and_sendmsg_programs() {
    require_root();
    if skip_without_dataplane("off_leaves_no_log_code_in_the_connect_and_sendmsg_programs") {
        return;
    }
    let cgroup = TestCgroup::new();
    for program in [
        programs::CONNECT4,
        programs::CONNECT6,
        programs::SENDMSG4,
        programs::SENDMSG6,
    ] {
        let (off_len, off_loads) = log_buffer_loads(&cgroup, program, KernelLogLevel::Off);
        let (warn_len, warn_loads) = log_buffer_loads(&cgroup, program, KernelLogLevel::Warn);
        println!(
            "{program}: {off_len} instructions at off, {warn_len} at warn ({warn_loads} loads of the log buffer)"
        );
        assert_eq!(off_loads, 0, "{program} touches the log buffer at off");
        assert!(warn_loads > 0, "{program} has no record code at warn");
        assert!(off_len < warn_len, "{program}: {off_len} vs {warn_len}");
    }
}
