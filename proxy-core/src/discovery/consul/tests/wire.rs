//! The HTTP client and the whole backend against a scripted HTTP server on 127.0.0.1.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};

use super::*;
use crate::discovery::consul::{
    http::{self, HttpError},
    spawn_consul,
};

/// Bound of real-time waits in these tests.
const REAL_WAIT: Duration = Duration::from_secs(10);

/// Answers the n-th connection with the n-th raw response (`None`: never answer), recording
/// each request (head and body). After the script, connections are held open unanswered.
struct Server {
    addr: SocketAddr,
    requests: Arc<Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

impl Server {
    async fn start(responses: Vec<Option<String>>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let requests = Arc::new(Mutex::new(Vec::new()));
        let log = requests.clone();
        let task = tokio::spawn(async move {
            let mut responses = responses.into_iter();
            let mut held = Vec::new();
            while let Ok((mut stream, _)) = listener.accept().await {
                let request = read_request(&mut stream).await;
                log.lock().unwrap().push(request);
                match responses.next().flatten() {
                    Some(raw) => {
                        let _ = stream.write_all(raw.as_bytes()).await;
                        let _ = stream.shutdown().await;
                    }
                    None => held.push(stream),
                }
            }
        });
        Self {
            addr,
            requests,
            task,
        }
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn read_request(stream: &mut TcpStream) -> String {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&raw).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("Content-Length: "))
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(0);
            if body.len() >= length {
                return text;
            }
        }
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return text,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
}

fn response(index: u64, body: &Value) -> String {
    let body = body.to_string();
    format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Consul-Index: {index}\r\n\
         X-Consul-Knownleader: true\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn chunked(index: u64, body: &Value) -> String {
    let body = body.to_string();
    let (a, b) = body.split_at(body.len() / 2);
    format!(
        "HTTP/1.1 200 OK\r\nX-Consul-Index: {index}\r\nTransfer-Encoding: chunked\r\n\r\n\
         {:x};ext=1\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
        a.len(),
        b.len()
    )
}

/// GETs `/` from a server that answers with `raw` and closes.
async fn get_raw(raw: &str) -> Result<http::HttpResponse, http::HttpError> {
    let server = Server::start(vec![Some(raw.to_owned())]).await;
    let address = server.addr.to_string();
    http::request(&address, "GET", "/", None, None, REAL_WAIT).await
}

#[tokio::test]
async fn length_chunked_and_eof_bodies_are_read_and_bad_answers_are_errors() {
    let r = get_raw("HTTP/1.1 200 OK\r\nX-Consul-Index: 12\r\nContent-Length: 2\r\n\r\n[]extra")
        .await
        .expect("content-length");
    assert_eq!(
        (r.status, r.header("X-CONSUL-INDEX"), r.body.as_slice()),
        (200, Some("12"), &b"[]"[..])
    );
    let r = get_raw(&chunked(3, &json!([1, 2, 3])))
        .await
        .expect("chunked");
    assert_eq!(r.body, b"[1,2,3]");
    let r = get_raw("HTTP/1.0 500 Internal Server Error\r\n\r\nNo path to datacenter\n")
        .await
        .expect("eof");
    assert_eq!(
        (r.status, r.body_excerpt().as_str()),
        (500, "No path to datacenter")
    );
    for bad in [
        "garbage",
        "SSH-2.0 x\r\n\r\n",
        "HTTP/1.1 abc OK\r\n\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ] {
        let err = get_raw(bad).await.expect_err(bad);
        assert!(matches!(err, HttpError::Http { .. }), "{bad:?}: {err}");
        assert!(
            err.to_string().starts_with("127.0.0.1:"),
            "names the agent: {err}"
        );
    }
    let huge = get_raw("HTTP/1.1 200 OK\r\nContent-Length: 70000000\r\n\r\n[")
        .await
        .expect_err("over the limit");
    assert!(err_is_too_large(&huge), "{huge}");
}

fn err_is_too_large(err: &HttpError) -> bool {
    matches!(err, HttpError::Malformed { .. }) && err.to_string().contains("larger than 64 MiB")
}

#[tokio::test]
async fn requests_are_http_1_1_with_host_and_close_and_bodies_are_sent() {
    let server = Server::start(vec![
        Some(response(1, &json!([]))),
        Some(response(2, &json!(true))),
    ])
    .await;
    let address = server.addr.to_string();
    let r = http::request(
        &address,
        "GET",
        "/v1/health/service/web",
        None,
        None,
        REAL_WAIT,
    )
    .await
    .expect("answer");
    assert_eq!((r.status, r.header("x-consul-index")), (200, Some("1")));
    let put = http::request(
        &address,
        "PUT",
        "/v1/agent/check/pass/c1",
        Some("t-1"),
        Some(b"{\"a\":1}"),
        REAL_WAIT,
    )
    .await
    .expect("answer");
    assert_eq!(put.body, b"true");
    let requests = server.requests();
    assert!(
        requests[0].starts_with("GET /v1/health/service/web HTTP/1.1\r\n"),
        "{requests:?}"
    );
    assert!(requests[0].contains(&format!("\r\nHost: {address}\r\n")));
    assert!(requests[0].contains("\r\nConnection: close\r\n"));
    assert!(
        !requests[0].contains("X-Consul-Token"),
        "no token, no header"
    );
    assert!(
        requests[1].contains("\r\nX-Consul-Token: t-1\r\n"),
        "{requests:?}"
    );
    assert!(requests[1].starts_with("PUT /v1/agent/check/pass/c1 HTTP/1.1\r\n"));
    assert!(
        requests[1].ends_with("\r\nContent-Length: 7\r\n\r\n{\"a\":1}"),
        "{requests:?}"
    );
}

#[tokio::test]
async fn a_silent_server_times_out_and_a_closed_port_is_refused() {
    let server = Server::start(vec![None]).await;
    let started = std::time::Instant::now();
    let err = http::request(
        &server.addr.to_string(),
        "GET",
        "/",
        None,
        None,
        Duration::from_millis(200),
    )
    .await
    .expect_err("no answer");
    assert!(matches!(err, HttpError::Timeout { .. }), "{err}");
    assert!(started.elapsed() < REAL_WAIT);
    let closed = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind")
        .local_addr()
        .expect("addr");
    let err = http::request(&closed.to_string(), "GET", "/", None, None, REAL_WAIT)
        .await
        .expect_err("refused");
    assert!(matches!(err, HttpError::Connect { .. }), "{err}");
    assert!(
        err.to_string().contains("is the Consul agent running"),
        "{err}"
    );
}

#[tokio::test]
async fn the_backend_watches_a_real_http_server() {
    let a = inst("a", "127.0.0.2", 8080);
    let b = inst("b", "", 8081);
    let server = Server::start(vec![
        Some(response(3, &body(std::slice::from_ref(&a)))),
        Some(chunked(4, &body(&[a, b]))),
    ])
    .await;
    let mut config = ConsulConfig::new("web");
    config.address = Some(format!("http://{}", server.addr));
    config.token = ConsulToken::new("secret-7");
    config.datacenter = Some("dc1".to_owned());
    config.tag = Some("blue".to_owned());
    config.wait = Duration::from_secs(1);
    let cluster = spawn_consul("web", config).expect("valid config");
    let mut updates = cluster.updates();
    let found = tokio::time::timeout(REAL_WAIT, updates.wait_for(|u| u.hosts.len() == 2)).await;
    assert!(matches!(found, Ok(Ok(_))), "last: {:?}", cluster.current());
    assert_eq!(
        addrs(&cluster.current()),
        ["127.0.0.1:8081", "127.0.0.2:8080"]
    );
    let lines: Vec<String> = server
        .requests()
        .iter()
        .map(|r| r.lines().next().unwrap_or("").to_owned())
        .collect();
    assert_eq!(
        lines[..2],
        [
            "GET /v1/health/service/web?dc=dc1&tag=blue HTTP/1.1",
            "GET /v1/health/service/web?dc=dc1&tag=blue&index=3&wait=1s HTTP/1.1",
        ]
    );
    let requests = server.requests();
    assert!(
        requests[..2]
            .iter()
            .all(|r| r.contains("\r\nX-Consul-Token: secret-7\r\n")),
        "the token goes in every query: {requests:?}"
    );
}
