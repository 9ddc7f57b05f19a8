//! `proxy dataplane show`: what the kernel serves, read straight from the pinned maps of an
//! instance, with or without a running daemon (as `cilium bpf lb list` does): every service, its
//! hosts and their share of the slots per priority, the live generation, the per-service
//! counters, the settings and the global counters.

use std::{collections::BTreeMap, fs, net::SocketAddr, path::Path};

use anyhow::Context as _;
use aya::maps::{HashMap, Map, MapData};
use proxy_common::{
    abi::maps,
    counters::ServiceCounts,
    service::{
        Backend, HASH_KEY_CGROUP, HASH_KEY_NETNS, HASH_KEY_PROCESS, HASH_KEY_SOCKET, HASH_KEY_USER,
        MAX_PRIORITIES, PROTO_TCP, PROTO_UDP, SERVICE_F_CX_LIMIT, SERVICE_F_DROP, SERVICE_F_END,
        SERVICE_F_LEAST_REQUEST, SERVICE_F_MAGLEV, SERVICE_F_NO_PROXY_DIALLED,
        SERVICE_F_NO_PROXY_HOSTS, SERVICE_F_PANIC, SERVICE_F_PASSIVE, SERVICE_F_PROXY,
        SERVICE_F_ROUND_ROBIN, SERVICE_F_SINGLE, SERVICE_HASH_KEY_MASK, SLOTS, Service, ServiceKey,
        SlotTable, SlotTableKey, hash_key_of,
        legacy::{BACKENDS_V1, SERVICES_V1, SLOTS_V1, ServiceV1},
    },
    socket::SETTINGS_F_SPLICE,
};
use serde::Serialize;

use crate::dataplane::{KernelMaps, RuntimeMaps, kernel_addr};

/// Everything `show` prints.
#[derive(Debug, Serialize)]
pub struct Snapshot {
    /// The pin directory read.
    pub pins: String,
    /// Whether a daemon holds the instance's lock now.
    pub daemon_running: bool,
    /// The service maps' layout: `current`, or the earlier one found (`SERVICES_V1`: a daemon
    /// of an earlier version left them; its counters are not read).
    pub layout: &'static str,
    /// The proxy listeners proxy-mode services are redirected to, if set.
    pub proxy_listeners: Vec<String>,
    /// Whether local pairs are spliced.
    pub splice: bool,
    pub services: Vec<ServiceView>,
    /// Non-zero global counters, by name.
    pub counters: BTreeMap<String, u64>,
}

/// One service as the kernel sees it.
#[derive(Debug, Serialize)]
pub struct ServiceView {
    /// `ip:port/tcp` or `/udp`.
    pub address: String,
    /// The name the configuration gives it, when a configuration was given.
    pub name: Option<String>,
    pub id: u32,
    pub generation: u32,
    /// `proxy`, `maglev` (followed by its hash key, `key:process`), `single`, `passive`.
    pub flags: Vec<String>,
    /// Per priority (0 first) the hosts and the slots each holds, of [`SLOTS`]; an empty list
    /// is a priority without a routable host.
    pub priorities: Vec<Vec<HostView>>,
    pub counters: CountsView,
}

/// A service's kernel counters (`SVC_COUNTERS_V3`, summed over CPUs).
#[derive(Debug, Default, Serialize)]
pub struct CountsView {
    pub to_host: u64,
    pub to_proxy: u64,
    pub no_host: u64,
    pub panic: u64,
    pub passive_failures: u64,
}

impl From<ServiceCounts> for CountsView {
    fn from(c: ServiceCounts) -> Self {
        Self {
            to_host: c.to_host,
            to_proxy: c.to_proxy,
            no_host: c.no_host,
            panic: c.panic,
            passive_failures: c.passive_failures,
        }
    }
}

/// One host of one priority.
#[derive(Debug, Serialize)]
pub struct HostView {
    pub address: String,
    /// Slots of the table that hold this host (its weight as the kernel applies it).
    pub slots: u32,
}

/// Reads the instance at `pin_dir`; `names` maps service keys to configured names.
pub fn read(pin_dir: &Path, names: &BTreeMap<ServiceKey, String>) -> anyhow::Result<Snapshot> {
    if !pin_dir.is_dir() {
        anyhow::bail!(
            "{} does not exist: no data path is pinned for this instance",
            pin_dir.display()
        );
    }
    if !pin_dir.join(maps::SERVICES).exists() && pin_dir.join(SERVICES_V1).exists() {
        return read_v1(pin_dir, names);
    }
    let KernelMaps {
        service, runtime, ..
    } = KernelMaps::open_pinned(pin_dir)
        .with_context(|| format!("opening the pinned maps in {}", pin_dir.display()))?;
    let runtime = RuntimeMaps::new(runtime);
    let service = &service;
    let mut services = Vec::new();
    for entry in &service.services {
        let (key, svc) = entry.context("reading the services map")?;
        let priorities = if svc.flags & SERVICE_F_SINGLE != 0 {
            vec![vec![HostView {
                address: backend_addr(&svc.backend).to_string(),
                slots: SLOTS as u32,
            }]]
        } else {
            levels(
                &svc,
                |key| service.slots.get(key, 0).ok(),
                |id| service.backends.get(&id, 0).ok(),
            )
        };
        let counters = service
            .svc_counters
            .get(&svc.id, 0)
            .map(|per_cpu| ServiceCounts::sum(per_cpu.iter()))
            .unwrap_or_default();
        services.push(ServiceView {
            address: service_addr(&key),
            name: names.get(&key).cloned(),
            id: svc.id,
            generation: svc.generation,
            flags: flag_names(svc.flags),
            priorities,
            counters: counters.into(),
        });
    }
    services.sort_by(|a, b| a.address.cmp(&b.address));
    let settings = runtime.settings();
    let proxy_listeners = [settings.proxy_v4, settings.proxy_v6]
        .iter()
        .filter(|b| b.family != 0)
        .map(|b| backend_addr(b).to_string())
        .collect();
    Ok(Snapshot {
        pins: pin_dir.display().to_string(),
        daemon_running: daemon_running(pin_dir),
        layout: "current",
        proxy_listeners,
        splice: settings.flags & SETTINGS_F_SPLICE != 0,
        services,
        counters: runtime
            .counters()
            .into_iter()
            .filter(|(_, v)| *v != 0)
            .map(|(n, v)| (n.to_owned(), v))
            .collect(),
    })
}

/// The service maps an earlier version (before `_V2`) left: services, their slot tables and
/// hosts. That version's counters and settings have other layouts and are not read.
fn read_v1(pin_dir: &Path, names: &BTreeMap<ServiceKey, String>) -> anyhow::Result<Snapshot> {
    fn open<K: aya::Pod, V: aya::Pod>(
        pin_dir: &Path,
        name: &str,
    ) -> anyhow::Result<HashMap<MapData, K, V>> {
        let data = MapData::from_pin(pin_dir.join(name))
            .with_context(|| format!("opening {name} in {}", pin_dir.display()))?;
        HashMap::try_from(Map::HashMap(data)).with_context(|| format!("reading {name}"))
    }
    let services: HashMap<MapData, ServiceKey, ServiceV1> = open(pin_dir, SERVICES_V1)?;
    let slots: HashMap<MapData, SlotTableKey, SlotTable> = open(pin_dir, SLOTS_V1)?;
    let backends: HashMap<MapData, u32, Backend> = open(pin_dir, BACKENDS_V1)?;
    let mut views = Vec::new();
    for entry in &services {
        let (key, old) = entry.context("reading SERVICES_V1")?;
        let svc = crate::dataplane::upgrade_v1(old);
        views.push(ServiceView {
            address: service_addr(&key),
            name: names.get(&key).cloned(),
            id: svc.id,
            generation: svc.generation,
            flags: flag_names(svc.flags),
            priorities: levels(
                &svc,
                |key| slots.get(key, 0).ok(),
                |id| backends.get(&id, 0).ok(),
            ),
            counters: CountsView::default(),
        });
    }
    views.sort_by(|a, b| a.address.cmp(&b.address));
    Ok(Snapshot {
        pins: pin_dir.display().to_string(),
        daemon_running: daemon_running(pin_dir),
        layout: SERVICES_V1,
        proxy_listeners: Vec::new(),
        splice: false,
        services: views,
        counters: BTreeMap::new(),
    })
}

/// Whether a daemon holds the instance's lock (an exclusive `flock` on the pin directory).
fn daemon_running(pin_dir: &Path) -> bool {
    let Ok(dir) = fs::File::open(pin_dir) else {
        return false;
    };
    matches!(dir.try_lock_shared(), Err(fs::TryLockError::WouldBlock))
}

/// The hosts of each priority of the live generation, with their slot counts (`table` and
/// `backend` read the slot tables and backends of the service's layout).
fn levels(
    svc: &Service,
    table: impl Fn(&SlotTableKey) -> Option<SlotTable>,
    backend: impl Fn(u32) -> Option<Backend>,
) -> Vec<Vec<HostView>> {
    let mut levels = Vec::new();
    for priority in 0..MAX_PRIORITIES {
        let key = SlotTableKey {
            service_id: svc.id,
            generation: svc.generation,
            priority,
        };
        let Some(table) = table(&key) else {
            continue;
        };
        let mut slots: BTreeMap<u32, u32> = BTreeMap::new();
        let len = (table.len as usize).min(table.slots.len());
        for id in &table.slots[..len] {
            *slots.entry(*id).or_default() += 1;
        }
        let mut hosts: Vec<HostView> = slots
            .into_iter()
            .map(|(id, n)| HostView {
                address: backend(id).map_or_else(
                    || format!("(backend {id} missing)"),
                    |b| backend_addr(&b).to_string(),
                ),
                slots: n,
            })
            .collect();
        hosts.sort_by(|a, b| b.slots.cmp(&a.slots).then(a.address.cmp(&b.address)));
        // Priorities are dense from 0: a missing table in the middle is an empty level.
        levels.resize_with(priority as usize, Vec::new);
        levels.push(hosts);
    }
    levels
}

/// What each single-bit flag is called in `proxy dataplane show`.
const FLAG_NAMES: [(u32, &str); 12] = [
    (SERVICE_F_PROXY, "proxy"),
    (SERVICE_F_MAGLEV, "maglev"),
    (SERVICE_F_ROUND_ROBIN, "round_robin"),
    (SERVICE_F_LEAST_REQUEST, "least_request"),
    (SERVICE_F_SINGLE, "single"),
    (SERVICE_F_PASSIVE, "passive"),
    (SERVICE_F_PANIC, "panic"),
    (SERVICE_F_CX_LIMIT, "max_connections"),
    (SERVICE_F_DROP, "drop_overloads"),
    (SERVICE_F_NO_PROXY_HOSTS, "no_proxy:hosts"),
    (SERVICE_F_NO_PROXY_DIALLED, "no_proxy:dialled"),
    (SERVICE_F_END, "end_on_host_failure"),
];

/// The names of `flags`' bits; a Maglev service's hash key follows `maglev` (`key:process`).
/// A bit this build does not know (a newer daemon's) is shown as `bit:N`, never hidden.
fn flag_names(flags: u32) -> Vec<String> {
    let known = FLAG_NAMES
        .iter()
        .fold(SERVICE_HASH_KEY_MASK, |all, (bit, _)| all | bit);
    let mut names: Vec<String> = FLAG_NAMES
        .iter()
        .filter(|(bit, _)| flags & bit != 0)
        .map(|(_, name)| (*name).to_owned())
        .collect();
    if flags & SERVICE_F_MAGLEV != 0 {
        names.push(
            match hash_key_of(flags) {
                HASH_KEY_NETNS => "key:netns",
                HASH_KEY_CGROUP => "key:cgroup",
                HASH_KEY_PROCESS => "key:process",
                HASH_KEY_USER => "key:user",
                HASH_KEY_SOCKET => "key:socket",
                _ => "key:unknown",
            }
            .to_owned(),
        );
    }
    let unknown = flags & !known;
    names.extend(
        (0..u32::BITS)
            .filter(|bit| unknown & (1 << bit) != 0)
            .map(|bit| format!("bit:{bit}")),
    );
    names
}

fn backend_addr(b: &Backend) -> SocketAddr {
    kernel_addr(b.addr, b.port, b.family)
}

fn service_addr(key: &ServiceKey) -> String {
    let proto = match key.proto {
        PROTO_TCP => "tcp",
        PROTO_UDP => "udp",
        _ => "?",
    };
    let addr = kernel_addr(key.addr, key.port, key.family);
    format!("{addr}/{proto}")
}

/// The snapshot as a table for people.
pub fn print(snap: &Snapshot, out: &mut impl std::io::Write) -> std::io::Result<()> {
    let state = if snap.daemon_running {
        "a daemon is running"
    } else {
        "no daemon is running: the kernel serves the last published state"
    };
    writeln!(out, "instance {} ({state})", snap.pins)?;
    if snap.layout != "current" {
        writeln!(
            out,
            "service maps of an earlier version ({}): the next daemon carries them over; counters and settings are not shown",
            snap.layout
        )?;
    }
    let listeners = if snap.proxy_listeners.is_empty() {
        "none".to_owned()
    } else {
        snap.proxy_listeners.join(", ")
    };
    writeln!(
        out,
        "proxy listener: {listeners}; splice: {}",
        if snap.splice { "on" } else { "off" }
    )?;
    writeln!(
        out,
        "{:<28} {:<16} {:>6} {:>5} {:<4} {:<28} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "SERVICE",
        "NAME",
        "ID",
        "GEN",
        "PRIO",
        "HOST",
        "SLOTS",
        "TO_HOST",
        "TO_PROXY",
        "NO_HOST",
        "PANIC",
        "FAILED"
    )?;
    for svc in &snap.services {
        let name = svc.name.as_deref().unwrap_or("-");
        let c = &svc.counters;
        let head = format!(
            "{:<28} {name:<16} {:>6} {:>5}",
            svc.address, svc.id, svc.generation
        );
        let counts = format!(
            "{:>10} {:>10} {:>10} {:>10} {:>10}",
            c.to_host, c.to_proxy, c.no_host, c.panic, c.passive_failures
        );
        let mut first = true;
        let mut line = |prio: &str, host: &str, slots: &str| {
            let (h, n) = if first {
                (head.as_str(), counts.as_str())
            } else {
                ("", "")
            };
            first = false;
            writeln!(out, "{h:<58} {prio:<4} {host:<28} {slots:>6} {n}")
        };
        let proxied = svc.flags.iter().any(|f| f == "proxy");
        if proxied {
            line("-", "(proxy listener)", "-")?;
        } else if svc.priorities.iter().all(Vec::is_empty) {
            line("-", "(no routable host: connects refused)", "-")?;
        }
        if !proxied {
            for (prio, hosts) in svc.priorities.iter().enumerate() {
                for host in hosts {
                    line(&prio.to_string(), &host.address, &host.slots.to_string())?;
                }
            }
        }
    }
    let counters: Vec<String> = snap
        .counters
        .iter()
        .map(|(n, v)| format!("{n}={v}"))
        .collect();
    writeln!(out, "counters: {}", counters.join(" "))?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use std::net::Ipv6Addr;

    use proxy_common::service::FAMILY_V4;

    use super::*;

    #[test]
    fn addresses_read_as_the_kernel_stores_them() {
        let v4 = Backend {
            addr: [u32::from_ne_bytes([127, 0, 0, 11]), 0, 0, 0],
            port: 8081u16.to_be(),
            family: FAMILY_V4,
            _pad: 0,
        };
        assert_eq!(backend_addr(&v4).to_string(), "127.0.0.11:8081");
        let six: Ipv6Addr = "fd00::1".parse().unwrap();
        let o = six.octets();
        let words = [0, 1, 2, 3]
            .map(|i| u32::from_ne_bytes([o[i * 4], o[i * 4 + 1], o[i * 4 + 2], o[i * 4 + 3]]));
        let key = ServiceKey {
            addr: words,
            port: 80u16.to_be(),
            proto: PROTO_UDP,
            family: proxy_common::service::FAMILY_V6,
        };
        assert_eq!(service_addr(&key), "[fd00::1]:80/udp");
        assert_eq!(
            flag_names(SERVICE_F_PROXY | SERVICE_F_PASSIVE),
            ["proxy", "passive"]
        );
        assert_eq!(
            flag_names(SERVICE_F_PROXY | SERVICE_F_NO_PROXY_HOSTS),
            ["proxy", "no_proxy:hosts"]
        );
        // A Maglev entry of an earlier daemon (no key bits) hashed on the namespace.
        assert_eq!(flag_names(SERVICE_F_MAGLEV), ["maglev", "key:netns"]);
        assert_eq!(flag_names(SERVICE_F_CX_LIMIT), ["max_connections"]);
        let user =
            SERVICE_F_MAGLEV | (HASH_KEY_USER << proxy_common::service::SERVICE_HASH_KEY_SHIFT);
        assert_eq!(flag_names(user), ["maglev", "key:user"]);
        assert_eq!(
            flag_names(SERVICE_F_LEAST_REQUEST | SERVICE_F_END),
            ["least_request", "end_on_host_failure"]
        );
        // A bit this build does not know is named by its number, not hidden.
        assert_eq!(flag_names(SERVICE_F_SINGLE | 1 << 15), ["single", "bit:15"]);
    }

    #[test]
    fn every_flag_bit_has_its_own_name() {
        let mut seen = 0;
        for (bit, name) in FLAG_NAMES {
            assert_eq!(bit.count_ones(), 1, "{name} is one bit");
            assert_eq!(seen & bit, 0, "{name} reuses a bit");
            assert_eq!(
                bit & SERVICE_HASH_KEY_MASK,
                0,
                "{name} is outside the hash key"
            );
            seen |= bit;
        }
        // The flags grow upwards from bit 0: every bit below the highest named one is named.
        assert_eq!(seen, (1 << FLAG_NAMES.len()) - 1);
        // And every flag proxy-common defines is in the table.
        let defined = include_str!("../../proxy-common/src/service.rs")
            .lines()
            .filter(|line| line.starts_with("pub const SERVICE_F_"))
            .count();
        assert_eq!(
            defined,
            FLAG_NAMES.len(),
            "a SERVICE_F_ flag without a name"
        );
    }
}
