//! Original destinations: where a redirected connection was going (from the kernel's map, an
//! iptables `SO_ORIGINAL_DST`, or a PROXY protocol header), and the ORIGINAL_DST cluster whose
//! hosts are created on demand from them and flushed after `cleanup_interval` unused.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex, RwLock},
    time::Duration,
};

use tokio::{net::TcpStream, time::Instant};

use crate::{addr::BackendAddr, pool::Pool};

/// Finds the original destination of an accepted connection from its addresses: `peer` and
/// `local` are the accepted socket's peer and local addresses (its 4-tuple). The daemon
/// implements it for the kernel's map (`dataplane::OriginalDestinations`: connect4/6 record the
/// destination, sockops re-keys it by 4-tuple).
pub trait OriginalDst: Send + Sync {
    /// The destination the client dialled, or `None` if the connection was not redirected.
    fn lookup(&self, peer: SocketAddr, local: SocketAddr) -> Option<SocketAddr>;
}

/// Knows no destination (for a listener that only serves iptables or PROXY protocol).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoOriginalDst;

impl OriginalDst for NoOriginalDst {
    fn lookup(&self, _: SocketAddr, _: SocketAddr) -> Option<SocketAddr> {
        None
    }
}

/// A table from (peer, local) to destination, filled by hand (tests, static setups).
#[derive(Debug, Default)]
pub struct OriginalDstTable {
    entries: RwLock<HashMap<(SocketAddr, SocketAddr), SocketAddr>>,
}

impl OriginalDstTable {
    /// Records that the connection `peer -> local` was dialled to `destination`.
    pub fn insert(&self, peer: SocketAddr, local: SocketAddr, destination: SocketAddr) {
        self.entries
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert((peer, local), destination);
    }

    /// Forgets a connection.
    pub fn remove(&self, peer: SocketAddr, local: SocketAddr) {
        self.entries
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&(peer, local));
    }
}

impl OriginalDst for OriginalDstTable {
    fn lookup(&self, peer: SocketAddr, local: SocketAddr) -> Option<SocketAddr> {
        self.entries
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&(peer, local))
            .copied()
    }
}

/// `SO_ORIGINAL_DST` (IPv4) or `IP6T_SO_ORIGINAL_DST` (IPv6) of a socket accepted after an
/// iptables `REDIRECT`; `None` when there is no NAT entry for it.
pub fn so_original_dst(stream: &TcpStream) -> Option<SocketAddr> {
    so_original_dst_at(stream, stream.local_addr().ok()?)
}

/// [`so_original_dst`] of a socket whose local address is known (`local` picks the option).
pub(crate) fn so_original_dst_at(
    stream: &impl std::os::fd::AsFd,
    local: SocketAddr,
) -> Option<SocketAddr> {
    let sock = socket2::SockRef::from(stream);
    let addr = match local {
        SocketAddr::V4(_) => sock.original_dst_v4(),
        SocketAddr::V6(a) if a.ip().to_ipv4_mapped().is_some() => sock.original_dst_v4(),
        SocketAddr::V6(_) => sock.original_dst_v6(),
    };
    addr.ok()?.as_socket()
}

/// Use of one ORIGINAL_DST host.
#[derive(Debug)]
struct HostUse {
    /// Connections and requests using it now.
    active: usize,
    /// When it was last taken or released.
    last_used: Instant,
}

/// The ORIGINAL_DST cluster: hosts exist while they are used and are flushed (with their
/// pooled HTTP connections) once unused for `cleanup_interval`.
pub struct OriginalDstCluster {
    hosts: Mutex<HashMap<BackendAddr, HostUse>>,
    cleanup_interval: Duration,
    pool: Arc<Pool>,
}

impl OriginalDstCluster {
    /// An empty cluster.
    pub fn new(cleanup_interval: Duration) -> Self {
        Self {
            hosts: Mutex::default(),
            cleanup_interval,
            pool: Arc::new(Pool::new(cleanup_interval)),
        }
    }

    /// The pooled HTTP connections to its hosts.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Takes a host (creating it on first use) until the lease is dropped.
    pub fn lease(self: &Arc<Self>, host: BackendAddr) -> HostLease {
        let mut hosts = self.lock();
        let entry = hosts.entry(host).or_insert(HostUse {
            active: 0,
            last_used: Instant::now(),
        });
        entry.active += 1;
        entry.last_used = Instant::now();
        HostLease {
            cluster: self.clone(),
            host,
        }
    }

    /// Flushes hosts unused for at least `cleanup_interval`; returns how many went.
    pub fn cleanup(&self) -> usize {
        let now = Instant::now();
        let mut hosts = self.lock();
        let before = hosts.len();
        hosts
            .retain(|_, u| u.active > 0 || now.duration_since(u.last_used) < self.cleanup_interval);
        let flushed = before - hosts.len();
        let live: Vec<BackendAddr> = hosts.keys().copied().collect();
        drop(hosts);
        self.pool.retain(|h| live.contains(&h));
        self.pool.expire_idle();
        flushed
    }

    /// Hosts known now.
    pub fn hosts(&self) -> Vec<BackendAddr> {
        let mut v: Vec<_> = self.lock().keys().copied().collect();
        v.sort();
        v
    }

    /// Runs [`Self::cleanup`] every `cleanup_interval` until the task is aborted.
    pub async fn run_cleanup(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.cleanup_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let flushed = self.cleanup();
            if flushed > 0 {
                tracing::debug!(
                    flushed,
                    "ORIGINAL_DST hosts flushed after cleanup_interval unused"
                );
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<BackendAddr, HostUse>> {
        self.hosts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A connection's or request's use of an ORIGINAL_DST host.
pub struct HostLease {
    cluster: Arc<OriginalDstCluster>,
    host: BackendAddr,
}

impl Drop for HostLease {
    fn drop(&mut self) {
        let mut hosts = self.cluster.lock();
        if let Some(u) = hosts.get_mut(&self.host) {
            u.active = u.active.saturating_sub(1);
            u.last_used = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(s: &str) -> BackendAddr {
        BackendAddr(s.parse().unwrap())
    }

    #[tokio::test(start_paused = true)]
    async fn unused_hosts_are_flushed_after_cleanup_interval() {
        let cluster = Arc::new(OriginalDstCluster::new(Duration::from_millis(5000)));
        let a = cluster.lease(host("127.0.0.1:1"));
        drop(cluster.lease(host("127.0.0.1:2")));
        tokio::time::advance(Duration::from_millis(4999)).await;
        assert_eq!(cluster.cleanup(), 0);
        tokio::time::advance(Duration::from_millis(1)).await;
        // The released host goes; the one still in use stays however old.
        assert_eq!(cluster.cleanup(), 1);
        assert_eq!(cluster.hosts(), vec![host("127.0.0.1:1")]);
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(cluster.cleanup(), 0);
        drop(a);
        tokio::time::advance(Duration::from_millis(4000)).await;
        assert_eq!(
            cluster.cleanup(),
            0,
            "released 4 s ago: still within the interval"
        );
        tokio::time::advance(Duration::from_millis(1000)).await;
        assert_eq!(cluster.cleanup(), 1);
        assert!(cluster.hosts().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn cleanup_task_runs_on_its_interval() {
        let cluster = Arc::new(OriginalDstCluster::new(Duration::from_secs(5)));
        drop(cluster.lease(host("127.0.0.1:9")));
        let task = tokio::spawn(cluster.clone().run_cleanup());
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert_eq!(cluster.hosts().len(), 1);
        // Ticks at 0, 5, 10: the host is 5 s old at the 5 s tick.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(cluster.hosts().is_empty());
        task.abort();
    }

    #[test]
    fn table_lookup() {
        let t = OriginalDstTable::default();
        let (p, l, d) = (
            "127.0.0.1:5".parse().unwrap(),
            "127.0.0.1:15001".parse().unwrap(),
            "127.77.0.1:80".parse().unwrap(),
        );
        t.insert(p, l, d);
        assert_eq!(t.lookup(p, l), Some(d));
        assert_eq!(t.lookup(l, p), None);
        t.remove(p, l);
        assert_eq!(t.lookup(p, l), None);
    }
}
