//! The TCP checker: connect, optionally send a payload, and fuzzy-match the response.
//!
//! "Fuzzy" is Envoy's rule: each expected block must appear somewhere in the bytes received so
//! far, after the end of the previous block's match. Data that does not (yet) match is not a
//! failure by itself; the check keeps reading until the blocks match, the peer closes (a network
//! failure) or the timeout fires.

use std::net::SocketAddr;

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

use super::{
    spec::TcpSpec,
    state::{CheckOutcome, FailureKind},
};

/// The most response bytes kept while waiting for a match; a peer that sends more without
/// matching fails the check rather than growing the buffer forever.
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

const NETWORK: CheckOutcome = CheckOutcome::Failed(FailureKind::Network);

/// Runs one TCP check (no timeout here; the caller bounds it).
pub async fn check(addr: SocketAddr, spec: &TcpSpec) -> CheckOutcome {
    let Ok(mut stream) = TcpStream::connect(addr).await else {
        return NETWORK;
    };
    if !spec.send.is_empty() && stream.write_all(&spec.send).await.is_err() {
        return NETWORK;
    }
    if spec.receive.is_empty() {
        return CheckOutcome::Healthy;
    }
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return NETWORK,
            Ok(n) => received.extend_from_slice(&chunk[..n]),
        }
        if fuzzy_match(&received, &spec.receive) {
            return CheckOutcome::Healthy;
        }
        if received.len() > MAX_RESPONSE_BYTES {
            return NETWORK;
        }
    }
}

/// Whether every block occurs in `data`, in order, without overlapping.
pub fn fuzzy_match(data: &[u8], blocks: &[Vec<u8>]) -> bool {
    let mut start = 0;
    for block in blocks {
        if block.is_empty() {
            continue;
        }
        let Some(pos) = data.get(start..).and_then(|rest| find(rest, block)) else {
            return false;
        };
        start += pos + block.len();
    }
    true
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_must_appear_in_order() {
        let blocks = vec![b"PO".to_vec(), b"NG".to_vec()];
        assert!(fuzzy_match(b"xxPOyyNGzz", &blocks));
        assert!(fuzzy_match(b"PONG", &blocks));
        assert!(!fuzzy_match(b"NGPO", &blocks));
        assert!(!fuzzy_match(b"PON", &blocks));
        assert!(fuzzy_match(b"anything", &[]));
    }
}
