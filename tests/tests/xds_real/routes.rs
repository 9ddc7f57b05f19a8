//! An inline route table side by side: the same HTTP requests through Envoy 1.40's listener
//! and through our proxy path (the chain compiled from what our client published for the same
//! resources) reach the same cluster, for paths, headers and query parameters.

use std::{collections::BTreeMap, net::SocketAddr, sync::Arc};

use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use integration_tests::xds_server::XdsServer;
use proxy_chain::{CompileRequest, Entries, compile};
use proxy_relay::{ProxyConfig, RouteTable, Service, ServiceTable};
use serde_json::json;
use tokio::sync::watch;

/// Keeps a test cluster's hosts (its sender must stay open).
type Routing = watch::Sender<proxy_core::health::Routing>;

use super::{
    proxy_support::{HttpServer, TestProxy, cluster, get, http1_client},
    resources::{Side, active, http_listener, static_cluster},
};

const VIP: &str = "127.77.240.10:80";

/// A request (path, headers) and the cluster that should answer it.
type Case = (
    &'static str,
    &'static [(&'static str, &'static str)],
    &'static str,
);

/// Requests and the cluster Envoy's route table sends each to.
const CASES: [Case; 11] = [
    ("/b/x", &[("x-v", "2")], "b"),
    ("/b/x", &[("x-v", "3")], "a"),
    ("/b/x", &[], "a"),
    ("/B/x", &[("x-v", "2")], "a"),
    ("/only-b", &[], "b"),
    ("/only-b/", &[], "a"),
    ("/r/42", &[], "b"),
    ("/r/42x", &[], "a"),
    ("/q?debug=1", &[], "b"),
    ("/q?other=1", &[], "a"),
    ("/", &[], "a"),
];

fn who(body: &str) -> String {
    body.split(' ').next().unwrap_or("").to_owned()
}

/// Our proxy path serving `VIP` with the chain our client published for listener `web`.
async fn our_proxy(side: &Side, hosts: &[(&str, SocketAddr)]) -> (TestProxy, Vec<Routing>) {
    let overlay = side.overlay.borrow().clone();
    let text = serde_json::to_string(&overlay.config_entries).expect("entries serialise");
    let entries = Entries::from_json(&text).expect("the published entries parse");
    let chain = compile(&CompileRequest::new("web", "dc1", "consul"), &entries)
        .expect("the published chain compiles");
    let mut clusters = BTreeMap::new();
    let mut senders = Vec::new();
    for (name, addr) in hosts {
        let (tx, handle) = cluster(name, &[*addr], true);
        clusters.insert((*name).to_owned(), handle);
        senders.push(tx);
    }
    let table = RouteTable::from_chain(&chain, &|t| clusters.get(&t.service).cloned())
        .expect("every target has a cluster");
    let mut services = ServiceTable::new();
    services.insert(
        VIP.parse().expect("literal"),
        Service::Http(Arc::new(table)),
    );
    (
        TestProxy::start(ProxyConfig::default(), services).await,
        senders,
    )
}

/// An HTTP/1.1 connection to Envoy's listener at `addr`.
async fn envoy_client(addr: SocketAddr) -> SendRequest<Full<Bytes>> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("Envoy's listener");
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("an HTTP/1.1 connection to Envoy");
    tokio::spawn(conn);
    sender
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_and_our_proxy_path_route_each_request_to_the_same_cluster() {
    let (a, b) = (HttpServer::start("a").await, HttpServer::start("b").await);
    let server = tokio::task::block_in_place(XdsServer::start);
    let listen = std::net::TcpListener::bind("127.77.240.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port on 127.77.240.1");
    let clusters = json!([
        static_cluster("a", "127.0.0.1", a.addr.port()),
        static_cluster("b", "127.0.0.1", b.addr.port())
    ]);
    server.push_resources("cluster", "1", clusters);
    let routes = json!([
        {"match": {"prefix": "/b", "headers": [{"name": "x-v", "string_match": {"exact": "2"}}]},
         "route": {"cluster": "b"}},
        {"match": {"path": "/only-b"}, "route": {"cluster": "b"}},
        {"match": {"safe_regex": {"regex": "/r/[0-9]+"}}, "route": {"cluster": "b"}},
        {"match": {"prefix": "/q", "query_parameters": [{"name": "debug", "present_match": true}]},
         "route": {"cluster": "b"}},
        {"match": {"prefix": "/"}, "route": {"cluster": "a"}}
    ]);
    let listener = http_listener("web", listen.port(), &routes);
    server.push_resources("listener", "1", json!([listener]));
    let mut side = Side::start(&server, false);
    let both = active(&["a", "b"], &["web"]);
    let seen = (side.envoy_active(&both).await, side.our_active(&both).await);
    assert_eq!(
        (&seen.0, &seen.1),
        (&both, &both),
        "Envoy's (left) and ours"
    );
    let (proxy, _senders) = our_proxy(&side, &[("a", a.addr), ("b", b.addr)]).await;
    for (path, headers, want) in CASES {
        // One connection per request on each side: a 404 or an error closes a connection.
        let theirs = get(&mut envoy_client(listen).await, path, headers).await;
        let vip = VIP.parse().expect("literal");
        let mine = get(&mut http1_client(&proxy, vip).await, path, headers).await;
        assert_eq!(
            ((theirs.0, who(&theirs.1)), (mine.0, who(&mine.1))),
            ((200, want.to_owned()), (200, want.to_owned())),
            "{path} {headers:?}: Envoy (left) and our proxy path (right): {theirs:?} / {mine:?}"
        );
    }
}
