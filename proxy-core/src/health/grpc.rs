//! The gRPC checker: `grpc.health.v1.Health/Check` over cleartext HTTP/2 (h2c, prior knowledge).
//!
//! The two messages are tiny, so they are encoded by hand rather than through generated code:
//! `HealthCheckRequest { string service = 1; }` and
//! `HealthCheckResponse { ServingStatus status = 1; }` with `SERVING = 1`.
//! Transport errors are network failures; a non-200 HTTP status, a non-zero `grpc-status` or any
//! status other than SERVING fail at once (Envoy reports them as active failures).

use std::net::SocketAddr;

use bytes::{Buf, Bytes, BytesMut};
use tokio::net::TcpStream;

use super::{
    spec::GrpcSpec,
    state::{CheckOutcome, FailureKind},
};

/// Largest response body accepted.
const MAX_BODY_BYTES: usize = 64 * 1024;
/// `ServingStatus.SERVING`.
const SERVING: u64 = 1;

const NETWORK: CheckOutcome = CheckOutcome::Failed(FailureKind::Network);
const FAILED: CheckOutcome = CheckOutcome::Failed(FailureKind::Immediate);

/// Runs one gRPC health check (no timeout here; the caller bounds it).
pub async fn check(addr: SocketAddr, spec: &GrpcSpec) -> CheckOutcome {
    let Ok(tcp) = TcpStream::connect(addr).await else {
        return NETWORK;
    };
    let Ok((client, connection)) = h2::client::handshake(tcp).await else {
        return NETWORK;
    };
    let driver = tokio::spawn(async move {
        // Ends with the connection; its error surfaces through the stream as well.
        let _ = connection.await;
    });
    let outcome = call(client, spec).await;
    driver.abort();
    outcome
}

async fn call(client: h2::client::SendRequest<Bytes>, spec: &GrpcSpec) -> CheckOutcome {
    let Ok(request) = http::Request::builder()
        .method(http::Method::POST)
        .uri(format!(
            "http://{}/grpc.health.v1.Health/Check",
            spec.authority
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("user-agent", "Envoy/HC")
        .body(())
    else {
        return FAILED;
    };
    let Ok(mut client) = client.ready().await else {
        return NETWORK;
    };
    let Ok((response, mut send)) = client.send_request(request, false) else {
        return NETWORK;
    };
    if send
        .send_data(frame(&encode_request(&spec.service_name)), true)
        .is_err()
    {
        return NETWORK;
    }
    let Ok(response) = response.await else {
        return NETWORK;
    };
    if response.status() != http::StatusCode::OK {
        return FAILED;
    }
    // A trailers-only response (grpc-status in the headers) carries no message, so it can not
    // report SERVING.
    if response.headers().contains_key("grpc-status") {
        return FAILED;
    }
    read_reply(response.into_body()).await
}

async fn read_reply(mut body: h2::RecvStream) -> CheckOutcome {
    let mut buf = BytesMut::new();
    while let Some(chunk) = body.data().await {
        let Ok(chunk) = chunk else {
            return NETWORK;
        };
        let _ = body.flow_control().release_capacity(chunk.len());
        buf.extend_from_slice(&chunk);
        if buf.len() > MAX_BODY_BYTES {
            return NETWORK;
        }
    }
    let Ok(trailers) = body.trailers().await else {
        return NETWORK;
    };
    let grpc_ok = trailers
        .as_ref()
        .and_then(|t| t.get("grpc-status"))
        .is_some_and(|s| s == "0");
    if !grpc_ok {
        return FAILED;
    }
    match unframe(&buf).and_then(decode_status) {
        Some(SERVING) => CheckOutcome::Healthy,
        Some(_) => FAILED,
        None => NETWORK,
    }
}

/// Encodes `HealthCheckRequest`; an empty service is the default and is omitted (proto3).
pub fn encode_request(service: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(service.len() + 6);
    if !service.is_empty() {
        out.push(0x0a); // field 1, wire type 2 (length-delimited)
        put_varint(&mut out, service.len() as u64);
        out.extend_from_slice(service.as_bytes());
    }
    out
}

/// Wraps a message in a gRPC length-prefixed frame (uncompressed).
pub fn frame(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + message.len());
    out.extend_from_slice(&[0]);
    out.extend_from_slice(
        &u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(message);
    out.freeze()
}

/// The first message of a gRPC body, if it is complete and uncompressed.
pub fn unframe(body: &[u8]) -> Option<&[u8]> {
    let (&flag, rest) = body.split_first()?;
    if flag != 0 || rest.len() < 4 {
        return None;
    }
    let len = u32::from_be_bytes(rest[..4].try_into().ok()?) as usize;
    rest.get(4..4 + len)
}

/// `HealthCheckResponse.status` (0 = UNKNOWN when absent); `None` if the message is malformed.
pub fn decode_status(mut msg: &[u8]) -> Option<u64> {
    let mut status = 0;
    while msg.has_remaining() {
        let key = get_varint(&mut msg)?;
        match (key >> 3, key & 7) {
            (1, 0) => status = get_varint(&mut msg)?,
            (_, 0) => {
                get_varint(&mut msg)?;
            }
            (_, 1) => msg = msg.get(8..)?,
            (_, 2) => {
                let len = usize::try_from(get_varint(&mut msg)?).ok()?;
                msg = msg.get(len..)?;
            }
            (_, 5) => msg = msg.get(4..)?,
            _ => return None,
        }
    }
    Some(status)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(msg: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = msg.split_first()?;
        *msg = rest;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_and_response_round_trip() {
        assert_eq!(encode_request(""), Vec::<u8>::new());
        assert_eq!(encode_request("ab"), vec![0x0a, 2, b'a', b'b']);
        let framed = frame(&[0x08, 0x01]);
        assert_eq!(&framed[..], &[0, 0, 0, 0, 2, 0x08, 0x01]);
        assert_eq!(unframe(&framed).and_then(decode_status), Some(SERVING));
        // NOT_SERVING, plus an unknown length-delimited field that must be skipped.
        assert_eq!(decode_status(&[0x12, 1, b'x', 0x08, 0x02]), Some(2));
        assert_eq!(decode_status(&[]), Some(0));
        assert_eq!(decode_status(&[0x08]), None);
        assert_eq!(unframe(&[1, 0, 0, 0, 0]), None);
    }
}
