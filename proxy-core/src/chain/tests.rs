//! Chain execution over hand-built routing: splits become weights, failover becomes levels,
//! redirects pick the redirected service's hosts, and each opt-in changes only what it says.

use std::collections::BTreeMap;

use proxy_chain::{CompileRequest, Entries, compile};

use super::*;
use crate::health::HostClass;

fn chain(entries: &str, tcp_splits: bool) -> CompiledDiscoveryChain {
    let entries = Entries::from_json(entries).expect("valid entries");
    let request = CompileRequest {
        allow_tcp_splitting: tcp_splits,
        ..CompileRequest::new("web", "dc1", "consul")
    };
    compile(&request, &entries).expect("compiles")
}

fn host(last: u8, version: &str) -> Host {
    let mut metadata = BTreeMap::new();
    metadata.insert("version".to_owned(), version.to_owned());
    Host::new(SocketAddr::from(([127, 0, 0, last], 80))).with_metadata(metadata)
}

fn routing(hosts: &[(Host, HostClass)]) -> Routing {
    Routing::compute(hosts, 50.0)
}

fn plan(chain: &CompiledDiscoveryChain, options: ChainOptions) -> ChainPlan {
    ChainPlan::new(chain, "dc1", options, |c| {
        ["web", "backup", "other"].contains(&c)
    })
    .expect("plans")
}

const SPLIT: &str = r#"[
  {"Kind":"service-defaults","Name":"web","Protocol":"http"},
  {"Kind":"service-splitter","Name":"web","Splits":[{"Weight":90,"ServiceSubset":"v1"},{"Weight":10,"ServiceSubset":"v2"}]},
  {"Kind":"service-resolver","Name":"web","Subsets":{"v1":{"Filter":"Service.Meta.version == v1"},"v2":{"Filter":"Service.Meta.version == v2"}}}
]"#;

fn share(level: &[(SocketAddr, u32)], pick: impl Fn(&SocketAddr) -> bool) -> f64 {
    let total: u32 = level.iter().map(|(_, w)| w).sum();
    let part: u32 = level.iter().filter(|(a, _)| pick(a)).map(|(_, w)| w).sum();
    f64::from(part) / f64::from(total)
}

#[test]
fn split_becomes_weights_by_subset() {
    let web = routing(&[
        (host(1, "v1"), HostClass::Healthy),
        (host(2, "v1"), HostClass::Healthy),
        (host(3, "v2"), HostClass::Healthy),
    ]);
    let levels = plan(&chain(SPLIT, false), ChainOptions::default()).levels(&|_| Some(web.clone()));
    assert_eq!(levels.len(), 1);
    let v2 = share(&levels[0], |a| a.ip().to_string() == "127.0.0.3");
    assert!((v2 - 0.10).abs() < 1e-6, "v2 share {v2}");
}

#[test]
fn a_leg_without_hosts_fails_its_share_unless_health_aware() {
    let web = routing(&[
        (host(1, "v1"), HostClass::Healthy),
        (host(3, "v2"), HostClass::Unhealthy),
    ]);
    let c = chain(SPLIT, false);
    let levels = plan(&c, ChainOptions::default()).levels(&|_| Some(web.clone()));
    let refused = share(&levels[0], |a| *a == REFUSE);
    assert!((refused - 0.10).abs() < 1e-6, "refused share {refused}");
    let aware = ChainOptions {
        health_aware_splits: true,
        ..Default::default()
    };
    let levels = plan(&c, aware).levels(&|_| Some(web.clone()));
    assert_eq!(levels[0].len(), 1, "{levels:?}");
    assert_eq!(levels[0][0].0, host(1, "").addr);
}

const FAILOVER: &str = r#"[
  {"Kind":"service-resolver","Name":"web","Failover":{"*":{"Service":"backup"}}}
]"#;

#[test]
fn failover_targets_become_lower_levels() {
    let web = routing(&[(host(1, "a"), HostClass::Healthy)]);
    let backup = routing(&[(host(9, "b"), HostClass::Healthy)]);
    let p = plan(&chain(FAILOVER, false), ChainOptions::default());
    let pick = |c: &str| {
        Some(if c == "web" {
            web.clone()
        } else {
            backup.clone()
        })
    };
    let levels = p.levels(&pick);
    assert_eq!(levels.len(), 2);
    assert_eq!(levels[1][0].0, host(9, "").addr);
    // Primary down: only the failover level is left, so the kernel uses it.
    let down = routing(&[(host(1, "a"), HostClass::Unhealthy)]);
    let levels = p.levels(&|c| {
        Some(if c == "web" {
            down.clone()
        } else {
            backup.clone()
        })
    });
    assert_eq!(levels.len(), 1);
    assert_eq!(levels[0][0].0, host(9, "").addr);
}

#[test]
fn failover_threshold_is_opt_in() {
    // One of four healthy: Consul keeps using the target; with a 50 % threshold we fail over.
    let web = routing(&[
        (host(1, "a"), HostClass::Healthy),
        (host(2, "a"), HostClass::Unhealthy),
        (host(3, "a"), HostClass::Unhealthy),
        (host(4, "a"), HostClass::Unhealthy),
    ]);
    let backup = routing(&[(host(9, "b"), HostClass::Healthy)]);
    let pick = |c: &str| {
        Some(if c == "web" {
            web.clone()
        } else {
            backup.clone()
        })
    };
    let c = chain(FAILOVER, false);
    let levels = plan(&c, ChainOptions::default()).levels(&pick);
    assert_ne!(
        levels[0][0].0,
        host(9, "").addr,
        "default: primary still used"
    );
    let opts = ChainOptions {
        failover_threshold_percent: 50,
        ..Default::default()
    };
    let levels = plan(&c, opts).levels(&pick);
    assert_eq!(levels[0][0].0, host(9, "").addr);
}

#[test]
fn redirect_uses_the_redirected_service() {
    let c = chain(
        r#"[{"Kind":"service-resolver","Name":"web","Redirect":{"Service":"other"}}]"#,
        false,
    );
    let p = plan(&c, ChainOptions::default());
    assert_eq!(p.clusters().into_iter().collect::<Vec<_>>(), ["other"]);
    let other = routing(&[(host(7, "x"), HostClass::Healthy)]);
    let levels = p.levels(&|c| (c == "other").then(|| other.clone()));
    assert_eq!(levels[0][0].0, host(7, "").addr);
}

#[test]
fn tcp_splits_need_the_opt_in() {
    let tcp_split = r#"[{"Kind":"service-splitter","Name":"web","Splits":[{"Weight":50,"Service":"web"},{"Weight":50,"Service":"other"}]}]"#;
    let entries = Entries::from_json(tcp_split).unwrap();
    let err = compile(&CompileRequest::new("web", "dc1", "consul"), &entries).unwrap_err();
    assert!(
        err.to_string()
            .contains("does not permit advanced routing or splitting"),
        "{err}"
    );
    let p = plan(
        &chain(tcp_split, true),
        ChainOptions {
            tcp_splits: true,
            ..Default::default()
        },
    );
    assert_eq!(p.legs.len(), 2);
}

#[test]
fn missing_cluster_and_routers_are_errors() {
    let c = chain(FAILOVER, false);
    let err = ChainPlan::new(&c, "dc1", ChainOptions::default(), |c| c == "web").unwrap_err();
    assert!(
        err.to_string().contains("needs a cluster named \"backup\""),
        "{err}"
    );
    let router = chain(
        r#"[{"Kind":"service-defaults","Name":"web","Protocol":"http"},{"Kind":"service-defaults","Name":"other","Protocol":"http"},{"Kind":"service-router","Name":"web","Routes":[{"Match":{"HTTP":{"PathPrefix":"/a"}},"Destination":{"Service":"other"}}]}]"#,
        false,
    );
    let err = ChainPlan::new(&router, "dc1", ChainOptions::default(), |_| true).unwrap_err();
    assert!(matches!(err, ChainExecError::NeedsProxyPath), "{err}");
}

#[test]
fn the_proxy_path_reads_every_route_target_and_needs_http() {
    let router = chain(
        r#"[{"Kind":"service-defaults","Name":"web","Protocol":"http"},{"Kind":"service-defaults","Name":"other","Protocol":"http"},{"Kind":"service-router","Name":"web","Routes":[{"Match":{"HTTP":{"PathPrefix":"/a"}},"Destination":{"Service":"other"}}]}]"#,
        false,
    );
    let clusters = route_clusters(&router, "dc1", &|_| true).expect("routes");
    assert_eq!(clusters.into_iter().collect::<Vec<_>>(), ["other", "web"]);
    let err = route_clusters(&router, "dc1", &|c| c == "web").unwrap_err();
    assert!(
        err.to_string().contains("needs a cluster named \"other\""),
        "{err}"
    );
    let tcp = chain(FAILOVER, false);
    let err = route_clusters(&tcp, "dc1", &|_| true).unwrap_err();
    assert!(
        matches!(err, ChainExecError::ProxyNeedsHttp(ref p) if p == "tcp"),
        "{err}"
    );
}

#[test]
fn target_routing_keeps_only_the_subset() {
    let c = chain(SPLIT, false);
    let legs = c.legs().unwrap();
    let v2 = &legs
        .iter()
        .find(|l| l.target.service_subset == "v2")
        .unwrap()
        .target;
    let r = routing(&[
        (host(1, "v1"), HostClass::Healthy),
        (host(2, "v2"), HostClass::Healthy),
        (host(3, "v2"), HostClass::Unhealthy),
    ]);
    let narrowed = target_routing(v2, &r);
    let addrs = |hs: &[Host]| {
        hs.iter()
            .map(|h| h.addr.ip().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(addrs(&narrowed.priorities[0].healthy), ["127.0.0.2"]);
    assert_eq!(
        addrs(&narrowed.priorities[0].all),
        ["127.0.0.2", "127.0.0.3"]
    );
    assert_eq!(addrs(&narrowed.routable()), ["127.0.0.2"]);
}
