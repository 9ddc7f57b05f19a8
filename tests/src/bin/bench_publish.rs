//! `cargo xtask bench` helper (root): time to publish N hosts into the kernel maps with the
//! daemon's own publisher (`proxy::dataplane`, in-process), as N services of one host and as
//! N/1000 services of 1,000 hosts, cold and as an update; meanwhile a thread in the cgroup keeps
//! connecting to a service whose host set flips between two sets of live listeners, and counts
//! connects that reached neither (a half-written set would show up there).
//!
//! Prints one JSON object (`*_ms` wall clock, `*_cpu_ms` CPU time of the publishing thread;
//! `hosts_x1000_*` is the grouped case whatever `--per` is). Usage: `bench_publish --hosts 10000 --cgroup /sys/fs/cgroup/.../x`
//! (`--per 100` makes the grouped case N/100 services of 100 hosts; the default is 1,000). The
//! maps are the daemon's default sizes, grown as a user would (`kernel_maps`) where N does not fit.
#![allow(unsafe_code, reason = "clock_gettime(2) of the thread CPU clock")]

use std::{
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use proxy::dataplane::{Dataplane, DataplaneOptions, ServiceSpec, publish_key};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn spec(name: String, vip: SocketAddr, hosts: Vec<SocketAddr>) -> ServiceSpec {
    ServiceSpec {
        name,
        key: publish_key(vip.ip(), vip.port(), proxy_common::service::PROTO_TCP),
        flags: 0,
        priorities: vec![hosts.into_iter().map(|h| (h, 1)).collect()],
        max_connections: None,
        drop_overload: 0,
    }
}

fn v4(base: Ipv4Addr, i: u32, port: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(u32::from(base) + i), port))
}

/// The default map sizes, grown where `hosts` would not fit: N one-host services (plus the
/// grouped ones and the flip service) in `SERVICES_V2`, and the grouped hosts twice in
/// `BACKENDS_V2` (an update writes the new set beside the live one).
fn map_sizes(hosts: u32) -> proxy_core::config::MapSizes {
    let mut sizes = proxy_core::config::MapSizes::default();
    sizes.services = sizes
        .services
        .max((hosts.saturating_mul(2) + 64).next_power_of_two());
    sizes.backends = sizes
        .backends
        .max((hosts.saturating_mul(2) + 64).next_power_of_two());
    sizes
}

/// Where each set of addresses starts: a /12 of loopback each, so that up to a million
/// services or hosts of one set never meet another set's (or the flip service's).
const SINGLE_VIPS: Ipv4Addr = Ipv4Addr::new(127, 16, 0, 0);
const GROUP_VIPS: Ipv4Addr = Ipv4Addr::new(127, 32, 0, 0);
const HOST_SETS: [Ipv4Addr; 4] = [
    Ipv4Addr::new(127, 48, 0, 0),
    Ipv4Addr::new(127, 64, 0, 0),
    Ipv4Addr::new(127, 80, 0, 0),
    Ipv4Addr::new(127, 96, 0, 0),
];

/// Nanoseconds this thread has run on a CPU, user and kernel time (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec that outlives the call; the clock id is a constant.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut ts) };
    if rc != 0 {
        return 0;
    }
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// Publishes every spec; milliseconds taken, wall clock and on a CPU (user + kernel time of this
/// thread: the figure that does not grow when other load shares the machine).
fn publish_all(dp: &mut Dataplane, specs: &[ServiceSpec]) -> (f64, f64) {
    let (t, cpu) = (Instant::now(), thread_cpu_ns());
    for s in specs {
        dp.publisher().publish(s).expect("publishing");
    }
    let cpu_ms = thread_cpu_ns().saturating_sub(cpu) as f64 / 1e6;
    (t.elapsed().as_secs_f64() * 1e3, cpu_ms)
}

#[expect(
    clippy::too_many_lines,
    reason = "one measurement script, step by step"
)]
fn main() {
    let hosts: u32 = arg("--hosts")
        .and_then(|h| h.parse().ok())
        .unwrap_or(10_000);
    let cgroup = PathBuf::from(arg("--cgroup").expect("--cgroup PATH"));
    let opts = DataplaneOptions {
        cgroup: cgroup.clone(),
        bpffs: PathBuf::from("/sys/fs/bpf"),
        instance: format!("proxy_bench_publish_{}", std::process::id()),
        // Plain kernel-path services, as the daemon publishes them.
        follow_sockets: false,
        kernel_log: proxy_core::config::KernelLogLevel::Off,
        kernel_maps: map_sizes(hosts),
    };
    let mut dp = Dataplane::open(&opts).expect("opening the data path");
    // Join the cgroup (for the flip check's connects); move back before shutdown removes it.
    let home = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("0::")
                    .map(|p| p.trim_start_matches('/').to_owned())
            })
        })
        .map(|rel| cgroup.parent().expect("cgroup under a mount").join(rel))
        .expect("our cgroup v2 path");
    std::fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string())
        .expect("joining the cgroup");

    // The flip check: two sets of 4 live listeners behind one VIP.
    let listeners: Vec<TcpListener> = (0..8)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("listener"))
        .collect();
    let addrs: Vec<SocketAddr> = listeners
        .iter()
        .map(|l| l.local_addr().expect("addr"))
        .collect();
    for l in &listeners {
        l.set_nonblocking(true).expect("nonblocking");
    }
    let flip_vip: SocketAddr = "127.77.200.1:80".parse().expect("vip");
    let set_a = spec("flip".into(), flip_vip, addrs[..4].to_vec());
    let set_b = spec("flip".into(), flip_vip, addrs[4..].to_vec());
    dp.publisher()
        .publish(&set_a)
        .expect("publishing the flip service");
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, bad) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let client = {
        let (stop, ok, bad) = (Arc::clone(&stop), Arc::clone(&ok), Arc::clone(&bad));
        thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match TcpStream::connect_timeout(&flip_vip, Duration::from_millis(500)) {
                    Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(_) => bad.fetch_add(1, Ordering::Relaxed),
                };
                for l in &listeners {
                    while l.accept().is_ok() {}
                }
            }
        })
    };

    let one = |i: u32, host_base: Ipv4Addr| {
        spec(
            format!("s{i}"),
            v4(SINGLE_VIPS, i, 80),
            vec![v4(host_base, i, 80)],
        )
    };
    let singles: Vec<ServiceSpec> = (0..hosts).map(|i| one(i, HOST_SETS[0])).collect();
    let singles_moved: Vec<ServiceSpec> = (0..hosts).map(|i| one(i, HOST_SETS[1])).collect();
    let per: u32 = arg("--per")
        .and_then(|p| p.parse().ok())
        .unwrap_or(1000)
        .clamp(1, hosts.max(1));
    let groups = hosts.div_ceil(per);
    let big = |g: u32, host_base: Ipv4Addr| {
        spec(
            format!("g{g}"),
            v4(GROUP_VIPS, g, 80),
            (0..per).map(|h| v4(host_base, g * per + h, 80)).collect(),
        )
    };
    let bigs: Vec<ServiceSpec> = (0..groups).map(|g| big(g, HOST_SETS[2])).collect();
    let bigs_moved: Vec<ServiceSpec> = (0..groups).map(|g| big(g, HOST_SETS[3])).collect();

    let mut flips = 0_u32;
    let mut flip = |dp: &mut Dataplane| {
        flips += 1;
        dp.publisher()
            .publish(if flips % 2 == 1 { &set_b } else { &set_a })
            .expect("flip");
    };
    let single = publish_all(&mut dp, &singles);
    flip(&mut dp);
    let single_update = publish_all(&mut dp, &singles_moved);
    flip(&mut dp);
    let big = publish_all(&mut dp, &bigs);
    flip(&mut dp);
    let big_update = publish_all(&mut dp, &bigs_moved);
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(500) {
        flip(&mut dp);
        thread::sleep(Duration::from_millis(2));
    }
    stop.store(true, Ordering::Relaxed);
    client.join().expect("client thread");
    std::fs::write(home.join("cgroup.procs"), std::process::id().to_string())
        .expect("leaving the cgroup");
    dp.shutdown();
    let (single_ms, single_update_ms, big_ms, big_update_ms) =
        (single.0, single_update.0, big.0, big_update.0);
    let (single_cpu, single_update_cpu, big_cpu, big_update_cpu) =
        (single.1, single_update.1, big.1, big_update.1);
    println!(
        "{{\"hosts\": {hosts}, \"per\": {per}, \"services_x1_ms\": {single_ms:.3}, \"services_x1_update_ms\": {single_update_ms:.3}, \
         \"hosts_x1000_ms\": {big_ms:.3}, \"hosts_x1000_update_ms\": {big_update_ms:.3}, \
         \"services_x1_cpu_ms\": {single_cpu:.3}, \"services_x1_update_cpu_ms\": {single_update_cpu:.3}, \
         \"hosts_x1000_cpu_ms\": {big_cpu:.3}, \"hosts_x1000_update_cpu_ms\": {big_update_cpu:.3}, \"flips\": {flips}, \
         \"flip_connects\": {}, \"flip_connect_failures\": {}}}",
        ok.load(Ordering::Relaxed),
        bad.load(Ordering::Relaxed)
    );
}
