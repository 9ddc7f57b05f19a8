//! Root: the proxy path behind an iptables-style `REDIRECT` (an nft `redirect` rule, which is
//! what `iptables -t nat -j REDIRECT` becomes on an nft-backed iptables). The proxy finds the
//! original destination with `SO_ORIGINAL_DST` (IPv4) or `IP6T_SO_ORIGINAL_DST` (IPv6) when
//! `iptables_redirect` is on, forwards to it with the payload intact; with it off the same
//! connection is refused and counted `downstream_cx_no_original_dst`.
//!
//! Each case runs in a fresh network namespace: the backend, the in-process proxy and the client
//! all live there, and so does the nft table (type nat, so conntrack runs only in that
//! namespace). The table is deleted explicitly on drop, then the namespace, also when the test
//! fails. The rule matches the client's own source address only, so the proxy's upstream
//! connection to the same destination is not redirected again.

use std::{
    net::SocketAddr,
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use integration_tests::kernel::{Netns, digest, in_netns, pattern, require_root};
use proxy_relay::{
    NoOriginalDst, OriginalDst, OriginalDstTable, ProxyConfig, ProxyDeps, Service, ServiceTable,
    serve,
};
use rstest::rstest;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpSocket},
};

/// The nft table each case creates in its namespace.
const TABLE: &str = "proxy_redirect_test";
/// Upper bound for any single wait.
const WAIT: Duration = Duration::from_secs(10);
/// Bytes the client sends through the proxy (and gets echoed back).
const PAYLOAD: usize = 256 * 1024;

/// The addresses of one address family inside the test namespace.
struct Family {
    /// `ip` or `ip6` (the nft payload expression).
    nft: &'static str,
    /// Addresses to add to the namespace's `lo` first.
    lo_addrs: &'static [&'static str],
    /// The destination the client dials, where the backend listens.
    dst: &'static str,
    /// The client's source address: the only one the rule redirects.
    client: &'static str,
    /// The proxy listener: the family's loopback, where `redirect` sends local connections.
    listener: &'static str,
}

const V4: Family = Family {
    nft: "ip",
    lo_addrs: &[],
    dst: "127.0.0.55:9000",
    client: "127.0.0.66",
    listener: "127.0.0.1:15001",
};

const V6: Family = Family {
    nft: "ip6",
    lo_addrs: &["fd00::55/128", "fd00::66/128"],
    dst: "[fd00::55]:9000",
    client: "fd00::66",
    listener: "[::1]:15001",
};

/// An nft table in a namespace, deleted on drop.
struct NftTable {
    netns: String,
}

impl NftTable {
    /// `table inet TABLE { chain out { type nat hook output ...; <rule> } }` in `netns`.
    fn load(netns: &Netns, rule: &str) -> Self {
        let text = format!(
            "table inet {TABLE} {{\n chain out {{\n  type nat hook output priority -100; policy accept;\n  {rule}\n }}\n}}\n"
        );
        let table = Self {
            netns: netns.name().to_owned(),
        };
        let out = Command::new("ip")
            .args(["netns", "exec", netns.name(), "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write as _;
                child
                    .stdin
                    .take()
                    .expect("nft stdin")
                    .write_all(text.as_bytes())?;
                child.wait_with_output()
            })
            .expect("running nft (is nftables installed?)");
        assert!(
            out.status.success(),
            "nft could not load {text}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        table
    }
}

impl Drop for NftTable {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "exec", &self.netns])
            .args(["nft", "delete", "table", "inet", TABLE])
            .stderr(Stdio::null())
            .status();
    }
}

/// What one case observed.
#[derive(Debug)]
struct Seen {
    /// The first line the client got: the address the backend's socket was accepted on.
    banner: String,
    /// Whether the echoed bytes equal the sent ones.
    intact: bool,
    /// Connections the backend accepted.
    accepted: u32,
    /// The proxy's stats.
    stats: Vec<(String, u64)>,
}

impl Seen {
    fn stat(&self, name: &str) -> u64 {
        self.stats
            .iter()
            .find(|(k, _)| k == name)
            .unwrap_or_else(|| panic!("no stat {name}: {:?}", self.stats))
            .1
    }
}

#[rstest]
fn redirected_connections_use_so_original_dst(
    #[values(V4, V6)] family: Family,
    #[values(true, false)] iptables_redirect: bool,
) {
    require_root();
    let netns = family_netns(&family);
    let dst: SocketAddr = family.dst.parse().unwrap();
    let listener: SocketAddr = family.listener.parse().unwrap();
    let rule = format!(
        "{nft} saddr {client} {nft} daddr {ip} tcp dport {port} redirect to :{lport}",
        nft = family.nft,
        client = family.client,
        ip = dst.ip(),
        port = dst.port(),
        lport = listener.port(),
    );
    let _table = NftTable::load(&netns, &rule);
    let client: SocketAddr = SocketAddr::new(family.client.parse().unwrap(), 0);
    let seen = block_on_in(&netns, move || {
        run_case(
            dst,
            dst,
            listener,
            client,
            iptables_redirect,
            Arc::new(NoOriginalDst),
        )
    });
    if iptables_redirect {
        assert_eq!(
            seen.banner,
            dst.to_string(),
            "reached the original destination: {seen:?}"
        );
        assert!(seen.intact, "payload intact: {seen:?}");
        assert_eq!(seen.accepted, 1, "{seen:?}");
        assert_eq!(seen.stat("downstream_cx_no_original_dst"), 0);
        assert_eq!(seen.stat("downstream_cx_total"), 1);
    } else {
        assert_eq!(seen.banner, "", "refused: {seen:?}");
        assert_eq!(seen.accepted, 0, "nothing reached the backend: {seen:?}");
        assert_eq!(seen.stat("downstream_cx_no_original_dst"), 1);
    }
}

/// With `iptables_redirect` on, NAT's answer is asked first. A connection that reached the
/// listener without NAT (as the kernel's connect hook sends it) is still followed by conntrack
/// while a nat table is loaded, and `SO_ORIGINAL_DST` then names the listener itself: the proxy
/// must go on to its other source (the kernel's map, here a table) rather than refuse it.
#[rstest]
fn unredirected_connections_fall_through_to_the_kernel_map(#[values(V4, V6)] family: Family) {
    require_root();
    let netns = family_netns(&family);
    let dst: SocketAddr = family.dst.parse().unwrap();
    let listener: SocketAddr = family.listener.parse().unwrap();
    // The rule matches nobody here; the table only makes conntrack follow every connection.
    let rule = format!(
        "{nft} saddr {client} tcp dport 1 redirect to :{lport}",
        nft = family.nft,
        client = family.client,
        lport = listener.port(),
    );
    let _table = NftTable::load(&netns, &rule);
    // The client dials the listener directly, from a fixed port, so the table can know it.
    let client = SocketAddr::new(family.client.parse().unwrap(), 41_001);
    let table = OriginalDstTable::default();
    table.insert(client, listener, dst);
    let seen = block_on_in(&netns, move || {
        run_case(dst, listener, listener, client, true, Arc::new(table))
    });
    assert_eq!(
        seen.banner,
        dst.to_string(),
        "reached the table's destination: {seen:?}"
    );
    assert!(seen.intact, "payload intact: {seen:?}");
    assert_eq!(seen.accepted, 1, "{seen:?}");
    assert_eq!(seen.stat("downstream_cx_no_original_dst"), 0);
}

/// A fresh namespace with the family's extra loopback addresses.
fn family_netns(family: &Family) -> Netns {
    let netns = Netns::new();
    for cidr in family.lo_addrs {
        netns.add_lo_addr(cidr);
    }
    netns
}

/// Runs the case `make` builds on a current-thread runtime inside `netns`.
fn block_on_in<F: std::future::Future<Output = Seen>>(
    netns: &Netns,
    make: impl FnOnce() -> F + Send + 'static,
) -> Seen {
    in_netns(netns, move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(make())
    })
    .join()
    .expect("the case ran in the namespace")
}

/// Backend (at `dst`), proxy and client (dialling `dial`) inside the namespace; returns what the
/// client and the proxy saw.
async fn run_case(
    dst: SocketAddr,
    dial: SocketAddr,
    listener: SocketAddr,
    client: SocketAddr,
    iptables_redirect: bool,
    original_dst: Arc<dyn OriginalDst>,
) -> Seen {
    let backend = TcpListener::bind(dst).await.expect("backend binds");
    let accepted = Arc::new(AtomicU32::new(0));
    let count = accepted.clone();
    let backend_task = tokio::spawn(async move {
        while let Ok((mut s, _)) = backend.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let local = s.local_addr().map(|a| a.to_string()).unwrap_or_default();
                let _ = s.write_all(format!("{local}\n").as_bytes()).await;
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    let mut services = ServiceTable::new();
    services.set_fallback(Service::OriginalDst { http: false });
    let config = ProxyConfig {
        listeners: vec![listener],
        iptables_redirect,
        ..ProxyConfig::default()
    };
    let deps = ProxyDeps {
        original_dst,
        services,
        splicer: None,
    };
    let proxy = serve(config, deps).await.expect("proxy starts");
    let (banner, intact) = tokio::time::timeout(WAIT, exchange(client, dial))
        .await
        .expect("the exchange ended in time");
    if !iptables_redirect {
        // The refusal is counted once the proxy saw the connection (bounded wait).
        let start = Instant::now();
        while stat(&proxy.stats(), "downstream_cx_no_original_dst") == 0 && start.elapsed() < WAIT {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let stats = proxy.stats();
    proxy.shutdown().await;
    backend_task.abort();
    Seen {
        banner,
        intact,
        accepted: accepted.load(Ordering::SeqCst),
        stats,
    }
}

/// Connects from `client` to `dst`, sends the payload, half-closes and reads everything back:
/// (the first line, whether the rest equals the payload).
async fn exchange(client: SocketAddr, dst: SocketAddr) -> (String, bool) {
    let socket = match client {
        SocketAddr::V4(_) => TcpSocket::new_v4(),
        SocketAddr::V6(_) => TcpSocket::new_v6(),
    }
    .unwrap();
    socket
        .bind(client)
        .expect("client binds its source address");
    // A refusal's reset may already reach the connect (the proxy's own threads accept).
    let Ok(mut stream) = socket.connect(dst).await else {
        return (String::new(), false);
    };
    let data = pattern(9, PAYLOAD);
    let (mut r, mut w) = stream.split();
    let send = async {
        // A refused connection is reset while we write: that is expected, not a failure here.
        let _ = w.write_all(&data).await;
        let _ = w.shutdown().await;
    };
    let mut received = Vec::new();
    let recv = async {
        let _ = r.read_to_end(&mut received).await;
    };
    tokio::join!(send, recv);
    let text_end = received.iter().position(|b| *b == b'\n');
    let Some(end) = text_end else {
        return (String::new(), false);
    };
    let banner = String::from_utf8_lossy(&received[..end]).into_owned();
    let rest = &received[end + 1..];
    (
        banner,
        rest.len() == data.len() && digest(rest) == digest(&data),
    )
}

fn stat(stats: &[(String, u64)], name: &str) -> u64 {
    stats.iter().find(|(k, _)| k == name).map_or(0, |(_, v)| *v)
}
