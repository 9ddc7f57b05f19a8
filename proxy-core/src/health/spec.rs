//! Validated health-check settings with every default applied: what a probe actually runs.
//!
//! A [`HealthCheckSpec`] is `Hash + Eq`, so two clusters asking for the same check on the same
//! address share one probe (see [`super::manager`]).

use std::time::Duration;

/// A validated `HealthCheck` (see [`super::config::HealthCheck::validate`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HealthCheckSpec {
    /// Per-check timeout.
    pub timeout: Duration,
    /// Base interval between checks.
    pub interval: Duration,
    /// Upper bound (exclusive) of the delay before the first check.
    pub initial_jitter: Duration,
    /// Upper bound (exclusive) of the delay added to each interval.
    pub interval_jitter: Duration,
    /// Percentage of the interval used as an extra jitter bound.
    pub interval_jitter_percent: u32,
    /// Consecutive threshold-counted failures to turn unhealthy.
    pub unhealthy_threshold: u32,
    /// Consecutive successes to turn healthy again.
    pub healthy_threshold: u32,
    /// Interval before the cluster carried traffic.
    pub no_traffic_interval: Duration,
    /// Interval for a healthy host before the cluster carried traffic.
    pub no_traffic_healthy_interval: Duration,
    /// Interval while unhealthy.
    pub unhealthy_interval: Duration,
    /// Interval while failures accumulate towards the threshold.
    pub unhealthy_edge_interval: Duration,
    /// Interval while successes accumulate towards the threshold.
    pub healthy_edge_interval: Duration,
    /// What a check does on the wire.
    pub kind: CheckKind,
}

/// The protocol of a check.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CheckKind {
    /// Raw TCP.
    Tcp(TcpSpec),
    /// HTTP/1.1 GET.
    Http(HttpSpec),
    /// gRPC health over h2c.
    Grpc(GrpcSpec),
    /// One UDP datagram and its reply (this daemon's own; Envoy has no UDP checker).
    Udp(UdpSpec),
}

/// UDP check: a datagram to the host on a connected socket, healthy on the expected reply.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum UdpSpec {
    /// Sends `send`; a reply datagram holding every `receive` block in order is healthy (any
    /// reply when `receive` is empty).
    Payload {
        /// The datagram.
        send: Vec<u8>,
        /// Blocks that must appear, in order, in one reply datagram.
        receive: Vec<Vec<u8>>,
    },
    /// A DNS query; healthy when the answer carries `rcode`.
    Dns(DnsProbe),
}

/// A validated DNS query for [`UdpSpec::Dns`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DnsProbe {
    /// The name in wire form (length-prefixed labels ending with the root's zero).
    pub qname: Vec<u8>,
    /// The query type (1 for `A`).
    pub qtype: u16,
    /// The RCODE a healthy server answers with (0, `NOERROR`, by default).
    pub rcode: u8,
}

/// Raw TCP check: empty `send` means connect-only.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct TcpSpec {
    /// Bytes written after connecting.
    pub send: Vec<u8>,
    /// Blocks that must appear in the response in this order.
    pub receive: Vec<Vec<u8>>,
}

/// HTTP/1.1 check.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HttpSpec {
    /// `Host` header (the cluster name unless configured).
    pub host: String,
    /// Request path.
    pub path: String,
    /// Healthy statuses.
    pub expected_statuses: Vec<StatusRange>,
    /// Statuses that count towards the unhealthy threshold.
    pub retriable_statuses: Vec<StatusRange>,
    /// Required `x-envoy-upstream-healthchecked-cluster` match.
    pub service_name_matcher: Option<StringMatch>,
}

/// gRPC health check.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GrpcSpec {
    /// `HealthCheckRequest.service`.
    pub service_name: String,
    /// `:authority` pseudo-header.
    pub authority: String,
}

/// A half-open HTTP status range `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StatusRange {
    /// Inclusive.
    pub start: u16,
    /// Exclusive.
    pub end: u16,
}

impl StatusRange {
    /// Whether `status` falls in any of `ranges`.
    pub fn any_contains(ranges: &[StatusRange], status: u16) -> bool {
        ranges.iter().any(|r| r.start <= status && status < r.end)
    }
}

/// A compiled string matcher; the pattern is already lower-cased when the flag is set.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum StringMatch {
    /// Equal.
    Exact(String, bool),
    /// Starts with.
    Prefix(String, bool),
    /// Ends with.
    Suffix(String, bool),
    /// Contains.
    Contains(String, bool),
}

impl StringMatch {
    /// Whether `value` matches.
    pub fn matches(&self, value: &str) -> bool {
        let (pattern, ignore_case) = match self {
            Self::Exact(p, i) | Self::Prefix(p, i) | Self::Suffix(p, i) | Self::Contains(p, i) => {
                (p.as_str(), *i)
            }
        };
        let value = if ignore_case {
            value.to_ascii_lowercase()
        } else {
            value.to_owned()
        };
        match self {
            Self::Exact(..) => value == pattern,
            Self::Prefix(..) => value.starts_with(pattern),
            Self::Suffix(..) => value.ends_with(pattern),
            Self::Contains(..) => value.contains(pattern),
        }
    }
}

impl HealthCheckSpec {
    /// This check for a host whose `health_check_config.hostname` is `hostname`: an HTTP
    /// check's `Host` and a gRPC check's `:authority` become it (Envoy's order: the host's
    /// name, then the check's own, then the cluster's name); a TCP or UDP check is unchanged.
    pub fn for_hostname(&self, hostname: &str) -> Self {
        let mut spec = self.clone();
        match &mut spec.kind {
            CheckKind::Http(http) => hostname.clone_into(&mut http.host),
            CheckKind::Grpc(grpc) => hostname.clone_into(&mut grpc.authority),
            CheckKind::Tcp(_) | CheckKind::Udp(_) => {}
        }
        spec
    }
}
