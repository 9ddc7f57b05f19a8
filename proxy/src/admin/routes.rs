//! Which path does what: the endpoint table (the index at `/` prints it), the methods each
//! takes, and the answers that cost next to nothing (`/ready`, the index, `/server_info`,
//! `/logging`, `/healthcheck/*`). The pages whose cost grows with the configuration are rendered
//! by `render`, on a blocking thread.

use std::{fmt::Write as _, sync::atomic::Ordering};

use hyper::{Method, StatusCode};
use tracing::info;

use super::{Response, State, render};

/// What an endpoint does, which decides the methods it takes and where it is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// Shows: GET and HEAD, on every listener.
    Read,
    /// Changes the server's state (Envoy's `mutates_server_state`): POST only, on the control
    /// socket (on TCP only when allowed).
    Change,
    /// Shows by GET or HEAD, changes by POST (`/logging`).
    Both,
}

/// One endpoint of the index.
struct Endpoint {
    path: &'static str,
    kind: Kind,
    help: &'static str,
}

/// Every endpoint, in the index's (alphabetical) order.
const ENDPOINTS: &[Endpoint] = &[
    Endpoint {
        path: "/",
        kind: Kind::Read,
        help: "this list of endpoints",
    },
    Endpoint {
        path: "/chain/<service>",
        kind: Kind::Read,
        help: "the service's compiled discovery chain (Consul's CompiledDiscoveryChain JSON)",
    },
    Endpoint {
        path: "/clusters",
        kind: Kind::Read,
        help: "every host of every cluster: health flags, weight, priority; ?format=json for \
               Envoy's JSON (envoy.admin.v3.Clusters)",
    },
    Endpoint {
        path: "/config_dump",
        kind: Kind::Read,
        help: "clusters, endpoints and listeners in Envoy's envoy.admin.v3.ConfigDump JSON; \
               ?format=proxy for the daemon's effective configuration",
    },
    Endpoint {
        path: "/healthcheck/fail",
        kind: Kind::Change,
        help: "fail health checks: /ready answers 503 DRAINING until /healthcheck/ok",
    },
    Endpoint {
        path: "/healthcheck/ok",
        kind: Kind::Change,
        help: "pass health checks again after /healthcheck/fail",
    },
    Endpoint {
        path: "/help",
        kind: Kind::Read,
        help: "this list of endpoints",
    },
    Endpoint {
        path: "/listeners",
        kind: Kind::Read,
        help: "each service's address and the proxy's listening sockets, `name::address` \
               lines; ?format=json for Envoy's JSON (envoy.admin.v3.Listeners)",
    },
    Endpoint {
        path: "/logging",
        kind: Kind::Both,
        help: "the log filter in force; POST /logging?level=<level> sets every target's level \
               (trace, debug, info, warning, error, critical, off)",
    },
    Endpoint {
        path: "/reload",
        kind: Kind::Change,
        help: "re-read the configuration file and apply what changed (as SIGHUP does); 400 for \
               an invalid file, 409 for a change that needs a restart: either changes nothing",
    },
    Endpoint {
        path: "/ready",
        kind: Kind::Read,
        help: "200 LIVE once every service is published, else 503",
    },
    Endpoint {
        path: "/reset_counters",
        kind: Kind::Change,
        help: "every counter shows zero from now on (gauges and histograms go on)",
    },
    Endpoint {
        path: "/routing",
        kind: Kind::Read,
        help: "the daemon's own view, as JSON: per cluster the services using it and which \
               hosts are routable now",
    },
    Endpoint {
        path: "/server_info",
        kind: Kind::Read,
        help: "version, state, uptime and command line options, as JSON",
    },
    Endpoint {
        path: "/stats",
        kind: Kind::Read,
        help: "every counter and gauge, `name: value` lines, then the histograms; \
               ?format=json|prometheus, ?filter=<regex> keeps the names it matches, \
               ?usedonly the stats ever non-zero",
    },
    Endpoint {
        path: "/stats/prometheus",
        kind: Kind::Read,
        help: "every counter, gauge and histogram in Prometheus' text format (Envoy's names); \
               ?filter= and ?usedonly as for /stats",
    },
];

/// Whether `path` is a page rendered on a blocking thread, in turn ([`render::page`]).
pub(super) fn is_page(path: &str) -> bool {
    matches!(
        path,
        "/stats"
            | "/stats/prometheus"
            | "/reset_counters"
            | "/clusters"
            | "/listeners"
            | "/routing"
            | "/config_dump"
    ) || path.starts_with("/chain/")
}

/// What the endpoint at `path` does; `None` for an unknown path.
pub(super) fn kind(path: &str) -> Option<Kind> {
    if path.starts_with("/chain/") {
        return Some(Kind::Read);
    }
    ENDPOINTS.iter().find(|e| e.path == path).map(|e| e.kind)
}

/// The answer to every request that is not a page; its method was checked ([`super::guard`]).
pub(super) fn answer(method: &Method, path: &str, query: &str, state: &State) -> Response {
    match path {
        "/ready" => ready(state),
        "/" | "/help" => Response::text(StatusCode::OK, index()),
        "/server_info" => Response::json(&super::info::server_info(state)),
        "/logging" if method == Method::POST => logging_set(query, state),
        "/logging" => logging_list(state),
        "/healthcheck/fail" | "/healthcheck/ok" => {
            let fail = path == "/healthcheck/fail";
            state.health_failed.store(fail, Ordering::Relaxed);
            if fail {
                info!(
                    "admin: failing health checks (/ready answers 503) until POST /healthcheck/ok"
                );
            } else {
                info!("admin: passing health checks again");
            }
            Response::text(StatusCode::OK, "OK\n")
        }
        _ => {
            let mut body = format!("not found: {path:?}\n\n");
            body.push_str(&index());
            Response::text(StatusCode::NOT_FOUND, body)
        }
    }
}

/// `/ready`: Envoy's answer (`LIVE`, or the state's name with 503), except that a daemon not yet
/// serving every service answers `NOT READY` as it always has.
fn ready(state: &State) -> Response {
    if !state.ready() {
        Response::text(StatusCode::SERVICE_UNAVAILABLE, "NOT READY\n")
    } else if state.health_failed.load(Ordering::Relaxed) {
        Response::text(StatusCode::SERVICE_UNAVAILABLE, "DRAINING\n")
    } else {
        Response::text(StatusCode::OK, "LIVE\n")
    }
}

/// The index: every endpoint with its help line; `(POST)` marks those that change state
/// (served on the control socket).
fn index() -> String {
    let mut out = String::from("admin endpoints:\n");
    for e in ENDPOINTS {
        let post = if e.kind == Kind::Change {
            " (POST)"
        } else {
            ""
        };
        let _ = writeln!(out, "  {}{post}: {}", e.path, e.help);
    }
    out.push_str(
        "\n(POST) and POST /logging change the daemon's state: served on the control socket \
         (admin.control_socket), refused with 403 on TCP unless admin.allow_tcp_mutations\n",
    );
    out
}

fn logging_list(state: &State) -> Response {
    match &state.launch.logging {
        Some(log) => Response::text(
            StatusCode::OK,
            format!("active log filter: {}\n", log.current()),
        ),
        None => Response::text(
            StatusCode::OK,
            "active log filter: (not managed by this server)\n",
        ),
    }
}

/// `POST /logging?level=<level>`; anything else in the query is a 400 that changes nothing.
fn logging_set(query: &str, state: &State) -> Response {
    let usage = format!(
        "\nusage: POST /logging?level=<level> (sets every target's level)\nlevels: {}\n",
        crate::logging::LEVELS.join(" ")
    );
    let bad =
        |why: String| Response::text(StatusCode::BAD_REQUEST, format!("error: {why}\n{usage}"));
    let mut params = query.split('&').filter(|p| !p.is_empty());
    let (Some(param), None) = (params.next(), params.next()) else {
        return bad("give exactly one parameter, level=<level>".to_owned());
    };
    let Some(level) = param.strip_prefix("level=") else {
        return bad(format!(
            "unsupported parameter {param:?}: only level= is (per-target levels are not)"
        ));
    };
    let Some(log) = &state.launch.logging else {
        return bad("this server's log filter cannot be changed at run time".to_owned());
    };
    match log.set_level(level) {
        Ok(now) => {
            info!(level, filter = %now, "admin: log level changed");
            Response::text(StatusCode::OK, format!("active log filter: {now}\n"))
        }
        Err(err) => bad(err.to_string()),
    }
}

/// A page that may be expensive (see [`is_page`]); runs on a blocking thread.
pub(super) fn page(path: &str, query: &str, state: &State) -> Response {
    let json = query.split('&').any(|kv| kv == "format=json");
    match path {
        "/stats" | "/stats/prometheus" => stats(path, query, state),
        "/reset_counters" => {
            let n = render::reset_counters(state);
            info!(counters = n, "admin: counters reset");
            Response::text(StatusCode::OK, "OK\n")
        }
        "/clusters" if json => Response::json(&render::clusters_json(state)),
        "/clusters" => Response::text(StatusCode::OK, render::clusters_text(state)),
        "/listeners" if json => Response::json(&render::listeners_json(state)),
        "/listeners" => Response::text(StatusCode::OK, render::listeners_text(state)),
        "/routing" => Response::json(&render::routing(state)),
        "/config_dump" if query.split('&').any(|kv| kv == "format=proxy") => {
            Response::json(&*state.config)
        }
        "/config_dump" => Response::json(&render::config_dump(state)),
        _ => {
            let service = path.strip_prefix("/chain/").unwrap_or(path);
            let failure = state
                .config
                .chain_failures
                .iter()
                .find(|f| f.service == service);
            match (state.config.chains.get(service), failure) {
                (Some(chain), _) => Response::json(chain),
                // Left out: its chain does not compile from the current entries.
                (None, Some(failure)) => Response::text(
                    StatusCode::NOT_FOUND,
                    format!(
                        "service {service:?} is left out until its chain compiles: {}\n",
                        failure.reason
                    ),
                ),
                (None, None) => Response::text(
                    StatusCode::NOT_FOUND,
                    format!("no discovery chain for service {service:?}\n"),
                ),
            }
        }
    }
}

/// `/stats` and `/stats/prometheus` with their query (400 for one that does not parse).
fn stats(path: &str, query: &str, state: &State) -> Response {
    let query = match render::StatsQuery::parse(query) {
        Ok(q) => q,
        Err(why) => return Response::text(StatusCode::BAD_REQUEST, format!("error: {why}\n")),
    };
    let format = match (path, query.format) {
        ("/stats/prometheus", _) => render::Format::Prometheus,
        (_, format) => format.unwrap_or(render::Format::Text),
    };
    match format {
        render::Format::Json => Response::json(&render::stats_map(state, &query)),
        render::Format::Text => Response::text(StatusCode::OK, render::stats_text(state, &query)),
        render::Format::Prometheus => Response::prometheus(render::prometheus(state, &query)),
    }
}
