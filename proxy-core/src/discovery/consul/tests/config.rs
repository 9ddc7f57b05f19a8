//! Configuration parsing, defaults and validation.

use super::*;
use crate::config::sources::consul::{ConsulConfigError, RetryBackoff};

fn parse(yaml: &str) -> Result<ConsulConfig, serde_norway::Error> {
    serde_norway::from_str(yaml)
}

#[test]
fn only_service_is_required_and_defaults_are_named() {
    let config = parse("service: web").expect("minimal config");
    assert_eq!(config, ConsulConfig::new("web"));
    assert_eq!(config.address, None);
    let access =
        crate::config::sources::consul::access::resolve(&config, &|_| None).expect("default");
    assert_eq!(access.authority, "127.0.0.1:8500", "Consul's default agent");
    assert_eq!(config.wait, Duration::from_secs(30));
    assert!(!config.only_passing);
    assert_eq!(
        config.retry_backoff,
        RetryBackoff {
            base_interval: Duration::from_secs(1),
            max_interval: Duration::from_secs(30),
        }
    );
    config.validate().expect("defaults are valid");
}

#[test]
fn every_field_parses_and_serializes_back() {
    let yaml = "address: 127.0.0.1:18500\nservice: web\ndatacenter: dc2\ntag: blue\nwait: 0.5s\n\
                only_passing: true\nretry_backoff: {base_interval: 200ms, max_interval: 2s}\n";
    let config = parse(yaml).expect("full config");
    assert_eq!(config.datacenter.as_deref(), Some("dc2"));
    assert_eq!(config.tag.as_deref(), Some("blue"));
    assert_eq!(config.wait, Duration::from_millis(500));
    assert!(config.only_passing);
    assert_eq!(
        config.retry_backoff.base_interval,
        Duration::from_millis(200)
    );
    let json = serde_json::to_value(&config).expect("serializes");
    assert_eq!(json["wait"], "0.500s");
    assert_eq!(json["retry_backoff"]["max_interval"], "2s");
    let back: ConsulConfig = serde_json::from_value(json).expect("round trip");
    assert_eq!(back, config);
    let minimal = serde_json::to_value(ConsulConfig::new("web")).expect("serializes");
    assert!(minimal.get("datacenter").is_none() && minimal.get("tag").is_none());
}

#[test]
fn unknown_fields_and_a_missing_service_are_rejected() {
    let err = parse("service: web\npassing: true").expect_err("unknown field");
    assert!(err.to_string().contains("unknown field `passing`"), "{err}");
    let err = parse("address: 127.0.0.1:8500").expect_err("no service");
    assert!(err.to_string().contains("missing field `service`"), "{err}");
    let err = parse("service: web\nretry_backoff: {base: 1s}").expect_err("unknown backoff field");
    assert!(err.to_string().contains("unknown field `base`"), "{err}");
}

#[test]
fn validation_names_the_field() {
    let check = |yaml: &str| {
        parse(yaml)
            .expect("parses")
            .validate()
            .expect_err("invalid")
    };
    assert!(matches!(
        check("service: web\naddress: localhost"),
        ConsulConfigError::Address { .. }
    ));
    assert!(matches!(
        check("service: web\naddress: ':8500'"),
        ConsulConfigError::Address { .. }
    ));
    assert!(matches!(
        check("service: ''"),
        ConsulConfigError::Empty { field: "service" }
    ));
    assert!(matches!(
        check("service: web\ntag: ''"),
        ConsulConfigError::Empty { field: "tag" }
    ));
    assert!(matches!(
        check("service: web\nwait: 0s"),
        ConsulConfigError::Wait { .. }
    ));
    assert!(matches!(
        check("service: web\nwait: 601s"),
        ConsulConfigError::Wait { .. }
    ));
    let err = check("service: web\nretry_backoff: {base_interval: 2s, max_interval: 1s}");
    assert!(matches!(err, ConsulConfigError::Backoff { .. }));
    assert!(err.to_string().starts_with("consul.retry_backoff"), "{err}");
    parse("service: web\naddress: consul.local:8500")
        .unwrap()
        .validate()
        .expect("host name ok");
}
