//! The admin server over real sockets: every endpoint, every refusal, the cost bounds, the
//! unix socket.

use std::{
    path::{Path, PathBuf},
    sync::Mutex,
    time::Instant,
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream, UnixStream},
};

use super::*;

fn state() -> State {
    let config = Config::parse("{}", std::path::Path::new("t.yaml")).expect("empty config");
    State::new(
        config,
        Arc::new(Mutex::new(None)),
        BTreeMap::new(),
        watch::channel(std::collections::BTreeSet::default()).1,
    )
}

mod authority;
mod bounds;
mod chain;
mod pages;

/// A free loopback address (bound a moment ago).
async fn free_addr() -> AdminAddress {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    AdminAddress::Tcp(listener.local_addr().unwrap())
}

/// A server under test; [`Served::stop`] also removes its control socket's directory.
struct Served {
    server: Server,
    dir: PathBuf,
}

impl Served {
    async fn stop(self) {
        self.server.stop().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Serves `state` on a free loopback port (returned) and a fresh control socket.
async fn serving(state: State) -> (Served, AdminAddress) {
    let (server, addr, _) = serving_both(state).await;
    (server, addr)
}

/// Serves `state`; returns the server, its TCP address and its control socket (in a fresh
/// directory of its own).
async fn serving_both(state: State) -> (Served, AdminAddress, AdminAddress) {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = scratch(&format!("control-{n}"));
    let (addr, control) = (free_addr().await, dir.join("control.sock"));
    let server = serve_with(&addr, &control, state)
        .await
        .expect("serving on loopback");
    (Served { server, dir }, addr, AdminAddress::Unix(control))
}

/// Serves `state`; returns the server and its control socket (where state changes go).
async fn controlled(state: State) -> (Served, AdminAddress) {
    let (server, _, control) = serving_both(state).await;
    (server, control)
}

/// Writes `request` raw and reads the whole answer (the server closes after one).
async fn exchange(addr: &AdminAddress, request: &str) -> String {
    let mut answer = Vec::new();
    match addr {
        AdminAddress::Tcp(tcp) => {
            let mut s = TcpStream::connect(tcp).await.unwrap();
            s.write_all(request.as_bytes()).await.unwrap();
            let _ = s.read_to_end(&mut answer).await;
        }
        AdminAddress::Unix(path) => {
            let mut s = UnixStream::connect(path).await.unwrap();
            s.write_all(request.as_bytes()).await.unwrap();
            let _ = s.read_to_end(&mut answer).await;
        }
    }
    String::from_utf8(answer).expect("UTF-8 answer")
}

async fn call(addr: &AdminAddress, method: &str, target: &str) -> (u16, String, String) {
    let answer = exchange(
        addr,
        &format!(
            "{method} {target} HTTP/1.1\r\nhost: {}\r\n\r\n",
            crate::status::host(addr)
        ),
    )
    .await;
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_owned())
}

async fn get(addr: &AdminAddress, target: &str) -> (u16, String) {
    let (status, _, body) = call(addr, "GET", target).await;
    (status, body)
}

#[tokio::test]
async fn the_index_lists_every_endpoint_and_unknown_paths_get_it_with_a_404() {
    let (server, addr) = serving(state()).await;
    let (status, index) = get(&addr, "/").await;
    assert_eq!(status, 200);
    for path in [
        "/chain/<service>",
        "/clusters",
        "/config_dump",
        "/healthcheck/fail (POST)",
        "/healthcheck/ok (POST)",
        "/help",
        "/listeners",
        "/logging",
        "/ready",
        "/reload (POST)",
        "/reset_counters (POST)",
        "/server_info",
        "/stats",
        "/stats/prometheus",
    ] {
        assert!(
            index.contains(&format!("\n  {path}: ")),
            "{path} missing:\n{index}"
        );
    }
    assert_eq!(get(&addr, "/help").await, (200, index.clone()));
    let (status, body) = get(&addr, "/nope?x=1").await;
    assert_eq!(status, 404);
    assert!(
        body.starts_with("not found: \"/nope\"\n\nadmin endpoints:\n"),
        "{body}"
    );
    server.stop().await;
}

#[tokio::test]
async fn server_info_reports_state_uptime_and_options() {
    let mut state = state().with_launch(Launch {
        config_path: Some(PathBuf::from("/etc/proxy/config.yaml")),
        log_level: "info".to_owned(),
        concurrency: 3,
        ..Launch::default()
    });
    let (server, addr) = serving(state.clone()).await;
    let info = |body: String| -> serde_json::Value { serde_json::from_str(&body).expect("JSON") };
    let (status, body) = get(&addr, "/server_info").await;
    assert_eq!(status, 200);
    let v = info(body);
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(v["state"], "INITIALIZING");
    assert_eq!(v["uptime_current_epoch"], "0s");
    assert_eq!(v["uptime_all_epochs"], "0s");
    let options = &v["command_line_options"];
    assert_eq!(options["config_path"], "/etc/proxy/config.yaml");
    assert_eq!(options["log_level"], "info");
    assert_eq!(options["concurrency"], 3);
    server.stop().await;
    state.assume_attached = true;
    let (server, addr) = serving(state).await;
    assert_eq!(info(get(&addr, "/server_info").await.1)["state"], "LIVE");
    server.stop().await;
}

/// Envoy's drain switch: after `/healthcheck/fail`, `/ready` is 503 DRAINING and so is
/// `/server_info`'s state, until `/healthcheck/ok`. GET changes nothing: it is a 405.
#[tokio::test]
async fn healthcheck_fail_and_ok_take_post_and_turn_ready_off_and_on() {
    let mut state = state();
    state.assume_attached = true;
    let (server, addr) = controlled(state).await;
    let server_state = async |addr: &AdminAddress| {
        let body = get(addr, "/server_info").await.1;
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["state"].clone()
    };
    assert_eq!(get(&addr, "/ready").await, (200, "LIVE\n".to_owned()));
    for method in ["GET", "HEAD", "PUT"] {
        let (status, head, _) = call(&addr, method, "/healthcheck/fail").await;
        assert_eq!(status, 405, "{method}");
        assert!(head.contains("\r\nallow: post"), "{method}: {head}");
    }
    let (_, _, body) = call(&addr, "GET", "/healthcheck/fail").await;
    assert_eq!(
        body,
        "method GET is not allowed on /healthcheck/fail: it changes the server's state, so it \
         takes POST\n"
    );
    assert_eq!(get(&addr, "/ready").await.0, 200, "a GET changed nothing");
    let (status, _, body) = call(&addr, "POST", "/healthcheck/fail").await;
    assert_eq!((status, body.as_str()), (200, "OK\n"));
    assert_eq!(get(&addr, "/ready").await, (503, "DRAINING\n".to_owned()));
    assert_eq!(server_state(&addr).await, "DRAINING");
    assert_eq!(call(&addr, "GET", "/healthcheck/ok").await.0, 405);
    assert_eq!(get(&addr, "/ready").await.0, 503, "a GET changed nothing");
    assert_eq!(call(&addr, "POST", "/healthcheck/ok").await.0, 200);
    assert_eq!(get(&addr, "/ready").await, (200, "LIVE\n".to_owned()));
    assert_eq!(server_state(&addr).await, "LIVE");
    server.stop().await;
}

/// `POST /reload` asks the daemon and answers with its outcome: 200 applied, 400 invalid file,
/// 409 needs a restart, 500 failed; a GET is a 405 that asks nothing. Pages read the
/// configuration in force after the daemon swaps it.
#[tokio::test]
async fn reload_asks_the_daemon_and_pages_follow_the_new_configuration() {
    let (reload_tx, mut reload_rx) = mpsc::channel::<ReloadRequest>(1);
    let parse = |yaml: &str| Config::parse(yaml, Path::new("t.yaml")).unwrap();
    let (live_tx, live_rx) = watch::channel(Live {
        config: Arc::new(parse("{}")),
        upstreams: BTreeMap::new(),
    });
    let (server, addr) = controlled(state().with_reload(live_rx, reload_tx)).await;
    let answers = [
        Ok("clusters: 1 added".to_owned()),
        Err(ReloadRefused::Invalid("t.yaml:3:7: bad".to_owned())),
        Err(ReloadRefused::NeedsRestart("instance changed".to_owned())),
        Err(ReloadRefused::Failed("no".to_owned())),
    ];
    let daemon = tokio::spawn(async move {
        for answer in answers {
            let request = reload_rx.recv().await.expect("a request");
            request.send(answer).unwrap();
        }
        reload_rx
    });
    assert_eq!(call(&addr, "GET", "/reload").await.0, 405);
    for (code, text) in [
        (200, "clusters: 1 added\n"),
        (400, "error: t.yaml:3:7: bad\n"),
        (409, "error: instance changed\n"),
        (500, "error: no\n"),
    ] {
        let (status, _, body) = call(&addr, "POST", "/reload").await;
        assert_eq!((status, body.as_str()), (code, text));
    }
    let mut reload_rx = daemon.await.unwrap();
    assert!(reload_rx.try_recv().is_err(), "the GET asked nothing");
    let (_, stats) = get(&addr, "/stats").await;
    assert!(stats.contains("server.services: 0"), "{stats}");
    live_tx.send_replace(Live {
        config: Arc::new(parse("services: [ { name: s, address: 127.77.0.1, port: 80, cluster: c } ]\nclusters: [ { name: c, load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 1 } } } } ] } ] } } ]\n")),
        upstreams: BTreeMap::new(),
    });
    let (_, stats) = get(&addr, "/stats").await;
    assert!(stats.contains("server.services: 1"), "{stats}");
    drop(reload_rx);
    let (status, _, _) = call(&addr, "POST", "/reload").await;
    assert_eq!(status, 503, "the daemon is gone");
    server.stop().await;
}

#[tokio::test]
async fn logging_lists_sets_and_refuses_bad_levels_without_changing_anything() {
    let (control, _subscriber) =
        crate::logging::LogControl::new("info", crate::logging::LogFormat::Text);
    control.set_level("info").unwrap();
    let state = state().with_launch(Launch {
        logging: Some(control.clone()),
        ..Launch::default()
    });
    let (server, addr) = controlled(state).await;
    assert_eq!(
        get(&addr, "/logging").await,
        (200, "active log filter: info\n".to_owned())
    );
    let (status, head, _) = call(&addr, "GET", "/logging?level=debug").await;
    assert_eq!(status, 405);
    assert!(head.contains("\r\nallow: post"), "{head}");
    assert_eq!(control.current(), "info", "a GET changed nothing");
    let (status, _, body) = call(&addr, "POST", "/logging?level=debug").await;
    assert_eq!((status, body.as_str()), (200, "active log filter: debug\n"));
    assert_eq!(control.current(), "debug");
    for (query, why) in [
        ("level=loud", "error: unknown log level \"loud\"\n"),
        ("level=", "error: unknown log level \"\"\n"),
        (
            "paths=a:debug",
            "error: unsupported parameter \"paths=a:debug\"",
        ),
        ("level=info&level=warn", "error: give exactly one parameter"),
    ] {
        let (status, _, body) = call(&addr, "POST", &format!("/logging?{query}")).await;
        assert_eq!(status, 400, "{query}");
        assert!(body.starts_with(why), "{query}: {body}");
        assert!(
            body.contains("levels: trace debug info warning"),
            "{query}: {body}"
        );
    }
    assert_eq!(
        control.current(),
        "debug",
        "a refused change changed nothing"
    );
    let (status, _, body) = call(&addr, "POST", "/logging").await;
    assert_eq!(status, 400, "a POST without a level changes nothing");
    assert!(
        body.starts_with("error: give exactly one parameter"),
        "{body}"
    );
    assert_eq!(control.current(), "debug");
    server.stop().await;
}

/// Hostile input: no panic, a clear refusal, and the server keeps answering.
#[tokio::test]
async fn malformed_and_oversized_requests_are_refused() {
    let (server, addr) = serving(state()).await;
    let huge = format!(
        "GET /stats HTTP/1.1\r\nx-big: {}\r\n\r\n",
        "a".repeat(2 * accept::MAX_REQUEST)
    );
    let answer = exchange(&addr, &huge).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    for garbage in [
        "BLAH\r\n\r\n",
        "GET\r\n\r\n",
        "\0\0\0\0\r\n\r\n",
        "GET / HTTP/9.9\r\n\r\n",
    ] {
        let answer = exchange(&addr, garbage).await;
        assert!(
            answer.is_empty()
                || answer.starts_with("HTTP/1.1 4")
                || answer.starts_with("HTTP/1.1 5"),
            "{garbage:?}: {answer}"
        );
    }
    // A body on a POST is ignored, not read.
    let posted = "POST /healthcheck/ok HTTP/1.1\r\ncontent-length: 5\r\n\r\nhello";
    let (server_c, control) = controlled(state()).await;
    assert!(exchange(&control, posted).await.starts_with("HTTP/1.1 200"));
    server_c.stop().await;
    assert_eq!(get(&addr, "/ready").await.0, 503);
    server.stop().await;
}

/// A fresh directory for one test's socket files.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("proxy-admin-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::symlink_metadata(path)
        .unwrap()
        .permissions()
        .mode()
        & 0o777
}

#[tokio::test]
async fn a_unix_socket_is_0600_served_and_removed_on_stop() {
    let dir = scratch("mode");
    let path = dir.join("admin.sock");
    let addr = AdminAddress::Unix(path.clone());
    let server = serve_with(&addr, &dir.join("control.sock"), state())
        .await
        .expect("serving on a unix socket");
    assert_eq!(mode(&path), 0o600);
    assert_eq!(get(&addr, "/ready").await, (503, "NOT READY\n".to_owned()));
    // `proxy status` over the socket.
    let status_addr = addr.clone();
    let (table, json) = tokio::task::spawn_blocking(move || {
        let status = |json| {
            let mut out = Vec::new();
            crate::status::run(&status_addr, Duration::from_secs(10), json, &mut out)
                .map(|()| String::from_utf8(out).expect("utf-8"))
        };
        Ok::<_, anyhow::Error>((status(false)?, status(true)?))
    })
    .await
    .unwrap()
    .expect("proxy status over the unix socket");
    assert!(table.starts_with("SERVICE"), "{table}");
    // `--json`: the /routing document on one line.
    assert_eq!(json.lines().count(), 1, "{json}");
    let routing: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    assert!(routing.is_array(), "{routing}");
    server.stop().await;
    assert!(!path.exists(), "the socket file is removed on stop");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_stale_socket_is_replaced_but_a_live_one_or_a_regular_file_is_refused() {
    let dir = scratch("stale");
    let path = dir.join("admin.sock");
    let addr = AdminAddress::Unix(path.clone());
    // Stale: bound, then its listener gone (as after kill -9).
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    let control = dir.join("control.sock");
    let server = serve_with(&addr, &control, state())
        .await
        .expect("replacing a stale socket");
    assert_eq!(get(&addr, "/ready").await.0, 503);
    // Live: this server still has it.
    let err = serve_with(&addr, &dir.join("other.sock"), state())
        .await
        .err()
        .expect("a live socket is refused");
    assert!(matches!(err, ListenError::InUse { .. }), "{err}");
    assert!(err.to_string().contains("another process serves"), "{err}");
    server.stop().await;
    // A regular file is never deleted.
    std::fs::write(&path, "keep me").unwrap();
    let err = serve_with(&addr, &control, state())
        .await
        .err()
        .expect("a regular file is refused");
    assert!(
        err.to_string().contains("exists and is not a socket"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "keep me");
    // Nor is a directory.
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir(&path).unwrap();
    let err = serve_with(&addr, &control, state())
        .await
        .err()
        .expect("a directory is refused");
    assert!(matches!(err, ListenError::NotASocket { .. }), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}
