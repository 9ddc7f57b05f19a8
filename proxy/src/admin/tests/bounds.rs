//! The cost bounds over real sockets: `/ready` never waits for a page or behind idle and slow
//! clients.

use super::*;

/// With every rendering turn taken (as by slow pages at scale), `/ready` still answers at
/// once and a page waits its turn, then gets 503, instead of tying up the runtime.
#[tokio::test]
async fn ready_answers_at_once_while_pages_wait_their_turn() {
    let state = state();
    let held = state
        .rendering
        .clone()
        .acquire_many_owned(RENDERING as u32)
        .await;
    let (server, addr) = serving(state.clone()).await;
    let started = Instant::now();
    let (status, body) = get(&addr, "/ready").await;
    assert_eq!((status, body.as_str()), (503, "NOT READY\n"));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let started = Instant::now();
    let (status, body) = get(&addr, "/stats").await;
    assert_eq!(status, 503);
    assert!(body.contains("busy: other admin requests"), "{body}");
    assert!(started.elapsed() >= TURN_TIMEOUT, "{:?}", started.elapsed());
    drop(held);
    assert_eq!(get(&addr, "/stats").await.0, 200);
    server.stop().await;
}

/// A client that never completes its request head is dropped after [`accept::HEAD_TIMEOUT`];
/// while more than [`accept::CONNECTIONS`] of them are connected, the next client sheds the
/// oldest and is served at once.
#[tokio::test]
async fn slow_clients_are_shed_and_time_out_while_ready_answers_at_once() {
    let (server, addr) = serving(state()).await;
    let AdminAddress::Tcp(tcp) = addr else {
        unreachable!()
    };
    let mut slow = Vec::new();
    for _ in 0..accept::CONNECTIONS + 8 {
        let mut s = TcpStream::connect(tcp).await.unwrap();
        s.write_all(b"GET /ready HTTP/1.1\r\n").await.unwrap();
        slow.push(s);
    }
    let started = Instant::now();
    let (status, _) = get(&addr, "/ready").await;
    let waited = started.elapsed();
    assert_eq!(status, 503);
    assert!(waited < Duration::from_secs(1), "{waited:?}");
    // The first was shed; the last is closed after the head deadline.
    let mut rest = Vec::new();
    let read = slow[0].read_to_end(&mut rest).await;
    assert!(read.is_err() || rest.is_empty(), "{rest:?}");
    let started = Instant::now();
    let last = slow.last_mut().unwrap();
    let read = last.read_to_end(&mut rest).await;
    let waited = started.elapsed();
    assert!(
        read.is_err() || rest.is_empty() || rest.starts_with(b"HTTP/1.1 408"),
        "{rest:?}"
    );
    assert!(
        waited <= accept::HEAD_TIMEOUT + Duration::from_secs(1),
        "{waited:?}"
    );
    server.stop().await;
}

/// Stopping the server closes the connections it was serving, not only its listeners.
#[tokio::test]
async fn stop_closes_the_connections_in_flight() {
    let (server, addr) = serving(state()).await;
    let AdminAddress::Tcp(tcp) = addr else {
        unreachable!()
    };
    let mut idle = TcpStream::connect(tcp).await.unwrap();
    // The daemon has it once a request on another connection was answered after it.
    assert_eq!(get(&addr, "/ready").await.0, 503);
    server.stop().await;
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(1), idle.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "still open a second after stop");
}
