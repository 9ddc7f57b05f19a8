//! Restart (root): `kill -9` of the daemon leaves the pinned programs, links, maps and the
//! sockhash with its sk_msg attachment in place; connections to the VIP keep working on the last
//! published state, splicing keeps working, and a new daemon adopts the pins. A client connects
//! in a loop across the kill and the restart: not one connect may fail.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use integration_tests::kernel::{
    BannerServers, Daemon, InCgroup, LoopReport, Netns, PinDir, TestCgroup, framed_exchange,
    require_root, skip_without_dataplane, tcp_loop, unique,
};
use proxy::dataplane::RuntimeMaps;
use proxy_common::abi::pins;

const VIP: &str = "127.77.5.1:80";
const HOSTS: [&str; 2] = ["127.0.0.81:8081", "127.0.0.82:8082"];
/// How long the client loops; the kill and the restart happen inside this window.
const LOOP_FOR: Duration = Duration::from_secs(8);

fn config(instance: &str, cgroup: &Path) -> String {
    let endpoints: String = HOSTS
        .iter()
        .map(|h| {
            let a: SocketAddr = h.parse().unwrap();
            format!(
                "            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}\n",
                a.ip(),
                a.port()
            )
        })
        .collect();
    let vip: SocketAddr = VIP.parse().unwrap();
    format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nsplice: true\nclusters:\n  - name: web\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{endpoints}services:\n  - name: web\n    address: \"{}\"\n    port: {}\n    cluster: web\n",
        cgroup.display(),
        vip.ip(),
        vip.port()
    )
}

fn counter(pins: &Path, name: &str) -> u64 {
    let maps = RuntimeMaps::open_pinned(pins).expect("opening the pinned maps");
    maps.counters()
        .into_iter()
        .find_map(|(n, v)| (n == name).then_some(v))
        .expect("counter")
}

/// The daemon's log without terminal colour codes.
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[test]
fn kill9_keeps_the_data_path_and_a_new_daemon_adopts_it() {
    require_root();
    if skip_without_dataplane("kill9_keeps_the_data_path_and_a_new_daemon_adopts_it") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let servers: Vec<(SocketAddr, &str, bool)> = HOSTS
        .iter()
        .map(|h| (h.parse().unwrap(), *h, false))
        .collect();
    let _servers = BannerServers::start(&netns, &servers);
    let instance = unique("rs");
    let pins = PathBuf::from("/sys/fs/bpf").join(&instance);
    // kill -9 leaves the pins on purpose: they go even when an assertion below fails.
    let _pin_guard = PinDir(pins.clone());
    let config = config(&instance, cgroup.path());
    // `splice: true`: sockops and sk_msg are attached, and local pairs are spliced.
    let mut first = Daemon::start(&config);

    let vip: SocketAddr = VIP.parse().unwrap();
    let client = InCgroup::spawn(Some(cgroup.path()), &netns, move || {
        serde_json::to_string(&tcp_loop(vip, 10_000_000, LOOP_FOR)).unwrap()
    });
    std::thread::sleep(Duration::from_secs(1));
    first.kill9();
    assert!(
        pins.join(pins::LINK_CONNECT4).exists(),
        "kill -9 must leave the pins"
    );

    // No daemon now: a local pair is still spliced through the pinned sockhash.
    let redirected = counter(&pins, "sk_msg_redirected");
    let listen: SocketAddr = "127.0.0.90:7000".parse().unwrap();
    let (up, down) = framed_exchange(cgroup.path(), &netns, listen, listen, 1 << 20);
    assert!(up && down, "bytes differ while the daemon is dead");
    let spliced = counter(&pins, "sk_msg_redirected") - redirected;
    assert!(spliced > 0, "sk_msg attachment did not survive kill -9");

    let second = Daemon::start(&config);
    let report = LoopReport::parse(&client.wait(Duration::from_secs(60)));
    println!(
        "across kill -9 and restart: {} connects, {} failed; {spliced} messages spliced without a daemon",
        report.ok(),
        report.failed()
    );
    assert_eq!(report.failed(), 0, "{report:?}");
    assert!(report.ok() > 100, "{report:?}");
    for banner in report.banners.keys() {
        assert!(HOSTS.contains(&banner.as_str()), "reached {banner}");
    }
    let log = strip_ansi(&second.log_text());
    assert!(
        log.contains("adopted=1"),
        "the new daemon did not adopt the service:\n{log}"
    );
    assert!(second.counter("connect_rewritten") > 0);
    drop(second);
    assert!(!pins.exists(), "a graceful stop removes the pins");
}
