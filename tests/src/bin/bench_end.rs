//! `cargo xtask bench` helper (root, Linux 6.5+ for `bpf_sock_destroy`): the cost of ending
//! kernel-path sockets when their host leaves, with the daemon's own reaper
//! (`proxy::dataplane::Dataplane::end_hosts`, in-process). In a network namespace of its own, a
//! child in a test cgroup holds `--sockets` N TCP connections through a `SERVICE_F_END` service
//! to host A and N through another flagged service to host B; the reaper then ends A. The child
//! watches its sockets with poll(2) from before the call, so the last one it sees ended is the
//! application's view, not the reaper's count.
//!
//! Prints one JSON object: `sockets` (N), `ended` (the reaper's count), `end_ms` (the call),
//! `sockets_per_s` (ended / call), `last_ended_ms` (from the call to the child seeing its last
//! socket to A ended), `walked` (sockets in the namespace the iterator visited at least),
//! `kept_open` (sockets to B still open afterwards: must be N). Exits with status 3 and the
//! reason on stderr when the kernel cannot end sockets. In the daemon a removed host is
//! ended after `proxy.drain_timeout`, a failed or ejected one at once; add the publish time
//! (the publish row) for the daemon's whole reaction. Usage: `bench_end --sockets 5000`.
#![allow(unsafe_code, reason = "poll(2), clock_gettime(2) and setrlimit(2)")]

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    os::{
        fd::{AsRawFd, RawFd},
        unix::net::UnixStream,
    },
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use integration_tests::kernel::{InCgroup, InProcess, Netns, TestCgroup, spec};
use proxy_common::service::SERVICE_F_END;

/// Bound on every wait.
const WAIT: Duration = Duration::from_secs(60);
const A: &str = "127.0.0.141:8141";
const B: &str = "127.0.0.142:8142";
const VIP_A: &str = "127.77.14.1:80";
const VIP_B: &str = "127.77.14.2:80";

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for this process and its child.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec that outlives the call; the clock id is a constant.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// Raises the soft open-file limit to `want`, or exits naming the hard limit that is lower.
fn raise_nofile(want: u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid rlimit for the calls' duration.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) };
    assert_eq!(rc, 0, "getrlimit: {}", std::io::Error::last_os_error());
    if want > limit.rlim_max {
        eprintln!(
            "bench_end: {want} descriptors per process needed, the hard limit is {}; ask for fewer --sockets",
            limit.rlim_max
        );
        std::process::exit(2);
    }
    limit.rlim_cur = want;
    // SAFETY: as above.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const limit) };
    assert_eq!(rc, 0, "setrlimit: {}", std::io::Error::last_os_error());
}

/// A listener in the namespace that accepts and holds every connection until `stop`.
fn hold(netns: &Netns, addr: SocketAddr, stop: &Arc<AtomicBool>) -> thread::JoinHandle<usize> {
    let (path, stop) = (netns.path(), Arc::clone(stop));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let t = thread::spawn(move || {
        proxy::enter_netns(&path).expect("entering the namespace");
        let listener = TcpListener::bind(addr).expect("binding a holding server");
        listener.set_nonblocking(true).expect("nonblocking");
        ready_tx.send(()).expect("alive");
        let mut held = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((conn, _)) => held.push(conn),
                Err(_) => thread::sleep(Duration::from_millis(1)),
            }
        }
        held.len()
    });
    ready_rx.recv_timeout(WAIT).expect("holding server started");
    t
}

/// In the child: waits (bounded) until every socket of `fds` reports an error or hang-up;
/// the monotonic time of the last one, or an error naming how many stayed open.
fn watch_ended(fds: &[RawFd]) -> Result<u64, String> {
    let mut polls: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        })
        .collect();
    let (mut last, deadline) = (0, monotonic_ns() + WAIT.as_nanos() as u64);
    while !polls.is_empty() {
        if monotonic_ns() > deadline {
            return Err(format!("{} sockets to A stayed open", polls.len()));
        }
        // SAFETY: `polls` is a valid array of pollfd of that length.
        let n = unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, 100) };
        if n > 0 {
            last = monotonic_ns();
            polls.retain(|p| p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLRDHUP) == 0);
        }
    }
    Ok(last)
}

/// Sockets of `conns` that are still open: a read would block.
fn still_open(conns: &[TcpStream]) -> usize {
    conns
        .iter()
        .filter(|c| {
            c.set_nonblocking(true).expect("nonblocking");
            matches!((&**c).read(&mut [0u8; 8]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
        })
        .count()
}

fn main() {
    let sockets: usize = arg("--sockets")
        .and_then(|n| n.parse().ok())
        .unwrap_or(5_000);
    // Each process holds one end of the 2N connections.
    raise_nofile(2 * sockets as u64 + 1024);
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let (a, b): (SocketAddr, SocketAddr) = (A.parse().unwrap(), B.parse().unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let servers = [hold(&netns, a, &stop), hold(&netns, b, &stop)];
    let mut dp = InProcess::open_with(&cgroup, false);
    if let Some(why) = dp.host_ending_unavailable() {
        // The harness reads this status as "not measured here", with this line as the reason.
        eprintln!("host ending is unavailable on this kernel: {why}");
        std::process::exit(3);
    }
    let mut keys = Vec::new();
    for (name, vip, host) in [("end-a", VIP_A, a), ("end-b", VIP_B, b)] {
        let spec = spec(name, vip.parse().unwrap(), false, SERVICE_F_END, &[host]);
        dp.publisher().publish(&spec).expect("publishing");
        keys.push(spec.key);
    }

    let (mut ours, theirs) = UnixStream::pair().expect("socket pair");
    let keep = theirs.as_raw_fd();
    let child = InCgroup::spawn_keeping(Some(cgroup.path()), &netns, keep, move || {
        let mut sync = theirs;
        let connect = |vip: &str| -> Vec<TcpStream> {
            (0..sockets)
                .map(|_| TcpStream::connect(vip).expect("connect through the service"))
                .collect()
        };
        let (to_a, to_b) = (connect(VIP_A), connect(VIP_B));
        let fds: Vec<RawFd> = to_a.iter().map(AsRawFd::as_raw_fd).collect();
        sync.write_all(b"r").expect("ready");
        let last = watch_ended(&fds);
        let open_b = still_open(&to_b);
        match last {
            Ok(ns) => format!("{ns} {open_b}"),
            Err(e) => format!("ERR {e}"),
        }
    });
    ours.set_read_timeout(Some(WAIT)).expect("timeout");
    ours.read_exact(&mut [0u8])
        .expect("the child's sockets are up");
    // The iterators walk the namespace of the thread that runs them.
    let path = netns.path();
    let (start, ended, end_ns) = thread::scope(|s| {
        s.spawn(|| {
            proxy::enter_netns(&path).expect("entering the namespace");
            let start = monotonic_ns();
            let ended = dp.end_hosts(keys[0], &[proxy::dataplane::backend_of(a)]);
            (start, ended, monotonic_ns() - start)
        })
        .join()
        .expect("reaper thread")
    });
    let ended = ended.expect("ending A");
    let report = child.wait(WAIT);
    stop.store(true, Ordering::Relaxed);
    let held: usize = servers.into_iter().map(|t| t.join().unwrap_or(0)).sum();
    drop(dp);
    let (last_ns, kept_open) = match report.split_once(' ') {
        Some((l, k)) if l != "ERR" => (
            l.parse::<u64>().expect("child's time"),
            k.parse::<usize>().expect("child's count"),
        ),
        _ => panic!("the child: {report}"),
    };
    // Both ends of every connection, plus the listeners.
    let walked = 2 * held + 2;
    println!(
        "{{\"sockets\": {sockets}, \"ended\": {ended}, \"end_ms\": {:.3}, \"sockets_per_s\": {:.0}, \
         \"last_ended_ms\": {:.3}, \"walked\": {walked}, \"kept_open\": {kept_open}}}",
        end_ns as f64 / 1e6,
        ended as f64 / (end_ns as f64 / 1e9),
        last_ns.saturating_sub(start) as f64 / 1e6
    );
    // A count that is off is a fault of the reaper, not a figure.
    if ended != sockets as u64 || kept_open != sockets {
        eprintln!(
            "wrong sockets ended: {ended} ended of {sockets} to A, {kept_open} of {sockets} to B still open"
        );
        std::process::exit(1);
    }
}
