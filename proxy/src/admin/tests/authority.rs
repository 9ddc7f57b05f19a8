//! Who may do what, over real sockets: the TCP listener shows and refuses state changes (403
//! naming the control socket), checks `Host` and methods; the control socket (mode 0600)
//! serves everything.

use super::*;

#[tokio::test]
async fn tcp_refuses_state_changes_that_the_control_socket_serves() {
    let mut state = state();
    state.assume_attached = true;
    let (server, tcp, control) = serving_both(state).await;
    let AdminAddress::Unix(path) = &control else {
        unreachable!()
    };
    assert_eq!(mode(path), 0o600);
    for target in [
        "/healthcheck/fail",
        "/reload",
        "/logging?level=debug",
        "/reset_counters",
    ] {
        let (status, _, body) = call(&tcp, "POST", target).await;
        assert_eq!(status, 403, "{target}: {body}");
        assert!(
            body.contains(&format!("send it to the control socket {}", path.display())),
            "{body}"
        );
    }
    assert_eq!(
        get(&tcp, "/ready").await,
        (200, "LIVE\n".to_owned()),
        "nothing changed"
    );
    assert_eq!(call(&control, "POST", "/healthcheck/fail").await.0, 200);
    assert_eq!(get(&tcp, "/ready").await, (503, "DRAINING\n".to_owned()));
    // `proxy reload` goes to the control socket; over TCP it learns where to go.
    let (tcp_c, control_c) = (tcp.clone(), control.clone());
    let (over_tcp, over_control) = tokio::task::spawn_blocking(move || {
        let timeout = Duration::from_secs(5);
        (
            crate::status::reload(&tcp_c, timeout).err(),
            crate::status::reload(&control_c, timeout).ok(),
        )
    })
    .await
    .unwrap();
    let refused = over_tcp.expect("403 over TCP").to_string();
    assert!(refused.contains("403 Forbidden"), "{refused}");
    assert!(
        matches!(over_control, Some(crate::status::Reloaded::Refused(ref why)) if why.contains("reload is not available")),
        "the control socket reached the handler"
    );
    server.stop().await;
    assert!(!path.exists(), "the control socket is removed on stop");
}

#[tokio::test]
async fn tcp_serves_state_changes_when_the_operator_allows_them() {
    let config = Config::parse(
        "admin: { allow_tcp_mutations: true }\n",
        Path::new("t.yaml"),
    )
    .expect("valid");
    let mut state = state();
    state.config = Arc::new(config);
    let (server, tcp) = serving(state).await;
    assert_eq!(call(&tcp, "POST", "/healthcheck/fail").await.0, 200);
    assert_eq!(get(&tcp, "/ready").await.0, 503);
    server.stop().await;
}

#[tokio::test]
async fn tcp_answers_only_requests_addressed_to_it_by_read_methods() {
    let (server, tcp, control) = serving_both(state()).await;
    let AdminAddress::Tcp(addr) = tcp else {
        unreachable!()
    };
    let status = |answer: String| answer.get(9..12).unwrap_or_default().to_owned();
    let forged = "GET /config_dump HTTP/1.1\r\nhost: attacker.example\r\n\r\n";
    let answer = exchange(&tcp, forged).await;
    assert_eq!(status(answer.clone()), "421", "{answer}");
    assert!(
        answer.contains("refused: host \"attacker.example\""),
        "{answer}"
    );
    let hostless = exchange(&tcp, "GET /ready HTTP/1.1\r\n\r\n").await;
    assert_eq!(status(hostless), "400");
    let named = format!(
        "GET /ready HTTP/1.1\r\nhost: localhost:{}\r\n\r\n",
        addr.port()
    );
    assert_eq!(status(exchange(&tcp, &named).await), "503");
    // The control socket checks no Host.
    assert_eq!(status(exchange(&control, forged).await), "200");
    for access in [&tcp, &control] {
        let (code, head, _) = call(access, "DELETE", "/stats").await;
        assert_eq!(code, 405);
        assert!(head.contains("\r\nallow: get, head"), "{head}");
        let (code, head, body) = call(access, "HEAD", "/ready").await;
        assert_eq!((code, body.as_str()), (503, ""));
        assert!(head.contains("content-length: 10"), "{head}");
    }
    server.stop().await;
}
