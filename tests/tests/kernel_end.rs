//! Host ending in the kernel (root; Linux 6.5+ for `bpf_sock_destroy`, skipped with the
//! reason before): connect4/6 record the backend of each socket of a `SERVICE_F_END` service,
//! and `Dataplane::end_hosts` ends exactly the recorded TCP and connected UDP sockets of the
//! hosts named, in the network namespace of the thread that calls it. Sockets to other hosts,
//! of a service without the flag, and from outside the cgroup stay open.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    os::{fd::AsRawFd as _, unix::net::UnixStream},
    time::Duration,
};

use integration_tests::kernel::{
    BannerServers, InCgroup, InProcess, Netns, TestCgroup, errno_name, in_netns, require_root,
    skip_without_dataplane, spec,
};
use proxy_common::service::SERVICE_F_END;
use rstest::rstest;

/// Bound on every wait of the test.
const WAIT: Duration = Duration::from_secs(20);

struct Family {
    /// The service with the flag, the one without, and the UDP one (flagged).
    vips: [&'static str; 3],
    /// Extra `lo` addresses in the namespace (IPv6).
    cidrs: &'static [&'static str],
    a: &'static str,
    b: &'static str,
}

const V4: Family = Family {
    vips: ["127.77.13.1:80", "127.77.13.2:80", "127.77.13.3:53"],
    cidrs: &[],
    a: "127.0.0.131:8131",
    b: "127.0.0.132:8132",
};

const V6: Family = Family {
    vips: ["[fd77::13:1]:80", "[fd77::13:2]:80", "[fd77::13:3]:53"],
    cidrs: &["fd00::131/128", "fd00::132/128"],
    a: "[fd00::131]:8131",
    b: "[fd00::132]:8132",
};

/// Connects to `vip` until one TCP connection reached each host (bounded); by their banners.
fn tcp_to_each(vip: SocketAddr, a: &str, b: &str) -> (TcpStream, TcpStream) {
    let (mut to_a, mut to_b) = (None, None);
    for _ in 0..200 {
        let conn = TcpStream::connect(vip).expect("connect through the service");
        conn.set_read_timeout(Some(WAIT)).unwrap();
        let mut banner = String::new();
        BufReader::new(&conn)
            .read_line(&mut banner)
            .expect("banner");
        match banner.trim() {
            x if x == a && to_a.is_none() => to_a = Some(conn),
            x if x == b && to_b.is_none() => to_b = Some(conn),
            _ => {}
        }
        if let (Some(x), Some(y)) = (&to_a, &to_b) {
            return (x.try_clone().unwrap(), y.try_clone().unwrap());
        }
    }
    panic!("200 connects to {vip} did not reach both hosts");
}

/// Connected UDP sockets to `vip` until one reached each host (bounded).
fn udp_to_each(vip: SocketAddr, a: &str, b: &str) -> (UdpSocket, UdpSocket) {
    let (mut to_a, mut to_b) = (None, None);
    let any = if vip.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
    for _ in 0..200 {
        let socket = UdpSocket::bind(any).unwrap();
        socket.set_read_timeout(Some(WAIT)).unwrap();
        socket.connect(vip).expect("connect a UDP socket");
        socket.send(b"?").expect("send");
        let mut buf = [0u8; 64];
        let n = socket.recv(&mut buf).expect("answer");
        match String::from_utf8_lossy(&buf[..n]).trim() {
            x if x == a && to_a.is_none() => to_a = Some(socket),
            x if x == b && to_b.is_none() => to_b = Some(socket),
            _ => {}
        }
        if let (Some(x), Some(y)) = (&to_a, &to_b) {
            return (x.try_clone().unwrap(), y.try_clone().unwrap());
        }
    }
    panic!("200 UDP sockets to {vip} did not reach both hosts");
}

/// The next read, without waiting: "open" when nothing is there, else the error (or "eof").
fn next_read(read: impl FnOnce(&mut [u8]) -> std::io::Result<usize>) -> String {
    match read(&mut [0u8; 64]) {
        Ok(0) => "eof".to_owned(),
        Ok(_) => "data".to_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => "open".to_owned(),
        Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => "ECONNABORTED".to_owned(),
        Err(e) => errno_name(&e),
    }
}

fn tcp_state(conn: &TcpStream) -> String {
    conn.set_nonblocking(true).unwrap();
    next_read(|buf| (&*conn).read(buf))
}

fn udp_state(socket: &UdpSocket) -> String {
    socket.set_nonblocking(true).unwrap();
    next_read(|buf| socket.recv(buf))
}

#[rstest]
#[case::ipv4(V4)]
#[case::ipv6(V6)]
fn ending_a_host_ends_only_its_recorded_sockets(#[case] fam: Family) {
    require_root();
    if skip_without_dataplane("ending_a_host_ends_only_its_recorded_sockets") {
        return;
    }
    let netns = Netns::new();
    let cgroup = TestCgroup::new();
    for cidr in fam.cidrs {
        netns.add_lo_addr(cidr);
    }
    let (a, b): (SocketAddr, SocketAddr) = (fam.a.parse().unwrap(), fam.b.parse().unwrap());
    let _servers = BannerServers::start_holding(
        &netns,
        &[
            (a, fam.a, false),
            (b, fam.b, false),
            (a, fam.a, true),
            (b, fam.b, true),
        ],
    );
    let mut dp = InProcess::open(&cgroup);
    if let Some(why) = dp.host_ending_unavailable() {
        eprintln!("SKIP ending_a_host_ends_only_its_recorded_sockets: {why}");
        return;
    }
    let vips: Vec<SocketAddr> = fam.vips.iter().map(|v| v.parse().unwrap()).collect();
    let mut keys = Vec::new();
    for (name, vip, udp, flags) in [
        ("on", vips[0], false, SERVICE_F_END),
        ("off", vips[1], false, 0),
        ("udp", vips[2], true, SERVICE_F_END),
    ] {
        let spec = spec(name, vip, udp, flags, &[a, b]);
        dp.publisher().publish(&spec).expect("publishing");
        keys.push(spec.key);
    }
    // From outside the cgroup, straight to B.
    let outside = in_netns(&netns, move || TcpStream::connect(b))
        .join()
        .unwrap()
        .expect("connect to B from outside the cgroup");
    outside.set_read_timeout(Some(WAIT)).unwrap();
    let mut banner = String::new();
    BufReader::new(&outside)
        .read_line(&mut banner)
        .expect("B's banner, outside the cgroup");

    let (mut ours, theirs) = UnixStream::pair().unwrap();
    let keep = theirs.as_raw_fd();
    let (name_a, name_b) = (fam.a, fam.b);
    let child = InCgroup::spawn_keeping(Some(cgroup.path()), &netns, keep, move || {
        let mut sync = theirs;
        let (on_a, on_b) = tcp_to_each(vips[0], name_a, name_b);
        let (off_a, off_b) = tcp_to_each(vips[1], name_a, name_b);
        let (udp_a, udp_b) = udp_to_each(vips[2], name_a, name_b);
        sync.write_all(b"r").expect("ready");
        let mut go = [0u8];
        sync.read_exact(&mut go).expect("go");
        [
            tcp_state(&on_b),
            tcp_state(&on_a),
            tcp_state(&off_b),
            tcp_state(&off_a),
            udp_state(&udp_b),
            udp_state(&udp_a),
        ]
        .join(" ")
    });
    ours.set_read_timeout(Some(WAIT)).unwrap();
    ours.read_exact(&mut [0u8])
        .expect("the client's sockets are up");
    // The iterators see the sockets of the namespace of the thread that runs them.
    let path = netns.path();
    // B through each flagged service in turn: a call ends only its own service's sockets.
    let ended = std::thread::scope(|s| {
        s.spawn(|| {
            proxy::enter_netns(&path).expect("entering the test namespace");
            [keys[0], keys[2]].map(|service| {
                dp.end_hosts(service, &[proxy::dataplane::backend_of(b)])
                    .expect("ending B")
            })
        })
        .join()
        .unwrap()
    });
    ours.write_all(b"g").unwrap();
    let report = child.wait(WAIT);
    assert_eq!(
        report, "ECONNABORTED open open open ECONNABORTED open",
        "TCP on->B, on->A, off->B, off->A; UDP ->B, ->A"
    );
    assert_eq!(
        ended,
        [1, 1],
        "B's TCP socket through the flagged TCP service, then its UDP socket through the UDP one"
    );
    assert_eq!(tcp_state(&outside), "open", "outside the cgroup");
}
