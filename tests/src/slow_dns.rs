//! A DNS server that answers late, in a test's network namespace: a cluster resolved through it
//! gets its first discovery result [`SLOW_ANSWER`] after it asked, which shows whatever waits (or
//! should wait) for a cluster's first hosts.

use std::{
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use crate::kernel::Netns;

/// How long [`SlowDns`] takes to answer.
pub const SLOW_ANSWER: Duration = Duration::from_millis(1500);

/// A DNS server that answers each A question with one address, [`SLOW_ANSWER`] after it came
/// (other questions get an empty answer). Stopped on drop.
pub struct SlowDns {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl SlowDns {
    /// Listens on `listen` (UDP) in `netns` and answers A questions with `answer`.
    pub fn start(netns: &Netns, listen: SocketAddr, answer: Ipv4Addr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (flag, path) = (stop.clone(), netns.path());
        let thread = std::thread::spawn(move || {
            proxy::enter_netns(&path).expect("entering the test namespace");
            let socket = UdpSocket::bind(listen).expect("binding the DNS server");
            socket
                .set_read_timeout(Some(Duration::from_millis(100)))
                .expect("timeout");
            ready_tx.send(()).expect("test alive");
            let mut buf = [0u8; 512];
            while !flag.load(Ordering::SeqCst) {
                let Ok((n, from)) = socket.recv_from(&mut buf) else {
                    continue;
                };
                if let Some(reply) = dns_reply(&buf[..n], answer) {
                    std::thread::sleep(SLOW_ANSWER);
                    let _ = socket.send_to(&reply, from);
                }
            }
        });
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("DNS server started");
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for SlowDns {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The answer to a one-question DNS `query`: `addr` for an A question, no record otherwise.
/// `None` for what is not a one-question query.
fn dns_reply(query: &[u8], addr: Ipv4Addr) -> Option<Vec<u8>> {
    if query.len() < 12 || query[4..6] != [0, 1] {
        return None;
    }
    // The question: labels up to the root, then type and class.
    let mut at = 12;
    while *query.get(at)? != 0 {
        at += 1 + usize::from(query[at]);
    }
    let end = at + 5;
    let qtype = query.get(at + 1..at + 3)?;
    let is_a = qtype == [0, 1];
    let mut reply = Vec::with_capacity(end + 16);
    reply.extend_from_slice(&query[..2]);
    // QR, RD, RA, no error; one question, one or no answer, nothing else.
    reply.extend_from_slice(&[0x81, 0x80, 0, 1, 0, u8::from(is_a), 0, 0, 0, 0]);
    reply.extend_from_slice(query.get(12..end)?);
    if is_a {
        // A pointer to the question's name, A, IN, TTL 300, four bytes.
        reply.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 1, 0x2c, 0, 4]);
        reply.extend_from_slice(&addr.octets());
    }
    Some(reply)
}
