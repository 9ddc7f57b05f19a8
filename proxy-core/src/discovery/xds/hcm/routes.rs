//! The routes of an HTTP connection manager's route table as service-router routes: Envoy's
//! matches (first match wins), defaults and actions, each field the proxy path cannot honour
//! exactly refused by name.

use envoy_types::pb::{
    envoy::{
        config::route::v3::{
            HeaderMatcher, QueryParameterMatcher, Route, RouteAction, RouteConfiguration,
            RouteMatch, VirtualHost, WeightedCluster, header_matcher::HeaderMatchSpecifier,
            query_parameter_matcher::QueryParameterMatchSpecifier, route::Action,
            route_action::ClusterSpecifier, route_match::PathSpecifier,
            weighted_cluster::ClusterWeight,
        },
        r#type::matcher::v3::{StringMatcher, string_matcher::MatchPattern},
    },
    google::protobuf::Duration as ProtoDuration,
};
use serde_json::{Map, Value, json};

use super::{Refuse, join};
use crate::discovery::xds::cds::ResourceError;

/// Envoy's route `timeout` when unset.
const DEFAULT_ROUTE_TIMEOUT: &str = "15s";
/// Envoy's HCM `stream_idle_timeout` when unset (the route `idle_timeout` falls back to it).
const DEFAULT_IDLE_TIMEOUT: &str = "300s";

/// Field numbers of `RouteConfiguration` refused.
const ROUTE_CONFIG_FIELDS: &[(u64, &str)] = &[
    (3, "internal_only_headers"),
    (4, "response_headers_to_add"),
    (5, "response_headers_to_remove"),
    (6, "request_headers_to_add"),
    (8, "request_headers_to_remove"),
    (9, "vhds"),
    (10, "most_specific_header_mutations_wins"),
    (11, "max_direct_response_body_size_bytes"),
    (12, "cluster_specifier_plugins"),
    (13, "request_mirror_policies"),
    (14, "ignore_port_in_host_matching"),
    (15, "ignore_path_parameters_in_path_matching"),
    (16, "typed_per_filter_config"),
    (17, "metadata"),
    (18, "vhost_header"),
    (19, "route_specifiers"),
];

/// Field numbers of `VirtualHost` refused.
const VHOST_FIELDS: &[(u64, &str)] = &[
    (4, "require_tls"),
    (5, "virtual_clusters"),
    (6, "rate_limits"),
    (7, "request_headers_to_add"),
    (8, "cors"),
    (10, "response_headers_to_add"),
    (11, "response_headers_to_remove"),
    (13, "request_headers_to_remove"),
    (14, "include_request_attempt_count"),
    (15, "typed_per_filter_config"),
    (16, "retry_policy"),
    (17, "hedge_policy"),
    (18, "per_request_buffer_limit_bytes"),
    (19, "include_attempt_count_in_response"),
    (20, "retry_policy_typed_config"),
    (21, "matcher"),
    (22, "request_mirror_policies"),
    (23, "include_is_timeout_retry_header"),
    (24, "metadata"),
    (25, "request_body_buffer_limit"),
    (26, "route_specifiers"),
];

/// Field numbers of `Route` refused.
const ROUTE_FIELDS: &[(u64, &str)] = &[
    (3, "redirect"),
    (4, "metadata"),
    (5, "decorator"),
    (7, "direct_response"),
    (9, "request_headers_to_add"),
    (10, "response_headers_to_add"),
    (11, "response_headers_to_remove"),
    (12, "request_headers_to_remove"),
    (13, "typed_per_filter_config"),
    (15, "tracing"),
    (16, "per_request_buffer_limit_bytes"),
    (17, "filter_action"),
    (18, "non_forwarding_action"),
    (19, "stat_prefix"),
    (20, "request_body_buffer_limit"),
    (21, "route_specifiers"),
];

/// Field numbers of `RouteMatch` refused.
const MATCH_FIELDS: &[(u64, &str)] = &[
    (4, "case_sensitive"),
    (8, "grpc"),
    (9, "runtime_fraction"),
    (11, "tls_context"),
    (12, "connect_matcher"),
    (13, "dynamic_metadata"),
    (14, "path_separated_prefix"),
    (15, "path_match_policy"),
    (16, "filter_state"),
    (17, "cookies"),
];

/// Field numbers of `RouteAction` refused.
const ACTION_FIELDS: &[(u64, &str)] = &[
    (2, "cluster_header"),
    (4, "metadata_match"),
    (6, "host_rewrite_literal"),
    (7, "auto_host_rewrite"),
    (9, "retry_policy"),
    (11, "priority"),
    (13, "rate_limits"),
    (14, "include_vh_rate_limits"),
    (15, "hash_policy"),
    (17, "cors"),
    (20, "cluster_not_found_response_code"),
    (23, "max_grpc_timeout"),
    (25, "upgrade_configs"),
    (26, "internal_redirect_action"),
    (27, "hedge_policy"),
    (28, "grpc_timeout_offset"),
    (29, "host_rewrite_header"),
    (30, "request_mirror_policies"),
    (31, "max_internal_redirects"),
    (32, "regex_rewrite"),
    (33, "retry_policy_typed_config"),
    (34, "internal_redirect_policy"),
    (35, "host_rewrite_path_regex"),
    (36, "max_stream_duration"),
    (37, "cluster_specifier_plugin"),
    (38, "append_x_forwarded_host"),
    (39, "inline_cluster_specifier_plugin"),
    (40, "early_data_policy"),
    (41, "path_rewrite_policy"),
    (42, "flush_timeout"),
    (45, "path_rewrite"),
];

/// Field numbers of `WeightedCluster` refused.
const WEIGHTED_FIELDS: &[(u64, &str)] = &[
    (2, "runtime_key_prefix"),
    (3, "total_weight"),
    (4, "header_name"),
    (5, "use_hash_policy"),
];

/// Field numbers of `WeightedCluster.ClusterWeight` refused.
const WEIGHT_FIELDS: &[(u64, &str)] = &[
    (3, "metadata_match"),
    (4, "request_headers_to_add"),
    (5, "response_headers_to_add"),
    (6, "response_headers_to_remove"),
    (9, "request_headers_to_remove"),
    (10, "typed_per_filter_config"),
    (11, "host_rewrite_literal"),
    (12, "cluster_header"),
];

/// One route, mapped: its service-router route, and the splitter of a weighted split.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Mapped {
    pub(super) route: Value,
    pub(super) weighted: Option<Vec<(String, u32)>>,
    pub(super) clusters: Vec<String>,
}

/// The routes of the one virtual host with domains `["*"]`; the last must match every request.
/// `at` is where the table is in its resource (empty for an RDS resource).
pub(super) fn route_config(
    r: &Refuse,
    at: &str,
    config: &RouteConfiguration,
) -> Result<Vec<Mapped>, ResourceError> {
    let clear = |c: &mut RouteConfiguration| {
        c.name.clear();
        c.virtual_hosts.clear();
        c.validate_clusters = None;
    };
    r.residual(config, clear, ROUTE_CONFIG_FIELDS, at)?;
    let [vhost] = config.virtual_hosts.as_slice() else {
        let reason = "must hold exactly one virtual host (with domains [\"*\"])";
        return Err(r.invalid(&join(at, "virtual_hosts"), reason));
    };
    let at = join(at, "virtual_hosts[0]");
    if vhost.domains != ["*"] {
        let reason = "only domains [\"*\"] is supported (the proxy path does not route by Host)";
        return Err(r.invalid(&format!("{at}.domains"), reason));
    }
    let clear = |v: &mut VirtualHost| {
        v.name.clear();
        v.domains.clear();
        v.routes.clear();
    };
    r.residual(vhost, clear, VHOST_FIELDS, &at)?;
    let routes: Vec<Mapped> = vhost
        .routes
        .iter()
        .enumerate()
        .map(|(i, route)| map_route(r, &format!("{at}.routes[{i}]"), route))
        .collect::<Result<_, _>>()?;
    if !vhost.routes.last().is_some_and(catch_all) {
        let reason = "the last route must match every request (prefix \"/\" without headers or query_parameters): Envoy answers 404 where no route matches, which a discovery chain cannot";
        return Err(r.invalid(&format!("{at}.routes"), reason));
    }
    Ok(routes)
}

/// Whether `route` matches every request.
fn catch_all(route: &Route) -> bool {
    route.r#match.as_ref().is_some_and(|m| {
        matches!(&m.path_specifier, Some(PathSpecifier::Prefix(p)) if p.is_empty() || p == "/")
            && m.headers.is_empty()
            && m.query_parameters.is_empty()
    })
}

/// One route as a service-router route.
fn map_route(r: &Refuse, at: &str, route: &Route) -> Result<Mapped, ResourceError> {
    let clear = |x: &mut Route| {
        x.name.clear();
        x.r#match = None;
        if matches!(x.action, Some(Action::Route(_))) {
            x.action = None;
        }
    };
    r.residual(route, clear, ROUTE_FIELDS, at)?;
    let m = route
        .r#match
        .as_ref()
        .ok_or_else(|| r.invalid(&format!("{at}.match"), "is required"))?;
    let http = route_match(r, &format!("{at}.match"), m)?;
    let Some(Action::Route(action)) = &route.action else {
        return Err(r.invalid(at, "needs a route action (cluster or weighted_clusters)"));
    };
    let (destination, weighted, clusters) = route_action(r, &format!("{at}.route"), action)?;
    let mut mapped = json!({"Destination": destination});
    if !http.is_empty() {
        mapped["Match"] = json!({"HTTP": http});
    }
    Ok(Mapped {
        route: mapped,
        weighted,
        clusters,
    })
}

/// A `RouteMatch` as Consul's `Match.HTTP`.
fn route_match(r: &Refuse, at: &str, m: &RouteMatch) -> Result<Map<String, Value>, ResourceError> {
    let mut rest = m.clone();
    // Envoy's default is case sensitive, as the router's matches are: true is honoured.
    if rest.case_sensitive.is_some_and(|c| c.value) {
        rest.case_sensitive = None;
    }
    let clear = |x: &mut RouteMatch| {
        x.headers.clear();
        x.query_parameters.clear();
        if matches!(
            x.path_specifier,
            Some(PathSpecifier::Prefix(_) | PathSpecifier::Path(_) | PathSpecifier::SafeRegex(_))
        ) {
            x.path_specifier = None;
        }
    };
    r.residual(&rest, clear, MATCH_FIELDS, at)?;
    let mut http = Map::new();
    match &m.path_specifier {
        Some(PathSpecifier::Prefix(p)) if p.is_empty() => {}
        Some(PathSpecifier::Prefix(p)) => {
            http.insert("PathPrefix".into(), json!(p));
        }
        Some(PathSpecifier::Path(p)) => {
            http.insert("PathExact".into(), json!(p));
        }
        Some(PathSpecifier::SafeRegex(re)) => {
            http.insert("PathRegex".into(), json!(re.regex));
        }
        _ => return Err(r.invalid(at, "needs prefix, path or safe_regex")),
    }
    let headers: Vec<Value> = (m.headers.iter().enumerate())
        .map(|(i, h)| header(r, &format!("{at}.headers[{i}]"), h))
        .collect::<Result<_, _>>()?;
    if !headers.is_empty() {
        http.insert("Header".into(), Value::Array(headers));
    }
    let query: Vec<Value> = (m.query_parameters.iter().enumerate())
        .map(|(i, q)| query_param(r, &format!("{at}.query_parameters[{i}]"), q))
        .collect::<Result<_, _>>()?;
    if !query.is_empty() {
        http.insert("QueryParam".into(), Value::Array(query));
    }
    Ok(http)
}

/// A `StringMatcher` as Consul's `Exact`/`Prefix`/`Suffix`/`Regex` (`ignore_case` and the
/// other patterns are refused).
fn string_match(
    r: &Refuse,
    at: &str,
    s: &StringMatcher,
) -> Result<(&'static str, String), ResourceError> {
    if s.ignore_case {
        return Err(r.unsupported(format!("{at}.ignore_case")));
    }
    match &s.match_pattern {
        Some(MatchPattern::Exact(v)) => Ok(("Exact", v.clone())),
        Some(MatchPattern::Prefix(v)) => Ok(("Prefix", v.clone())),
        Some(MatchPattern::Suffix(v)) => Ok(("Suffix", v.clone())),
        Some(MatchPattern::SafeRegex(re)) => Ok(("Regex", re.regex.clone())),
        Some(MatchPattern::Contains(_)) => Err(r.unsupported(format!("{at}.contains"))),
        _ => Err(r.unsupported(format!("{at} (custom or empty pattern)"))),
    }
}

/// A `HeaderMatcher` as Consul's header match.
#[expect(
    deprecated,
    reason = "Envoy 1.40 still takes the older header match fields"
)]
fn header(r: &Refuse, at: &str, h: &HeaderMatcher) -> Result<Value, ResourceError> {
    if h.treat_missing_header_as_empty {
        return Err(r.unsupported(format!("{at}.treat_missing_header_as_empty")));
    }
    if h.name.starts_with(':') {
        let reason =
            "pseudo-headers (:authority, :path, :method, ...) are not matched by the proxy path";
        return Err(r.invalid(&format!("{at}.name"), reason));
    }
    let mut out = json!({"Name": h.name});
    let (key, value) = match &h.header_match_specifier {
        Some(HeaderMatchSpecifier::PresentMatch(present)) => {
            // Envoy: present_match false matches an absent header; invert_match flips it.
            let invert = *present == h.invert_match;
            out["Present"] = json!(true);
            if invert {
                out["Invert"] = json!(true);
            }
            return Ok(out);
        }
        Some(HeaderMatchSpecifier::ExactMatch(v)) => ("Exact", v.clone()),
        Some(HeaderMatchSpecifier::PrefixMatch(v)) => ("Prefix", v.clone()),
        Some(HeaderMatchSpecifier::SuffixMatch(v)) => ("Suffix", v.clone()),
        Some(HeaderMatchSpecifier::SafeRegexMatch(re)) => ("Regex", re.regex.clone()),
        Some(HeaderMatchSpecifier::StringMatch(s)) => {
            string_match(r, &format!("{at}.string_match"), s)?
        }
        Some(HeaderMatchSpecifier::RangeMatch(_)) => {
            return Err(r.unsupported(format!("{at}.range_match")));
        }
        Some(HeaderMatchSpecifier::ContainsMatch(_)) => {
            return Err(r.unsupported(format!("{at}.contains_match")));
        }
        None => return Err(r.invalid(at, "needs a match (present_match, string_match, ...)")),
    };
    if h.invert_match {
        // Envoy never matches an absent header with an inverted value match; a router does.
        return Err(r.unsupported(format!("{at}.invert_match (only with present_match)")));
    }
    out[key] = json!(value);
    Ok(out)
}

/// A `QueryParameterMatcher` as Consul's query match.
fn query_param(r: &Refuse, at: &str, q: &QueryParameterMatcher) -> Result<Value, ResourceError> {
    let mut out = json!({"Name": q.name});
    match &q.query_parameter_match_specifier {
        Some(QueryParameterMatchSpecifier::PresentMatch(true)) => out["Present"] = json!(true),
        Some(QueryParameterMatchSpecifier::StringMatch(s)) => {
            match string_match(r, &format!("{at}.string_match"), s)? {
                (key @ ("Exact" | "Regex"), value) => out[key] = json!(value),
                (key, _) => {
                    let field = format!("{at}.string_match.{}", key.to_lowercase());
                    return Err(r.unsupported(field));
                }
            }
        }
        _ => return Err(r.invalid(at, "needs string_match or present_match: true")),
    }
    Ok(out)
}

/// A `RouteAction` as Consul's `Destination` (the service filled in by the caller for a
/// weighted split), the split's clusters and weights, and the clusters named.
#[expect(clippy::type_complexity, reason = "three results, named once")]
fn route_action(
    r: &Refuse,
    at: &str,
    a: &RouteAction,
) -> Result<(Map<String, Value>, Option<Vec<(String, u32)>>, Vec<String>), ResourceError> {
    let clear = |x: &mut RouteAction| {
        x.prefix_rewrite.clear();
        x.timeout = None;
        x.idle_timeout = None;
        if matches!(
            x.cluster_specifier,
            Some(ClusterSpecifier::Cluster(_) | ClusterSpecifier::WeightedClusters(_))
        ) {
            x.cluster_specifier = None;
        }
    };
    r.residual(a, clear, ACTION_FIELDS, at)?;
    let mut destination = Map::new();
    let (weighted, clusters) = match &a.cluster_specifier {
        Some(ClusterSpecifier::Cluster(c)) => {
            destination.insert("Service".into(), json!(c));
            (None, vec![c.clone()])
        }
        Some(ClusterSpecifier::WeightedClusters(w)) => {
            let split = weights(r, &format!("{at}.weighted_clusters"), w)?;
            let names = split.iter().map(|(n, _)| n.clone()).collect();
            (Some(split), names)
        }
        _ => return Err(r.invalid(at, "names no cluster (cluster or weighted_clusters)")),
    };
    if !a.prefix_rewrite.is_empty() {
        destination.insert("PrefixRewrite".into(), json!(a.prefix_rewrite));
    }
    timeouts(a, &mut destination);
    Ok((destination, weighted, clusters))
}

/// The route's `timeout` and `idle_timeout` (Envoy's defaults when unset; none when zero).
fn timeouts(a: &RouteAction, destination: &mut Map<String, Value>) {
    let timeout = a
        .timeout
        .map_or(Some(DEFAULT_ROUTE_TIMEOUT.to_owned()), go_duration);
    if let Some(t) = timeout {
        destination.insert("RequestTimeout".into(), json!(t));
    }
    let idle = a
        .idle_timeout
        .map_or(Some(DEFAULT_IDLE_TIMEOUT.to_owned()), go_duration);
    if let Some(t) = idle {
        destination.insert("IdleTimeout".into(), json!(t));
    }
}

/// The clusters and weights of `weighted_clusters`.
fn weights(r: &Refuse, at: &str, w: &WeightedCluster) -> Result<Vec<(String, u32)>, ResourceError> {
    let clear = |x: &mut WeightedCluster| x.clusters.clear();
    r.residual(w, clear, WEIGHTED_FIELDS, at)?;
    let mut out = Vec::with_capacity(w.clusters.len());
    for (i, c) in w.clusters.iter().enumerate() {
        let clear = |x: &mut ClusterWeight| {
            x.name.clear();
            x.weight = None;
        };
        r.residual(c, clear, WEIGHT_FIELDS, &format!("{at}.clusters[{i}]"))?;
        out.push((c.name.clone(), c.weight.map_or(0, |w| w.value)));
    }
    Ok(out)
}

/// A protobuf duration as Go's syntax; `None` for zero (Envoy: disabled; Consul: unset).
fn go_duration(d: ProtoDuration) -> Option<String> {
    let nanos = i128::from(d.seconds) * 1_000_000_000 + i128::from(d.nanos);
    (nanos != 0).then(|| format!("{nanos}ns"))
}
