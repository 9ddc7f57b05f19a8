//! PROXY protocol v1 (text) and v2 (binary) headers, as HAProxy's specification defines them:
//! for users whose load balancer or iptables setup passes the original destination that way.
//!
//! The reader never consumes a byte past the header: it reads exactly what the header's own
//! framing says is still missing, so the payload that follows stays in the socket for the copy
//! loop or the HTTP server.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use proxy_core::config::proxy::ProxyProtocolMode;
use tokio::io::{AsyncRead, AsyncReadExt};

/// The v2 signature: `\r\n\r\n\0\r\nQUIT\n`.
const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// Longest v1 header, CRLF included (the specification's 107 bytes).
const V1_MAX: usize = 107;
/// Shortest header of either version ("PROXY UNKNOWN\r\n" is 15): reading this much first never
/// reads into the payload.
const MIN_PREFIX: usize = 8;
/// Fixed part of a v2 header.
const V2_FIXED: usize = 16;

/// What a header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProxyHeader {
    /// The client as the sender of the header saw it; `None` for `UNKNOWN` / `LOCAL` / `UNSPEC`.
    pub source: Option<SocketAddr>,
    /// The address the client dialled; `None` for `UNKNOWN` / `LOCAL` / `UNSPEC`.
    pub destination: Option<SocketAddr>,
}

/// Why a header was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ProxyProtocolError {
    /// The bytes are not a PROXY protocol header of an accepted version.
    #[error("not a PROXY protocol {expected} header")]
    NotAHeader {
        /// What was expected.
        expected: &'static str,
    },
    /// A v1 header that does not parse.
    #[error("malformed PROXY protocol v1 header: {0}")]
    BadV1(&'static str),
    /// A v2 header that does not parse.
    #[error("malformed PROXY protocol v2 header: {0}")]
    BadV2(&'static str),
    /// The peer closed or the read failed before the header was complete.
    #[error("reading the PROXY protocol header: {0}")]
    Io(#[from] std::io::Error),
    /// The header did not arrive in time.
    #[error("no PROXY protocol header within {0:?}")]
    Timeout(Duration),
}

/// Reads one header from `stream`, consuming exactly its bytes.
pub async fn read_header<S: AsyncRead + Unpin>(
    stream: &mut S,
    mode: ProxyProtocolMode,
    timeout: Duration,
) -> Result<ProxyHeader, ProxyProtocolError> {
    let read = async {
        let mut buf = Vec::with_capacity(V2_FIXED + 36);
        loop {
            let need = missing(&buf, mode)?;
            if need == 0 {
                return parse_complete(&buf, mode);
            }
            let start = buf.len();
            buf.resize(start + need, 0);
            stream.read_exact(&mut buf[start..]).await?;
        }
    };
    tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| ProxyProtocolError::Timeout(timeout))?
}

/// Bytes still needed before `buf` holds a complete header (0: it does).
fn missing(buf: &[u8], mode: ProxyProtocolMode) -> Result<usize, ProxyProtocolError> {
    if buf.len() < MIN_PREFIX {
        return Ok(MIN_PREFIX - buf.len());
    }
    if buf.starts_with(&V2_SIGNATURE[..MIN_PREFIX]) {
        accept(mode, ProxyProtocolMode::V2)?;
        if buf.len() < V2_FIXED {
            return Ok(V2_FIXED - buf.len());
        }
        let total = V2_FIXED + usize::from(u16::from_be_bytes([buf[14], buf[15]]));
        return Ok(total - buf.len());
    }
    if buf.starts_with(b"PROXY ") {
        accept(mode, ProxyProtocolMode::V1)?;
        if buf.ends_with(b"\r\n") {
            return Ok(0);
        }
        if buf.len() >= V1_MAX {
            return Err(ProxyProtocolError::BadV1("longer than 107 bytes"));
        }
        // One byte at a time: the line's end is not known in advance, and the payload follows.
        return Ok(1);
    }
    Err(ProxyProtocolError::NotAHeader {
        expected: expected(mode),
    })
}

fn accept(mode: ProxyProtocolMode, version: ProxyProtocolMode) -> Result<(), ProxyProtocolError> {
    if mode == ProxyProtocolMode::Any || mode == version {
        Ok(())
    } else {
        Err(ProxyProtocolError::NotAHeader {
            expected: expected(mode),
        })
    }
}

fn expected(mode: ProxyProtocolMode) -> &'static str {
    match mode {
        ProxyProtocolMode::V1 => "v1",
        ProxyProtocolMode::V2 => "v2",
        ProxyProtocolMode::Any | ProxyProtocolMode::Off => "v1 or v2",
    }
}

/// Parses a header at the start of `buf`: `Ok(None)` if more bytes are needed, otherwise the
/// header and its length.
pub fn parse(
    buf: &[u8],
    mode: ProxyProtocolMode,
) -> Result<Option<(ProxyHeader, usize)>, ProxyProtocolError> {
    let mut len = 0;
    loop {
        match missing(&buf[..len], mode)? {
            0 => return parse_complete(&buf[..len], mode).map(|h| Some((h, len))),
            need if len + need > buf.len() => return Ok(None),
            need => len += need,
        }
    }
}

fn parse_complete(buf: &[u8], mode: ProxyProtocolMode) -> Result<ProxyHeader, ProxyProtocolError> {
    if buf.starts_with(&V2_SIGNATURE[..MIN_PREFIX]) {
        accept(mode, ProxyProtocolMode::V2)?;
        parse_v2(buf)
    } else {
        accept(mode, ProxyProtocolMode::V1)?;
        parse_v1(buf)
    }
}

/// `PROXY TCP4|TCP6 <src> <dst> <sport> <dport>\r\n` or `PROXY UNKNOWN ...\r\n`.
fn parse_v1(line: &[u8]) -> Result<ProxyHeader, ProxyProtocolError> {
    let bad = ProxyProtocolError::BadV1;
    let line = line.strip_suffix(b"\r\n").ok_or(bad("no CRLF"))?;
    let line = std::str::from_utf8(line).map_err(|_| bad("not ASCII"))?;
    let mut words = line.split(' ');
    let (_proxy, family) = (words.next(), words.next().ok_or(bad("no protocol"))?);
    if family == "UNKNOWN" {
        return Ok(ProxyHeader {
            source: None,
            destination: None,
        });
    }
    let v6 = match family {
        "TCP4" => false,
        "TCP6" => true,
        _ => return Err(bad("protocol is not TCP4, TCP6 or UNKNOWN")),
    };
    let fields: Vec<&str> = words.collect();
    let [src, dst, sport, dport] = fields[..] else {
        return Err(bad("expected source, destination and two ports"));
    };
    let ip = |s: &str| -> Result<IpAddr, ProxyProtocolError> {
        let ip: IpAddr = s.parse().map_err(|_| bad("bad address"))?;
        if ip.is_ipv6() != v6 {
            return Err(bad("address family does not match the protocol"));
        }
        Ok(ip)
    };
    let port = |s: &str| -> Result<u16, ProxyProtocolError> {
        // The specification forbids leading zeros; "0" itself is a valid port.
        if s.is_empty() || (s.len() > 1 && s.starts_with('0')) {
            return Err(bad("bad port"));
        }
        s.parse().map_err(|_| bad("bad port"))
    };
    Ok(ProxyHeader {
        source: Some(SocketAddr::new(ip(src)?, port(sport)?)),
        destination: Some(SocketAddr::new(ip(dst)?, port(dport)?)),
    })
}

/// The binary header: signature, version/command, family/transport, length, addresses, TLVs.
fn parse_v2(buf: &[u8]) -> Result<ProxyHeader, ProxyProtocolError> {
    let bad = ProxyProtocolError::BadV2;
    if buf.len() < V2_FIXED || buf[..12] != V2_SIGNATURE {
        return Err(bad("bad signature"));
    }
    let (version, command) = (buf[12] >> 4, buf[12] & 0x0f);
    if version != 2 {
        return Err(bad("version is not 2"));
    }
    let body = &buf[V2_FIXED..];
    let none = ProxyHeader {
        source: None,
        destination: None,
    };
    match command {
        // LOCAL: the sender's own connection (health checks); addresses are to be ignored.
        0 => return Ok(none),
        1 => {}
        _ => return Err(bad("command is neither LOCAL nor PROXY")),
    }
    let (family, transport) = (buf[13] >> 4, buf[13] & 0x0f);
    if transport != 1 && family != 0 {
        return Err(bad("transport is not STREAM"));
    }
    match family {
        0 => Ok(none),
        1 => {
            let a = body.get(..12).ok_or(bad("short IPv4 address block"))?;
            let ip = |o: usize| IpAddr::V4(Ipv4Addr::new(a[o], a[o + 1], a[o + 2], a[o + 3]));
            let port = |o: usize| u16::from_be_bytes([a[o], a[o + 1]]);
            Ok(ProxyHeader {
                source: Some(SocketAddr::new(ip(0), port(8))),
                destination: Some(SocketAddr::new(ip(4), port(10))),
            })
        }
        2 => {
            let a = body.get(..36).ok_or(bad("short IPv6 address block"))?;
            let ip = |o: usize| {
                let octets: [u8; 16] = a[o..o + 16].try_into().expect("16 bytes");
                IpAddr::V6(Ipv6Addr::from(octets))
            };
            let port = |o: usize| u16::from_be_bytes([a[o], a[o + 1]]);
            Ok(ProxyHeader {
                source: Some(SocketAddr::new(ip(0), port(32))),
                destination: Some(SocketAddr::new(ip(16), port(34))),
            })
        }
        // AF_UNIX carries no socket address we could forward to.
        3 => Ok(none),
        _ => Err(bad("unknown address family")),
    }
}

/// Encodes a v2 PROXY header (used by tests and by callers that chain proxies).
pub fn encode_v2(source: SocketAddr, destination: SocketAddr) -> Vec<u8> {
    let mut out = V2_SIGNATURE.to_vec();
    out.push(0x21);
    if let (SocketAddr::V4(s), SocketAddr::V4(d)) = (source, destination) {
        out.extend_from_slice(&[0x11, 0, 12]);
        out.extend_from_slice(&s.ip().octets());
        out.extend_from_slice(&d.ip().octets());
    } else {
        let v6 = |a: SocketAddr| match a.ip() {
            IpAddr::V4(ip) => ip.to_ipv6_mapped().octets(),
            IpAddr::V6(ip) => ip.octets(),
        };
        out.extend_from_slice(&[0x21, 0, 36]);
        out.extend_from_slice(&v6(source));
        out.extend_from_slice(&v6(destination));
    }
    out.extend_from_slice(&source.port().to_be_bytes());
    out.extend_from_slice(&destination.port().to_be_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANY: ProxyProtocolMode = ProxyProtocolMode::Any;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn v1_tcp4_tcp6_and_unknown() {
        let text = b"PROXY TCP4 192.0.2.1 127.77.0.1 56324 443\r\nGET /";
        let (h, len) = parse(text, ANY).unwrap().unwrap();
        assert_eq!(len, text.len() - 5);
        assert_eq!(h.source, Some(sa("192.0.2.1:56324")));
        assert_eq!(h.destination, Some(sa("127.77.0.1:443")));
        let (h, _) = parse(b"PROXY TCP6 ::1 fd77::1 1 80\r\n", ANY)
            .unwrap()
            .unwrap();
        assert_eq!(h.destination, Some(sa("[fd77::1]:80")));
        let (h, len) = parse(b"PROXY UNKNOWN\r\nx", ANY).unwrap().unwrap();
        assert_eq!((h.destination, len), (None, 15));
    }

    #[test]
    fn v1_rejects_malformed() {
        for bad in [
            &b"PROXY TCP4 ::1 127.0.0.1 1 2\r\n"[..],
            b"PROXY TCP4 127.0.0.1 127.0.0.1 01 2\r\n",
            b"PROXY TCP4 127.0.0.1 127.0.0.1 1 70000\r\n",
            b"PROXY TCP5 127.0.0.1 127.0.0.1 1 2\r\n",
            b"PROXY TCP4 127.0.0.1 127.0.0.1 1\r\n",
        ] {
            assert!(
                parse(bad, ANY).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let long = [b"PROXY ".as_slice(), &[b'1'; 120]].concat();
        assert!(matches!(
            parse(&long, ANY),
            Err(ProxyProtocolError::BadV1(_))
        ));
        assert!(parse(b"GET / HTTP/1.1\r\n", ANY).is_err());
    }

    #[test]
    fn incomplete_asks_for_more() {
        assert!(parse(b"PROXY TCP4 1", ANY).unwrap().is_none());
        let v2 = encode_v2(sa("10.0.0.1:1000"), sa("127.77.0.1:80"));
        for cut in [3, 12, 16, v2.len() - 1] {
            assert!(parse(&v2[..cut], ANY).unwrap().is_none(), "cut {cut}");
        }
    }

    #[test]
    fn v2_inet_inet6_local_and_tlvs() {
        let v2 = encode_v2(sa("10.0.0.1:1000"), sa("127.77.0.1:80"));
        let (h, len) = parse(&[v2.as_slice(), b"payload"].concat(), ANY)
            .unwrap()
            .unwrap();
        assert_eq!(
            (h.source, h.destination, len),
            (Some(sa("10.0.0.1:1000")), Some(sa("127.77.0.1:80")), 28)
        );
        let v6 = encode_v2(sa("[::1]:5"), sa("[fd77::2]:8080"));
        let (h, len) = parse(&v6, ANY).unwrap().unwrap();
        assert_eq!((h.destination, len), (Some(sa("[fd77::2]:8080")), 52));
        // LOCAL command: no destination.
        let mut local = v2.clone();
        local[12] = 0x20;
        assert_eq!(parse(&local, ANY).unwrap().unwrap().0.destination, None);
        // A TLV after the addresses is skipped through the length field.
        let mut tlv = v2.clone();
        tlv[15] = 12 + 4;
        tlv.extend_from_slice(&[0x04, 0, 1, 0xaa, b'x']);
        let (h, len) = parse(&tlv, ANY).unwrap().unwrap();
        assert_eq!((h.destination, len), (Some(sa("127.77.0.1:80")), 32));
        // Bad version.
        let mut bad = v2;
        bad[12] = 0x11;
        assert!(matches!(
            parse(&bad, ANY),
            Err(ProxyProtocolError::BadV2(_))
        ));
    }

    #[test]
    fn mode_restricts_version() {
        let v2 = encode_v2(sa("10.0.0.1:1"), sa("127.0.0.1:2"));
        assert!(parse(&v2, ProxyProtocolMode::V1).is_err());
        assert!(parse(b"PROXY UNKNOWN\r\n", ProxyProtocolMode::V2).is_err());
        assert!(parse(&v2, ProxyProtocolMode::V2).unwrap().is_some());
    }

    #[tokio::test]
    async fn reader_stops_at_the_header() {
        let mut data: &[u8] = b"PROXY TCP4 127.0.0.2 127.0.0.3 1 2\r\nhello";
        let h = read_header(&mut data, ANY, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(h.destination, Some(sa("127.0.0.3:2")));
        assert_eq!(data, b"hello");
        let v2 = [
            encode_v2(sa("127.0.0.2:1"), sa("127.0.0.3:2")),
            b"rest".to_vec(),
        ]
        .concat();
        let mut data = v2.as_slice();
        read_header(&mut data, ANY, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(data, b"rest");
    }
}
