//! The admin interface's authority and bounds (root), against the real daemon, with an
//! unprivileged user (uid and gid 65534, in a forked child) as the adversary: it cannot reach
//! the control socket (mode 0600), gets 403 on TCP for every state change and 421 for a forged
//! `Host`; and while it holds a thousand idle connections and 64 half-sent request heads on the
//! TCP port (reopening what the daemon closes), `/ready`, `proxy status` and `proxy reload`
//! still answer within 1 s.
#![allow(
    unsafe_code,
    reason = "setrlimit(2), setgid(2) and setuid(2) of the forked adversary"
)]

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    os::{fd::AsRawFd as _, unix::net::UnixStream},
    path::PathBuf,
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use integration_tests::kernel::{
    Daemon, InCgroup, Netns, PinDir, TestCgroup, http_get, proxy_bin, require_root,
    skip_without_dataplane, unique,
};

/// The adversary's user and group.
const NOBODY: u32 = 65534;
/// Idle connections and half-sent request heads the adversary holds.
const IDLE: usize = 1000;
const SLOW: usize = 64;
/// What every answer under abuse must take at most.
const ANSWER_WITHIN: Duration = Duration::from_secs(1);

fn config(instance: &str, cgroup: &TestCgroup) -> String {
    format!(
        "instance: {instance}\ncgroup: {}\nadmin:\n  address: \"{{admin}}\"\nclusters:\n  - name: web\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 8081 }} }} }}\nservices:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: web }}\n",
        cgroup.path().display()
    )
}

/// Becomes uid and gid 65534 with no supplementary groups (in a forked child), after raising
/// the soft file limit to the hard one for the adversary's connections.
fn become_nobody() {
    // SAFETY: plain system calls on this process's own credentials and limits; `limit` is a
    // valid rlimit for getrlimit to fill.
    unsafe {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit), 0);
        limit.rlim_cur = limit.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &raw const limit), 0);
        assert_eq!(libc::setgroups(0, std::ptr::null()), 0, "setgroups");
        assert_eq!(libc::setgid(NOBODY), 0, "setgid");
        assert_eq!(libc::setuid(NOBODY), 0, "setuid");
        assert_eq!((libc::getuid(), libc::geteuid()), (NOBODY, NOBODY));
    }
}

/// Sends `request` raw to `addr` and reads the whole answer (bounded).
fn exchange(addr: SocketAddr, request: &str) -> String {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    answer
}

/// The status line of `method target` on `addr` with `host`, and the body.
fn ask(addr: SocketAddr, method: &str, target: &str, host: &str) -> (String, String) {
    let answer = exchange(
        addr,
        &format!("{method} {target} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n"),
    );
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    (
        head.lines().next().unwrap_or_default().to_owned(),
        body.to_owned(),
    )
}

/// `proxy ARGS --admin=unix:CONTROL` as root: exit code, output, and how long it took.
fn proxy_cli(command: &str, control: &std::path::Path) -> (i32, String, Duration) {
    let started = Instant::now();
    let out = Command::new(proxy_bin())
        .arg(command)
        .arg(format!("--admin=unix:{}", control.display()))
        .arg("--timeout=10")
        .output()
        .expect("running proxy");
    let took = started.elapsed();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text, took)
}

struct Started {
    daemon: Daemon,
    netns: Netns,
    _pins: PinDir,
    _cgroup: TestCgroup,
}

fn start() -> Started {
    let (netns, cgroup, instance) = (Netns::new(), TestCgroup::new(), unique("adm"));
    let pins = PinDir(PathBuf::from("/sys/fs/bpf").join(&instance));
    let daemon = Daemon::start_in(&netns, &config(&instance, &cgroup));
    Started {
        daemon,
        netns,
        _pins: pins,
        _cgroup: cgroup,
    }
}

#[test]
fn an_unprivileged_user_reads_but_changes_nothing() {
    require_root();
    if skip_without_dataplane("an_unprivileged_user_reads_but_changes_nothing") {
        return;
    }
    let s = start();
    let filter = s.daemon.get("/logging").expect("GET /logging");
    let seen = tries_as_nobody(&s);
    println!("as uid {NOBODY}:\n{seen}");
    let control = s.daemon.control.display().to_string();
    let line = |start: &str| {
        seen.lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no {start:?} in\n{seen}"))
    };
    assert_eq!(
        line("control socket"),
        "control socket: Err(PermissionDenied)"
    );
    for target in ["/reload", "/healthcheck/fail", "/logging"] {
        let line = line(&format!("POST {target}"));
        assert!(line.contains("403 Forbidden"), "{line}");
        assert!(
            line.contains(&format!("control socket {control}")),
            "{line}"
        );
    }
    assert!(line("GET /ready").ends_with("): HTTP/1.1 200 OK"), "{seen}");
    let forged = line("GET /config_dump (rebound.example:15000)");
    assert!(
        forged.ends_with(": HTTP/1.1 421 Misdirected Request"),
        "{forged}"
    );
    let put = line("PUT /stats");
    assert!(put.ends_with(": HTTP/1.1 405 Method Not Allowed"), "{put}");
    // Nothing changed: still LIVE, no reload asked, the log filter as it was.
    assert_eq!(s.daemon.get("/ready"), Some((200, "LIVE\n".to_owned())));
    assert!(!s.daemon.log_text().contains("reload requested"));
    assert_eq!(s.daemon.get("/logging"), Some(filter));
    // Root, on the control socket: reload and status work by the CLI.
    let (code, text, _) = proxy_cli("reload", &s.daemon.control);
    assert_eq!(code, 0, "{text}");
    let (code, text, _) = proxy_cli("status", &s.daemon.control);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("127.0.0.1:8081"), "{text}");
}

/// What uid 65534 gets, one line per attempt: the control socket, state changes over TCP, a
/// read, a forged `Host`, a method a page does not take.
fn tries_as_nobody(s: &Started) -> String {
    let (admin, control) = (s.daemon.admin, s.daemon.control.clone());
    let host = admin.to_string();
    InCgroup::spawn(None, &s.netns, move || {
        become_nobody();
        let mut lines = Vec::new();
        let socket = UnixStream::connect(&control)
            .map(drop)
            .map_err(|e| e.kind());
        lines.push(format!("control socket: {socket:?}"));
        for target in ["/reload", "/healthcheck/fail", "/logging?level=trace"] {
            let (status, body) = ask(admin, "POST", target, &host);
            lines.push(format!("POST {target}: {status}: {}", body.trim_end()));
        }
        for (method, target, host) in [
            ("GET", "/ready", host.as_str()),
            ("GET", "/config_dump", "rebound.example:15000"),
            ("PUT", "/stats", host.as_str()),
        ] {
            let status = ask(admin, method, target, host).0;
            lines.push(format!("{method} {target} ({host}): {status}"));
        }
        lines.join("\n")
    })
    .wait(Duration::from_secs(30))
}

/// The adversary's connections: opened, and reopened when the daemon closes them.
struct Siege {
    admin: SocketAddr,
    host: String,
    conns: Vec<(TcpStream, bool)>,
    reopened: Arc<AtomicUsize>,
}

impl Siege {
    fn open(&self, slow: bool) -> std::io::Result<TcpStream> {
        let mut s = TcpStream::connect_timeout(&self.admin, Duration::from_secs(5))?;
        if slow {
            // Half a request head, then nothing.
            write!(s, "GET /ready HTTP/1.1\r\nhost: {}\r\nx-wait:", self.host)?;
        }
        s.set_nonblocking(true)?;
        Ok(s)
    }

    /// Replaces every connection the daemon closed; how many.
    fn refill(&mut self) -> usize {
        let mut n = 0;
        for i in 0..self.conns.len() {
            let closed = !matches!(
                self.conns[i].0.peek(&mut [0u8; 1]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
            );
            if closed && let Ok(fresh) = self.open(self.conns[i].1) {
                self.conns[i].0 = fresh;
                n += 1;
            }
        }
        self.reopened.fetch_add(n, Ordering::Relaxed);
        n
    }
}

impl Siege {
    /// [`IDLE`] idle connections and [`SLOW`] half-sent heads to `admin`.
    fn start(admin: SocketAddr) -> Self {
        let mut siege = Self {
            admin,
            host: admin.to_string(),
            conns: Vec::new(),
            reopened: Arc::new(AtomicUsize::new(0)),
        };
        for i in 0..IDLE + SLOW {
            let slow = i >= IDLE;
            let s = siege
                .open(slow)
                .unwrap_or_else(|e| panic!("connection {i} failed: {e}"));
            siege.conns.push((s, slow));
        }
        siege
    }

    /// Keeps the siege up in a thread, refilling every 50 ms until `stop` (at most 60 s).
    fn hold(mut self, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            for _ in 0..1200 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                self.refill();
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    }
}

/// In the child, as uid 65534: holds the siege, times `/ready`, tells the parent on `sync`,
/// and keeps the siege up until the parent answers; returns what it counted.
fn besiege(admin: SocketAddr, sync: &mut UnixStream) -> String {
    become_nobody();
    let siege = Siege::start(admin);
    let reopened = Arc::clone(&siege.reopened);
    let stop = Arc::new(AtomicBool::new(false));
    let holder = siege.hold(Arc::clone(&stop));
    // Not a synchronisation: the siege must outlast the daemon's 2 s head deadline, so that
    // what it closes is reopened while the answers are timed.
    std::thread::sleep(Duration::from_secs(3));
    let started = Instant::now();
    let ready = http_get(admin, "/ready");
    let took = started.elapsed();
    writeln!(sync, "{}", took.as_millis()).unwrap();
    sync.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let _ = sync.read(&mut [0u8; 1]);
    stop.store(true, Ordering::Relaxed);
    holder.join().expect("the holder");
    format!(
        "{} reopened; /ready as uid {NOBODY}: {ready:?} in {} ms",
        reopened.load(Ordering::Relaxed),
        took.as_millis()
    )
}

/// How long each answer took, as root, under siege.
struct Answers {
    ready: (Option<(u16, String)>, Duration),
    status: (i32, String, Duration),
    reload: (i32, String, Duration),
}

/// `/ready` over TCP, then `proxy status` and `proxy reload` on the control socket.
fn answers_as_root(daemon: &Daemon) -> Answers {
    let started = Instant::now();
    let ready = daemon.get("/ready");
    Answers {
        ready: (ready, started.elapsed()),
        status: proxy_cli("status", &daemon.control),
        reload: proxy_cli("reload", &daemon.control),
    }
}

#[test]
fn ready_status_and_reload_answer_under_a_thousand_idle_connections() {
    require_root();
    if skip_without_dataplane("ready_status_and_reload_answer_under_a_thousand_idle_connections") {
        return;
    }
    let s = start();
    let admin = s.daemon.admin;
    let (mut ours, mut theirs) = UnixStream::pair().expect("socketpair");
    let theirs_fd = theirs.as_raw_fd();
    let child = InCgroup::spawn_keeping(None, &s.netns, theirs_fd, move || {
        besiege(admin, &mut theirs)
    });
    ours.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut nobody_ms = String::new();
    BufReader::new(&ours)
        .read_line(&mut nobody_ms)
        .expect("the siege is up");
    let root = answers_as_root(&s.daemon);
    ours.write_all(b"x").unwrap();
    let report = child.wait(Duration::from_secs(90));
    let (ready, status, reload) = (&root.ready, &root.status, &root.reload);
    println!(
        "siege of {IDLE} idle and {SLOW} half-sent connections from uid {NOBODY}: {report}\nroot: /ready {:?} in {} ms; proxy status exit {} in {} ms; proxy reload exit {} in {} ms",
        ready.0,
        ready.1.as_millis(),
        status.0,
        status.2.as_millis(),
        reload.0,
        reload.2.as_millis()
    );
    assert!(
        report.contains(": Some((200, \"LIVE\\n\")) in "),
        "{report}"
    );
    let nobody_ms: u128 = nobody_ms.trim().parse().expect("milliseconds");
    assert!(nobody_ms < ANSWER_WITHIN.as_millis(), "{report}");
    let reopened: usize = report
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        reopened >= SLOW,
        "the daemon closed the stalled heads: {report}"
    );
    assert_eq!(ready.0, Some((200, "LIVE\n".to_owned())));
    assert!(ready.1 < ANSWER_WITHIN, "/ready took {:?}", ready.1);
    assert_eq!(status.0, 0, "{}", status.1);
    assert!(status.1.contains("127.0.0.1:8081"), "{}", status.1);
    assert!(status.2 < ANSWER_WITHIN, "proxy status took {:?}", status.2);
    assert_eq!(reload.0, 0, "{}", reload.1);
    assert!(reload.2 < ANSWER_WITHIN, "proxy reload took {:?}", reload.2);
}
