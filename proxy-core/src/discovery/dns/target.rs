//! What one resolution of one target yields: the hosts of a STRICT_DNS / LOGICAL_DNS endpoint
//! name, or of a DNS SRV service name.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::SocketAddr,
    time::Duration,
};

use super::resolver::{AddressRecord, DnsResolve, ResolveError, resolve_addresses};
use crate::{
    config::sources::dns::{DnsEndpoint, DnsLookupFamily},
    host::{Host, HostDetail},
};

/// A DNS SRV service to discover, e.g. `_http._tcp.web.svc.test`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SrvService {
    /// The SRV owner name (`_service._proto.name`).
    pub name: String,
    /// Metadata attached to every host found through this name.
    pub metadata: BTreeMap<String, String>,
}

impl SrvService {
    /// A service with no metadata.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            metadata: BTreeMap::new(),
        }
    }
}

/// One name the cluster keeps resolving.
#[derive(Clone, Debug)]
pub(crate) enum Target {
    /// A/AAAA of an endpoint's address.
    Endpoint(DnsEndpoint),
    /// SRV of a service, then A/AAAA of each SRV target.
    Srv(SrvService),
}

/// Hosts of one successful resolution.
#[derive(Clone, Debug, Default)]
pub(crate) struct Answer {
    /// Hosts in answer order, one per distinct address.
    pub hosts: Vec<Host>,
    /// Smallest TTL of all records used; `None` when the answer was empty.
    pub min_ttl: Option<Duration>,
    /// TTL of the first address record; `None` when the answer was empty.
    pub first_ttl: Option<Duration>,
}

impl Target {
    /// The queried name, for logs.
    pub fn name(&self) -> &str {
        match self {
            Self::Endpoint(endpoint) => &endpoint.address,
            Self::Srv(service) => &service.name,
        }
    }

    /// Resolves this target once.
    pub async fn resolve(
        &self,
        resolver: &dyn DnsResolve,
        family: DnsLookupFamily,
    ) -> Result<Answer, ResolveError> {
        match self {
            Self::Endpoint(endpoint) => {
                let records = resolve_addresses(resolver, &endpoint.address, family).await?;
                Ok(endpoint_answer(endpoint, &records))
            }
            Self::Srv(service) => srv_answer(service, resolver, family).await,
        }
    }
}

/// Every distinct `address:port` is a host carrying the endpoint's attributes (Envoy dedupes by
/// the address string; the TTL is the minimum over the records kept).
fn endpoint_answer(endpoint: &DnsEndpoint, records: &[AddressRecord]) -> Answer {
    let mut answer = Answer {
        first_ttl: records.first().map(|r| r.ttl),
        ..Answer::default()
    };
    let mut seen = BTreeSet::new();
    for record in records {
        let addr = SocketAddr::new(record.ip, endpoint.port);
        if !seen.insert(addr) {
            continue;
        }
        answer.min_ttl = Some(answer.min_ttl.map_or(record.ttl, |t| t.min(record.ttl)));
        let hostname = endpoint
            .hostname
            .clone()
            .unwrap_or_else(|| endpoint.address.clone());
        let host = Host {
            weight: endpoint.weight.max(1),
            priority: endpoint.priority,
            eds_health: endpoint.health,
            locality_weight: endpoint.locality_weight,
            ..Host::new(addr)
        };
        answer.hosts.push(host.with_detail(HostDetail {
            metadata: endpoint.metadata.clone(),
            hostname: Some(hostname),
            health_check: endpoint.health_check.clone(),
            locality: endpoint.locality.clone(),
        }));
    }
    answer
}

/// SRV records become hosts: SRV priority ranks (lowest value = priority 0, next distinct value
/// = 1, ...), SRV weight is the host weight (0 becomes 1, the smallest weight a host can have),
/// SRV port is the port. Target "." (service explicitly unavailable) yields nothing. A failed
/// address lookup of any target fails the whole resolution, so the previous hosts are kept.
async fn srv_answer(
    service: &SrvService,
    resolver: &dyn DnsResolve,
    family: DnsLookupFamily,
) -> Result<Answer, ResolveError> {
    let mut records = resolver.lookup_srv(&service.name).await?;
    let ranks: BTreeSet<u16> = records.iter().map(|r| r.priority).collect();
    let rank = |priority: u16| ranks.iter().position(|p| *p == priority).unwrap_or(0) as u32;
    records.sort_by_key(|r| r.priority);

    let mut answer = Answer::default();
    let mut lookups: HashMap<String, Vec<AddressRecord>> = HashMap::new();
    let mut seen = BTreeSet::new();
    for srv in &records {
        let target = srv.target.trim_end_matches('.');
        if target.is_empty() {
            continue;
        }
        if !lookups.contains_key(target) {
            let addresses = resolve_addresses(resolver, target, family).await?;
            lookups.insert(target.to_owned(), addresses);
        }
        answer.min_ttl = Some(answer.min_ttl.map_or(srv.ttl, |t| t.min(srv.ttl)));
        for record in &lookups[target] {
            let addr = SocketAddr::new(record.ip, srv.port);
            answer.min_ttl = answer.min_ttl.map(|t| t.min(record.ttl));
            answer.first_ttl.get_or_insert(record.ttl);
            if seen.insert(addr) {
                let host = Host {
                    weight: u32::from(srv.weight).max(1),
                    priority: rank(srv.priority),
                    ..Host::new(addr)
                };
                answer.hosts.push(
                    host.with_metadata(service.metadata.clone())
                        .with_hostname(Some(target.to_owned())),
                );
            }
        }
    }
    Ok(answer)
}
