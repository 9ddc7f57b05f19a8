//! The epoll engine: plain TCP connections (`splice: copy`, no PROXY protocol) run on a few
//! threads of their own, each with an epoll instance and its own `SO_REUSEPORT` socket of every
//! listener, instead of one tokio task per connection. An epoll event goes straight to the
//! connection it belongs to: no task, no waker, no scheduler, no deregistration before close,
//! which costs less CPU per connection (BENCHMARKS.md has the measurement).
//!
//! The engine is a driver of the relay core both drivers share: it starts a connection with
//! `conn.rs` (route lookup, admission guard, host, connect with the client's first bytes, its
//! outcome), moves its bytes with `flow.rs` (the copy rules and the ends' rules), and applies
//! the cluster's verdict on routing changes; what is its own is epoll, its timers (connect
//! timeout, drain deadline) and its slots. HTTP services go to the tokio path from the engine's
//! accept (with the connection's guard); the routing and shutdown signals come in from tokio
//! tasks through a mailbox (a queue and an eventfd).

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    io,
    net::SocketAddr,
    os::fd::AsFd,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use proxy_core::{time::after, upstream::OpenConnection};
use tracing::{debug, warn};

use crate::{
    addr::ClientAddr,
    cluster::{ActiveLease, ClusterHandle, HostVerdict},
    conn::{self, Action, Actions, Admitted, Chosen, ConnectFailure, ProxyClose, Target},
    connect_attempts::{self, Attempts},
    drain::DrainWatcher,
    flow::{self, End, Flows, SCRATCH, Side},
    listener,
    orig_dst::HostLease,
    shared::Shared,
    stats::ProxyStats,
    sys::{self, Epoll, EpollEvent, EventFd},
};

/// Events taken per `epoll_wait`.
const EVENTS: usize = 256;
/// Pause after a failed `accept()` (EMFILE and the like), as the tokio accept loop does.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// A yield after idle that is not given back within this long means another task keeps the
/// CPU busy (it was not a waker about to block): the thread stops yielding for
/// [`YIELD_BACKOFF`].
const YIELD_HELD: Duration = Duration::from_micros(200);
const YIELD_BACKOFF: Duration = Duration::from_secs(1);
/// The eventfd's token; listeners are `LISTENER | i`, connections `index << 1 | side`.
const MAILBOX: u64 = u64::MAX;
const LISTENER: u64 = 1 << 62;

/// A message from the tokio side to an engine thread.
#[derive(Debug, Clone, Copy)]
enum Cmd {
    /// Shutdown started: stop accepting.
    Drain,
    /// Shutdown's deadline passed: reset every connection.
    Close,
    /// The routing of cluster `i` changed.
    Routing(usize),
    /// Leave the thread.
    Stop,
}

/// A queue of commands and the eventfd that wakes the thread for them.
struct Mailbox {
    eventfd: EventFd,
    cmds: Mutex<Vec<Cmd>>,
}

impl Mailbox {
    fn new() -> io::Result<Self> {
        Ok(Self {
            eventfd: EventFd::new()?,
            cmds: Mutex::new(Vec::new()),
        })
    }

    fn send(&self, cmd: Cmd) {
        self.cmds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(cmd);
        self.eventfd.notify();
    }

    fn take(&self) -> Vec<Cmd> {
        self.eventfd.reset();
        std::mem::take(
            &mut *self
                .cmds
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

/// The services as the engine sees them: a cluster is an index into `clusters`, the distinct
/// clusters behind them.
struct Routes {
    actions: Actions<usize>,
    clusters: Vec<ClusterHandle>,
}

impl Routes {
    fn new(shared: &Shared) -> Self {
        let mut clusters: Vec<ClusterHandle> = Vec::new();
        let mut by_name: HashMap<String, Vec<usize>> = HashMap::new();
        let actions = Actions::compile(&shared.services, |c| {
            let same = by_name.entry(c.name().to_owned()).or_default();
            // A service's own connect attempts keep its handle apart.
            let found = same.iter().find(|&&i| {
                clusters[i].same_routing(c)
                    && clusters[i].connect_attempts() == c.connect_attempts()
            });
            if let Some(&i) = found {
                i
            } else {
                clusters.push(c.clone());
                same.push(clusters.len() - 1);
                clusters.len() - 1
            }
        });
        Self { actions, clusters }
    }
}

/// The running engine: its threads' mailboxes.
pub(crate) struct Engine {
    mailboxes: Vec<Arc<Mailbox>>,
}

impl Engine {
    /// Starts one thread per element of `listeners` (each holds one `SO_REUSEPORT` socket of
    /// every listener address), and the tokio tasks that pass shutdown and routing changes on.
    /// Returns the engine and those tasks.
    #[expect(
        clippy::needless_pass_by_value,
        reason = "the threads each take a clone of the Arc; the caller gives its own up"
    )]
    pub(crate) fn start(
        listeners: Vec<Vec<std::net::TcpListener>>,
        shared: Arc<Shared>,
        watcher: &DrainWatcher,
    ) -> io::Result<(Self, Vec<tokio::task::JoinHandle<()>>)> {
        let routes = Arc::new(Routes::new(&shared));
        let rt = tokio::runtime::Handle::current();
        let mut mailboxes = Vec::new();
        let mut workers = Vec::new();
        for sockets in listeners {
            let mailbox = Arc::new(Mailbox::new()?);
            workers.push(Worker::new(
                sockets,
                mailbox.clone(),
                shared.clone(),
                routes.clone(),
                rt.clone(),
                watcher.clone(),
            )?);
            mailboxes.push(mailbox);
        }
        for (i, worker) in workers.into_iter().enumerate() {
            let spawned = std::thread::Builder::new()
                .name(format!("proxy-engine-{i}"))
                .spawn(move || worker.run());
            if let Err(err) = spawned {
                // The threads already running leave again: nothing is left half-started.
                mailboxes[..i].iter().for_each(|m| m.send(Cmd::Stop));
                return Err(err);
            }
        }
        let mut tasks = Vec::new();
        let phases = watcher.phases();
        let boxes = mailboxes.clone();
        tasks.push(tokio::spawn(async move {
            phases.draining().await;
            for m in &*boxes {
                m.send(Cmd::Drain);
            }
            phases.closing().await;
            for m in &*boxes {
                m.send(Cmd::Close);
            }
        }));
        for (i, cluster) in routes.clusters.iter().enumerate() {
            let mut routing = cluster.routing_watch();
            let boxes = mailboxes.clone();
            tasks.push(tokio::spawn(async move {
                while routing.changed().await.is_ok() {
                    for m in &*boxes {
                        m.send(Cmd::Routing(i));
                    }
                }
            }));
        }
        Ok((Self { mailboxes }, tasks))
    }

    /// How many threads the engine runs.
    #[cfg(test)]
    pub(crate) fn threads(&self) -> usize {
        self.mailboxes.len()
    }

    /// Lets the threads go (they reset what is still open).
    pub(crate) fn stop(&self) {
        for m in &self.mailboxes {
            m.send(Cmd::Close);
            m.send(Cmd::Stop);
        }
    }
}

/// `proxy.yield_after_idle`: after a long enough sleep in `epoll_wait`, the thread gives way
/// once before it handles its events (ARCHITECTURE.md, "The epoll engine").
///
/// A wakeup from idle usually comes from a client or backend on the same CPU that has just
/// written and is about to wait for the answer. If the woken thread preempts it, that task is
/// still runnable when the thread writes on, so the next task of the exchange is placed on
/// another CPU, which is idle and, after a long sleep, slow to wake. Giving way lets the waker
/// block first; the exchange then stays on one CPU. A busy thread (short sleeps) never yields.
struct IdleYield {
    /// The sleep that makes a wakeup count as from idle; zero: never.
    after: Duration,
    /// Set after a yield that was held too long: no yield before then.
    off_until: Option<Instant>,
}

impl IdleYield {
    fn new(after: Duration) -> Self {
        Self {
            after,
            off_until: None,
        }
    }

    /// Whether a thread that went to sleep at `asleep` and woke with events at `now` gives way.
    fn due(&mut self, asleep: Instant, now: Instant) -> bool {
        if self.after.is_zero() || now.saturating_duration_since(asleep) < self.after {
            return false;
        }
        match self.off_until {
            Some(until) if now < until => false,
            _ => {
                self.off_until = None;
                true
            }
        }
    }

    /// The yield made at `at` came back at `now`.
    fn gave_way(&mut self, at: Instant, now: Instant) {
        if now.saturating_duration_since(at) > YIELD_HELD {
            debug!(
                held_us = now.saturating_duration_since(at).as_micros() as u64,
                "the CPU is busy: no yield after idle for a second"
            );
            self.off_until = Some(now + YIELD_BACKOFF);
        }
    }
}

struct Conn {
    serial: u64,
    client: std::net::TcpStream,
    upstream: std::net::TcpStream,
    host: crate::addr::BackendAddr,
    cluster: Option<usize>,
    _lease: Option<HostLease>,
    /// LEAST_REQUEST: the connection's place in its host's open count.
    _active: Option<ActiveLease>,
    /// A cluster's host: the connection's place in `upstream_cx_active`.
    open: Option<OpenConnection>,
    /// Counts the connection until its slot is freed.
    _admitted: Admitted<Arc<ProxyStats>>,
    /// Set while the connect is on: its deadline.
    connecting: Option<Instant>,
    /// The connects made and still allowed (`max_connect_attempts`).
    attempts: Attempts,
    /// Set while the host is removed: when the connection closes.
    drain_deadline: Option<Instant>,
    /// client -> upstream, upstream -> client.
    flows: Flows,
}

#[derive(Clone, Copy)]
enum Timer {
    Conn(usize, u64),
    Listener(usize),
}

struct Worker {
    ep: Epoll,
    listeners: Vec<Option<(std::net::TcpListener, Option<SocketAddr>)>>,
    mailbox: Arc<Mailbox>,
    shared: Arc<Shared>,
    routes: Arc<Routes>,
    rt: tokio::runtime::Handle,
    watcher: Option<DrainWatcher>,
    draining: bool,
    conns: Vec<Option<Conn>>,
    vacant: Vec<usize>,
    live: usize,
    serial: u64,
    timers: BinaryHeap<Reverse<(Instant, u64, usize, bool)>>,
    scratch: Vec<u8>,
    idle_yield: IdleYield,
}

const CONN_EVENTS: u32 = (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLET) as u32;

impl Worker {
    fn new(
        sockets: Vec<std::net::TcpListener>,
        mailbox: Arc<Mailbox>,
        shared: Arc<Shared>,
        routes: Arc<Routes>,
        rt: tokio::runtime::Handle,
        watcher: DrainWatcher,
    ) -> io::Result<Self> {
        let ep = Epoll::new()?;
        ep.add(mailbox.eventfd.as_fd(), libc::EPOLLIN as u32, MAILBOX)?;
        let mut listeners = Vec::new();
        for (i, l) in sockets.into_iter().enumerate() {
            ep.add(l.as_fd(), libc::EPOLLIN as u32, LISTENER | i as u64)?;
            // A listener on one address gives its sockets that address: no getsockname.
            let local = l.local_addr().ok().filter(|a| !a.ip().is_unspecified());
            listeners.push(Some((l, local)));
        }
        Ok(Self {
            ep,
            listeners,
            mailbox,
            routes,
            rt,
            watcher: Some(watcher),
            draining: false,
            conns: Vec::new(),
            vacant: Vec::new(),
            live: 0,
            serial: 0,
            timers: BinaryHeap::new(),
            scratch: vec![0; SCRATCH],
            idle_yield: IdleYield::new(shared.config.yield_after_idle),
            shared,
        })
    }

    fn run(mut self) {
        let mut events = vec![EpollEvent { events: 0, u64: 0 }; EVENTS];
        loop {
            let timeout = self.next_timeout();
            let asleep = (!self.idle_yield.after.is_zero()).then(Instant::now);
            let n = match self.ep.wait(&mut events, timeout) {
                Ok(n) => n,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => {
                    warn!(%err, "the proxy engine's epoll_wait failed; its connections are reset");
                    self.close_all("the engine failed");
                    return;
                }
            };
            if n > 0
                && let Some(asleep) = asleep
            {
                let now = Instant::now();
                if self.idle_yield.due(asleep, now) {
                    sys::sched_yield();
                    self.idle_yield.gave_way(now, Instant::now());
                }
            }
            for ev in &events[..n] {
                let (token, flags) = (ev.u64, ev.events);
                if token == MAILBOX {
                    for cmd in self.mailbox.take() {
                        if self.command(cmd) {
                            return;
                        }
                    }
                } else if token & LISTENER != 0 {
                    self.accept((token & !LISTENER) as usize);
                } else {
                    let side = if token & 1 == 0 {
                        Side::Client
                    } else {
                        Side::Upstream
                    };
                    self.ready((token >> 1) as usize, side, flags);
                }
            }
            self.fire_timers();
            if self.draining && self.live == 0 {
                // The last connection is gone: shutdown may complete.
                self.watcher = None;
            }
        }
    }

    /// Acts on a command; true means leave.
    fn command(&mut self, cmd: Cmd) -> bool {
        match cmd {
            Cmd::Drain => {
                self.draining = true;
                self.close_listeners();
            }
            Cmd::Close => {
                self.draining = true;
                self.close_listeners();
                self.close_all("shutdown deadline passed");
            }
            Cmd::Routing(ci) => self.routing_changed(ci),
            Cmd::Stop => {
                self.close_all("the proxy stopped");
                return true;
            }
        }
        false
    }

    /// Stops accepting: the listening sockets leave epoll, then close. Closing alone would not
    /// do: after a takeover the daemon that took over holds the same sockets, so they stay
    /// open, and epoll (which watches the open socket, not the descriptor) would go on
    /// reporting their connections here.
    fn close_listeners(&mut self) {
        for slot in &mut self.listeners {
            if let Some((listener, _)) = slot.take() {
                self.ep.delete(listener.as_fd());
            }
        }
    }

    /// Whether a connection's timer still stands: a connect that finished, a host that came
    /// back or a connection that ended leave theirs behind.
    fn timer_stands(&self, at: Instant, serial: u64, index: usize, listener: bool) -> bool {
        if listener {
            return true;
        }
        match self.conns.get(index) {
            Some(Some(c)) => {
                c.serial == serial && (c.connecting == Some(at) || c.drain_deadline == Some(at))
            }
            _ => false,
        }
    }

    fn next_timeout(&mut self) -> i32 {
        // Stale timers are dropped here rather than waited for: most connects finish at once
        // and would otherwise wake the thread at their deadline for nothing.
        while let Some(Reverse((at, serial, index, listener))) = self.timers.peek().copied() {
            if self.timer_stands(at, serial, index, listener) {
                break;
            }
            self.timers.pop();
        }
        match self.timers.peek() {
            None => -1,
            Some(Reverse((at, ..))) => {
                let left = at.saturating_duration_since(Instant::now());
                // Rounded up: waking a millisecond early would just wait again.
                left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
            }
        }
    }

    fn add_timer(&mut self, at: Instant, t: Timer) {
        let (serial, index, listener) = match t {
            Timer::Conn(i, s) => (s, i, false),
            Timer::Listener(i) => (0, i, true),
        };
        self.timers.push(Reverse((at, serial, index, listener)));
    }

    fn fire_timers(&mut self) {
        if self.timers.is_empty() {
            return;
        }
        let now = Instant::now();
        while let Some(Reverse((at, serial, index, listener))) = self.timers.peek().copied() {
            if at > now {
                break;
            }
            self.timers.pop();
            if !self.timer_stands(at, serial, index, listener) {
                continue;
            }
            if listener {
                if let Some(Some((l, _))) = self.listeners.get(index) {
                    let _ = self
                        .ep
                        .add(l.as_fd(), libc::EPOLLIN as u32, LISTENER | index as u64);
                }
                continue;
            }
            let Some(Some(conn)) = self.conns.get(index) else {
                continue;
            };
            if conn.serial != serial {
                continue;
            }
            if conn.connecting.is_some_and(|d| d <= now) {
                let cluster = conn.cluster.map(|ci| &self.routes.clusters[ci]);
                let failure = ConnectFailure::TimedOut(self.shared.connect_timeout(cluster));
                self.connect_failed(index, &failure);
            } else if conn.drain_deadline.is_some_and(|d| d <= now) {
                self.close(index, ProxyClose::Drained);
            }
        }
    }

    fn accept(&mut self, li: usize) {
        loop {
            let Some(Some((listener, local))) = self.listeners.get(li) else {
                return;
            };
            let local = *local;
            match sys::accept_nonblocking(listener) {
                Ok((stream, peer)) => self.start(stream, ClientAddr(peer), local),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => {
                    // Level-triggered: taken out of epoll for a moment so the loop does not
                    // spin on an error that persists (EMFILE).
                    warn!(%err, "accept on the proxy listener failed");
                    self.ep.delete(listener.as_fd());
                    self.add_timer(Instant::now() + ACCEPT_BACKOFF, Timer::Listener(li));
                    return;
                }
            }
        }
    }

    /// A new connection: its original destination, its route, and the upstream connect with
    /// the client's first bytes (`conn.rs`, as the tokio path starts one).
    fn start(&mut self, client: std::net::TcpStream, peer: ClientAddr, local: Option<SocketAddr>) {
        // The connection's slot (or the HTTP task it goes to) keeps the guard; every other
        // path drops it on return.
        let admitted = Admitted::new(self.shared.stats.clone());
        // Field borrows, not clones: an Arc's count is a cache line the threads would share.
        let stats = &*self.shared.stats;
        let Some(orig) = listener::redirected_destination(&client, peer, local, &self.shared)
        else {
            ProxyStats::inc(&stats.downstream_cx_no_original_dst);
            debug!(client = %peer, "no original destination: refused");
            flow::abort(&client);
            return;
        };
        let routes = &*self.routes;
        let (target, cluster) = match routes.actions.lookup(orig) {
            None => {
                ProxyStats::inc(&stats.downstream_cx_no_route);
                debug!(client = %peer, %orig, "no service at the original destination: refused");
                flow::abort(&client);
                return;
            }
            Some(Action::Http(service)) => {
                let Some(watcher) = self.watcher.clone() else {
                    flow::abort(&client);
                    return;
                };
                self.rt.spawn(listener::serve_http_accepted(
                    client,
                    peer,
                    orig,
                    service.clone(),
                    self.shared.clone(),
                    watcher,
                    admitted,
                ));
                return;
            }
            Some(Action::Original) => (Target::Original(orig), None),
            Some(Action::Cluster(ci)) => (Target::Cluster(&routes.clusters[*ci]), Some(*ci)),
        };
        let mut attempts = Attempts::new(target, true);
        let scratch = &mut self.scratch;
        let shared = &self.shared;
        let started =
            connect_attempts::start(&client, target, &mut attempts, Vec::new(), scratch, shared);
        let Some((chosen, up)) = started else {
            return;
        };
        let (host, upstream, unsent, connecting) =
            (chosen.host, up.socket, up.unsent, up.connecting);
        let handle = cluster.map(|ci| &routes.clusters[ci]);
        if !connecting {
            conn::connected(host, handle, chosen.open.as_ref());
        }
        self.serial += 1;
        let serial = self.serial;
        let conns = &mut self.conns;
        let index = self.vacant.pop().unwrap_or_else(|| {
            conns.push(None);
            conns.len() - 1
        });
        let token = (index as u64) << 1;
        if let Err(err) = (self.ep.add(client.as_fd(), CONN_EVENTS, token))
            .and_then(|()| self.ep.add(upstream.as_fd(), CONN_EVENTS, token | 1))
        {
            warn!(%err, "could not register a connection with the proxy engine");
            flow::abort(&client);
            flow::abort(&upstream);
            self.vacant.push(index);
            return;
        }
        let timeout = self.shared.connect_timeout(handle);
        let connecting = connecting.then(|| after(Instant::now(), timeout));
        if let Some(at) = connecting {
            self.timers.push(Reverse((at, serial, index, false)));
        }
        self.conns[index] = Some(Conn {
            serial,
            client,
            upstream,
            host,
            cluster,
            _lease: chosen.lease,
            _active: chosen.active,
            open: chosen.open,
            _admitted: admitted,
            connecting,
            attempts,
            drain_deadline: None,
            flows: Flows::new(unsent),
        });
        self.live += 1;
    }

    /// An event on one of a connection's sockets.
    fn ready(&mut self, index: usize, side: Side, flags: u32) {
        let Some(Some(conn)) = self.conns.get_mut(index) else {
            return;
        };
        // An end (or an error) is announced once: from here this side is read until the
        // kernel says so, not only until a short read. Only the direction this side feeds is
        // read; the other is written to only when it holds bytes.
        let end = (libc::EPOLLRDHUP | libc::EPOLLHUP | libc::EPOLLERR) as u32;
        let flow = conn.flows.from(side);
        if flags & end != 0 {
            flow.ended = true;
        }
        if flags & (end | libc::EPOLLIN as u32) != 0 {
            flow.readable = true;
        }
        if conn.connecting.is_some() {
            if side == Side::Client {
                // Read once connected (edge-triggered: what is queued stays readable).
                return;
            }
            let failed = flags & (libc::EPOLLERR | libc::EPOLLHUP) as u32 != 0;
            let err = match conn.upstream.take_error() {
                Ok(None) if !failed => {
                    if flags & libc::EPOLLOUT as u32 == 0 {
                        return;
                    }
                    None
                }
                Ok(Some(e)) | Err(e) => Some(e),
                Ok(None) => Some(io::Error::from(io::ErrorKind::ConnectionRefused)),
            };
            let cluster = conn.cluster.map(|ci| &self.routes.clusters[ci]);
            if let Some(err) = err {
                self.connect_failed(index, &ConnectFailure::Error(err));
                return;
            }
            conn::connected(conn.host, cluster, conn.open.as_ref());
            conn.connecting = None;
        }
        self.pump(index);
    }

    /// A connection's connect failed (counted): another host gets a turn while its attempts
    /// allow (a new upstream socket in the slot, with the client's unsent bytes), else the
    /// connection ends (`connect_attempts.rs` counted it and reset the client).
    fn connect_failed(&mut self, index: usize, failure: &ConnectFailure) {
        let Some(Some(conn)) = self.conns.get_mut(index) else {
            return;
        };
        let stats = &*self.shared.stats;
        let cluster = conn.cluster.map(|ci| &self.routes.clusters[ci]);
        conn::connect_failed(failure, conn.host, cluster, stats);
        // ORIGINAL_DST has one attempt: `retry` says no, and only clusters are tried again.
        let again = conn.attempts.retry(cluster, &conn.client, stats);
        let started = cluster.filter(|_| again).and_then(|c| {
            let carried = conn.flows.restart();
            let (client, attempts) = (&conn.client, &mut conn.attempts);
            let scratch = &mut self.scratch;
            let shared = &self.shared;
            connect_attempts::start(
                client,
                Target::Cluster(c),
                attempts,
                carried,
                scratch,
                shared,
            )
        });
        match started {
            Some((chosen, up)) => self.restarted(index, chosen, up),
            None => self.free(index),
        }
    }

    /// Connection `index` tried another host: `up` takes the failed socket's place, with its
    /// own connect timer.
    fn restarted(&mut self, index: usize, chosen: Chosen, up: connect_attempts::Upstream) {
        let Some(Some(old)) = self.conns.get_mut(index).map(Option::take) else {
            return;
        };
        let cluster = old.cluster.map(|ci| &self.routes.clusters[ci]);
        if !up.connecting {
            conn::connected(chosen.host, cluster, chosen.open.as_ref());
        }
        let timeout = self.shared.connect_timeout(cluster);
        let connecting = up.connecting.then(|| after(Instant::now(), timeout));
        self.serial += 1;
        // The failed socket and its host's guards go when `old` does, at the end.
        let mut conn = Conn {
            serial: self.serial,
            upstream: up.socket,
            host: chosen.host,
            _lease: chosen.lease,
            _active: chosen.active,
            open: chosen.open,
            connecting,
            drain_deadline: None,
            ..old
        };
        conn.flows.set_unsent(up.unsent);
        let token = ((index as u64) << 1) | 1;
        let added = self.ep.add(conn.upstream.as_fd(), CONN_EVENTS, token);
        if let Err(err) = &added {
            warn!(%err, "could not register a connection with the proxy engine");
            flow::abort(&conn.client);
        }
        self.conns[index] = Some(conn);
        match (added, connecting) {
            (Err(_), _) => self.free(index),
            (Ok(()), Some(at)) => self.add_timer(at, Timer::Conn(index, self.serial)),
            (Ok(()), None) => {}
        }
    }

    /// Moves bytes both ways until both sockets would block (`flow.rs`); ends the connection
    /// when both directions are done or a side failed.
    fn pump(&mut self, index: usize) {
        let Some(Some(conn)) = self.conns.get_mut(index) else {
            return;
        };
        let stats = &self.shared.stats;
        let end = match conn
            .flows
            .pump(&conn.client, &conn.upstream, &mut self.scratch, stats)
        {
            Err(failed) => End::Failed(failed),
            Ok(_) if conn.flows.done() => End::Done,
            Ok(_) => return,
        };
        flow::finish(&end, &conn.client, &conn.upstream, stats);
        self.free(index);
    }

    /// The routing of cluster `ci` changed: drain or close its connections whose host left
    /// (the rule is the cluster's, [`ClusterHandle::verdict`], as on the tokio path).
    fn routing_changed(&mut self, ci: usize) {
        let cluster = &self.routes.clusters[ci];
        let policy = self.shared.drain_policy();
        let now = Instant::now();
        let mut close = Vec::new();
        let mut timers = Vec::new();
        for (i, slot) in self.conns.iter_mut().enumerate() {
            let Some(conn) = slot else { continue };
            if conn.cluster != Some(ci) {
                continue;
            }
            match cluster.verdict(cluster.host_state(conn.host), policy) {
                HostVerdict::Close => close.push(i),
                HostVerdict::Drain => {
                    if conn.drain_deadline.is_none() {
                        let at = after(now, policy.drain_timeout);
                        conn.drain_deadline = Some(at);
                        timers.push((at, i, conn.serial));
                    }
                }
                HostVerdict::Keep => conn.drain_deadline = None,
            }
        }
        for (at, i, serial) in timers {
            self.add_timer(at, Timer::Conn(i, serial));
        }
        for i in close {
            self.close(i, ProxyClose::HealthFailure);
        }
    }

    /// Resets every connection, counted as shutdown closes; `why` says which stop it was.
    fn close_all(&mut self, why: &'static str) {
        if self.live > 0 {
            debug!(
                why,
                connections = self.live,
                "the engine resets its connections"
            );
        }
        for i in 0..self.conns.len() {
            if self.conns[i].is_some() {
                self.close(i, ProxyClose::Shutdown);
            }
        }
    }

    /// The proxy ends a connection: counted by why, both sides reset (`flow::finish`).
    fn close(&mut self, index: usize, why: ProxyClose) {
        if let Some(Some(conn)) = self.conns.get(index) {
            debug!(host = %conn.host, "closing a connection");
            let end = End::Closed(why);
            flow::finish(&end, &conn.client, &conn.upstream, &self.shared.stats);
        }
        self.free(index);
    }

    /// Closes a connection's sockets (which takes them out of epoll) and frees its slot.
    fn free(&mut self, index: usize) {
        if let Some(conn) = self.conns.get_mut(index).and_then(Option::take) {
            drop(conn);
            self.vacant.push(index);
            self.live -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn yields_only_after_a_long_enough_sleep() {
        let mut y = IdleYield::new(50 * US);
        let t = Instant::now();
        assert!(
            !y.due(t, t + 49 * US),
            "a busy thread runs its events at once"
        );
        assert!(y.due(t, t + 50 * US));
        assert!(y.due(t, t + 1000 * US));
        let mut off = IdleYield::new(Duration::ZERO);
        assert!(!off.due(t, t + Duration::from_secs(10)), "0s turns it off");
    }

    #[test]
    fn a_yield_held_too_long_stops_yielding_for_a_while() {
        let mut y = IdleYield::new(50 * US);
        let t = Instant::now();
        // The waker blocked soon: the CPU came back at once, yielding goes on.
        y.gave_way(t, t + 30 * US);
        assert!(y.due(t, t + 100 * US));
        // Another task held the CPU: no yield until the backoff has passed.
        let back = t + 100 * US + YIELD_HELD + US;
        y.gave_way(t + 100 * US, back);
        assert!(!y.due(back, back + Duration::from_millis(5)));
        assert!(!y.due(back, (back + YIELD_BACKOFF).checked_sub(US).unwrap()));
        assert!(y.due(back, back + YIELD_BACKOFF));
        assert!(y.off_until.is_none(), "the backoff is over");
    }
}
