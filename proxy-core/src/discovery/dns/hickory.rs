//! [`DnsResolve`] on hickory-resolver: configurable name servers (UDP, and TCP for truncated
//! answers) and no response cache, so
//! every refresh asks the server and sees TTL and record changes at once.
//!
//! hickory's cache clamps record TTLs to its `positive_max_ttl`, so limiting the cache by TTL
//! would corrupt the TTLs `respect_dns_ttl` reads. Instead the cache is sized 0 and the entry for
//! a query is cleared right before the query is made.

use std::{net::IpAddr, time::Duration};

use hickory_resolver::{
    TokioResolver,
    config::{ConnectionConfig, NameServerConfig, ResolveHosts, ResolverConfig},
    net::{DnsError, NetError, runtime::TokioRuntimeProvider},
    proto::{
        op::ResponseCode,
        rr::{RData, Record, RecordType},
    },
};

use super::{
    config::DnsSettings,
    resolver::{AddressFamily, AddressRecord, BoxFuture, DnsResolve, ResolveError, SrvRecord},
};

/// The production resolver.
#[derive(Clone)]
pub struct HickoryResolver {
    resolver: TokioResolver,
}

/// The resolver could not be built (unreadable `/etc/resolv.conf` when `dns_resolvers` is empty).
#[derive(Debug, thiserror::Error)]
#[error("cannot build the DNS resolver from dns_resolvers or /etc/resolv.conf: {0}")]
pub struct BuildResolverError(#[source] NetError);

impl HickoryResolver {
    /// A resolver for `settings.dns_resolvers` (UDP, TCP on truncation), or the system's name
    /// servers when empty.
    pub fn new(settings: &DnsSettings) -> Result<Self, BuildResolverError> {
        let provider = TokioRuntimeProvider::default();
        let mut builder = if settings.dns_resolvers.is_empty() {
            TokioResolver::builder(provider).map_err(BuildResolverError)?
        } else {
            // UDP first, TCP when an answer comes back truncated (as c-ares does): a name with
            // more records than a UDP answer holds would otherwise never resolve.
            let servers = settings.dns_resolvers.iter().map(|server| {
                let (mut udp, mut tcp) = (ConnectionConfig::udp(), ConnectionConfig::tcp());
                udp.port = server.0.port();
                tcp.port = server.0.port();
                NameServerConfig::new(server.0.ip(), true, vec![udp, tcp])
            });
            let mut builder = TokioResolver::builder_with_config(
                ResolverConfig::from_name_servers(servers.collect()),
                provider,
            );
            builder.options_mut().use_hosts_file = ResolveHosts::Never;
            builder
        };
        builder.options_mut().cache_size = 0;
        Ok(Self {
            resolver: builder.build().map_err(BuildResolverError)?,
        })
    }

    async fn lookup(
        &self,
        name: &str,
        record_type: RecordType,
    ) -> Result<Vec<Record>, ResolveError> {
        let failed = |source: NetError| ResolveError {
            name: name.to_owned(),
            record_type: record_type_name(record_type),
            source: Box::new(source),
        };
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
            Err(err) => Err(failed(err)),
        }
    }
}

fn record_type_name(record_type: RecordType) -> &'static str {
    match record_type {
        RecordType::A => "A",
        RecordType::AAAA => "AAAA",
        RecordType::SRV => "SRV",
        _ => "other",
    }
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
            // CNAME records of the chain are skipped; the address record's own TTL is used.
            let addresses = records.iter().filter_map(|record| {
                let ip = match &record.data {
                    RData::A(a) => IpAddr::V4(a.0),
                    RData::AAAA(aaaa) => IpAddr::V6(aaaa.0),
                    _ => return None,
                };
                Some(AddressRecord {
                    ip,
                    ttl: ttl(record),
                })
            });
            Ok(addresses.collect())
        })
    }

    fn lookup_srv<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Vec<SrvRecord>, ResolveError>> {
        Box::pin(async move {
            let records = self.lookup(name, RecordType::SRV).await?;
            let srv = records.iter().filter_map(|record| match &record.data {
                RData::SRV(srv) => Some(SrvRecord {
                    priority: srv.priority,
                    weight: srv.weight,
                    port: srv.port,
                    target: srv.target.to_ascii(),
                    ttl: ttl(record),
                }),
                _ => None,
            });
            Ok(srv.collect())
        })
    }
}
