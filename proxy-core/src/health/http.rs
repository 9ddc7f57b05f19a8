//! The HTTP/1.1 checker: `GET path` with a `Host` header, judged on the status and headers.
//!
//! Verdicts, in Envoy's order: `x-envoy-immediate-health-check-fail` fails at once; a status in
//! `expected_statuses` passes (degraded with `x-envoy-degraded`) unless `service_name_matcher`
//! rejects `x-envoy-upstream-healthchecked-cluster`; a status in `retriable_statuses` counts
//! towards `unhealthy_threshold`; any other status fails at once. Only the status line and the
//! headers are read; the body is ignored. A malformed response is a network failure.

use std::net::SocketAddr;

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

use super::{
    spec::{HttpSpec, StatusRange},
    state::{CheckOutcome, FailureKind},
};

/// Largest response head (status line plus headers) accepted.
const MAX_HEAD_BYTES: usize = 16 * 1024;

const NETWORK: CheckOutcome = CheckOutcome::Failed(FailureKind::Network);

/// A parsed response head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-cased, in arrival order.
    pub headers: Vec<(String, String)>,
}

impl ResponseHead {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Runs one HTTP check (no timeout here; the caller bounds it).
pub async fn check(addr: SocketAddr, spec: &HttpSpec) -> CheckOutcome {
    let Ok(mut stream) = TcpStream::connect(addr).await else {
        return NETWORK;
    };
    if stream.write_all(request(spec).as_bytes()).await.is_err() {
        return NETWORK;
    }
    match read_head(&mut stream).await {
        Some(head) => judge(&head, spec),
        None => NETWORK,
    }
}

/// The request bytes; `Connection: close` because connections are not reused.
pub fn request(spec: &HttpSpec) -> String {
    format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: Envoy/HC\r\nConnection: close\r\n\r\n",
        spec.path, spec.host
    )
}

async fn read_head(stream: &mut TcpStream) -> Option<ResponseHead> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    loop {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return parse_head(&buf[..end]);
        }
        if buf.len() > MAX_HEAD_BYTES {
            return None;
        }
    }
}

/// Parses `HTTP/1.x NNN reason\r\nname: value\r\n...` (without the final blank line).
pub fn parse_head(head: &[u8]) -> Option<ResponseHead> {
    let text = std::str::from_utf8(head).ok()?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next()?;
    let mut parts = status_line.splitn(3, ' ');
    if !parts.next()?.starts_with("HTTP/1.") {
        return None;
    }
    let status: u16 = parts.next()?.parse().ok()?;
    if !(100..600).contains(&status) {
        return None;
    }
    let headers = lines
        .map(|line| {
            let (name, value) = line.split_once(':')?;
            Some((name.trim().to_ascii_lowercase(), value.trim().to_owned()))
        })
        .collect::<Option<Vec<_>>>()?;
    Some(ResponseHead { status, headers })
}

/// Turns a response head into a verdict.
pub fn judge(head: &ResponseHead, spec: &HttpSpec) -> CheckOutcome {
    if head.header("x-envoy-immediate-health-check-fail").is_some() {
        return CheckOutcome::Failed(FailureKind::Immediate);
    }
    if !StatusRange::any_contains(&spec.expected_statuses, head.status) {
        return if StatusRange::any_contains(&spec.retriable_statuses, head.status) {
            CheckOutcome::Failed(FailureKind::Retriable)
        } else {
            CheckOutcome::Failed(FailureKind::Immediate)
        };
    }
    if let Some(matcher) = &spec.service_name_matcher {
        let cluster = head
            .header("x-envoy-upstream-healthchecked-cluster")
            .unwrap_or("");
        if !matcher.matches(cluster) {
            return CheckOutcome::Failed(FailureKind::Immediate);
        }
    }
    if head.header("x-envoy-degraded").is_some() {
        CheckOutcome::Degraded
    } else {
        CheckOutcome::Healthy
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::spec::StringMatch;

    fn spec() -> HttpSpec {
        HttpSpec {
            host: "svc".into(),
            path: "/healthz".into(),
            expected_statuses: vec![StatusRange {
                start: 200,
                end: 201,
            }],
            retriable_statuses: vec![StatusRange {
                start: 503,
                end: 504,
            }],
            service_name_matcher: None,
        }
    }

    fn head(status: u16, headers: &[(&str, &str)]) -> ResponseHead {
        let headers = headers
            .iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect();
        ResponseHead { status, headers }
    }

    #[test]
    fn statuses_map_to_verdicts() {
        let s = spec();
        assert_eq!(judge(&head(200, &[]), &s), CheckOutcome::Healthy);
        assert_eq!(
            judge(&head(201, &[]), &s),
            CheckOutcome::Failed(FailureKind::Immediate)
        );
        assert_eq!(
            judge(&head(503, &[]), &s),
            CheckOutcome::Failed(FailureKind::Retriable)
        );
        assert_eq!(
            judge(&head(500, &[]), &s),
            CheckOutcome::Failed(FailureKind::Immediate)
        );
        assert_eq!(
            judge(&head(200, &[("x-envoy-degraded", "")]), &s),
            CheckOutcome::Degraded
        );
        let fail = head(200, &[("x-envoy-immediate-health-check-fail", "true")]);
        assert_eq!(
            judge(&fail, &s),
            CheckOutcome::Failed(FailureKind::Immediate)
        );
    }

    #[test]
    fn service_name_matcher_checks_the_header() {
        let mut s = spec();
        s.service_name_matcher = Some(StringMatch::Prefix("locations".into(), false));
        let ok = head(
            200,
            &[("x-envoy-upstream-healthchecked-cluster", "locations-prod")],
        );
        assert_eq!(judge(&ok, &s), CheckOutcome::Healthy);
        let bad = head(200, &[("x-envoy-upstream-healthchecked-cluster", "users")]);
        assert_eq!(
            judge(&bad, &s),
            CheckOutcome::Failed(FailureKind::Immediate)
        );
        assert_eq!(
            judge(&head(200, &[]), &s),
            CheckOutcome::Failed(FailureKind::Immediate)
        );
    }

    #[test]
    fn parses_heads_and_builds_requests() {
        let h = parse_head(b"HTTP/1.1 503 Service Unavailable\r\nX-Envoy-Degraded: 1").unwrap();
        assert_eq!(h.status, 503);
        assert_eq!(h.header("x-envoy-degraded"), Some("1"));
        assert!(parse_head(b"garbage").is_none());
        assert!(parse_head(b"HTTP/1.1 99 x").is_none());
        assert!(request(&spec()).starts_with("GET /healthz HTTP/1.1\r\nHost: svc\r\n"));
    }
}
