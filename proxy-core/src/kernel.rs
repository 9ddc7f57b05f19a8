//! The kernel form of a service, computed in one place: its key, its flags, and, from the
//! routing of the clusters it reads, its weighted levels. The daemon's publisher only writes
//! what [`ServiceTemplate::spec`] returns.
//!
//! A [`ServiceTemplate`] holds what does not depend on hosts (made once per configuration);
//! [`ServiceTemplate::spec`] turns the clusters' current [`Routing`] into a [`ServiceSpec`]:
//! a chain service's levels from its plan, a plain service's from its cluster, a refused share
//! pointed at the address the kernel refuses, the panic flag when a cluster is in panic. A
//! service keeps only the hosts of its own address family. A proxy-mode service carries hosts
//! only for the time no proxy listens ([`no_proxy_fallback`]).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use proxy_common::service::{
    FAMILY_V4, HASH_KEY_CGROUP, HASH_KEY_NETNS, HASH_KEY_PROCESS, HASH_KEY_SOCKET, HASH_KEY_USER,
    PROTO_TCP, PROTO_UDP, SERVICE_F_CX_LIMIT, SERVICE_F_DROP, SERVICE_F_END,
    SERVICE_F_LEAST_REQUEST, SERVICE_F_MAGLEV, SERVICE_F_NO_PROXY_DIALLED,
    SERVICE_F_NO_PROXY_HOSTS, SERVICE_F_PANIC, SERVICE_F_PASSIVE, SERVICE_F_PROXY,
    SERVICE_F_ROUND_ROBIN, SERVICE_HASH_KEY_SHIFT, ServiceKey, hash_key_of,
};

pub mod ending;

use crate::{
    chain::{self, ChainPlan},
    config::{
        Config, HashKey, LbPolicy, Protocol, Service, ServiceMode,
        circuit_breakers::{CircuitBreakers, Priority},
    },
    health::Routing,
    lb,
};

/// What a service should look like in the kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceSpec {
    /// Name, for errors and logs.
    pub name: String,
    /// The service address.
    pub key: ServiceKey,
    /// `SERVICE_F_*` flags.
    pub flags: u32,
    /// Routable hosts with weights, by failover priority (index 0 = highest).
    pub priorities: Vec<Vec<(SocketAddr, u32)>>,
    /// The connections the cgroup may have open to the service at once (its cluster's explicit
    /// `max_connections`), with `SERVICE_F_CX_LIMIT` in `flags`; `None`: no limit.
    pub max_connections: Option<u32>,
    /// The share of connects refused at random (its cluster's `policy.drop_overloads`), parts
    /// per million, with `SERVICE_F_DROP` in `flags`; 0: none.
    pub drop_overload: u32,
}

/// The kernel's key of a service.
pub fn service_key(svc: &Service) -> ServiceKey {
    let proto = match svc.protocol {
        Protocol::Tcp => PROTO_TCP,
        Protocol::Udp => PROTO_UDP,
    };
    ServiceKey::new(svc.address, svc.port, proto)
}

/// The parts of a service's kernel entry that do not depend on its hosts.
#[derive(Clone, Debug)]
pub struct ServiceTemplate {
    /// The service's name.
    pub name: String,
    /// Its kernel key.
    pub key: ServiceKey,
    /// Its `SERVICE_F_*` flags but the panic flag, which follows the hosts.
    pub flags: u32,
    /// The chain's plan, for a chain service on the kernel path.
    plan: Option<ChainPlan>,
    /// The kernel's connection limit ([`kernel_max_connections`]).
    max_connections: Option<u32>,
    /// Whether the kernel applies its cluster's drop overload ([`kernel_drops`]).
    drops: bool,
    /// The clusters it reads that end their hosts' connections on the kernel path
    /// (`close_connections_on_host_health_failure`, [`ending`]); empty for a proxy-mode service.
    end_clusters: Vec<String>,
    /// Where a refused share of connections is sent: the unspecified address of the service's
    /// family, port 0, which the kernel's connect refuses (ECONNREFUSED).
    refuse: SocketAddr,
}

impl ServiceTemplate {
    /// The templates of every service of `config`, in its order.
    pub fn all(config: &Config) -> Vec<Self> {
        config
            .services
            .iter()
            .map(|svc| Self::new(svc, config))
            .collect()
    }

    /// The template of `svc`, a service of `config`.
    pub fn new(svc: &Service, config: &Config) -> Self {
        let key = service_key(svc);
        // The key's family: an IPv4-mapped VIP is an IPv4 service.
        let unspecified: IpAddr = if key.family == FAMILY_V4 {
            Ipv4Addr::UNSPECIFIED.into()
        } else {
            Ipv6Addr::UNSPECIFIED.into()
        };
        let plan = config.chain_plan(svc);
        let max_connections = kernel_max_connections(svc, config);
        let limit = if max_connections.is_some() {
            SERVICE_F_CX_LIMIT
        } else {
            0
        };
        let end_clusters = end_clusters(svc, config);
        let end = if end_clusters.is_empty() {
            0
        } else {
            SERVICE_F_END
        };
        Self {
            name: svc.name.clone(),
            key,
            flags: flags(svc, config, &policies(svc, config, plan.as_ref())) | limit | end,
            end_clusters,
            plan,
            max_connections,
            drops: kernel_drops(svc, config),
            refuse: SocketAddr::new(unspecified, 0),
        }
    }

    /// The service's kernel entry for the clusters' routing now; `routing_of` answers for each
    /// cluster the service reads (`Config::service_clusters`, in that order), `None` for one
    /// not running.
    pub fn spec(&self, clusters: &[(&str, &Routing)]) -> ServiceSpec {
        let routing_of = |name: &str| {
            clusters
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, r)| (*r).clone())
        };
        let mut priorities = match &self.plan {
            Some(plan) => plan.levels(&routing_of),
            None => clusters
                .first()
                .map(|(_, routing)| lb::kernel_levels(routing))
                .unwrap_or_default(),
        };
        for level in &mut priorities {
            for (addr, _) in level.iter_mut() {
                if *addr == chain::REFUSE {
                    *addr = self.refuse;
                }
            }
        }
        if !self.reads_hosts() {
            priorities.clear();
        }
        keep_own_family(&mut priorities, self.refuse.is_ipv4());
        let panic = clusters.iter().any(|(_, routing)| routing.in_panic());
        let drop_overload = match clusters.first() {
            Some((_, routing)) if self.drops => routing.drop_overload.per_million(),
            _ => 0,
        };
        let mut flags = self.flags;
        if panic {
            flags |= SERVICE_F_PANIC;
        }
        if drop_overload > 0 {
            flags |= SERVICE_F_DROP;
        }
        ServiceSpec {
            name: self.name.clone(),
            key: self.key,
            flags,
            priorities,
            max_connections: self.max_connections,
            drop_overload,
        }
    }

    /// Whether the kernel follows this service's connections with sockops: proxy mode, a
    /// cluster with outlier detection, LEAST_REQUEST, or `max_connections`.
    pub fn follows_sockets(&self) -> bool {
        let followed =
            SERVICE_F_PROXY | SERVICE_F_PASSIVE | SERVICE_F_LEAST_REQUEST | SERVICE_F_CX_LIMIT;
        self.flags & followed != 0
    }

    /// Whether the kernel may connect to this service's hosts, so that its levels are
    /// published: a direct-mode service, or a proxy-mode one whose connects go to a host while
    /// no proxy listens (`SERVICE_F_NO_PROXY_HOSTS`). Otherwise the kernel entry carries no
    /// host, and its clusters are not followed for it.
    pub fn reads_hosts(&self) -> bool {
        self.flags & SERVICE_F_PROXY == 0 || self.flags & SERVICE_F_NO_PROXY_HOSTS != 0
    }

    /// Whether the kernel rotates this service's hosts (ROUND_ROBIN, Linux 5.12 and later).
    pub fn rotates(&self) -> bool {
        self.flags & SERVICE_F_ROUND_ROBIN != 0
    }

    /// What the kernel's consistent hashing keys on for this service (a `HASH_KEY_*` value),
    /// `None` when it does not hash.
    pub fn hash_key(&self) -> Option<u32> {
        (self.flags & SERVICE_F_MAGLEV != 0).then_some(hash_key_of(self.flags))
    }
}

/// The `HASH_KEY_*` value of `key`, in the kernel's encoding.
pub fn kernel_hash_key(key: HashKey) -> u32 {
    match key {
        HashKey::Netns => HASH_KEY_NETNS,
        HashKey::Cgroup => HASH_KEY_CGROUP,
        HashKey::Process => HASH_KEY_PROCESS,
        HashKey::User => HASH_KEY_USER,
        HashKey::Socket => HASH_KEY_SOCKET,
    }
}

/// The load-balancing policies that choose for `svc` (whose chain plan, on the kernel path, is
/// `plan`): the one its chain's resolvers set (`LoadBalancer`), else its clusters'
/// `lb_policy`.
pub fn policies(svc: &Service, config: &Config, plan: Option<&ChainPlan>) -> Vec<LbPolicy> {
    let clusters = match plan {
        Some(ChainPlan {
            policy: Some(policy),
            ..
        }) => return vec![*policy],
        Some(plan) => plan.clusters().into_iter().collect(),
        None => config.service_clusters(svc),
    };
    clusters
        .iter()
        .filter_map(|c| config.cluster(c))
        .map(|c| c.lb_policy)
        .collect()
}

/// The `max_connections` the kernel holds `svc` to: its cluster's, when the `DEFAULT`
/// thresholds of its `circuit_breakers` set one explicitly, for a direct-mode TCP service that
/// reads exactly one cluster. `None` otherwise: a cluster without it keeps the kernel path
/// unlimited (Envoy's implicit 1024 would refuse connects that run today); a chain over several
/// clusters is not limited (the kernel does not know which cluster a host came from); UDP has
/// no connections; the proxy path holds proxy-mode services to the limit itself.
pub fn kernel_max_connections(svc: &Service, config: &Config) -> Option<u32> {
    if svc.mode != ServiceMode::Direct || svc.protocol != Protocol::Tcp {
        return None;
    }
    let [cluster] = config.service_clusters(svc).try_into().ok()?;
    let breakers: &CircuitBreakers = config.cluster(&cluster)?.circuit_breakers.as_ref()?;
    breakers
        .thresholds
        .iter()
        .find(|t| t.priority == Priority::Default)?
        .max_connections
}

/// Whether the kernel applies the drop overload of `svc`'s cluster: a direct-mode TCP service
/// of one cluster, as for `max_connections` (the kernel does not know which of a chain's
/// clusters a host came from; a proxy-mode service's proxy drops its HTTP requests itself).
pub fn kernel_drops(svc: &Service, config: &Config) -> bool {
    svc.mode == ServiceMode::Direct
        && svc.protocol == Protocol::Tcp
        && config.service_clusters(svc).len() == 1
}

/// What the kernel does with a connect to proxy-mode service `svc` while no proxy listens (a
/// restart's gap, or a killed daemon): `SERVICE_F_NO_PROXY_HOSTS` for a service the proxy
/// serves per connection from one cluster's hosts (it would only have copied bytes to one of
/// them), `SERVICE_F_NO_PROXY_DIALLED` for one of a plain ORIGINAL_DST cluster (it would have
/// connected to the address dialled), nothing for one the proxy routes per HTTP request (a
/// chain, or ORIGINAL_DST choosing by `use_http_header`), which the kernel cannot route: that
/// one is refused. 0 for a direct-mode service.
pub fn no_proxy_fallback(svc: &Service, config: &Config) -> u32 {
    if svc.mode != ServiceMode::Proxy || config.chains.contains_key(&svc.name) {
        return 0;
    }
    if !config.is_original_dst(&svc.cluster) {
        return SERVICE_F_NO_PROXY_HOSTS;
    }
    let by_header = config
        .cluster(&svc.cluster)
        .and_then(|c| c.original_dst_lb_config.as_ref())
        .is_some_and(|o| o.use_http_header);
    if by_header {
        0
    } else {
        SERVICE_F_NO_PROXY_DIALLED
    }
}

/// Leaves in `levels` only the hosts of the service's family (IPv4 when `v4`), and no level
/// that this empties. connect4/6 cannot move a socket to the other family: a host of the other
/// family in a dual-stack cluster is no host of this service (the kernel would count
/// `connect_family_mismatch` and let the connect go to the VIP untouched).
fn keep_own_family(levels: &mut Vec<Vec<(SocketAddr, u32)>>, v4: bool) {
    for level in levels.iter_mut() {
        level.retain(|(addr, _)| addr.is_ipv4() == v4);
    }
    levels.retain(|level| !level.is_empty());
}

/// Whether the data path needs sockops: a service whose connections it follows, or splicing of
/// local socket pairs. Without either, sockops is not attached and the cgroup's connections pay
/// connect4 alone.
pub fn needs_sockops(config: &Config, templates: &[ServiceTemplate]) -> bool {
    config.splice || templates.iter().any(ServiceTemplate::follows_sockets)
}

/// The flags of `svc` that follow from the `policies` that choose for it (see [`policies`]),
/// its clusters' outlier detection and its mode.
fn flags(svc: &Service, config: &Config, policies: &[LbPolicy]) -> u32 {
    let names = config.service_clusters(svc);
    let clusters: Vec<_> = names.iter().filter_map(|c| config.cluster(c)).collect();
    let any = |policy: LbPolicy| policies.contains(&policy);
    let direct = svc.mode == ServiceMode::Direct;
    // RING_HASH is served by the Maglev table: consistent hashing with the same ~1/N movement.
    let maglev = policies.iter().any(|p| p.hashes());
    // Consistent hashing wins over rotation when a chain mixes the two. A proxy-mode service's
    // kernel entry only redirects: the proxy rotates (`ClusterHandle`).
    let round_robin = !maglev && direct && any(LbPolicy::RoundRobin);
    // Least request needs sockops to count each backend's connections; the proxy counts its
    // own for proxy-mode services.
    let least = !maglev && !round_robin && direct && any(LbPolicy::LeastRequest);
    // Only outlier detection reads the kernel's passive signal: without it sockops does not
    // follow the service's connections at all.
    let passive = clusters.iter().any(|c| c.outlier_detection.is_some());
    let key = if maglev && direct {
        kernel_hash_key(svc.hash_key.unwrap_or_default()) << SERVICE_HASH_KEY_SHIFT
    } else {
        0
    };
    [
        (maglev, SERVICE_F_MAGLEV),
        (round_robin, SERVICE_F_ROUND_ROBIN),
        (least, SERVICE_F_LEAST_REQUEST),
        (!direct, SERVICE_F_PROXY),
        (passive, SERVICE_F_PASSIVE),
    ]
    .into_iter()
    .filter(|(on, _)| *on)
    .fold(key | no_proxy_fallback(svc, config), |flags, (_, flag)| {
        flags | flag
    })
}

/// The clusters of a direct-mode `svc` whose `close_connections_on_host_health_failure`
/// (unset: `proxy.close_connections_on_host_health_failure`) is on.
fn end_clusters(svc: &Service, config: &Config) -> Vec<String> {
    if svc.mode != ServiceMode::Direct {
        return Vec::new();
    }
    let default = config.proxy.close_connections_on_host_health_failure;
    config
        .service_clusters(svc)
        .into_iter()
        .filter(|name| {
            config.cluster(name).is_some_and(|c| {
                c.close_connections_on_host_health_failure
                    .unwrap_or(default)
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
