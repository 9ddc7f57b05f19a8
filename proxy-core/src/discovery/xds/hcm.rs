//! LDS and RDS: a listener whose one filter is an HTTP connection manager, with an inline
//! `route_config` or one named for RDS over ADS, as a `mode: proxy` service whose discovery
//! chain is generated from the routes.
//!
//! The service is named like the listener, with `chain` of the same name. Its config entries, in
//! Consul's JSON form: a service-router named like the listener holding the routes in order
//! (first match wins, as Envoy's), a service-splitter `<listener>/route/<i>` for each route with
//! `weighted_clusters`, a service-resolver named like the listener redirecting the chain's
//! implicit default to the catch-all route's first cluster (never reached: the last route must
//! match every request), and service-defaults with protocol http for every name the chain uses.
//! Anything the proxy path cannot do exactly as Envoy does is refused by name.
//!
//! An RDS listener's form holds the service only; its chain is generated when its
//! RouteConfiguration is held ([`with_routes`]).

use envoy_types::pb::{
    envoy::{
        config::{
            core::v3::{ApiVersion, ConfigSource, config_source::ConfigSourceSpecifier},
            route::v3::RouteConfiguration,
        },
        extensions::filters::network::http_connection_manager::v3::{
            HttpConnectionManager, HttpFilter, Rds, http_connection_manager::RouteSpecifier,
            http_filter::ConfigType,
        },
    },
    google::protobuf::Any,
};
use prost::Message;
use serde_json::{Value, json};

use crate::discovery::xds::{
    cds::{ResourceError, refuse_residual},
    listener::{ListenerForm, percentages},
};

mod routes;

use self::routes::{Mapped, route_config};

/// The type URL of the router HTTP filter's config.
pub const ROUTER_TYPE_URL: &str =
    "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router";

/// Field numbers of `HttpConnectionManager` not honoured, for refusals.
const HCM_FIELDS: &[(u64, &str)] = &[
    (1, "codec_type"),
    (6, "add_user_agent"),
    (7, "tracing"),
    (8, "http_protocol_options"),
    (9, "http2_protocol_options"),
    (10, "server_name"),
    (12, "drain_timeout"),
    (13, "access_log"),
    (14, "use_remote_address"),
    (15, "generate_request_id"),
    (16, "forward_client_cert_details"),
    (17, "set_current_client_cert_details"),
    (18, "proxy_100_continue"),
    (19, "xff_num_trusted_hops"),
    (20, "represent_ipv4_remote_address_as_ipv4_mapped_ipv6"),
    (21, "skip_xff_append"),
    (22, "via"),
    (24, "stream_idle_timeout"),
    (25, "internal_address_config"),
    (26, "delayed_close_timeout"),
    (28, "request_timeout"),
    (29, "max_request_headers_kb"),
    (30, "normalize_path"),
    (31, "scoped_routes"),
    (32, "preserve_external_request_id"),
    (33, "merge_slashes"),
    (34, "server_header_transformation"),
    (35, "common_http_protocol_options"),
    (36, "request_id_extension"),
    (37, "always_set_request_id_in_response"),
    (38, "local_reply_config"),
    (39, "strip_matching_host_port"),
    (40, "stream_error_on_invalid_http_message"),
    (41, "request_headers_timeout"),
    (42, "strip_any_host_port"),
    (43, "path_normalization_options"),
    (44, "http3_protocol_options"),
    (45, "path_with_escaped_slashes_action"),
    (46, "original_ip_detection_extensions"),
    (47, "strip_trailing_host_dot"),
    (48, "scheme_header_transformation"),
    (49, "proxy_status_config"),
    (50, "typed_header_validation_config"),
    (51, "append_x_forwarded_port"),
    (52, "early_header_mutation_extensions"),
    (53, "add_proxy_protocol_connection_state"),
    (54, "access_log_flush_interval"),
    (55, "flush_access_log_on_new_request"),
    (56, "access_log_options"),
    (57, "append_local_overload"),
    (58, "http1_safe_max_connection_duration"),
    (59, "stream_flush_timeout"),
    (60, "forward_client_cert_matcher"),
    (61, "forward_proto_config"),
    (62, "drain_timeout_jitter"),
];

/// The type URL of RDS resources.
pub const ROUTE_TYPE_URL: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";

/// A route table, mapped: its routes, and whether a cluster not known refuses it.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteTable {
    routes: Vec<Mapped>,
    /// Envoy's `validate_clusters` (true by default inline, false by default over RDS).
    pub validate_clusters: bool,
}

/// Builds refusals naming the resource (a listener or a route configuration).
struct Refuse<'a> {
    kind: &'static str,
    name: &'a str,
}

impl Refuse<'_> {
    fn unsupported(&self, field: String) -> ResourceError {
        ResourceError::Unsupported {
            kind: self.kind,
            name: self.name.to_owned(),
            field,
        }
    }

    fn invalid(&self, field: &str, reason: &str) -> ResourceError {
        ResourceError::Invalid {
            kind: self.kind,
            name: self.name.to_owned(),
            field: field.to_owned(),
            reason: reason.to_owned(),
        }
    }

    /// `refuse_residual` with the field named under `at`.
    fn residual<M: Message + Clone>(
        &self,
        msg: &M,
        clear: impl FnOnce(&mut M),
        names: &[(u64, &str)],
        at: &str,
    ) -> Result<(), ResourceError> {
        refuse_residual(msg, clear, names, |f| self.unsupported(join(at, &f)))
    }
}

/// `at.field`, or `field` at a resource's top.
fn join(at: &str, field: &str) -> String {
    if at.is_empty() {
        field.to_owned()
    } else {
        format!("{at}.{field}")
    }
}

/// The HTTP connection manager in `any` (the listener's one filter) as a `mode: proxy` service
/// at `address:port`, or the first field refused.
pub fn file_form(
    listener: &str,
    address: &str,
    port: u32,
    any: &Any,
) -> Result<ListenerForm, ResourceError> {
    let r = Refuse {
        kind: "listener",
        name: listener,
    };
    let at = "http_connection_manager";
    let hcm = HttpConnectionManager::decode(any.value.as_slice()).map_err(|e| {
        r.invalid(
            at,
            &format!("does not decode as HttpConnectionManager: {e}"),
        )
    })?;
    let clear = |h: &mut HttpConnectionManager| {
        h.stat_prefix.clear();
        h.http_filters.clear();
        h.upgrade_configs.clear();
        if matches!(
            h.route_specifier,
            Some(RouteSpecifier::RouteConfig(_) | RouteSpecifier::Rds(_))
        ) {
            h.route_specifier = None;
        }
    };
    r.residual(&hcm, clear, HCM_FIELDS, at)?;
    router_only(&r, &hcm.http_filters)?;
    let upgrades = upgrade_configs(&r, &hcm)?;
    let service = service(listener, address, port, &upgrades);
    match &hcm.route_specifier {
        Some(RouteSpecifier::RouteConfig(config)) => {
            // Envoy checks an inline route table's clusters unless told not to.
            let table = RouteTable {
                routes: route_config(&r, "route_config", config)?,
                validate_clusters: config.validate_clusters.is_none_or(|v| v.value),
            };
            Ok(with_routes(listener, service, None, &table))
        }
        Some(RouteSpecifier::Rds(rds)) => Ok(ListenerForm {
            service,
            entries: Vec::new(),
            clusters: Vec::new(),
            validate_clusters: false,
            rds: Some(rds_name(&r, rds)?),
        }),
        _ => Err(r.invalid(at, "needs route_config or rds")),
    }
}

/// The route configuration an `rds` names; its source must be ADS (the stream it comes on).
fn rds_name(r: &Refuse, rds: &Rds) -> Result<String, ResourceError> {
    let at = "http_connection_manager.rds";
    let source = rds.config_source.clone().unwrap_or_default();
    if !matches!(
        source.config_source_specifier,
        Some(ConfigSourceSpecifier::Ads(_))
    ) {
        let reason =
            "config_source must be ads ({}): route configurations come on the ADS stream only";
        return Err(r.invalid(&format!("{at}.config_source"), reason));
    }
    let clear = |c: &mut ConfigSource| {
        c.config_source_specifier = None;
        if c.resource_api_version == ApiVersion::V3 as i32 {
            c.resource_api_version = 0;
        }
    };
    let names = &[
        (4, "initial_fetch_timeout"),
        (6, "resource_api_version"),
        (7, "authorities"),
    ];
    r.residual(&source, clear, names, &format!("{at}.config_source"))?;
    if rds.route_config_name.is_empty() {
        return Err(r.invalid(&format!("{at}.route_config_name"), "is required"));
    }
    Ok(rds.route_config_name.clone())
}

/// An RDS resource as a route table, or the first field refused naming it.
pub fn route_table(config: &RouteConfiguration) -> Result<RouteTable, ResourceError> {
    let r = Refuse {
        kind: "route configuration",
        name: &config.name,
    };
    Ok(RouteTable {
        routes: route_config(&r, "", config)?,
        validate_clusters: config.validate_clusters.is_some_and(|v| v.value),
    })
}

/// The listener's service in the file's form.
fn service(listener: &str, address: &str, port: u32, upgrades: &Value) -> Value {
    json!({"name": listener, "address": address, "port": port, "mode": "proxy",
        "chain": listener, "upgrade_configs": upgrades})
}

/// The listener's form with `table`'s chain: its config entries and the clusters it names.
pub fn with_routes(
    listener: &str,
    service: Value,
    rds: Option<String>,
    table: &RouteTable,
) -> ListenerForm {
    let (entries, clusters) = chain_entries(listener, table.routes.clone());
    ListenerForm {
        service,
        entries,
        clusters,
        validate_clusters: table.validate_clusters,
        rds,
    }
}

/// `http_filters` must be exactly the router, with nothing set.
fn router_only(r: &Refuse, filters: &[HttpFilter]) -> Result<(), ResourceError> {
    let at = "http_connection_manager.http_filters";
    let [filter] = filters else {
        let reason = "must hold exactly one filter, the router (envoy.filters.http.router); other HTTP filters are not supported";
        return Err(r.invalid(at, reason));
    };
    let clear = |f: &mut HttpFilter| {
        f.name.clear();
        f.config_type = None;
    };
    r.residual(
        filter,
        clear,
        &[(6, "is_optional"), (7, "disabled")],
        &format!("{at}[0]"),
    )?;
    match &filter.config_type {
        Some(ConfigType::TypedConfig(any)) if any.type_url == ROUTER_TYPE_URL => {
            if any.value.is_empty() {
                Ok(())
            } else {
                Err(r.unsupported(format!("{at}[0].typed_config (router options)")))
            }
        }
        None if filter.name == "envoy.filters.http.router" => Ok(()),
        _ => Err(r.invalid(
            &format!("{at}[0]"),
            "only the router filter (envoy.extensions.filters.http.router.v3.Router) is supported",
        )),
    }
}

/// The HCM's `upgrade_configs` in the file's form (`[]` when unset: Envoy allows none).
fn upgrade_configs(r: &Refuse, hcm: &HttpConnectionManager) -> Result<Value, ResourceError> {
    let mut list = Vec::new();
    for (i, u) in hcm.upgrade_configs.iter().enumerate() {
        if !u.filters.is_empty() {
            let field = format!("http_connection_manager.upgrade_configs[{i}].filters");
            return Err(r.unsupported(field));
        }
        let enabled = u.enabled.is_none_or(|e| e.value);
        list.push(json!({"upgrade_type": u.upgrade_type, "enabled": enabled}));
    }
    Ok(Value::Array(list))
}

/// The chain's config entries, and the clusters the routes name.
fn chain_entries(listener: &str, routes: Vec<Mapped>) -> (Vec<Value>, Vec<String>) {
    let mut entries = Vec::new();
    let mut clusters: Vec<String> = Vec::new();
    let mut router_routes = Vec::with_capacity(routes.len());
    let mut http_names = vec![listener.to_owned()];
    let fallback = routes.last().and_then(|m| m.clusters.first().cloned());
    for (i, mut m) in routes.into_iter().enumerate() {
        if let Some(split) = &m.weighted {
            let name = format!("{listener}/route/{i}");
            // `None` (no weight at all) is refused by the file's rules on the empty splits.
            let splits = percentages(split).unwrap_or_default();
            entries.push(json!({"Kind": "service-splitter", "Name": name, "Splits": splits}));
            m.route["Destination"]["Service"] = json!(name);
            http_names.push(name);
        }
        for c in m.clusters {
            if !clusters.contains(&c) {
                clusters.push(c);
            }
        }
        router_routes.push(m.route);
    }
    // The chain's implicit default route is never reached (the last route matches every
    // request); it must still resolve, so it goes to a cluster the catch-all names.
    let fallback = fallback.unwrap_or_default();
    entries.push(json!({"Kind": "service-router", "Name": listener, "Routes": router_routes}));
    entries.push(
        json!({"Kind": "service-resolver", "Name": listener, "Redirect": {"Service": fallback}}),
    );
    http_names.extend(clusters.iter().cloned());
    for name in http_names {
        entries.push(json!({"Kind": "service-defaults", "Name": name, "Protocol": "http"}));
    }
    (entries, clusters)
}
