//! Why a service-router's routes could not be compiled ([`RouteError`]): shared by the route
//! matchers and the retry policies.

/// Why routes could not be built.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// A route's regular expression does not compile.
    #[error("route {route}: bad regular expression {regex:?}: {source}")]
    Regex {
        /// Index of the route.
        route: usize,
        /// The expression.
        regex: String,
        /// Why.
        #[source]
        source: regex::Error,
    },
    /// A method name is not valid.
    #[error("route {route}: invalid method {method:?}")]
    Method {
        /// Index of the route.
        route: usize,
        /// The method.
        method: String,
    },
    /// A header name is not valid.
    #[error("route {route}: invalid header name {name:?}")]
    HeaderName {
        /// Index of the route.
        route: usize,
        /// The name.
        name: String,
    },
    /// A target has no cluster to send to.
    #[error(
        "route {route}: target {target} has no cluster (is a cluster configured for service {service:?}?)"
    )]
    NoCluster {
        /// Index of the route.
        route: usize,
        /// Target ID.
        target: String,
        /// Its service.
        service: String,
    },
    /// A `RetryOn` condition the proxy path does not know.
    #[error(
        "route {route}: retry condition {condition:?} is not supported (supported: 5xx, \
         gateway-error, reset, connect-failure, envoy-ratelimited, retriable-4xx, refused-stream, \
         cancelled, deadline-exceeded, internal, resource-exhausted, unavailable)"
    )]
    RetryCondition {
        /// Index of the route.
        route: usize,
        /// The condition.
        condition: String,
    },
    /// A `RetryOnStatusCodes` entry that is not an HTTP status code.
    #[error(
        "route {route}: RetryOnStatusCodes contains {code}, which is not an HTTP status (100-599)"
    )]
    RetryStatus {
        /// Index of the route.
        route: usize,
        /// The code.
        code: u32,
    },
    /// The chain itself is inconsistent.
    #[error(transparent)]
    Chain(#[from] proxy_chain::ChainError),
}
