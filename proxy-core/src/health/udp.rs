//! The UDP checker: one datagram to the host, healthy on the expected reply.
//!
//! Envoy has no UDP checker; this one follows its TCP checker where the two can agree. The
//! socket is connected to the host, so only the host's replies are read, and an ICMP port
//! unreachable (the host is up, nothing listens) surfaces as `ECONNREFUSED` on the next read: a
//! network failure at once, not after the timeout. A host that drops the datagram, or a
//! datagram lost on the way, leaves the check to its timeout; `unhealthy_threshold` absorbs a
//! loss as it absorbs any other single failure. One datagram per check, never retransmitted.
//!
//! Two forms (see [`UdpSpec`]):
//! - payload: `send` goes out as is; a reply holding every `receive` block in order (Envoy's
//!   fuzzy match, within one datagram) is healthy, any reply when `receive` is empty. A reply
//!   that does not match is skipped: the check waits for another until its timeout.
//! - DNS: a query for the name and type, recursion desired, a fresh random ID; a reply with
//!   that ID whose RCODE is the expected one is healthy, another RCODE is a failure counted
//!   towards the threshold (a resolver answers `SERVFAIL` for a moment when its own upstream
//!   stalls). Malformed replies and replies to another ID are skipped.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

use tokio::net::UdpSocket;

use super::{
    spec::{DnsProbe, UdpSpec},
    state::{CheckOutcome, FailureKind},
    tcp::fuzzy_match,
};

/// The bytes of a reply that are read; the rest of a longer datagram is cut off by the kernel.
/// A DNS answer to a query without EDNS fits in 512.
const MAX_REPLY_BYTES: usize = 4096;

const NETWORK: CheckOutcome = CheckOutcome::Failed(FailureKind::Network);

/// Runs one UDP check (no timeout here; the caller bounds it).
pub async fn check(addr: SocketAddr, spec: &UdpSpec) -> CheckOutcome {
    let any: SocketAddr = match addr {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let Ok(socket) = UdpSocket::bind(any).await else {
        return NETWORK;
    };
    if socket.connect(addr).await.is_err() {
        return NETWORK;
    }
    let id = fastrand::u16(..);
    let query;
    let datagram = match spec {
        UdpSpec::Payload { send, .. } => send.as_slice(),
        UdpSpec::Dns(probe) => {
            query = dns_query(id, probe);
            query.as_slice()
        }
    };
    if socket.send(datagram).await.is_err() {
        return NETWORK;
    }
    let mut reply = vec![0u8; MAX_REPLY_BYTES];
    loop {
        let Ok(n) = socket.recv(&mut reply).await else {
            return NETWORK;
        };
        if let Some(outcome) = judge(spec, id, &reply[..n]) {
            return outcome;
        }
    }
}

/// What one reply datagram says: an outcome, or `None` to wait for another.
pub fn judge(spec: &UdpSpec, id: u16, reply: &[u8]) -> Option<CheckOutcome> {
    match spec {
        UdpSpec::Payload { receive, .. } => {
            fuzzy_match(reply, receive).then_some(CheckOutcome::Healthy)
        }
        UdpSpec::Dns(probe) => {
            let rcode = dns_rcode(reply, id)?;
            Some(if rcode == probe.rcode {
                CheckOutcome::Healthy
            } else {
                CheckOutcome::Failed(FailureKind::Retriable)
            })
        }
    }
}

/// A standard query (opcode 0, RD set, one question of class IN) for `probe`.
pub fn dns_query(id: u16, probe: &DnsProbe) -> Vec<u8> {
    let mut q = Vec::with_capacity(12 + probe.qname.len() + 4);
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00]); // RD
    q.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0]); // QDCOUNT 1, no other sections
    q.extend_from_slice(&probe.qname);
    q.extend_from_slice(&probe.qtype.to_be_bytes());
    q.extend_from_slice(&1u16.to_be_bytes()); // IN
    q
}

/// The RCODE of `reply` if it is a response (QR set, opcode 0) to the query with `id`.
pub fn dns_rcode(reply: &[u8], id: u16) -> Option<u8> {
    let header = reply.get(..12)?;
    let is_response = header[2] & 0x80 != 0;
    let opcode = (header[2] >> 3) & 0x0f;
    (u16::from_be_bytes([header[0], header[1]]) == id && is_response && opcode == 0)
        .then_some(header[3] & 0x0f)
}

/// `name` (dots between labels, the root's dot optional) in wire form: each label 1 to 63
/// bytes of letters, digits, `-` or `_`, 255 bytes in all.
pub fn dns_qname(name: &str) -> Result<Vec<u8>, &'static str> {
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() {
        return Err("it is empty (the root is not a name to check)");
    }
    let mut wire = Vec::with_capacity(name.len() + 2);
    for label in name.split('.') {
        if label.is_empty() {
            return Err("it has an empty label");
        }
        if label.len() > 63 {
            return Err("a label is longer than 63 bytes");
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err("a label holds a character other than a letter, digit, `-` or `_`");
        }
        wire.push(label.len() as u8);
        wire.extend_from_slice(label.as_bytes());
    }
    wire.push(0);
    if wire.len() > 255 {
        return Err("it is longer than 255 bytes");
    }
    Ok(wire)
}

/// Query types a check may ask for, by name.
pub const QUERY_TYPES: &[(&str, u16)] = &[
    ("A", 1),
    ("NS", 2),
    ("CNAME", 5),
    ("SOA", 6),
    ("PTR", 12),
    ("MX", 15),
    ("TXT", 16),
    ("AAAA", 28),
    ("SRV", 33),
];

/// RCODEs a check may expect, by name.
pub const RCODES: &[(&str, u8)] = &[
    ("NOERROR", 0),
    ("FORMERR", 1),
    ("SERVFAIL", 2),
    ("NXDOMAIN", 3),
    ("NOTIMP", 4),
    ("REFUSED", 5),
];

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(rcode: u8) -> UdpSpec {
        UdpSpec::Dns(DnsProbe {
            qname: dns_qname("health.svc.test.").unwrap(),
            qtype: 1,
            rcode,
        })
    }

    fn reply(id: u16, flags: [u8; 2]) -> Vec<u8> {
        let mut r = id.to_be_bytes().to_vec();
        r.extend_from_slice(&flags);
        r.extend_from_slice(&[0; 8]);
        r
    }

    #[test]
    fn the_query_is_a_standard_recursive_question() {
        let DnsProbe { qname, .. } = match probe(0) {
            UdpSpec::Dns(p) => p,
            UdpSpec::Payload { .. } => unreachable!(),
        };
        assert_eq!(qname, b"\x06health\x03svc\x04test\x00");
        let q = dns_query(
            0xabcd,
            &DnsProbe {
                qname,
                qtype: 28,
                rcode: 0,
            },
        );
        assert_eq!(&q[..12], &[0xab, 0xcd, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&q[q.len() - 4..], &[0, 28, 0, 1]);
    }

    #[test]
    fn only_a_response_to_our_id_decides() {
        let spec = probe(0);
        // NOERROR, QR set.
        assert_eq!(
            judge(&spec, 7, &reply(7, [0x81, 0x80])),
            Some(CheckOutcome::Healthy)
        );
        // NXDOMAIN where NOERROR is expected: a counted failure.
        assert_eq!(
            judge(&spec, 7, &reply(7, [0x81, 0x83])),
            Some(CheckOutcome::Failed(FailureKind::Retriable))
        );
        assert_eq!(
            judge(&probe(3), 7, &reply(7, [0x81, 0x83])),
            Some(CheckOutcome::Healthy)
        );
        // Another ID, a query rather than a response, another opcode, a short datagram: skipped.
        assert_eq!(judge(&spec, 7, &reply(8, [0x81, 0x80])), None);
        assert_eq!(judge(&spec, 7, &reply(7, [0x01, 0x00])), None);
        assert_eq!(judge(&spec, 7, &reply(7, [0x91, 0x80])), None);
        assert_eq!(judge(&spec, 7, &[0, 7, 0x81]), None);
        assert_eq!(judge(&spec, 7, &[]), None);
    }

    #[test]
    fn a_payload_reply_matches_within_one_datagram() {
        let spec = UdpSpec::Payload {
            send: b"PING".to_vec(),
            receive: vec![b"PO".to_vec(), b"NG".to_vec()],
        };
        assert_eq!(judge(&spec, 0, b"xPONGx"), Some(CheckOutcome::Healthy));
        assert_eq!(judge(&spec, 0, b"NGPO"), None);
        let any = UdpSpec::Payload {
            send: b"PING".to_vec(),
            receive: vec![],
        };
        assert_eq!(judge(&any, 0, b""), Some(CheckOutcome::Healthy));
    }

    #[test]
    fn names_are_checked_label_by_label() {
        assert_eq!(dns_qname("a.b").unwrap(), b"\x01a\x01b\x00");
        assert_eq!(
            dns_qname("_dns._udp.x.").unwrap(),
            b"\x04_dns\x04_udp\x01x\x00"
        );
        assert!(dns_qname("").is_err());
        assert!(dns_qname(".").is_err());
        assert!(dns_qname("a..b").is_err());
        assert!(dns_qname("a b.c").is_err());
        assert!(dns_qname(&"x".repeat(64)).is_err());
        let long = vec!["x".repeat(63); 4].join(".");
        assert!(dns_qname(&long).is_err(), "{} bytes", long.len() + 2);
        assert!(dns_qname(&vec!["x".repeat(63); 3].join(".")).is_ok());
    }
}
