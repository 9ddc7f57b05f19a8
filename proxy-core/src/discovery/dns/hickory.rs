//! [`DnsResolve`] on hickory-resolver: configurable name servers (UDP, and TCP for truncated
//! answers) and no response cache, so
//! every refresh asks the server and sees TTL and record changes at once.
//!
//! hickory's cache clamps record TTLs to its `positive_max_ttl`, so limiting the cache by TTL
//! would corrupt the TTLs `respect_dns_ttl` reads. Instead the cache is sized 0 and the entry for
//! a query is cleared right before the query is made.
//!
//! Tries follow Envoy's c-ares resolver ([`QueryLimits`]): one datagram per try, a try that
//! fails (a timeout, a refused or unreachable server, SERVFAIL, REFUSED) is followed at once by
//! the next, and the lookup fails when the tries are spent. The sockets ([`super::transport`])
//! make a server that is down fail a try at once instead of after its timeout.

use std::{net::IpAddr, time::Duration};

use hickory_resolver::{
    Resolver,
    config::{ConnectionConfig, NameServerConfig, ResolveHosts, ResolverConfig, ResolverOpts},
    net::{DnsError, NetError},
    proto::{
        op::ResponseCode,
        rr::{RData, Record, RecordType},
    },
};
use tracing::debug;

use super::{
    resolver::{AddressFamily, AddressRecord, BoxFuture, DnsResolve, ResolveError, SrvRecord},
    transport::Transport,
};
use crate::config::sources::dns::{DnsSettings, QueryLimits};

/// The production resolver.
#[derive(Clone)]
pub struct HickoryResolver {
    resolver: Resolver<Transport>,
    tries: u8,
}

/// The resolver could not be built (unreadable `/etc/resolv.conf` when `dns_resolvers` is empty).
#[derive(Debug, thiserror::Error)]
#[error("cannot build the DNS resolver from dns_resolvers or /etc/resolv.conf: {0}")]
pub struct BuildResolverError(#[source] NetError);

impl HickoryResolver {
    /// A resolver for `settings.dns_resolvers` (UDP, TCP on truncation), or the system's name
    /// servers when empty, with Envoy's default [`QueryLimits`].
    pub fn new(settings: &DnsSettings) -> Result<Self, BuildResolverError> {
        Self::with_limits(settings, QueryLimits::default())
    }

    /// Like [`HickoryResolver::new`], with other tries and try timeout.
    pub fn with_limits(
        settings: &DnsSettings,
        limits: QueryLimits,
    ) -> Result<Self, BuildResolverError> {
        let provider = Transport::default();
        let mut builder = if settings.dns_resolvers.is_empty() {
            Resolver::builder(provider).map_err(BuildResolverError)?
        } else {
            // UDP first, TCP when an answer comes back truncated (as c-ares does): a name with
            // more records than a UDP answer holds would otherwise never resolve.
            let servers = settings.dns_resolvers.iter().map(|server| {
                let (mut udp, mut tcp) = (ConnectionConfig::udp(), ConnectionConfig::tcp());
                udp.port = server.0.port();
                tcp.port = server.0.port();
                NameServerConfig::new(server.0.ip(), true, vec![udp, tcp])
            });
            let mut builder = Resolver::builder_with_config(
                ResolverConfig::from_name_servers(servers.collect()),
                provider,
            );
            builder.options_mut().use_hosts_file = ResolveHosts::Never;
            builder
        };
        set_options(builder.options_mut(), limits);
        Ok(Self {
            resolver: builder.build().map_err(BuildResolverError)?,
            tries: limits.tries.max(1),
        })
    }

    /// One query, tried up to `tries` times.
    async fn lookup(
        &self,
        name: &str,
        record_type: RecordType,
    ) -> Result<Vec<Record>, ResolveError> {
        let mut left = self.tries;
        loop {
            match self.try_once(name, record_type).await {
                Ok(records) => return Ok(records),
                Err(err) if left <= 1 => {
                    return Err(ResolveError {
                        name: name.to_owned(),
                        record_type: record_type_name(record_type),
                        source: Box::new(err),
                    });
                }
                Err(err) => {
                    left -= 1;
                    debug!(name, %record_type, %err, left, "dns try failed, trying again");
                }
            }
        }
    }

    /// One try: NXDOMAIN and NODATA are an empty answer, anything else that is not an answer
    /// is the try's failure.
    async fn try_once(&self, name: &str, record_type: RecordType) -> Result<Vec<Record>, NetError> {
        self.resolver.clear_lookup_cache(name, record_type);
        match self.resolver.lookup(name, record_type).await {
            Ok(lookup) => Ok(lookup.answers().to_vec()),
            Err(NetError::Dns(DnsError::NoRecordsFound(no_records)))
                if matches!(
                    no_records.response_code,
                    ResponseCode::NXDomain | ResponseCode::NoError
                ) =>
            {
                Ok(Vec::new())
            }
            Err(err) => Err(err),
        }
    }
}

/// hickory's options for c-ares' way of trying.
fn set_options(options: &mut ResolverOpts, limits: QueryLimits) {
    options.cache_size = 0;
    options.timeout = limits.timeout;
    // hickory's own retry skips SERVFAIL and REFUSED answers, which c-ares tries again; the
    // tries are counted in `lookup` instead.
    options.attempts = 0;
    // hickory asks two servers at once by default; c-ares asks one per try.
    options.num_concurrent_reqs = 1;
}

fn record_type_name(record_type: RecordType) -> &'static str {
    match record_type {
        RecordType::A => "A",
        RecordType::AAAA => "AAAA",
        RecordType::SRV => "SRV",
        _ => "other",
    }
}

/// The A and AAAA records of an answer, with their own TTLs (the CNAME records of a chain are
/// skipped; any other record is ignored).
pub fn address_records(records: &[Record]) -> Vec<AddressRecord> {
    records
        .iter()
        .filter_map(|record| {
            let ip = match &record.data {
                RData::A(a) => IpAddr::V4(a.0),
                RData::AAAA(aaaa) => IpAddr::V6(aaaa.0),
                _ => return None,
            };
            Some(AddressRecord {
                ip,
                ttl: ttl(record),
            })
        })
        .collect()
}

/// The SRV records of an answer (any other record is ignored).
pub fn srv_records(records: &[Record]) -> Vec<SrvRecord> {
    records
        .iter()
        .filter_map(|record| match &record.data {
            RData::SRV(srv) => Some(SrvRecord {
                priority: srv.priority,
                weight: srv.weight,
                port: srv.port,
                target: srv.target.to_ascii(),
                ttl: ttl(record),
            }),
            _ => None,
        })
        .collect()
}

fn ttl(record: &Record) -> Duration {
    Duration::from_secs(u64::from(record.ttl))
}

impl DnsResolve for HickoryResolver {
    fn lookup_addresses<'a>(
        &'a self,
        name: &'a str,
        family: AddressFamily,
    ) -> BoxFuture<'a, Result<Vec<AddressRecord>, ResolveError>> {
        let record_type = match family {
            AddressFamily::V4 => RecordType::A,
            AddressFamily::V6 => RecordType::AAAA,
        };
        Box::pin(async move {
            let records = self.lookup(name, record_type).await?;
            Ok(address_records(&records))
        })
    }

    fn lookup_srv<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Vec<SrvRecord>, ResolveError>> {
        Box::pin(async move {
            let records = self.lookup(name, RecordType::SRV).await?;
            Ok(srv_records(&records))
        })
    }
}
