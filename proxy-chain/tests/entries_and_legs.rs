//! Entry sets (JSON and YAML input, lookup, duplicates), the CLI helper's output, and the
//! flattening of compiled chains into legs.

mod support;

use proxy_chain::{
    ChainError, CompileRequest, ConfigEntry, Entries, EntryKind, Host, Overrides, compile,
    compile_json_cli, entries::EntryRef, filter::HealthStatus,
};
use serde_json::json;
use support::*;

const YAML: &str = r"
- Kind: service-defaults
  Name: web
  Protocol: http
- Kind: service-splitter
  Name: web
  Splits:
    - Weight: 90
      ServiceSubset: v1
    - Weight: 10
      ServiceSubset: v2
- Kind: service-resolver
  Name: web
  ConnectTimeout: 15s
  Subsets:
    v1:
      Filter: Service.Meta.version == 1
    v2:
      Filter: Service.Meta.version == 2
      OnlyPassing: true
  Failover:
    v2:
      Targets:
        - ServiceSubset: v1
        - Datacenter: dc2
";

#[test]
fn yaml_entries_compile_like_json() {
    let parsed: Vec<ConfigEntry> = serde_norway::from_str(YAML).expect("yaml parses");
    let from_yaml = Entries::from_entries(parsed).expect("valid");
    let json_text =
        serde_json::to_string(&serde_norway::from_str::<serde_json::Value>(YAML).unwrap()).unwrap();
    let from_json = Entries::from_json(&json_text).expect("valid");
    assert_eq!(from_yaml, from_json);
    let req = CompileRequest::new("web", "dc1", TRUST_DOMAIN);
    let chain = compile(&req, &from_yaml).expect("compiles");
    let v2 = &chain.nodes["resolver:v2.web.default.default.dc1"];
    let failover = v2.resolver.as_ref().unwrap().failover.as_ref().unwrap();
    assert_eq!(
        failover.targets,
        ["v1.web.default.default.dc1", "v2.web.default.default.dc2"]
    );
}

#[test]
fn lookup_by_kind_and_name() {
    let set =
        entries(json!([protocol("web", "http"), {"Kind": "service-resolver", "Name": "web"}]));
    assert!(
        matches!(set.get(EntryKind::ServiceDefaults, "web"), Some(EntryRef::ServiceDefaults(d)) if d.protocol == "http")
    );
    assert!(matches!(
        set.get(EntryKind::ServiceResolver, "web"),
        Some(EntryRef::ServiceResolver(_))
    ));
    assert!(set.get(EntryKind::ServiceRouter, "web").is_none());
    assert!(set.router("web").is_none() && set.proxy_defaults().is_none());
    assert!(!set.is_chain_empty());
}

#[test]
fn duplicates_invalid_entries_and_bad_json_are_rejected() {
    let dup =
        Entries::from_json(&json!([protocol("web", "http"), protocol("web", "grpc")]).to_string());
    assert_eq!(
        dup.unwrap_err().to_string(),
        "duplicate config entry: kind=\"service-defaults\", name=\"web\""
    );
    let invalid = Entries::from_json(
        &json!([{"Kind": "service-splitter", "Name": "web", "Splits": []}]).to_string(),
    );
    match invalid.unwrap_err() {
        ChainError::InvalidEntry { kind, name, source } => {
            assert_eq!((kind, name.as_str()), ("service-splitter", "web"));
            assert_eq!(source.to_string(), "no splits configured");
        }
        other => panic!("{other}"),
    }
    let bad_kind = Entries::from_json(r#"[{"Kind": "mesh", "Name": "mesh"}]"#).unwrap_err();
    assert!(
        bad_kind
            .to_string()
            .starts_with("invalid config entries JSON: unknown variant `mesh`"),
        "{bad_kind}"
    );
}

#[test]
fn request_fields_are_required() {
    type Clear = fn(&mut CompileRequest);
    let set = Entries::new();
    let cases: [(Clear, &str); 6] = [
        (|r| r.service_name.clear(), "serviceName is required"),
        (
            |r| r.evaluate_in_namespace.clear(),
            "evaluateInNamespace is required",
        ),
        (
            |r| r.evaluate_in_partition.clear(),
            "evaluateInPartition is required",
        ),
        (
            |r| r.evaluate_in_datacenter.clear(),
            "evaluateInDatacenter is required",
        ),
        (
            |r| r.evaluate_in_trust_domain.clear(),
            "evaluateInTrustDomain is required",
        ),
        (
            |r| r.use_in_datacenter.clear(),
            "useInDatacenter is required",
        ),
    ];
    for (clear, message) in cases {
        let mut req = request();
        clear(&mut req);
        assert_eq!(compile(&req, &set).unwrap_err().to_string(), message);
    }
}

#[test]
fn cli_helper_prints_consul_json_in_go_field_order() {
    let entries_json =
        json!([{"Kind": "service-resolver", "Name": "web", "RequestTimeout": "15s"}]).to_string();
    let out =
        compile_json_cli(&entries_json, "web", "dc1", Overrides::default()).expect("compiles");
    let expected = r#"{
  "ServiceName": "web",
  "Namespace": "default",
  "Partition": "default",
  "Datacenter": "dc1",
  "Protocol": "tcp",
  "StartNode": "resolver:web.default.default.dc1",
  "Nodes": {
    "resolver:web.default.default.dc1": {
      "Type": "resolver",
      "Name": "web.default.default.dc1",
      "Resolver": {
        "ConnectTimeout": "5s",
        "RequestTimeout": 15000000000,
        "Target": "web.default.default.dc1"
      }
    }
  },
  "Targets": {
    "web.default.default.dc1": {
      "ConnectTimeout": "5s",
      "ID": "web.default.default.dc1",
      "Service": "web",
      "Namespace": "default",
      "Partition": "default",
      "Datacenter": "dc1",
      "MeshGateway": {},
      "Subset": {},
      "TransparentProxy": {},
      "SNI": "web.default.dc1.internal.consul",
      "Name": "web.default.dc1.internal.consul"
    }
  }
}"#;
    assert_eq!(out, expected);
    let overrides = Overrides {
        protocol: "http".into(),
        trust_domain: "example.org".into(),
        ..Default::default()
    };
    let custom: serde_json::Value =
        serde_json::from_str(&compile_json_cli(&entries_json, "web", "dc1", overrides).unwrap())
            .unwrap();
    assert_eq!(custom["Protocol"], "http");
    assert_eq!(
        custom["Targets"]["web.default.default.dc1"]["SNI"],
        "web.default.dc1.internal.example.org"
    );
    assert_eq!(custom["CustomizationHash"].as_str().map(str::len), Some(8));
}

#[test]
fn mesh_gateway_mode_parses_consul_spellings() {
    assert_eq!(
        "remote".parse::<proxy_chain::MeshGatewayMode>().unwrap(),
        proxy_chain::MeshGatewayMode::Remote
    );
    assert_eq!(
        "bogus"
            .parse::<proxy_chain::MeshGatewayMode>()
            .unwrap_err()
            .to_string(),
        "Invalid Mesh Gateway Mode: \"bogus\""
    );
}

fn host(version: &str, checks: Vec<HealthStatus>) -> Host {
    Host {
        service_name: "web".into(),
        service_meta: [("version".to_owned(), version.to_owned())].into(),
        checks,
        ..Default::default()
    }
}

#[test]
fn legs_of_a_split_chain_with_failover() {
    let set =
        Entries::from_entries(serde_norway::from_str::<Vec<ConfigEntry>>(YAML).unwrap()).unwrap();
    let chain = compile(&CompileRequest::new("web", "dc1", TRUST_DOMAIN), &set).unwrap();
    let legs = chain.legs().unwrap();
    assert_eq!(
        legs.iter().map(|l| l.weight).collect::<Vec<_>>(),
        [90.0, 10.0]
    );
    let (v1, v2) = (&legs[0], &legs[1]);
    assert_eq!(
        (v1.target.service.as_str(), v1.target.datacenter.as_str()),
        ("web", "dc1")
    );
    assert_eq!(v1.connect_timeout.to_string(), "15s");
    assert!(v1.failover.is_empty());
    let failover: Vec<_> = v2
        .failover
        .iter()
        .map(|t| (t.service_subset.as_str(), t.datacenter.as_str()))
        .collect();
    assert_eq!(failover, [("v1", "dc1"), ("v2", "dc2")]);
    let passing = host("1", vec![HealthStatus::Passing]);
    let warning_v2 = host("2", vec![HealthStatus::Warning]);
    assert!(v1.target.admits(&passing));
    assert!(!v1.target.admits(&host("1", vec![HealthStatus::Critical])));
    assert!(!v2.target.admits(&passing), "v1 host is not in subset v2");
    assert!(!v2.target.admits(&warning_v2), "v2 is OnlyPassing");
    assert!(v2.target.admits(&host("2", vec![HealthStatus::Passing])));
    assert!(v2.failover[0].admits(&passing));
}

#[test]
fn legs_of_a_router_chain_use_the_catch_all_route() {
    let set = entries(json!([
        protocol("web", "http"), protocol("api", "http"),
        {"Kind": "service-router", "Name": "web", "Routes": [simple_route("api")]},
        {"Kind": "service-splitter", "Name": "web", "Splits": [
            {"Weight": 50, "Service": "api"}, {"Weight": 50}]},
    ]));
    let chain = compile(&CompileRequest::new("web", "dc1", TRUST_DOMAIN), &set).unwrap();
    let legs = chain.legs().unwrap();
    let shape: Vec<_> = legs
        .iter()
        .map(|l| (l.weight, l.target.service.as_str()))
        .collect();
    assert_eq!(shape, [(50.0, "api"), (50.0, "web")]);
    let routes = chain.route_legs().unwrap();
    assert_eq!(routes.len(), 2);
    assert_eq!(routes[0].legs.len(), 1);
    assert_eq!(routes[0].legs[0].target.service, "api");
    assert_eq!(routes[1].legs, legs);
}

#[test]
fn legs_of_a_default_chain() {
    let chain = compile(&request(), &Entries::new()).unwrap();
    let routes = chain.route_legs().unwrap();
    assert_eq!(routes.len(), 1);
    let leg = &routes[0].legs[0];
    assert_eq!(
        (leg.weight, leg.target.id.as_str()),
        (100.0, "main.default.default.dc1")
    );
    assert!(leg.target.filter.is_none() && leg.target.admits(&Host::default()));
}
