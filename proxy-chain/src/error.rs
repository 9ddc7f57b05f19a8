//! Errors. Every message that has a Consul counterpart is Consul's text, byte for byte, so users
//! see the phrases they know; the few messages Consul has no equivalent for say so in their doc.

use crate::{duration::GoDuration, filter::FilterError, quote::go_quote};

/// An Enterprise-only field used with Consul CE semantics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EnterpriseFeature {
    /// A namespace other than the default.
    #[error("Setting Namespace requires Consul Enterprise")]
    Namespace,
    /// An admin partition.
    #[error("Setting Partition requires Consul Enterprise")]
    Partition,
    /// A sameness group.
    #[error("Setting SamenessGroup requires Consul Enterprise")]
    SamenessGroup,
    /// A failover policy mode.
    #[error("Setting failover policies requires Consul Enterprise")]
    FailoverPolicy,
}

/// Why a subset name is not a DNS label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SubsetNameError {
    /// Empty or longer than 63 bytes.
    #[error("must be non-empty and 63 characters or fewer")]
    Length,
    /// Not `^[a-z0-9]([a-z0-9-]*[a-z0-9])?$`.
    #[error(
        "must be 63 characters or fewer, begin or end with lower case alphanumeric characters, and contain lower case alphanumeric characters or '-' in between"
    )]
    Charset,
}

/// A config entry that fails Consul's `Validate()`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ValidationError {
    #[error("Name is required")]
    NameRequired,
    #[error("{0}")]
    Enterprise(EnterpriseFeature),
    #[error("invalid name ({}), only \"global\" is supported", go_quote(.0))]
    ProxyDefaultsName(String),
    #[error("Route[{index}] {field} doesn't start with '/': {}", go_quote(.value))]
    RoutePathNoSlash {
        index: usize,
        field: &'static str,
        value: String,
    },
    #[error("Route[{0}] should only contain at most one of PathExact, PathPrefix, or PathRegex")]
    RouteMultiplePaths(usize),
    #[error("Route[{route}] Header[{header}] missing required Name field")]
    RouteHeaderName { route: usize, header: usize },
    #[error(
        "Route[{route}] Header[{header}] should only contain one of Present, Exact, Prefix, Suffix, or Regex"
    )]
    RouteHeaderMatchers { route: usize, header: usize },
    #[error("Route[{route}] QueryParam[{param}] missing required Name field")]
    RouteQueryParamName { route: usize, param: usize },
    #[error(
        "Route[{route}] QueryParam[{param}] should only contain one of Present, Exact, or Regex"
    )]
    RouteQueryParamMatchers { route: usize, param: usize },
    #[error("Route[{index}] Methods contains an invalid method {}", go_quote(.method))]
    RouteInvalidMethod { index: usize, method: String },
    #[error("Route[{index}] Methods contains {} more than once", go_quote(.method))]
    RouteDuplicateMethod { index: usize, method: String },
    #[error(
        "Route[{0}] cannot make use of PrefixRewrite without configuring either PathExact or PathPrefix"
    )]
    RoutePrefixRewrite(usize),
    #[error("Route[{index}] contains an invalid retry condition: {}", go_quote(.condition))]
    RouteRetryCondition { index: usize, condition: String },
    #[error("no splits configured")]
    NoSplits,
    #[error(
        "split destination occurs more than once: service={}, subset={}, namespace={}, partition={}",
        go_quote(.service), go_quote(.subset), go_quote(.namespace), go_quote(.partition)
    )]
    DuplicateSplit {
        service: String,
        subset: String,
        namespace: String,
        partition: String,
    },
    #[error("the sum of all split weights must be 100, not {0:.6}")]
    SplitWeightSum(f32),
    /// Ours: Consul 1.8.7 accepts a negative weight when the sum is 100 (`[200, -100]`), but a
    /// weight is a share of the traffic, which no proxy can make negative.
    #[error(
        "Splits[{index}] has a negative Weight ({weight}): a weight is the split's share of the traffic, from 0 to 100"
    )]
    NegativeSplitWeight { index: usize, weight: f32 },
    #[error("Subset defined with empty name")]
    SubsetEmptyName,
    #[error("Subset {} is invalid: {reason}", go_quote(.name))]
    SubsetName {
        name: String,
        reason: SubsetNameError,
    },
    #[error("Filter for subset {} is not a valid expression: {source}", go_quote(.name))]
    SubsetFilter { name: String, source: FilterError },
    #[error("DefaultSubset {} is not a valid subset", go_quote(.0))]
    DefaultSubset(String),
    #[error("Cross-datacenter redirect is only supported in the default partition")]
    RedirectCrossDcPartition,
    #[error("Cross-datacenter and cross-partition redirect is not supported")]
    RedirectCrossDcAndPartition,
    #[error("Redirect: {0}")]
    RedirectEnterprise(EnterpriseFeature),
    #[error("Redirect and Failover cannot both be set")]
    RedirectAndFailover,
    #[error("Redirect is empty")]
    RedirectEmpty,
    #[error("Redirect.Peer cannot be set with Redirect.ServiceSubset")]
    RedirectPeerWithSubset,
    #[error("Redirect.Partition cannot be set with Redirect.Peer")]
    RedirectPartitionWithPeer,
    #[error("Redirect.Peer cannot be set with Redirect.Datacenter")]
    RedirectPeerWithDatacenter,
    #[error("Redirect.{0} defined without Redirect.Service")]
    RedirectWithoutService(&'static str),
    #[error("Redirect.ServiceSubset {} is not a valid subset of {}", go_quote(.subset), go_quote(.service))]
    RedirectSubset { subset: String, service: String },
    #[error("Cross-datacenter failover is only supported in the default partition")]
    FailoverCrossDcPartition,
    #[error("Bad Failover[{}]: {feature}", go_quote(.subset))]
    FailoverEnterprise {
        subset: String,
        feature: EnterpriseFeature,
    },
    #[error("Bad Failover[{}]: not a valid subset subset", go_quote(.0))]
    FailoverNotSubset(String),
    #[error(
        "Bad Failover[{}]: one of Service, ServiceSubset, Namespace, Targets, or Datacenters is required",
        go_quote(.0)
    )]
    FailoverEmpty(String),
    #[error("Bad Failover[{}]: Policy must be one of '', 'default', or 'order-by-locality'", go_quote(.0))]
    FailoverPolicy(String),
    #[error(
        "Bad Failover[{}]: ServiceSubset {} is not a valid subset of {}",
        go_quote(.subset), go_quote(.service_subset), go_quote(.service)
    )]
    FailoverSubset {
        subset: String,
        service_subset: String,
        service: String,
    },
    #[error("Bad Failover[{}]: Targets cannot be set with {field}", go_quote(.subset))]
    FailoverTargetsWith { subset: String, field: &'static str },
    #[error("Bad Failover[{}].Targets[{index}]: {feature}", go_quote(.subset))]
    FailoverTargetEnterprise {
        subset: String,
        index: usize,
        feature: EnterpriseFeature,
    },
    #[error("Bad Failover[{}].Targets[{index}]: {conflict}", go_quote(.subset))]
    FailoverTargetConflict {
        subset: String,
        index: usize,
        conflict: &'static str,
    },
    #[error(
        "Bad Failover[{}].Targets[{index}]: ServiceSubset {} is not a valid subset of {}",
        go_quote(.subset), go_quote(.service_subset), go_quote(.service)
    )]
    FailoverTargetSubset {
        subset: String,
        index: usize,
        service_subset: String,
        service: String,
    },
    #[error("Bad Failover[{}].Datacenters: found empty datacenter", go_quote(.0))]
    FailoverEmptyDatacenter(String),
    #[error("Bad ConnectTimeout '{0}', must be >= 0")]
    ConnectTimeout(GoDuration),
    #[error("Bad RequestTimeout '{0}', must be >= 0")]
    RequestTimeout(GoDuration),
    #[error("Prioritize-by-locality requires Consul Enterprise ")]
    PrioritizeByLocality,
    #[error("Bad LoadBalancer policy: {} is not supported", go_quote(.0))]
    LbPolicy(String),
    #[error(
        "Bad LoadBalancer configuration. RingHashConfig specified for incompatible load balancing policy {}",
        go_quote(.0)
    )]
    LbRingHashConfig(String),
    #[error(
        "Bad LoadBalancer configuration. LeastRequestConfig specified for incompatible load balancing policy {}",
        go_quote(.0)
    )]
    LbLeastRequestConfig(String),
    #[error("Bad LoadBalancer configuration: HashPolicies specified for non-hash-based Policy: {}", go_quote(.0))]
    LbHashPoliciesNotHashBased(String),
    #[error("Bad LoadBalancer HashPolicy[{index}]: {} is not a supported field", go_quote(.field))]
    HashPolicyField { index: usize, field: String },
    #[error(
        "Bad LoadBalancer HashPolicy[{index}]: A single hash policy cannot hash both a source address and a {}",
        go_quote(.field)
    )]
    HashPolicySourceIpAndField { index: usize, field: String },
    #[error(
        "Bad LoadBalancer HashPolicy[{0}]: A FieldValue cannot be specified when hashing SourceIP"
    )]
    HashPolicySourceIpValue(usize),
    #[error("Bad LoadBalancer HashPolicy[{index}]: Field {} was specified without a FieldValue", go_quote(.field))]
    HashPolicyFieldWithoutValue { index: usize, field: String },
    #[error("Bad LoadBalancer HashPolicy[{0}]: FieldValue requires a Field to apply to")]
    HashPolicyValueWithoutField(usize),
    #[error("Bad LoadBalancer HashPolicy[{index}]: cookie_config provided for {}", go_quote(.field))]
    HashPolicyCookieConfig { index: usize, field: String },
    #[error("Bad LoadBalancer HashPolicy[{0}]: a session cookie cannot have an associated TTL")]
    HashPolicySessionTtl(usize),
}

/// Errors from building entry sets, compiling chains and flattening them into legs.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error("serviceName is required")]
    ServiceNameRequired,
    #[error("evaluateInNamespace is required")]
    NamespaceRequired,
    #[error("evaluateInPartition is required")]
    PartitionRequired,
    #[error("evaluateInDatacenter is required")]
    DatacenterRequired,
    #[error("evaluateInTrustDomain is required")]
    TrustDomainRequired,
    #[error("useInDatacenter is required")]
    UseInDatacenterRequired,
    #[error(
        "discovery chain {} uses inconsistent protocols; service {} has {} which is not {}",
        go_quote(.chain), go_quote(.service), go_quote(.protocol), go_quote(.expected)
    )]
    InconsistentProtocols {
        chain: String,
        service: String,
        protocol: String,
        expected: String,
    },
    #[error(
        "discovery chain {} uses a protocol {} that does not permit advanced routing or splitting behavior",
        go_quote(.chain), go_quote(.protocol)
    )]
    AdvancedRoutingProtocol { chain: String, protocol: String },
    #[error(
        "discovery chain {} has more than {max} service-splitters leading one into the next; this compiler stops there",
        go_quote(.chain)
    )]
    SplittersTooDeep { chain: String, max: usize },
    #[error("detected circular reference: [{}]", .0.join(" -> "))]
    CircularReference(Vec<String>),
    #[error("detected circular resolver redirect: [{}]", .0.join(" -> "))]
    CircularRedirect(Vec<String>),
    #[error("service {} does not have a subset named {}", go_quote(.service), go_quote(.subset))]
    MissingSubset { service: String, subset: String },
    #[error("service {} has an external SNI set; cannot define redirects for external services", go_quote(.0))]
    ExternalSniRedirect(String),
    #[error("service {} has an external SNI set; cannot define subsets for external services", go_quote(.0))]
    ExternalSniSubsets(String),
    #[error("service {} has an external SNI set; cannot define failover for external services", go_quote(.0))]
    ExternalSniFailover(String),
    /// An entry failed validation; the message is Consul's, `kind` and `name` say which entry.
    #[error("{source}")]
    InvalidEntry {
        kind: &'static str,
        name: String,
        source: Box<ValidationError>,
    },
    /// Two entries share a kind and name (no Consul equivalent: Consul stores one per key).
    #[error("duplicate config entry: kind={}, name={}", go_quote(.kind), go_quote(.name))]
    DuplicateEntry { kind: &'static str, name: String },
    /// The entries document is not a JSON array of Consul config entries (no Consul equivalent).
    #[error("invalid config entries JSON: {0}")]
    Parse(#[source] serde_json::Error),
    /// The compiled chain could not be written as JSON (no Consul equivalent).
    #[error("cannot serialize compiled chain: {0}")]
    Serialize(#[source] serde_json::Error),
    /// A mesh gateway mode other than `""`, `none`, `local` or `remote` (Consul's text).
    #[error("Invalid Mesh Gateway Mode: {}", go_quote(.0))]
    InvalidMeshGatewayMode(String),
    /// A compiled target's subset filter does not parse (only for chains not built by
    /// [`crate::compile`], whose entries are validated).
    #[error("target {}: {source}", go_quote(.target))]
    TargetFilter { target: String, source: FilterError },
    /// A compiled chain refers to a node or target it does not contain.
    #[error("compiled chain {} refers to missing {what} {}", go_quote(.chain), go_quote(.key))]
    Dangling {
        chain: String,
        what: &'static str,
        key: String,
    },
}
