//! Test servers in a test namespace ([`Servers`]: a thread per listener, one per connection),
//! a one-request HTTP server naming itself and the path it got, and GETs from inside a cgroup.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use crate::kernel::{InCgroup, Netns, TestCgroup};

/// Servers in the test namespace: a thread per listener, and one per connection running
/// `handle(connection, name)`. Stopped and joined on drop.
pub struct Servers {
    stop: Arc<AtomicBool>,
    addrs: Vec<SocketAddr>,
    netns: std::path::PathBuf,
    threads: Vec<JoinHandle<()>>,
}

impl Servers {
    pub fn start(
        netns: &Netns,
        servers: &[(SocketAddr, &str)],
        handle: fn(TcpStream, &str),
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for &(addr, name) in servers {
            let (stop, name, path) = (stop.clone(), name.to_owned(), netns.path());
            let (ready_tx, ready_rx) = std::sync::mpsc::channel();
            threads.push(std::thread::spawn(move || {
                proxy::enter_netns(&path).expect("entering the test namespace");
                let listener = TcpListener::bind(addr).expect("binding a test server");
                ready_tx.send(()).expect("test alive");
                for conn in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    if let Ok(conn) = conn {
                        let name = name.clone();
                        std::thread::spawn(move || handle(conn, &name));
                    }
                }
            }));
            ready_rx
                .recv_timeout(Duration::from_secs(5))
                .expect("test server started");
        }
        let addrs = servers.iter().map(|&(a, _)| a).collect();
        Self {
            stop,
            addrs,
            netns: netns.path(),
            threads,
        }
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let (addrs, path) = (self.addrs.clone(), self.netns.clone());
        // Wake the blocking accepts from inside the namespace.
        let waker = std::thread::spawn(move || {
            if proxy::enter_netns(&path).is_ok() {
                for addr in addrs {
                    let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(200));
                }
            }
        });
        let _ = waker.join();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Answers one HTTP/1.1 request with `<name> <path>`.
pub fn http_server(mut conn: TcpStream, name: &str) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 8192 {
        match conn.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    let path = String::from_utf8_lossy(&head)
        .split_whitespace()
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    let body = format!("{name} {path}");
    let _ = write!(
        conn,
        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// GETs `paths` on `vip` from inside the cgroup; the bodies, one per line.
pub fn get_in_cgroup(
    vip: SocketAddr,
    netns: &Netns,
    cgroup: &TestCgroup,
    paths: &[&str],
) -> Vec<String> {
    let paths: Vec<String> = paths.iter().map(|p| (*p).to_owned()).collect();
    let child = InCgroup::spawn(Some(cgroup.path()), netns, move || {
        let mut out = Vec::new();
        for path in paths {
            let body = (|| -> std::io::Result<String> {
                let mut s = TcpStream::connect_timeout(&vip, Duration::from_secs(2))?;
                s.set_read_timeout(Some(Duration::from_secs(5)))?;
                write!(
                    s,
                    "GET {path} HTTP/1.1\r\nhost: web\r\nconnection: close\r\n\r\n"
                )?;
                let mut text = String::new();
                s.read_to_string(&mut text)?;
                Ok(text
                    .split_once("\r\n\r\n")
                    .map(|(_, b)| b.to_owned())
                    .unwrap_or(text))
            })();
            out.push(body.unwrap_or_else(|e| format!("error: {e}")));
        }
        out.join("\n")
    });
    child
        .wait(Duration::from_secs(30))
        .lines()
        .map(str::to_owned)
        .collect()
}
