//! A real UDP echo server: socat on 127.0.0.1, every datagram sent back to its sender.
//!
//! The binary comes from the project's setup (`apt-get install -y socat`); missing, it is a test
//! failure, not a skip. Each server takes a port that was free a moment ago, keeps it across
//! [`UdpEcho::stop`] and [`UdpEcho::restart`], and is killed by its PID on drop.

use std::{
    io::Read as _,
    net::{SocketAddr, UdpSocket},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// How long socat may take to start echoing.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// A running `socat UDP4-RECVFROM:<port>,fork PIPE`.
pub struct UdpEcho {
    addr: SocketAddr,
    child: Option<Child>,
}

impl UdpEcho {
    /// Starts socat on a free loopback port and waits until it echoes.
    pub fn start() -> Self {
        crate::start_retrying("socat", 5, || {
            let probe = UdpSocket::bind("127.0.0.1:0").expect("binding a probe socket");
            let addr = probe.local_addr().expect("probe address");
            drop(probe);
            let mut echo = Self { addr, child: None };
            echo.spawn()?;
            Ok(echo)
        })
    }

    /// The address datagrams go to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Kills socat (its PID): the port is closed, datagrams to it draw ICMP port unreachable.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts socat again on the same port.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn()
            .unwrap_or_else(|log| panic!("socat did not restart on {}: {log}", self.addr));
    }

    /// Starts the child and waits until a datagram comes back; `Err` with its output when it
    /// exited or never echoed.
    fn spawn(&mut self) -> Result<(), String> {
        let listen = format!(
            "UDP4-RECVFROM:{},bind={},reuseaddr,fork",
            self.addr.port(),
            self.addr.ip()
        );
        let child = Command::new("socat")
            .args([listen.as_str(), "PIPE"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start socat (install it: apt-get install -y socat): {e}")
            });
        self.child = Some(child);
        let client = UdpSocket::bind("127.0.0.1:0").expect("binding a client socket");
        client
            .set_read_timeout(Some(Duration::from_millis(100)))
            .expect("read timeout");
        let deadline = Instant::now() + START_TIMEOUT;
        let mut buf = [0u8; 16];
        while Instant::now() < deadline {
            let _ = client.send_to(b"ready?", self.addr);
            if let Ok((n, from)) = client.recv_from(&mut buf)
                && from == self.addr
                && &buf[..n] == b"ready?"
            {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                let mut log = String::new();
                if let Some(mut err) = child.stderr.take() {
                    let _ = err.read_to_string(&mut log);
                }
                self.child = None;
                return Err(format!("socat exited ({status}): {log}"));
            }
        }
        self.stop();
        Err(format!(
            "socat did not echo on {} within {START_TIMEOUT:?}",
            self.addr
        ))
    }
}

impl Drop for UdpEcho {
    fn drop(&mut self) {
        self.stop();
    }
}
