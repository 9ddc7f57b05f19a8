//! HTTP routes of a Consul service-router, compiled for the proxy: matchers (path exact /
//! prefix / regex, headers, query parameters, methods), weighted legs to clusters with failover,
//! prefix rewrite, request and idle timeouts, retries ([`RetryPolicy`]) and header changes.
//! First matching route wins; the compiled chain always ends with a catch-all.

mod error;
mod hash;
mod retry;

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Uri};
use proxy_chain::{
    CompiledDiscoveryChain, RouteLegs, TargetLeg,
    entries::{
        HttpHeaderModifiers, ServiceRoute, ServiceRouteHttpMatch, ServiceRouteMatchHeader,
        ServiceRouteMatchQueryParam,
    },
};
use proxy_core::lb::{Balancer, hash_policy::HashPolicy};
use regex::Regex;

pub use self::{
    error::RouteError,
    hash::{Hashed, Peers, RequestHash},
    retry::{AttemptFailure, RetryPolicy, backoff},
};
use crate::{
    cluster::{ClusterHandle, random_u64},
    http::upgrade::UpgradePolicy,
};

/// How a route matches the request path.
#[derive(Debug, Clone)]
enum PathMatch {
    Any,
    Exact(String),
    Prefix(String),
    /// Full match, as Envoy's `safe_regex` does.
    Regex(Regex),
}

/// One header or query criterion.
#[derive(Debug, Clone)]
enum ValueMatch {
    Present,
    Exact(String),
    Prefix(String),
    Suffix(String),
    Regex(Regex),
}

impl ValueMatch {
    fn matches(&self, value: Option<&str>) -> bool {
        let Some(v) = value else { return false };
        match self {
            ValueMatch::Present => true,
            ValueMatch::Exact(e) => v == e,
            ValueMatch::Prefix(p) => v.starts_with(p.as_str()),
            ValueMatch::Suffix(s) => v.ends_with(s.as_str()),
            ValueMatch::Regex(r) => r.is_match(v),
        }
    }
}

/// A route's match criteria; all must hold.
#[derive(Debug, Clone)]
pub struct RouteMatch {
    path: PathMatch,
    headers: Vec<(HeaderName, ValueMatch, bool)>,
    query: Vec<(String, ValueMatch)>,
    methods: Vec<Method>,
}

impl RouteMatch {
    /// Compiles a service-router route's match (`None`: matches everything).
    pub fn from_consul(
        route: usize,
        m: Option<&ServiceRouteHttpMatch>,
    ) -> Result<Self, RouteError> {
        let Some(m) = m else {
            return Ok(Self {
                path: PathMatch::Any,
                headers: vec![],
                query: vec![],
                methods: vec![],
            });
        };
        let path = if !m.path_exact.is_empty() {
            PathMatch::Exact(m.path_exact.clone())
        } else if !m.path_prefix.is_empty() {
            PathMatch::Prefix(m.path_prefix.clone())
        } else if !m.path_regex.is_empty() {
            PathMatch::Regex(full_regex(route, &m.path_regex)?)
        } else {
            PathMatch::Any
        };
        let headers = m
            .header
            .iter()
            .map(|h| header_match(route, h))
            .collect::<Result<_, _>>()?;
        let query = m
            .query_param
            .iter()
            .map(|q| query_match(route, q))
            .collect::<Result<_, _>>()?;
        let methods = m
            .methods
            .iter()
            .map(|s| {
                Method::from_bytes(s.to_uppercase().as_bytes()).map_err(|_| RouteError::Method {
                    route,
                    method: s.clone(),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            path,
            headers,
            query,
            methods,
        })
    }

    /// Whether the request matches.
    pub fn matches<B>(&self, req: &Request<B>) -> bool {
        let path = req.uri().path();
        let path_ok = match &self.path {
            PathMatch::Any => true,
            PathMatch::Exact(p) => path == p,
            PathMatch::Prefix(p) => path.starts_with(p.as_str()),
            PathMatch::Regex(r) => r.is_match(path),
        };
        if !path_ok || (!self.methods.is_empty() && !self.methods.contains(req.method())) {
            return false;
        }
        let headers_ok = self.headers.iter().all(|(name, m, invert)| {
            let value = joined_header(req.headers(), name);
            m.matches(value.as_deref()) != *invert
        });
        headers_ok
            && self
                .query
                .iter()
                .all(|(name, m)| m.matches(query_value(req.uri(), name).as_deref()))
    }
}

/// Envoy matches the values of a repeated header joined with commas.
fn joined_header(headers: &HeaderMap, name: &HeaderName) -> Option<String> {
    let values: Vec<&str> = headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    (!values.is_empty()).then(|| values.join(","))
}

/// The first value of query parameter `name` (percent-decoding `%XX` and `+`).
fn query_value(uri: &Uri, name: &str) -> Option<String> {
    uri.query()?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (decode(k) == name).then(|| decode(v))
    })
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let hex = |b: u8| char::from(b).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn full_regex(route: usize, re: &str) -> Result<Regex, RouteError> {
    Regex::new(&format!("^(?:{re})$")).map_err(|source| RouteError::Regex {
        route,
        regex: re.to_owned(),
        source,
    })
}

fn header_match(
    route: usize,
    h: &ServiceRouteMatchHeader,
) -> Result<(HeaderName, ValueMatch, bool), RouteError> {
    let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| RouteError::HeaderName {
        route,
        name: h.name.clone(),
    })?;
    let m = if h.present {
        ValueMatch::Present
    } else if !h.exact.is_empty() {
        ValueMatch::Exact(h.exact.clone())
    } else if !h.prefix.is_empty() {
        ValueMatch::Prefix(h.prefix.clone())
    } else if !h.suffix.is_empty() {
        ValueMatch::Suffix(h.suffix.clone())
    } else if !h.regex.is_empty() {
        ValueMatch::Regex(full_regex(route, &h.regex)?)
    } else {
        // Consul validation requires one matcher; an empty exact value is Envoy's "present".
        ValueMatch::Present
    };
    Ok((name, m, h.invert))
}

fn query_match(
    route: usize,
    q: &ServiceRouteMatchQueryParam,
) -> Result<(String, ValueMatch), RouteError> {
    let m = if q.present {
        ValueMatch::Present
    } else if !q.exact.is_empty() {
        ValueMatch::Exact(q.exact.clone())
    } else if !q.regex.is_empty() {
        ValueMatch::Regex(full_regex(route, &q.regex)?)
    } else {
        ValueMatch::Present
    };
    Ok((q.name.clone(), m))
}

/// One weighted share of a route.
#[derive(Clone)]
pub struct RouteLeg {
    /// Share in percent.
    pub weight: f32,
    /// Target ID (for logs).
    pub target: String,
    /// The target's cluster, then its failover clusters in order.
    pub clusters: Vec<ClusterHandle>,
    /// Connect timeout from the resolver (`None`: the proxy's default).
    pub connect_timeout: Option<Duration>,
    /// What RING_HASH and MAGLEV hash: the resolver's `HashPolicies` when its policy hashes,
    /// else the service's `hash_policy`.
    pub hash: RequestHash,
}

/// A compiled route.
#[derive(Clone)]
pub struct Route {
    /// The match.
    pub matcher: RouteMatch,
    /// Weighted legs.
    pub legs: Vec<RouteLeg>,
    /// Path rewrite: (matched exact path or prefix, replacement).
    pub prefix_rewrite: Option<(String, String)>,
    /// Envoy's route `timeout` (Consul's `RequestTimeout`): from the end of the downstream
    /// request to the end of the upstream response, body included, shared by all attempts
    /// (`None`: no limit).
    pub request_timeout: Option<Duration>,
    /// Envoy's route `idle_timeout` (Consul's `IdleTimeout`): the longest time without request
    /// or response activity (`None`: no limit).
    pub idle_timeout: Option<Duration>,
    /// When and how often requests are retried.
    pub retry: RetryPolicy,
    /// Request header changes.
    pub request_headers: Option<HttpHeaderModifiers>,
    /// Response header changes.
    pub response_headers: Option<HttpHeaderModifiers>,
}

impl Route {
    /// Builds a route from a chain's route and its legs; `cluster_of` maps a target to its
    /// cluster.
    pub fn from_legs(
        index: usize,
        rl: &RouteLegs,
        cluster_of: &dyn Fn(&TargetLeg) -> Option<ClusterHandle>,
    ) -> Result<Self, RouteError> {
        let def: &ServiceRoute = &rl.definition;
        let http = def.match_.as_ref().and_then(|m| m.http.as_ref());
        let matcher = RouteMatch::from_consul(index, http)?;
        let dest = def.destination.clone().unwrap_or_default();
        let no_cluster = |t: &TargetLeg| RouteError::NoCluster {
            route: index,
            target: t.id.clone(),
            service: t.service.clone(),
        };
        let mut legs = Vec::new();
        for leg in &rl.legs {
            let mut primary = cluster_of(&leg.target).ok_or_else(|| no_cluster(&leg.target))?;
            // The resolver's LoadBalancer is its targets' cluster policy, as Consul's xDS makes it.
            let resolver = leg.load_balancer.as_ref();
            if let Some(balancer) = resolver.and_then(Balancer::of_resolver) {
                primary = primary.with_balancer(balancer);
            }
            let mut clusters = vec![primary];
            // Failover targets without a cluster here are skipped: they may be other datacenters.
            clusters.extend(leg.failover.iter().filter_map(cluster_of));
            let nanos = leg.connect_timeout.as_nanos();
            legs.push(RouteLeg {
                weight: leg.weight,
                target: leg.target.id.clone(),
                clusters,
                connect_timeout: (nanos > 0).then(|| Duration::from_nanos(nanos as u64)),
                hash: resolver_hash(resolver),
            });
        }
        let prefix_rewrite = (!dest.prefix_rewrite.is_empty())
            .then(|| {
                http.map(|h| {
                    if h.path_exact.is_empty() {
                        h.path_prefix.clone()
                    } else {
                        h.path_exact.clone()
                    }
                })
            })
            .flatten()
            .filter(|m| !m.is_empty())
            .map(|m| (m, dest.prefix_rewrite.clone()));
        let retry = RetryPolicy::from_destination(index, &dest)?;
        let positive = |nanos: i64| (nanos > 0).then(|| Duration::from_nanos(nanos as u64));
        Ok(Self {
            matcher,
            legs,
            prefix_rewrite,
            request_timeout: positive(dest.request_timeout.as_nanos()),
            idle_timeout: positive(dest.idle_timeout.as_nanos()),
            retry,
            request_headers: dest.request_headers.clone(),
            response_headers: dest.response_headers.clone(),
        })
    }

    /// A leg by weight.
    pub fn pick_leg(&self) -> Option<&RouteLeg> {
        let total: f32 = self.legs.iter().map(|l| l.weight.max(0.0)).sum();
        if total <= 0.0 {
            return self.legs.first();
        }
        let mut r = (random_u64() % 1_000_000) as f32 / 1_000_000.0 * total;
        for leg in &self.legs {
            if r < leg.weight {
                return Some(leg);
            }
            r -= leg.weight.max(0.0);
        }
        self.legs.last()
    }

    /// The request path after the prefix rewrite (query kept).
    pub fn rewrite(&self, uri: &Uri) -> Option<String> {
        let (matched, replacement) = self.prefix_rewrite.as_ref()?;
        let rest = uri.path().strip_prefix(matched.as_str())?;
        let mut path = format!("{replacement}{rest}");
        if let Some(q) = uri.query() {
            path.push('?');
            path.push_str(q);
        }
        Some(path)
    }
}

/// A resolver's `HashPolicies` in Envoy's form, when its policy hashes (Consul's xDS sets a
/// route's `hash_policy` only then).
fn resolver_hash(lb: Option<&proxy_chain::entries::LoadBalancer>) -> RequestHash {
    let policies = lb
        .filter(|lb| lb.is_hash_based())
        .map(|lb| {
            lb.hash_policies
                .iter()
                .filter_map(HashPolicy::from_consul)
                .collect()
        })
        .unwrap_or_default();
    RequestHash::new(policies)
}

/// Applies header changes (remove, then set, then add), as Envoy's header manipulation does.
pub fn apply_headers(headers: &mut HeaderMap, m: Option<&HttpHeaderModifiers>) {
    let Some(m) = m else { return };
    for name in &m.remove {
        headers.remove(name.as_str());
    }
    for (k, v) in &m.set {
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            headers.insert(k, v);
        }
    }
    for (k, v) in &m.add {
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            headers.append(k, v);
        }
    }
}

/// The routes of one HTTP service, in order, and the upgrades it allows.
#[derive(Clone)]
pub struct RouteTable {
    routes: Vec<Route>,
    upgrades: UpgradePolicy,
}

impl RouteTable {
    /// Routes from a compiled chain; `cluster_of` maps each target to the cluster serving it.
    pub fn from_chain(
        chain: &CompiledDiscoveryChain,
        cluster_of: &dyn Fn(&TargetLeg) -> Option<ClusterHandle>,
    ) -> Result<Self, RouteError> {
        let routes = chain
            .route_legs()?
            .iter()
            .enumerate()
            .map(|(i, rl)| Route::from_legs(i, rl, cluster_of))
            .collect::<Result<_, _>>()?;
        Ok(Self::new(routes))
    }

    /// Routes given directly (WebSocket upgrades allowed, the default).
    pub fn new(routes: Vec<Route>) -> Self {
        Self {
            routes,
            upgrades: UpgradePolicy::default(),
        }
    }

    /// The same routes with the service's `upgrade_configs`.
    #[must_use]
    pub fn with_upgrades(mut self, upgrades: UpgradePolicy) -> Self {
        self.upgrades = upgrades;
        self
    }

    /// The same routes with the service's `hash_policy` for every leg whose resolver sets
    /// none.
    #[must_use]
    pub fn with_hash_policy(mut self, policies: &[HashPolicy]) -> Self {
        let legs = self.routes.iter_mut().flat_map(|r| r.legs.iter_mut());
        for leg in legs.filter(|l| l.hash.is_empty()) {
            leg.hash = RequestHash::new(policies.to_vec());
        }
        self
    }

    /// The upgrade types requests may ask for.
    pub fn upgrades(&self) -> &UpgradePolicy {
        &self.upgrades
    }

    /// The first route the request matches.
    pub fn route<B>(&self, req: &Request<B>) -> Option<&Route> {
        self.routes.iter().find(|r| r.matcher.matches(req))
    }

    /// Every cluster the routes use (for pool sweeps).
    pub fn clusters(&self) -> Vec<ClusterHandle> {
        self.routes
            .iter()
            .flat_map(|r| r.legs.iter().flat_map(|l| l.clusters.iter().cloned()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn http_match(json: &str) -> RouteMatch {
        let m: ServiceRouteHttpMatch = serde_json::from_str(json).unwrap();
        RouteMatch::from_consul(0, Some(&m)).unwrap()
    }

    fn req(method: &str, uri: &str, headers: &[(&str, &str)]) -> Request<()> {
        let mut b = Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn paths() {
        let exact = http_match(r#"{"PathExact": "/a"}"#);
        assert!(exact.matches(&req("GET", "/a", &[])));
        assert!(exact.matches(&req("GET", "/a?x=1", &[])));
        assert!(!exact.matches(&req("GET", "/a/b", &[])));
        let prefix = http_match(r#"{"PathPrefix": "/api/"}"#);
        assert!(prefix.matches(&req("GET", "/api/v1", &[])));
        assert!(!prefix.matches(&req("GET", "/apix", &[])));
        let re = http_match(r#"{"PathRegex": "/item/[0-9]+"}"#);
        assert!(re.matches(&req("GET", "/item/42", &[])));
        assert!(
            !re.matches(&req("GET", "/item/42/x", &[])),
            "regex matches the whole path"
        );
        assert!(
            RouteMatch::from_consul(0, None)
                .unwrap()
                .matches(&req("POST", "/anything", &[]))
        );
    }

    #[test]
    fn headers_with_invert_and_repeats() {
        let m = http_match(
            r#"{"Header": [{"Name": "x-env", "Exact": "canary"}, {"Name": "x-debug", "Present": true, "Invert": true}]}"#,
        );
        assert!(m.matches(&req("GET", "/", &[("x-env", "canary")])));
        assert!(!m.matches(&req("GET", "/", &[("x-env", "canary"), ("x-debug", "1")])));
        assert!(!m.matches(&req("GET", "/", &[("x-env", "prod")])));
        let p = http_match(
            r#"{"Header": [{"Name": "ua", "Prefix": "curl/"}, {"Name": "h", "Suffix": ".com"}]}"#,
        );
        assert!(p.matches(&req("GET", "/", &[("ua", "curl/8"), ("h", "a.com")])));
        let r = http_match(r#"{"Header": [{"Name": "v", "Regex": "a,b"}]}"#);
        assert!(
            r.matches(&req("GET", "/", &[("v", "a"), ("v", "b")])),
            "repeated values joined"
        );
    }

    #[test]
    fn query_and_methods() {
        let m = http_match(
            r#"{"QueryParam": [{"Name": "version", "Exact": "2 beta"}, {"Name": "id", "Regex": "[0-9]+"}], "Methods": ["get", "POST"]}"#,
        );
        assert!(m.matches(&req("GET", "/?version=2+beta&id=7", &[])));
        assert!(m.matches(&req("POST", "/?id=7&version=2%20beta", &[])));
        assert!(!m.matches(&req("PUT", "/?version=2+beta&id=7", &[])));
        assert!(!m.matches(&req("GET", "/?version=2+beta&id=x7", &[])));
        assert!(!m.matches(&req("GET", "/?id=7", &[])));
        let present = http_match(r#"{"QueryParam": [{"Name": "debug", "Present": true}]}"#);
        assert!(present.matches(&req("GET", "/?debug", &[])));
        assert!(!present.matches(&req("GET", "/?x=debug", &[])));
    }

    #[test]
    fn bad_regex_is_an_error() {
        let m: ServiceRouteHttpMatch =
            serde_json::from_str(r#"{"PathRegex": "(unclosed"}"#).unwrap();
        let err = RouteMatch::from_consul(3, Some(&m)).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("route 3: bad regular expression"),
            "{err}"
        );
    }

    #[test]
    fn rewrite_and_header_changes() {
        let route = Route {
            matcher: http_match(r#"{"PathPrefix": "/old/"}"#),
            legs: vec![],
            prefix_rewrite: Some(("/old/".into(), "/new/".into())),
            request_timeout: None,
            idle_timeout: None,
            retry: RetryPolicy::default(),
            request_headers: None,
            response_headers: None,
        };
        assert_eq!(
            route.rewrite(&"/old/x?y=1".parse().unwrap()).as_deref(),
            Some("/new/x?y=1")
        );
        let mut h = HeaderMap::new();
        h.insert("x-remove", HeaderValue::from_static("1"));
        h.insert("x-set", HeaderValue::from_static("old"));
        let m: HttpHeaderModifiers = serde_json::from_str(
            r#"{"Remove": ["x-remove"], "Set": {"x-set": "new"}, "Add": {"x-add": "a"}}"#,
        )
        .unwrap();
        apply_headers(&mut h, Some(&m));
        assert!(h.get("x-remove").is_none());
        assert_eq!(h["x-set"], "new");
        assert_eq!(h["x-add"], "a");
    }
}
