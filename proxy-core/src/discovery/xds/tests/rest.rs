//! REST-JSON polling against a scripted HTTP/1.1 server on 127.0.0.1: ACK, NACK with
//! error_detail on the next poll, failures keep the hosts.

use std::time::Duration;

use serde_json::{Value, json};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::mpsc,
};

use super::fixtures::{WAIT, ports, wait_for};
use crate::{
    config::sources::xds::{EdsWatch, NodeConfig, Transport, XdsSource},
    discovery::xds::{CLA_TYPE_URL, EDS_REST_PATH, spawn_eds},
};

/// One scripted answer: status and body.
type Answer = (u16, String);

/// Serves one answer per connection from `answers` (the last one repeats) and reports each
/// request's path and JSON body.
async fn serve(
    listener: TcpListener,
    answers: Vec<Answer>,
    seen: mpsc::UnboundedSender<(String, Value)>,
) {
    for index in 0.. {
        let Ok((mut socket, _)) = listener.accept().await else {
            return;
        };
        let (path, body) = read_request(&mut socket).await;
        let _ = seen.send((path, serde_json::from_slice(&body).unwrap_or(Value::Null)));
        let (status, body) = &answers[index.min(answers.len() - 1)];
        let head = format!(
            "HTTP/1.1 {status} X\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        let _ = socket.write_all(format!("{head}{body}").as_bytes()).await;
    }
}

async fn read_request(socket: &mut TcpStream) -> (String, Vec<u8>) {
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = socket.read(&mut buf).await.expect("read request");
        assert!(n > 0, "client closed before a full request");
        data.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&data).to_string();
        let Some(end) = text.find("\r\n\r\n") else {
            continue;
        };
        let length = text[..end]
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().parse::<usize>().unwrap())
            })
            .unwrap_or(0);
        if data.len() >= end + 4 + length {
            let path = text
                .split_whitespace()
                .nth(1)
                .unwrap_or_default()
                .to_owned();
            return (path, data[end + 4..end + 4 + length].to_vec());
        }
    }
}

#[expect(clippy::needless_pass_by_value, reason = "called with json! literals")]
fn answer(version: &str, nonce: &str, port: Value) -> Answer {
    let body = json!({
        "versionInfo": version,
        "nonce": nonce,
        "typeUrl": CLA_TYPE_URL,
        "resources": [{
            "@type": CLA_TYPE_URL,
            "clusterName": "web",
            "endpoints": [{"lbEndpoints": [{
                "endpoint": {"address": {"socketAddress": {"address": "127.0.0.1", "portValue": port}}},
                "healthStatus": "HEALTHY"
            }]}]
        }]
    });
    (200, body.to_string())
}

#[tokio::test]
async fn rest_polls_acks_nacks_and_keeps_hosts_on_failure() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let answers = vec![
        answer("1", "r1", json!(7001)),
        answer("2", "r2", json!(70000)),
        answer("3", "r3", json!("7003")),
        (500, "boom".to_owned()),
    ];
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let server = tokio::spawn(serve(listener, answers, seen_tx));
    let source = XdsSource {
        transport: Transport::Rest {
            uri: format!("http://{addr}"),
            refresh_delay: Duration::from_millis(20),
            request_timeout: Duration::from_secs(2),
        },
        node: NodeConfig {
            id: "node-1".into(),
            cluster: "edge".into(),
            ..NodeConfig::default()
        },
        initial_fetch_timeout: Duration::ZERO,
        backoff: (Duration::from_millis(20), Duration::from_millis(40)),
        tls: None,
    };
    let client = spawn_eds(
        source,
        vec![EdsWatch {
            cluster: "web".into(),
            resource: "web".into(),
        }],
    )
    .unwrap();
    let mut updates = client.updates("web").unwrap();
    let mut next = async || {
        tokio::time::timeout(WAIT, seen.recv())
            .await
            .expect("a poll")
            .expect("server alive")
    };

    let (path, first) = next().await;
    assert_eq!(path, EDS_REST_PATH);
    assert_eq!(
        first,
        json!({
            "node": {
                "id": "node-1",
                "cluster": "edge",
                "userAgentName": "proxy",
                "userAgentVersion": env!("CARGO_PKG_VERSION")
            },
            "resourceNames": ["web"],
            "typeUrl": CLA_TYPE_URL
        })
    );
    let (_, second) = next().await;
    assert_eq!(
        (
            second["versionInfo"].as_str(),
            second["responseNonce"].as_str()
        ),
        (Some("1"), Some("r1"))
    );
    assert!(second.get("errorDetail").is_none());
    let (_, third) = next().await;
    assert_eq!(
        (
            third["versionInfo"].as_str(),
            third["responseNonce"].as_str()
        ),
        (Some("1"), Some("r2"))
    );
    let message = third["errorDetail"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("value must be less than or equal to 65535"),
        "{third}"
    );
    let (_, fourth) = next().await;
    assert_eq!(fourth["versionInfo"].as_str(), Some("3"));
    assert!(fourth.get("errorDetail").is_none());
    let update = wait_for(&mut updates, "REST v3", |u| u.version_info == "3").await;
    assert_eq!(ports(&update), [7003]);
    // The fourth answer is a 500 (repeated): failures counted, hosts kept.
    let _ = next().await;
    let deadline = tokio::time::Instant::now() + WAIT;
    let stats = || client.cluster_stats("web").unwrap().values().source;
    while stats().update_failure < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a 500 must count as a failure"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(ports(&client.current("web").unwrap()), [7003]);
    let stats = stats();
    assert_eq!((stats.update_success, stats.update_rejected), (2, 1));
    server.abort();
}
