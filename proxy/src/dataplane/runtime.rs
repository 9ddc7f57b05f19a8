//! The maps the daemon reads and writes while it runs, besides the publisher's: settings (the
//! splice switch and the proxy listener addresses), counters, original destinations of proxied
//! connections, the kernel's passive health signal, and the kernel path's connects per host.
//!
//! [`RuntimeMaps`] works on the maps of a loaded [`Dataplane`](super::Dataplane), or on the pins
//! of an instance whose daemon is gone ([`RuntimeMaps::open_pinned`]): counters and settings stay
//! reachable after a crash. The maps come from the typed handle [`KernelMaps`].

use std::{
    collections::HashMap as StdHashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::Path,
    sync::Arc,
};

use aya::maps::{HashMap, MapData, PerCpuArray, PerCpuHashMap};
use proxy_common::{
    abi::maps::{HOST_CX, PASSIVE, SETTINGS},
    counters,
    service::{Backend, FAMILY_V4, FAMILY_V6, ServiceKey},
    socket::{
        HOST_CX_ENTRIES, PassiveCounts, SETTINGS_F_SPLICE, SETTINGS_KEY, Settings, SockTuple,
    },
};

use super::{
    DataplaneError,
    maps::{KernelMaps, RuntimeMapSet},
    publish::backend_of,
};

/// What the kernel saw of one backend (summed over CPUs, cumulative since the maps were
/// created; a consumer keeps the previous reading and acts on the difference).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PassiveReport {
    /// The backend's address.
    pub backend: SocketAddr,
    /// Connects that never got established (refused, unreachable, timed out).
    pub connect_failures: u64,
    /// Established connections that ended in a reset or abort.
    pub resets: u64,
    /// Failures (of both kinds) since the last connect to the backend that got established:
    /// the current run of consecutive failures.
    pub run: u64,
}

/// Original destinations of connections redirected to the proxy listener. Cheap to clone (the
/// clones share the map); usable from many tasks.
#[derive(Clone)]
pub struct OriginalDestinations {
    map: Arc<HashMap<MapData, SockTuple, ServiceKey>>,
}

impl OriginalDestinations {
    fn new(map: HashMap<MapData, SockTuple, ServiceKey>) -> Self {
        Self { map: Arc::new(map) }
    }

    /// The service address a client dialled before connect4/6 redirected it to the proxy:
    /// `peer` and `local` are the accepted socket's peer and local addresses. `None` when the
    /// connection was not redirected (or its entry is gone).
    pub fn lookup(&self, peer: SocketAddr, local: SocketAddr) -> Option<SocketAddr> {
        let key = client_view(peer, local)?;
        let vip = self.map.get(&key, 0).ok()?;
        Some(socket_addr(vip.addr, vip.port, vip.family))
    }

    /// Number of entries (connections redirected to the proxy and not closed yet).
    pub fn len(&self) -> usize {
        self.map.keys().flatten().count()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Handles on the run-time maps.
pub struct RuntimeMaps {
    settings: HashMap<MapData, u32, Settings>,
    counters: PerCpuArray<MapData, u64>,
    orig_dst: OriginalDestinations,
    passive: PerCpuHashMap<MapData, Backend, PassiveCounts>,
    passive_run: HashMap<MapData, Backend, u64>,
    host_cx: Option<PerCpuHashMap<MapData, Backend, u64>>,
}

impl RuntimeMaps {
    /// Wraps the run-time maps of a [`KernelMaps`](super::KernelMaps).
    pub fn new(maps: RuntimeMapSet) -> Self {
        let RuntimeMapSet {
            settings,
            counters,
            orig_dst,
            passive,
            passive_run,
            host_cx,
        } = maps;
        Self {
            settings,
            counters,
            orig_dst: OriginalDestinations::new(orig_dst),
            passive,
            passive_run,
            host_cx,
        }
    }

    /// Opens the pinned maps of the instance at `pin_dir`, without loading any program
    /// ([`KernelMaps::open_pinned`]).
    pub fn open_pinned(pin_dir: &Path) -> Result<Self, DataplaneError> {
        Ok(Self::new(KernelMaps::open_pinned(pin_dir)?.runtime))
    }

    /// Counters summed over CPUs, with their names (`proxy_common::counters::NAMES`).
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        counters::NAMES
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let total = self
                    .counters
                    .get(&(i as u32), 0)
                    .map_or(0, |per_cpu| per_cpu.iter().sum());
                (*name, total)
            })
            .collect()
    }

    /// The settings the kernel reads now (defaults when none were written).
    pub fn settings(&self) -> Settings {
        self.settings.get(&SETTINGS_KEY, 0).unwrap_or_default()
    }

    /// Turns socket-to-socket splicing of local connections on or off. Affects connections
    /// established from now on; spliced ones stay spliced until they close.
    pub fn set_splice(&mut self, on: bool) -> Result<(), DataplaneError> {
        let mut s = self.settings();
        s.flags = if on {
            s.flags | SETTINGS_F_SPLICE
        } else {
            s.flags & !SETTINGS_F_SPLICE
        };
        self.write_settings(s)
    }

    /// Sets the proxy listener that proxy-mode services of `addr`'s family are redirected to.
    /// One listener per family; IPv4-mapped clients of dual-stack sockets use the IPv4 one.
    pub fn set_proxy_listener(&mut self, addr: SocketAddr) -> Result<(), DataplaneError> {
        let mut s = self.settings();
        match addr {
            SocketAddr::V4(_) => s.proxy_v4 = backend_of(addr),
            SocketAddr::V6(_) => s.proxy_v6 = backend_of(addr),
        }
        self.write_settings(s)
    }

    /// Removes the proxy listener of one family: until one is set again, proxy-mode connects of
    /// that family go where the service's `SERVICE_F_NO_PROXY_*` flag says (its hosts, or the
    /// address dialled), and are refused without one.
    pub fn clear_proxy_listener(&mut self, ipv6: bool) -> Result<(), DataplaneError> {
        let mut s = self.settings();
        if ipv6 {
            s.proxy_v6 = Backend::default();
        } else {
            s.proxy_v4 = Backend::default();
        }
        self.write_settings(s)
    }

    fn write_settings(&mut self, s: Settings) -> Result<(), DataplaneError> {
        self.settings
            .insert(SETTINGS_KEY, s, 0)
            .map_err(|source| DataplaneError::Map {
                name: SETTINGS,
                source,
            })
    }

    /// Original destinations of proxied connections.
    pub fn original_destinations(&self) -> &OriginalDestinations {
        &self.orig_dst
    }

    /// The passive health signal: per backend, summed over CPUs, cumulative.
    pub fn passive_counters(&self) -> Result<Vec<PassiveReport>, DataplaneError> {
        let mut out = Vec::new();
        for entry in &self.passive {
            let (backend, per_cpu) = entry.map_err(|source| DataplaneError::Map {
                name: PASSIVE,
                source,
            })?;
            let mut report = PassiveReport {
                backend: socket_addr(backend.addr, backend.port, backend.family),
                connect_failures: 0,
                resets: 0,
                run: self.passive_run.get(&backend, 0).unwrap_or(0),
            };
            for c in per_cpu.iter() {
                report.connect_failures += c.connect_failures;
                report.resets += c.resets;
            }
            out.push(report);
        }
        out.sort_by_key(|r| r.backend);
        Ok(out)
    }

    /// The kernel path's connects per host address, summed over CPUs, cumulative since the map
    /// was created (`HOST_CX_V1`; empty without it). One pass over the map, at most
    /// `HOST_CX_ENTRIES` entries (twice that read, should a key evicted mid-pass restart the
    /// walk; a host read twice keeps its later count).
    pub fn host_connects(&self) -> Result<StdHashMap<SocketAddr, u64>, DataplaneError> {
        let mut out = StdHashMap::new();
        let Some(map) = &self.host_cx else {
            return Ok(out);
        };
        for entry in map.iter().take(2 * HOST_CX_ENTRIES as usize) {
            let (backend, per_cpu) = entry.map_err(|source| DataplaneError::Map {
                name: HOST_CX,
                source,
            })?;
            let total = per_cpu.iter().fold(0u64, |sum, n| sum.wrapping_add(*n));
            out.insert(
                socket_addr(backend.addr, backend.port, backend.family),
                total,
            );
        }
        Ok(out)
    }

    /// Forgets the passive counters of a backend that is gone (the map is LRU as well).
    pub fn forget_passive(&mut self, backend: SocketAddr) {
        let _ = self.passive.remove(&backend_of(backend));
        let _ = self.passive_run.remove(&backend_of(backend));
    }
}

/// The accepted socket's (peer, local) as the client's socket saw the connection; IPv4-mapped
/// addresses (a dual-stack listener) are keyed as IPv4, like sockops keys them.
fn client_view(peer: SocketAddr, local: SocketAddr) -> Option<SockTuple> {
    let canon = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    let (client, server) = (backend_of(canon(peer)), backend_of(canon(local)));
    (client.family == server.family).then_some(SockTuple {
        local: client.addr,
        remote: server.addr,
        local_port: client.port,
        remote_port: server.port,
        family: client.family,
        _pad: [0; 3],
    })
}

/// A kernel address (network-order words, network-order port) as a socket address.
pub fn socket_addr(words: [u32; 4], port_be: u16, family: u8) -> SocketAddr {
    let ip = if family == FAMILY_V6 {
        let mut octets = [0u8; 16];
        for (i, w) in words.iter().enumerate() {
            octets[4 * i..4 * i + 4].copy_from_slice(&w.to_ne_bytes());
        }
        IpAddr::V6(Ipv6Addr::from(octets))
    } else {
        debug_assert_eq!(family, FAMILY_V4);
        IpAddr::V4(Ipv4Addr::from(words[0].to_ne_bytes()))
    };
    SocketAddr::new(ip, u16::from_be(port_be))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip() {
        for a in ["127.77.0.1:80", "[fd77::1]:8080"] {
            let a: SocketAddr = a.parse().unwrap();
            let b = backend_of(a);
            assert_eq!(socket_addr(b.addr, b.port, b.family), a);
        }
    }

    #[test]
    fn mapped_peers_are_keyed_as_ipv4() {
        let peer: SocketAddr = "[::ffff:127.0.0.1]:40000".parse().unwrap();
        let local: SocketAddr = "[::ffff:127.0.0.1]:15001".parse().unwrap();
        let key = client_view(peer, local).unwrap();
        assert_eq!(key.family, FAMILY_V4);
        assert_eq!(key.local_port, 40000u16.to_be());
        assert_eq!(key.remote_port, 15001u16.to_be());
    }
}
