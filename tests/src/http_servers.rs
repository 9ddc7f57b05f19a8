//! Test servers in a test namespace ([`Servers`]: a thread per listener, one per connection),
//! a one-request HTTP server naming itself and the path it got, a keep-alive backend that holds
//! each request until released ([`HoldingBackend`]), and GETs from inside a cgroup.

use std::{
    collections::HashSet,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
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

/// How long a [`HoldingBackend`] holds a request at most, and waits for anything.
const HOLD_BOUND: Duration = Duration::from_secs(20);

/// A backend's state: requests held now, paths answered 503 once, whether released, whether
/// its accept loop is to end.
#[derive(Default)]
struct Gate {
    held: usize,
    failed: HashSet<String>,
    released: bool,
    stopping: bool,
}

/// An HTTP/1.1 backend (keep-alive) that holds each request until released; a path under
/// `/fail-once/` is answered 503 at once the first time it comes.
pub struct HoldingBackend {
    gate: Arc<(Mutex<Gate>, Condvar)>,
    addr: SocketAddr,
    netns: std::path::PathBuf,
    accept: Option<std::thread::JoinHandle<()>>,
}

impl HoldingBackend {
    /// Starts listening at `addr` in `netns`.
    pub fn start(netns: &Netns, addr: SocketAddr) -> Self {
        let gate = Arc::new((Mutex::new(Gate::default()), Condvar::new()));
        let listener = crate::kernel::in_netns(netns, move || {
            TcpListener::bind(addr).expect("backend binds")
        })
        .join()
        .expect("binding in the namespace");
        let g = gate.clone();
        let accept = std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                if g.0
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .stopping
                {
                    return;
                }
                let g = g.clone();
                std::thread::spawn(move || serve(conn, &g));
            }
        });
        Self {
            gate,
            addr,
            netns: netns.path(),
            accept: Some(accept),
        }
    }

    /// Waits until `n` requests are held.
    pub fn until_held(&self, n: usize) {
        let (lock, cv) = &*self.gate;
        let deadline = Instant::now() + HOLD_BOUND;
        let mut gate = lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while gate.held < n {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "{}: {} held, not {n}",
                self.addr,
                gate.held
            );
            gate = cv
                .wait_timeout(gate, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Lets every held request be answered, and every later one at once.
    pub fn release(&self) {
        self.gate
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .released = true;
        self.gate.1.notify_all();
    }
}

impl Drop for HoldingBackend {
    fn drop(&mut self) {
        self.gate
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .stopping = true;
        self.release();
        // The accept loop ends at its next connection once released: make one.
        let addr = self.addr;
        let _ = in_netns_at_path(&self.netns, move || {
            let _ = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
        });
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

fn in_netns_at_path(path: &std::path::Path, f: impl FnOnce() + Send + 'static) -> bool {
    crate::kernel::in_netns_at(path.to_owned(), f)
        .join()
        .is_ok()
}

/// Answers the requests of one connection, each when the gate says.
fn serve(mut conn: TcpStream, gate: &(Mutex<Gate>, Condvar)) {
    let _ = conn.set_read_timeout(Some(HOLD_BOUND));
    // Bounded: one request per turn, the connection ends on a read timeout or close.
    for _ in 0..64 {
        let Some(path) = read_head(&mut conn) else {
            return;
        };
        let (lock, cv) = gate;
        let mut g = lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if path.starts_with("/fail-once/") && g.failed.insert(path.clone()) {
            drop(g);
            let _ = conn
                .write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nfail");
            continue;
        }
        g.held += 1;
        cv.notify_all();
        let deadline = Instant::now() + HOLD_BOUND;
        while !g.released && Instant::now() < deadline {
            g = cv
                .wait_timeout(g, HOLD_BOUND)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        g.held -= 1;
        drop(g);
        let body = format!("ok {path}");
        let _ = write!(
            conn,
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
    }
}

/// The path of the next request's head (a GET: no body), or `None` at its end.
fn read_head(conn: &mut TcpStream) -> Option<String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() > 16 * 1024 || conn.read(&mut byte).ok()? != 1 {
            return None;
        }
        head.push(byte[0]);
    }
    let text = String::from_utf8_lossy(&head);
    text.split_whitespace().nth(1).map(str::to_owned)
}
