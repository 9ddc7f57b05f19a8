//! The resolver seam: one-family address lookups and SRV lookups with per-record TTLs, and
//! Envoy's `dns_lookup_family` rules built on top of them.
//!
//! An answer with no records (NXDOMAIN or NODATA) is a *successful* empty answer, as Envoy's
//! c-ares resolver reports it; only transport errors, timeouts and error rcodes (SERVFAIL,
//! REFUSED, ...) are failures.

use std::{future::Future, net::IpAddr, pin::Pin, time::Duration};

use crate::config::sources::dns::DnsLookupFamily;

/// A boxed, `Send` future, so [`DnsResolve`] can be used as a trait object.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One address family, i.e. one query type (A or AAAA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AddressFamily {
    /// A records.
    V4,
    /// AAAA records.
    V6,
}

impl AddressFamily {
    /// The DNS record type name.
    pub fn record_type(self) -> &'static str {
        match self {
            Self::V4 => "A",
            Self::V6 => "AAAA",
        }
    }

    fn matches(self, ip: IpAddr) -> bool {
        matches!(
            (self, ip),
            (Self::V4, IpAddr::V4(_)) | (Self::V6, IpAddr::V6(_))
        )
    }
}

/// One A or AAAA record of an answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AddressRecord {
    /// The address.
    pub ip: IpAddr,
    /// The record's TTL as the server sent it.
    pub ttl: Duration,
}

/// One SRV record of an answer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SrvRecord {
    /// SRV priority: lower is preferred.
    pub priority: u16,
    /// SRV weight among records of the same priority.
    pub weight: u16,
    /// Port of the service on `target`.
    pub port: u16,
    /// Host name to resolve to addresses; "." means "service not available here".
    pub target: String,
    /// The record's TTL.
    pub ttl: Duration,
}

/// A failed lookup (not an empty answer).
#[derive(Debug, thiserror::Error)]
#[error("dns lookup of {name} ({record_type}) failed, is the name server reachable? {source}")]
pub struct ResolveError {
    /// The queried name.
    pub name: String,
    /// The queried record type.
    pub record_type: &'static str,
    /// What went wrong.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

/// A DNS client: the real one is [`super::HickoryResolver`], tests use [`super::FakeResolver`].
pub trait DnsResolve: Send + Sync + 'static {
    /// A (`V4`) or AAAA (`V6`) records of `name`, in answer order; empty for NXDOMAIN/NODATA.
    fn lookup_addresses<'a>(
        &'a self,
        name: &'a str,
        family: AddressFamily,
    ) -> BoxFuture<'a, Result<Vec<AddressRecord>, ResolveError>>;

    /// SRV records of `name`, in answer order; empty for NXDOMAIN/NODATA.
    fn lookup_srv<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Vec<SrvRecord>, ResolveError>>;
}

/// Resolves `name` following Envoy's lookup-family rules.
///
/// * `V4_ONLY` / `V6_ONLY`: one query.
/// * `AUTO` (AAAA first) and `V4_PREFERRED` (A first): when the preferred query fails or yields
///   no address, the other family is queried and its outcome (addresses, empty or failure) is
///   the result.
/// * `ALL`: both queries; AAAA addresses first, then A. It fails only when both fail.
///
/// An IP literal resolves to itself with TTL 0 (so `respect_dns_ttl` falls back to the refresh
/// rate), if its family is asked for.
pub async fn resolve_addresses(
    resolver: &dyn DnsResolve,
    name: &str,
    family: DnsLookupFamily,
) -> Result<Vec<AddressRecord>, ResolveError> {
    use AddressFamily::{V4, V6};
    match family {
        DnsLookupFamily::V4Only => query(resolver, name, V4).await,
        DnsLookupFamily::V6Only => query(resolver, name, V6).await,
        DnsLookupFamily::Auto => with_fallback(resolver, name, V6, V4).await,
        DnsLookupFamily::V4Preferred => with_fallback(resolver, name, V4, V6).await,
        DnsLookupFamily::All => {
            let v6 = query(resolver, name, V6).await;
            let v4 = query(resolver, name, V4).await;
            match (v6, v4) {
                (Err(err), Err(_)) => Err(err),
                (Ok(mut v6), Ok(v4)) => {
                    v6.extend(v4);
                    Ok(v6)
                }
                (Ok(only), Err(err)) | (Err(err), Ok(only)) => {
                    tracing::debug!(name, %err, "one address family failed, using the other");
                    Ok(only)
                }
            }
        }
    }
}

async fn with_fallback(
    resolver: &dyn DnsResolve,
    name: &str,
    first: AddressFamily,
    second: AddressFamily,
) -> Result<Vec<AddressRecord>, ResolveError> {
    match query(resolver, name, first).await {
        Ok(records) if !records.is_empty() => Ok(records),
        Ok(_) => query(resolver, name, second).await,
        Err(err) => {
            tracing::debug!(name, %err, "preferred address family failed, trying the other");
            query(resolver, name, second).await
        }
    }
}

async fn query(
    resolver: &dyn DnsResolve,
    name: &str,
    family: AddressFamily,
) -> Result<Vec<AddressRecord>, ResolveError> {
    if let Ok(ip) = name.parse::<IpAddr>() {
        let literal = AddressRecord {
            ip,
            ttl: Duration::ZERO,
        };
        return Ok(family.matches(ip).then_some(literal).into_iter().collect());
    }
    resolver.lookup_addresses(name, family).await
}
