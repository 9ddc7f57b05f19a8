//! The harness's HTTP/1.0 client, for Consul's API, the xDS server's control port and the
//! daemons' /ready: one call per connection, no chunked answers.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::Context as _;

/// Bound of one call.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// One HTTP/1.0 call (no chunked answers); `(status, body)`.
pub fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> anyhow::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, CALL_TIMEOUT)
        .with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(CALL_TIMEOUT))?;
    let body = body.unwrap_or("");
    // One buffer, one write: `write!` on the socket itself would send each formatted piece as
    // its own segment.
    let request = format!(
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes())
        .with_context(|| format!("sending {method} {path} to {addr}"))?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)
        .with_context(|| format!("{method} {path} on {addr}"))?;
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("{method} {path} on {addr}: no HTTP status"))?;
    let text = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Ok((status, text.to_owned()))
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    #[test]
    fn a_call_sends_the_body_and_reads_status_and_body() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            c.set_read_timeout(Some(CALL_TIMEOUT)).unwrap();
            // Read the whole request before answering: closing with unread bytes would reset
            // the connection under the client's read.
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while !request.ends_with(b"\r\n\r\nabc") {
                let n = c.read(&mut buf).unwrap();
                assert!(n > 0, "EOF after {:?}", String::from_utf8_lossy(&request));
                request.extend_from_slice(&buf[..n]);
            }
            c.write_all(b"HTTP/1.0 201 Created\r\nX: y\r\n\r\n{\"ok\":1}")
                .unwrap();
            String::from_utf8_lossy(&request).into_owned()
        });
        let (status, body) = call(addr, "PUT", "/v1/x", Some("abc")).unwrap();
        assert_eq!((status, body.as_str()), (201, "{\"ok\":1}"));
        let request = server.join().unwrap();
        assert!(request.starts_with("PUT /v1/x HTTP/1.0\r\n"), "{request}");
        assert!(
            request.contains("Content-Length: 3\r\n") && request.ends_with("\r\n\r\nabc"),
            "{request}"
        );
    }
}
