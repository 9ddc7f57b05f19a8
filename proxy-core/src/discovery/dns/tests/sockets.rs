//! The real resolver against name servers on 127.0.0.1 that this test starts: a closed port, a
//! server that reads and never answers, one that answers SERVFAIL, one that answers A records.
//! Real time, every wait bounded; one test on paused time (its doc says why).

use std::{
    net::{Ipv4Addr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use hickory_resolver::proto::{
    op::{Message, ResponseCode},
    rr::{RData, Record, RecordType, rdata::A},
};
use tokio::{net::UdpSocket, task::JoinHandle};

use crate::{
    config::sources::dns::{
        DnsEndpoint, DnsLookupFamily, DnsResolverAddress, DnsSettings, QueryLimits, RefreshRate,
    },
    discovery::dns::{AddressFamily, DnsResolve, HickoryResolver, StatValues, spawn_strict_dns},
};

/// Bound of every wait in these tests.
const WAIT: Duration = Duration::from_secs(5);

/// What a test name server does with a query.
#[derive(Clone, Copy)]
enum Behaviour {
    /// Reads it and never answers.
    Drop,
    /// Answers SERVFAIL.
    ServFail,
    /// Answers every A query with this address.
    Answer(Ipv4Addr),
}

/// A name server on a UDP socket of 127.0.0.1 that counts the queries it receives.
struct TestServer {
    addr: SocketAddr,
    queries: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl TestServer {
    async fn start(addr: SocketAddr, behaviour: Behaviour) -> Self {
        let socket = UdpSocket::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("test name server cannot bind {addr}: {e}"));
        let addr = socket.local_addr().expect("its address");
        let queries = Arc::new(AtomicUsize::new(0));
        let counted = queries.clone();
        let task = tokio::spawn(async move {
            let mut buf = vec![0; 4096];
            while let Ok((len, from)) = socket.recv_from(&mut buf).await {
                counted.fetch_add(1, Ordering::SeqCst);
                if let Some(reply) = reply(&buf[..len], behaviour) {
                    let _ = socket.send_to(&reply, from).await;
                }
            }
        });
        Self {
            addr,
            queries,
            task,
        }
    }

    fn queries(&self) -> usize {
        self.queries.load(Ordering::SeqCst)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn reply(query: &[u8], behaviour: Behaviour) -> Option<Vec<u8>> {
    let query = Message::from_vec(query).ok()?;
    let mut response = match behaviour {
        Behaviour::Drop => return None,
        Behaviour::ServFail => Message::error_msg(
            query.metadata.id,
            query.metadata.op_code,
            ResponseCode::ServFail,
        ),
        Behaviour::Answer(ip) => {
            let mut response = Message::response(query.metadata.id, query.metadata.op_code);
            for q in query
                .queries
                .iter()
                .filter(|q| q.query_type() == RecordType::A)
            {
                response.add_answer(Record::from_rdata(q.name().clone(), 5, RData::A(A(ip))));
            }
            response
        }
    };
    response.add_queries(query.queries);
    response.to_vec().ok()
}

/// A UDP port on 127.0.0.1 that answers every datagram with ICMP port unreachable, held until
/// dropped: a socket bound there and connected to port 9, so the kernel matches no datagram from
/// anyone else to it, and no other socket can bind the port meanwhile. (A port bound and released
/// at once could be taken by a DNS server that a test running beside this one starts.)
struct ClosedPort {
    addr: SocketAddr,
    _socket: std::net::UdpSocket,
}

fn closed_port() -> ClosedPort {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind an ephemeral UDP port");
    socket
        .connect("127.0.0.1:9")
        .expect("connecting the closed port elsewhere");
    ClosedPort {
        addr: socket.local_addr().expect("its address"),
        _socket: socket,
    }
}

fn settings(server: SocketAddr) -> DnsSettings {
    DnsSettings {
        dns_lookup_family: DnsLookupFamily::V4Only,
        dns_resolvers: vec![DnsResolverAddress(server)],
        ..DnsSettings::default()
    }
}

/// Waits (at most [`WAIT`]) until `done` holds for the cluster's stats.
async fn wait_stats(
    stats: impl Fn() -> StatValues,
    done: impl Fn(&StatValues) -> bool,
) -> Duration {
    let start = Instant::now();
    while !done(&stats()) {
        assert!(
            start.elapsed() < WAIT,
            "stats never got there; last: {:?}",
            stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    start.elapsed()
}

#[test]
fn query_limits_default_to_envoys_c_ares_settings() {
    let limits = QueryLimits::default();
    assert_eq!((limits.timeout, limits.tries), (Duration::from_secs(5), 4));
}

/// A closed port answers with ICMP port unreachable: the lookup fails at once (every try), as
/// c-ares reports it, instead of waiting for the try timeout.
#[tokio::test]
async fn a_refused_server_fails_the_lookup_at_once() {
    let closed = closed_port();
    let resolver = HickoryResolver::new(&settings(closed.addr)).expect("resolver");
    let start = Instant::now();
    let result = tokio::time::timeout(
        WAIT,
        resolver.lookup_addresses("web.svc.test", AddressFamily::V4),
    )
    .await
    .expect("the lookup ends");
    let err = result.expect_err("nothing answers");
    let took = start.elapsed();
    assert!(took < Duration::from_millis(500), "took {took:?}: {err}");
}

/// The cluster counts the refusal as a failure at once, retries on `dns_failure_refresh_rate`
/// (not `dns_refresh_rate`, 5 s by default) and picks the records up at the first retry after
/// the server is back.
#[tokio::test]
async fn a_refused_server_is_a_failure_with_backoff_until_it_returns() {
    let closed = closed_port();
    let server = closed.addr;
    let settings = DnsSettings {
        dns_failure_refresh_rate: Some(RefreshRate {
            base_interval: Duration::from_millis(100),
            max_interval: Some(Duration::from_millis(200)),
        }),
        ..settings(server)
    };
    let resolver = Arc::new(HickoryResolver::new(&settings).expect("resolver"));
    let endpoint = DnsEndpoint::new("web.svc.test", 80);
    let cluster = spawn_strict_dns("web", settings, vec![endpoint], resolver).expect("valid");
    let stats = || cluster.stats().values();

    let first = wait_stats(stats, |s| s.source.update_failure >= 1).await;
    assert!(
        first < Duration::from_millis(500),
        "first failure after {first:?}"
    );
    assert!(cluster.current().initialized && cluster.current().hosts.is_empty());
    // Backoff bounds 100, 200, 200 ms: three more failures well within a second, where the
    // refresh rate would allow none.
    let more = wait_stats(stats, |s| s.source.update_failure >= 4).await;
    assert!(
        more < Duration::from_secs(1),
        "three more failures took {more:?}"
    );
    assert_eq!(stats().source.update_success, 0);

    drop(closed);
    let _back = TestServer::start(server, Behaviour::Answer(Ipv4Addr::new(127, 0, 0, 9))).await;
    let back = wait_stats(stats, |s| s.source.update_success >= 1).await;
    assert!(
        back < Duration::from_millis(500),
        "records arrived after {back:?}"
    );
    let hosts: Vec<String> = cluster
        .current()
        .hosts
        .iter()
        .map(|h| h.addr.to_string())
        .collect();
    assert_eq!(hosts, ["127.0.0.9:80"]);
}

/// A server that drops queries gets exactly one datagram per try (hickory alone would resend
/// each try's query up to three times), and the lookup fails after the default tries, each
/// lasting the default try timeout. On paused time: the clock jumps to each timer once nothing
/// else is ready, so the tries' durations are exact and a loaded machine cannot stretch them,
/// while the datagrams still go through the real socket to the server.
#[tokio::test(start_paused = true)]
async fn a_dropping_server_gets_one_datagram_per_try() {
    let server = TestServer::start("127.0.0.1:0".parse().unwrap(), Behaviour::Drop).await;
    let limits = QueryLimits::default();
    let resolver = HickoryResolver::with_limits(&settings(server.addr), limits).expect("resolver");
    let start = tokio::time::Instant::now();
    let lookup = resolver.lookup_addresses("web.svc.test", AddressFamily::V4);
    let result = tokio::time::timeout(limits.timeout * 10, lookup)
        .await
        .expect("the lookup ends");
    let took = start.elapsed();
    assert!(result.is_err(), "nothing answers");
    assert_eq!(server.queries(), usize::from(limits.tries));
    let tries = u32::from(limits.tries);
    assert_eq!(
        took,
        limits.timeout * tries,
        "{tries} tries of {:?}",
        limits.timeout
    );
}

/// SERVFAIL fails a try; c-ares tries again (unlike hickory's own retry), one datagram per try.
#[tokio::test]
async fn servfail_is_tried_again_up_to_the_tries() {
    let server = TestServer::start("127.0.0.1:0".parse().unwrap(), Behaviour::ServFail).await;
    let resolver = HickoryResolver::new(&settings(server.addr)).expect("resolver");
    let lookup = resolver.lookup_addresses("web.svc.test", AddressFamily::V4);
    let result = tokio::time::timeout(WAIT, lookup)
        .await
        .expect("the lookup ends");
    assert!(result.is_err(), "SERVFAIL is a failure");
    assert_eq!(server.queries(), usize::from(QueryLimits::default().tries));
}
