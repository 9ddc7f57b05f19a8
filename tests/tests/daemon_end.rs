//! Host ending through the real daemon (root, kernel 6.5+ for `bpf_sock_destroy`): a client in
//! the cgroup holds connections through two services to hosts A and B; B fails its health
//! check. The service whose cluster sets `close_connections_on_host_health_failure` has its
//! connection to B ended (the client's next read or write fails with `ECONNABORTED`) and
//! reconnects land on A; its connection to A, the other service's connection to B (option
//! off) and a connection from outside the cgroup straight to B stay open, and so does the
//! connection to B through a third service, whose cluster (option on) checks B on another port
//! and still finds it healthy: a cluster ends only its own connections, as Envoy's do. Connected
//! UDP sockets likewise. A host that DNS discovery removes is ended only after `proxy.drain_timeout`.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::{fd::AsRawFd as _, unix::net::UnixStream},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use integration_tests::{
    kernel::{
        Daemon, InCgroup, Netns, PinDir, TestCgroup, errno_name, in_netns, require_root,
        skip_without_dataplane, unique,
    },
    unbound::Unbound,
};

const VIP_ON: &str = "127.77.12.1:80";
const VIP_OFF: &str = "127.77.12.2:80";
const UDP_VIP: &str = "127.77.12.3:53";
/// The service whose cluster checks the hosts on their health port + [`OWN_CHECK`].
const VIP_OWN: &str = "127.77.12.5:80";
const OWN_CHECK: u16 = 100;
/// Hosts: (traffic address, health-check port).
const A: (&str, u16) = ("127.0.0.121:8121", 9121);
const B: (&str, u16) = ("127.0.0.122:8122", 9122);
/// Bound on every wait of the test.
const WAIT: Duration = Duration::from_secs(20);

/// Whether the kernel's BTF names `bpf_sock_destroy` (Linux 6.5; printed skip otherwise).
fn skip_without_sock_destroy(test: &str) -> bool {
    let btf = std::fs::read("/sys/kernel/btf/vmlinux").unwrap_or_default();
    let have = |name: &[u8]| btf.windows(name.len()).any(|w| w == name);
    if have(b"\0bpf_sock_destroy\0") && have(b"\0bpf_iter_udp\0") {
        return false;
    }
    eprintln!("SKIP {test}: the kernel has no bpf_sock_destroy or bpf_iter_udp (Linux 6.5)");
    true
}

/// Echo servers (TCP and UDP) that first send their one-byte name, and health listeners that
/// accept and drop, each stoppable; every thread ends when the test drops them.
struct Servers {
    stop: Vec<(Arc<AtomicBool>, JoinHandle<()>)>,
}

impl Servers {
    fn start(netns: &Netns, name: u8, addr: SocketAddr, health: SocketAddr) -> Self {
        let mut stop = Vec::new();
        for kind in 0..3 {
            let flag = Arc::new(AtomicBool::new(false));
            let f = flag.clone();
            let thread = in_netns(netns, move || match kind {
                0 => echo_tcp(name, addr, &f),
                1 => echo_udp(name, addr, &f),
                _ => accept_and_drop(health, &f),
            });
            stop.push((flag, thread));
        }
        wait_listening(netns, health);
        Self { stop }
    }

    /// One more health listener, on `health`, up until the servers are dropped.
    fn also_health(&mut self, netns: &Netns, health: SocketAddr) {
        let flag = Arc::new(AtomicBool::new(false));
        let f = flag.clone();
        let thread = in_netns(netns, move || accept_and_drop(health, &f));
        self.stop.push((flag, thread));
        wait_listening(netns, health);
    }

    /// Closes the first health listener: the host fails its next check there.
    fn fail_health(&mut self) {
        let (flag, thread) = self.stop.remove(2);
        flag.store(true, Ordering::Relaxed);
        thread.join().expect("health listener thread");
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        for (flag, thread) in self.stop.drain(..) {
            flag.store(true, Ordering::Relaxed);
            let _ = thread.join();
        }
    }
}

/// Binding happens on the server's thread: waits until `health` takes connections (bounded).
fn wait_listening(netns: &Netns, health: SocketAddr) {
    let deadline = Instant::now() + WAIT;
    while in_netns(netns, move || TcpStream::connect(health).is_err())
        .join()
        .unwrap()
    {
        assert!(
            Instant::now() < deadline,
            "health listener {health} never came up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn echo_tcp(name: u8, addr: SocketAddr, stop: &AtomicBool) {
    let listener = TcpListener::bind(addr).expect("binding a TCP echo server");
    listener.set_nonblocking(true).unwrap();
    while !stop.load(Ordering::Relaxed) {
        let Ok((mut conn, _)) = listener.accept() else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        std::thread::spawn(move || {
            conn.set_nonblocking(false).unwrap();
            conn.set_read_timeout(Some(WAIT * 2)).unwrap();
            if conn.write_all(&[name]).is_err() {
                return;
            }
            let mut buf = [0u8; 64];
            while let Ok(n @ 1..) = conn.read(&mut buf) {
                if conn.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
        });
    }
}

/// Answers each datagram with the server's name.
fn echo_udp(name: u8, addr: SocketAddr, stop: &AtomicBool) {
    let socket = UdpSocket::bind(addr).expect("binding a UDP echo server");
    socket
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let mut buf = [0u8; 64];
    while !stop.load(Ordering::Relaxed) {
        if let Ok((_, from)) = socket.recv_from(&mut buf) {
            let _ = socket.send_to(&[name], from);
        }
    }
}

fn accept_and_drop(addr: SocketAddr, stop: &AtomicBool) {
    let listener = TcpListener::bind(addr).expect("binding a health listener");
    listener.set_nonblocking(true).unwrap();
    while !stop.load(Ordering::Relaxed) {
        if listener.accept().is_err() {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A cluster of A and B that checks them on their health port + `check_offset`.
fn cluster(name: &str, close: bool, check_offset: u16) -> String {
    let endpoint = |(addr, health): (&str, u16)| {
        let health = health + check_offset;
        let addr: SocketAddr = addr.parse().unwrap();
        format!(
            "            - endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }}, health_check_config: {{ port_value: {health} }} }}\n",
            addr.ip(),
            addr.port(),
        )
    };
    format!(
        "  - name: {name}\n    close_connections_on_host_health_failure: {close}\n    health_checks:\n      - {{ timeout: 0.5s, interval: 0.2s, no_traffic_interval: 0.2s, unhealthy_threshold: 1, healthy_threshold: 1, tcp_health_check: {{}} }}\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n{}{}",
        endpoint(A),
        endpoint(B)
    )
}

/// Connects to `vip` until one connection reached each of A and B (bounded).
fn one_to_each(vip: SocketAddr) -> (TcpStream, TcpStream) {
    let (mut a, mut b) = (None, None);
    for _ in 0..200 {
        let mut conn = TcpStream::connect(vip).expect("connect through the service");
        conn.set_read_timeout(Some(WAIT)).unwrap();
        let mut name = [0u8];
        conn.read_exact(&mut name).expect("the host's name");
        match name[0] {
            b'A' if a.is_none() => a = Some(conn),
            b'B' if b.is_none() => b = Some(conn),
            _ => {}
        }
        if let (Some(a), Some(b)) = (&a, &b) {
            return (a.try_clone().unwrap(), b.try_clone().unwrap());
        }
    }
    panic!("200 connects to {vip} did not reach both hosts");
}

/// One echo round trip, or the errno of the first call that failed.
fn echo(conn: &mut TcpStream) -> Result<(), String> {
    conn.write_all(b"x").map_err(|e| errno(&e))?;
    let mut byte = [0u8];
    conn.read_exact(&mut byte).map_err(|e| errno(&e))
}

fn errno(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ECONNABORTED) => "ECONNABORTED".to_owned(),
        _ => errno_name(e),
    }
}

/// Connected UDP sockets to `vip` until one reached each host (bounded), by their answers.
fn udp_one_to_each(vip: SocketAddr) -> (UdpSocket, UdpSocket) {
    let (mut a, mut b) = (None, None);
    for _ in 0..200 {
        let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
        socket.set_read_timeout(Some(WAIT)).unwrap();
        socket
            .connect(vip)
            .expect("connect a UDP socket through the service");
        match udp_ask(&socket).as_deref() {
            Ok("A") if a.is_none() => a = Some(socket),
            Ok("B") if b.is_none() => b = Some(socket),
            _ => {}
        }
        if let (Some(a), Some(b)) = (&a, &b) {
            return (a.try_clone().unwrap(), b.try_clone().unwrap());
        }
    }
    panic!("200 UDP sockets to {vip} did not reach both hosts");
}

/// Sends one datagram and reads the answer: the host's name, or the errno.
fn udp_ask(socket: &UdpSocket) -> Result<String, String> {
    socket.send(b"?").map_err(|e| errno(&e))?;
    let mut name = [0u8; 8];
    let n = socket.recv(&mut name).map_err(|e| errno(&e))?;
    Ok(String::from_utf8_lossy(&name[..n]).into_owned())
}

/// The child: connections through both services and a UDP socket to each host, then "ready"
/// on `ready`; then, once B's connection through `VIP_ON` fails, what every other connection
/// and ten reconnects see.
fn client(ready: &mut UnixStream) -> String {
    let (vip_on, vip_off) = (VIP_ON.parse().unwrap(), VIP_OFF.parse().unwrap());
    let (mut on_a, mut on_b) = one_to_each(vip_on);
    let (mut off_a, mut off_b) = one_to_each(vip_off);
    let (_, mut own_b) = one_to_each(VIP_OWN.parse().unwrap());
    let (udp_a, udp_b) = udp_one_to_each(UDP_VIP.parse().unwrap());
    ready.write_all(b"r").expect("telling the test");
    let deadline = Instant::now() + WAIT;
    let ended = loop {
        if let Err(errno) = echo(&mut on_b) {
            break errno;
        }
        if Instant::now() > deadline {
            return "B's connection was never ended".to_owned();
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // The next read: nothing is queued (every answer was read), so until the socket is ended
    // a non-blocking read finds nothing.
    udp_b.set_nonblocking(true).unwrap();
    let udp_ended = loop {
        match udp_b.recv(&mut [0u8; 8]) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    break "never ended".to_owned();
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => break errno(&e),
            Ok(_) => {}
        }
    };
    let mut reconnects = String::new();
    for _ in 0..10 {
        let mut conn = TcpStream::connect(vip_on).expect("reconnect");
        let mut name = [0u8];
        conn.read_exact(&mut name).expect("the host's name");
        reconnects.push(char::from(name[0]));
    }
    let kept = |r: Result<(), String>| r.map_or_else(|e| e, |()| "open".to_owned());
    format!(
        "{ended} {} {} {} {} {udp_ended} {} {reconnects}",
        kept(echo(&mut on_a)),
        kept(echo(&mut off_a)),
        kept(echo(&mut off_b)),
        kept(echo(&mut own_b)),
        udp_ask(&udp_a).unwrap_or_else(|e| e),
    )
}

#[test]
fn a_failed_hosts_kernel_path_connections_are_ended_and_no_others() {
    require_root();
    if skip_without_dataplane("daemon_end") || skip_without_sock_destroy("daemon_end") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let start = |name: u8, (addr, port): (&str, u16)| {
        let addr: SocketAddr = addr.parse().unwrap();
        Servers::start(&netns, name, addr, SocketAddr::new(addr.ip(), port))
    };
    let mut a = start(b'A', A);
    let mut b = start(b'B', B);
    for (servers, (addr, port)) in [(&mut a, A), (&mut b, B)] {
        let ip = addr.parse::<SocketAddr>().unwrap().ip();
        servers.also_health(&netns, SocketAddr::new(ip, port + OWN_CHECK));
    }
    let instance = unique("end");
    let _pins = PinDir(PathBuf::from("/sys/fs/bpf").join(&instance));
    let service = |name: &str, vip: &str, cluster: &str, proto: &str| {
        let vip: SocketAddr = vip.parse().unwrap();
        format!(
            "  - {{ name: {name}, address: \"{}\", port: {}, cluster: {cluster}, protocol: {proto} }}\n",
            vip.ip(),
            vip.port()
        )
    };
    let config = format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n{}{}{}{}services:\n{}{}{}{}",
        cgroup.path().display(),
        cluster("on", true, 0),
        cluster("off", false, 0),
        cluster("udp", true, 0),
        cluster("own", true, OWN_CHECK),
        service("on", VIP_ON, "on", "TCP"),
        service("off", VIP_OFF, "off", "TCP"),
        service("udp", UDP_VIP, "udp", "UDP"),
        service("own", VIP_OWN, "own", "TCP"),
    );
    let daemon = Daemon::start_in(&netns, &config);
    // From outside the cgroup, straight to B: never recorded, never ended.
    let b_addr: SocketAddr = B.0.parse().unwrap();
    let mut outside = in_netns(&netns, move || TcpStream::connect(b_addr))
        .join()
        .unwrap()
        .expect("connect to B from outside the cgroup");
    outside.set_read_timeout(Some(WAIT)).unwrap();
    let mut name = [0u8];
    outside.read_exact(&mut name).unwrap();

    let (mut ours, theirs) = UnixStream::pair().unwrap();
    let keep = theirs.as_raw_fd();
    let child = InCgroup::spawn_keeping(Some(cgroup.path()), &netns, keep, move || {
        let mut ready = theirs;
        client(&mut ready)
    });
    ours.set_read_timeout(Some(WAIT * 2)).unwrap();
    let mut byte = [0u8];
    if let Err(err) = ours.read_exact(&mut byte) {
        panic!(
            "the client's connections never came up ({err}): {:?}; the daemon's log:\n{}",
            child.result(WAIT),
            daemon.log_text()
        );
    }
    b.fail_health();
    let report = child.wait(WAIT * 3);
    println!("client: {report}");
    assert_eq!(
        report,
        "ECONNABORTED open open open open ECONNABORTED A AAAAAAAAAA",
        "B's connection through the service with the option (then A's, the other service's to A and to B, the third service's to B, the UDP socket to B, to A, and ten reconnects); the daemon's log:\n{}",
        daemon.log_text()
    );
    assert_eq!(echo(&mut outside), Ok(()), "outside the cgroup: open");
    // The log file is read while the daemon writes it: wait for the line (bounded) rather than
    // read once (a read can land mid-write and find nothing usable).
    assert!(
        daemon.wait_log("ended kernel-path sockets", WAIT),
        "{}",
        daemon.log_text()
    );
}

/// The DNS name of the removal test's hosts, and the hosts (one port for both).
const NAME: &str = "web.svc.test.";
const DNS_A: &str = "127.0.0.123:8123";
const DNS_B: &str = "127.0.0.124:8123";
const DNS_VIP: &str = "127.77.12.4:80";
/// Long enough that the check right after the removal is far from it.
const DRAIN: Duration = Duration::from_secs(3);

/// STRICT_DNS removes B: B's connection through the service stays open until the drain
/// deadline, then is ended; the connection to A stays open.
#[test]
fn a_removed_hosts_connections_are_ended_after_the_drain_deadline() {
    require_root();
    let test = "a_removed_hosts_connections_are_ended_after_the_drain_deadline";
    if skip_without_dataplane(test) || skip_without_sock_destroy(test) {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    let (a, b): (SocketAddr, SocketAddr) = (DNS_A.parse().unwrap(), DNS_B.parse().unwrap());
    // Health listeners nobody checks (no health_checks): the same fixture.
    let _a = Servers::start(&netns, b'A', a, SocketAddr::new(a.ip(), 9123));
    let _b = Servers::start(&netns, b'B', b, SocketAddr::new(b.ip(), 9124));
    let record = |addr: SocketAddr| format!("{NAME} 5 IN A {}", addr.ip());
    let dns = Unbound::start_in(&netns.path(), &[record(a).as_str(), record(b).as_str()]);
    let instance = unique("endd");
    let _pins = PinDir(PathBuf::from("/sys/fs/bpf").join(&instance));
    let vip: SocketAddr = DNS_VIP.parse().unwrap();
    let config = format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nproxy: {{ drain_timeout: {}s }}\nclusters:\n  - name: web\n    type: STRICT_DNS\n    dns_refresh_rate: 0.2s\n    dns_lookup_family: V4_ONLY\n    dns_resolvers: [\"{}\"]\n    close_connections_on_host_health_failure: true\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: web.svc.test, port_value: {} }} }} }}\nservices:\n  - {{ name: web, address: \"{}\", port: {}, cluster: web }}\n",
        cgroup.path().display(),
        DRAIN.as_secs(),
        dns.addr(),
        a.port(),
        vip.ip(),
        vip.port(),
    );
    let daemon = Daemon::start_in(&netns, &config);
    let (mut ours, theirs) = UnixStream::pair().unwrap();
    let keep = theirs.as_raw_fd();
    let child = InCgroup::spawn_keeping(Some(cgroup.path()), &netns, keep, move || {
        let mut sync = theirs;
        let (mut to_a, mut to_b) = one_to_each(vip);
        sync.write_all(b"r").expect("ready");
        sync.read_exact(&mut [0u8]).expect("B removed");
        let right_after = echo(&mut to_b).map_or_else(|e| e, |()| "open".to_owned());
        let deadline = Instant::now() + WAIT;
        let ended = loop {
            if let Err(errno) = echo(&mut to_b) {
                break errno;
            }
            if Instant::now() > deadline {
                break "never ended".to_owned();
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let a_state = echo(&mut to_a).map_or_else(|e| e, |()| "open".to_owned());
        format!("{right_after} {ended} {a_state}")
    });
    ours.set_read_timeout(Some(WAIT * 2)).unwrap();
    ours.read_exact(&mut [0u8])
        .expect("the client's connections are up");
    dns.replace(NAME, &[record(a).as_str()]);
    let gone = format!("web::{b}::");
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, body) = daemon.get("/clusters").expect("admin /clusters");
        if !body.contains(&gone) {
            break;
        }
        assert!(Instant::now() < deadline, "B never left /clusters:\n{body}");
        std::thread::sleep(Duration::from_millis(50));
    }
    ours.write_all(b"g").unwrap();
    let report = child.wait(WAIT * 3);
    assert_eq!(
        report, "open ECONNABORTED open",
        "B right after its removal, B later, A"
    );
    assert!(
        daemon.wait_log("removed, drain deadline passed", WAIT),
        "{}",
        daemon.log_text()
    );
}
