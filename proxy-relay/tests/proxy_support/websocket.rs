//! A minimal WebSocket (RFC 6455) echo server and client for the upgrade tests: the opening
//! handshake (`Sec-WebSocket-Accept` = base64 of SHA-1 over the key and the protocol's GUID) and
//! frames up to 64 KiB, over plain TCP on loopback.
//!
//! The server echoes text and binary messages, answers a close with a close and then closes its
//! socket; the message `close-please` makes it start the close itself. Every wait is bounded by
//! [`super::WAIT`].

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use base64::Engine as _;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};

use super::WAIT;

/// The GUID the handshake appends to the client's key (RFC 6455 section 1.3).
const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
/// Frame opcodes.
pub const TEXT: u8 = 0x1;
pub const CLOSE: u8 = 0x8;
/// Largest frame payload either side accepts here.
const MAX_PAYLOAD: usize = 64 * 1024;
/// Largest handshake head either side reads.
const MAX_HEAD: usize = 8 * 1024;
/// The second header byte's length value saying a 16-bit length follows.
const LEN_16: u8 = 0x7e;

/// The `Sec-WebSocket-Accept` value for `key`.
pub fn accept_key(key: &str) -> String {
    let digest = ring::digest::digest(
        &ring::digest::SHA1_FOR_LEGACY_USE_ONLY,
        format!("{key}{GUID}").as_bytes(),
    );
    base64::engine::general_purpose::STANDARD.encode(digest.as_ref())
}

/// Reads an HTTP head (through the blank line), bounded in size and time.
pub async fn read_head(stream: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert!(head.len() < MAX_HEAD, "HTTP head too long");
        let n = tokio::time::timeout(WAIT, stream.read(&mut byte))
            .await
            .expect("HTTP head in time")
            .expect("read the HTTP head");
        assert_eq!(n, 1, "connection closed inside the HTTP head: {head:?}");
        head.push(byte[0]);
    }
    String::from_utf8(head).expect("HTTP head is text")
}

/// The value of header `name` in `head` (case-insensitive name).
pub fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// Writes one frame; `mask` as a client must.
pub async fn write_frame(stream: &mut TcpStream, opcode: u8, payload: &[u8], mask: bool) {
    let mut frame = vec![0x80 | opcode];
    let mask_bit = if mask { 0x80 } else { 0 };
    match payload.len() {
        n @ 0..=125 => frame.push(mask_bit | u8::try_from(n).unwrap()),
        n => {
            frame.push(mask_bit | LEN_16);
            frame.extend_from_slice(&u16::try_from(n).unwrap().to_be_bytes());
        }
    }
    let key = [0x37, 0xfa, 0x21, 0x3d];
    if mask {
        frame.extend_from_slice(&key);
    }
    frame.extend(
        payload
            .iter()
            .enumerate()
            .map(|(i, b)| if mask { b ^ key[i % 4] } else { *b }),
    );
    stream.write_all(&frame).await.expect("write a frame");
}

/// Reads one frame: (opcode, unmasked payload); `None` at a clean end of stream before it.
pub async fn read_frame(stream: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    let mut head = [0u8; 2];
    let n = tokio::time::timeout(WAIT, stream.read(&mut head[..1]))
        .await
        .expect("a frame or the end of the stream in time")
        .expect("read a frame");
    if n == 0 {
        return None;
    }
    read_exact(stream, &mut head[1..]).await;
    let mut len = usize::from(head[1] & 0x7f);
    if len == usize::from(LEN_16) {
        let mut b = [0u8; 2];
        read_exact(stream, &mut b).await;
        len = usize::from(u16::from_be_bytes(b));
    }
    assert!(len <= MAX_PAYLOAD, "frame of {len} bytes");
    let mut key = [0u8; 4];
    if head[1] & 0x80 != 0 {
        read_exact(stream, &mut key).await;
    }
    let mut payload = vec![0u8; len];
    read_exact(stream, &mut payload).await;
    for (i, b) in payload.iter_mut().enumerate() {
        *b ^= key[i % 4];
    }
    Some((head[0] & 0x0f, payload))
}

async fn read_exact(stream: &mut TcpStream, buf: &mut [u8]) {
    tokio::time::timeout(WAIT, stream.read_exact(buf))
        .await
        .expect("frame bytes in time")
        .expect("frame bytes");
}

/// Whether the peer has closed its side: the next read returns end of stream (bounded wait).
pub async fn at_eof(stream: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(
        tokio::time::timeout(WAIT, stream.read(&mut b)).await,
        Ok(Ok(0))
    )
}

/// The WebSocket echo server.
pub struct EchoServer {
    pub addr: SocketAddr,
    /// Connections accepted.
    pub connections: Arc<AtomicUsize>,
    /// The request heads of the handshakes, in order.
    pub heads: Arc<std::sync::Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

impl EchoServer {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let heads = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (count, seen) = (connections.clone(), heads.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(echo(stream, seen.clone()));
            }
        });
        Self {
            addr,
            connections,
            heads,
            task,
        }
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One server connection: the handshake (400 without a key), then echo until a close.
async fn echo(mut stream: TcpStream, heads: Arc<std::sync::Mutex<Vec<String>>>) {
    let head = read_head(&mut stream).await;
    heads.lock().unwrap().push(head.clone());
    let Some(key) = header(&head, "sec-websocket-key") else {
        let _ = stream
            .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            .await;
        return;
    };
    let reply = format!(
        "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-accept: {}\r\n\r\n",
        accept_key(key)
    );
    stream.write_all(reply.as_bytes()).await.unwrap();
    while let Some((opcode, payload)) = read_frame(&mut stream).await {
        if opcode == CLOSE {
            write_frame(&mut stream, CLOSE, &payload, false).await;
            break;
        }
        if payload == b"close-please" {
            write_frame(&mut stream, CLOSE, &1000u16.to_be_bytes(), false).await;
            // The client's close answers ours; then the server closes the TCP connection.
            let answer = read_frame(&mut stream).await;
            assert_eq!(
                answer.map(|f| f.0),
                Some(CLOSE),
                "the client answers a close"
            );
            break;
        }
        write_frame(&mut stream, opcode, &payload, false).await;
    }
    let _ = stream.shutdown().await;
}

/// A client handshake on `stream` for `path` asking for `upgrade`; returns the response head.
pub async fn handshake(stream: &mut TcpStream, path: &str, upgrade: &str, key: &str) -> String {
    let req = format!(
        "GET {path} HTTP/1.1\r\nhost: svc\r\nconnection: Upgrade\r\nupgrade: {upgrade}\r\nsec-websocket-version: 13\r\nsec-websocket-key: {key}\r\n\r\n"
    );
    stream.write_all(req.as_bytes()).await.unwrap();
    read_head(stream).await
}
