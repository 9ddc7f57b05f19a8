//! Parsing, defaults, serialization and validation of `DnsSettings`.

use std::{net::SocketAddr, time::Duration};

use crate::config::sources::dns::{
    DnsConfigError, DnsLookupFamily, DnsResolverAddress, DnsSettings, RefreshRate,
};

fn parse(yaml: &str) -> Result<DnsSettings, serde_norway::Error> {
    serde_norway::from_str(yaml)
}

#[test]
fn empty_config_has_envoy_defaults() {
    let settings = parse("{}").unwrap();
    assert_eq!(settings, DnsSettings::default());
    assert_eq!(settings.dns_refresh_rate, Duration::from_millis(5000));
    assert!(!settings.respect_dns_ttl);
    assert_eq!(settings.dns_failure_refresh_rate, None);
    assert_eq!(settings.dns_jitter, None);
    assert_eq!(settings.dns_lookup_family, DnsLookupFamily::Auto);
    assert!(settings.dns_resolvers.is_empty());
    assert_eq!(settings.dns_stale_bound, None, "Envoy's: stale hosts kept");
    settings.validate().unwrap();
}

const FULL: &str = r#"
dns_refresh_rate: 0.5s
respect_dns_ttl: true
dns_failure_refresh_rate: {base_interval: 250ms, max_interval: 2s}
dns_jitter: 100ms
dns_lookup_family: V4_PREFERRED
dns_resolvers:
  - socket_address: {address: 127.0.0.1, port_value: 5353}
  - "127.0.0.2:5354"
  - "::1"
dns_stale_bound: 30s
"#;

#[test]
fn full_config_parses_and_round_trips() {
    let settings = parse(FULL).unwrap();
    assert_eq!(settings.dns_refresh_rate, Duration::from_millis(500));
    assert_eq!(
        settings.dns_failure_refresh_rate,
        Some(RefreshRate {
            base_interval: Duration::from_millis(250),
            max_interval: Some(Duration::from_secs(2))
        })
    );
    assert_eq!(settings.dns_jitter, Some(Duration::from_millis(100)));
    let resolvers: Vec<SocketAddr> = settings.dns_resolvers.iter().map(|r| r.0).collect();
    let expected = ["127.0.0.1:5353", "127.0.0.2:5354", "[::1]:53"];
    assert_eq!(
        resolvers,
        expected.map(|a| a.parse::<SocketAddr>().unwrap())
    );
    let json = serde_json::to_value(&settings).unwrap();
    assert_eq!(json["dns_refresh_rate"], "0.500s");
    assert_eq!(
        json["dns_resolvers"][0]["socket_address"]["port_value"],
        5353
    );
    assert_eq!(json["dns_lookup_family"], "V4_PREFERRED");
    assert_eq!(settings.dns_stale_bound, Some(Duration::from_secs(30)));
    assert_eq!(json["dns_stale_bound"], "30s");
    let back: DnsSettings = serde_json::from_value(json).unwrap();
    assert_eq!(back, settings);
}

#[test]
fn every_lookup_family_name_parses() {
    let cases = [
        ("AUTO", DnsLookupFamily::Auto),
        ("UNSPECIFIED", DnsLookupFamily::Auto),
        ("V4_ONLY", DnsLookupFamily::V4Only),
        ("V6_ONLY", DnsLookupFamily::V6Only),
        ("V4_PREFERRED", DnsLookupFamily::V4Preferred),
        ("ALL", DnsLookupFamily::All),
    ];
    for (name, family) in cases {
        let settings = parse(&format!("dns_lookup_family: {name}")).unwrap();
        assert_eq!(settings.dns_lookup_family, family);
    }
    assert!(parse("dns_lookup_family: V5_ONLY").is_err());
}

#[test]
fn unknown_fields_and_bad_values_are_rejected() {
    let err = parse("dns_refresh_rat: 5s").unwrap_err().to_string();
    assert!(err.contains("dns_refresh_rat"), "{err}");
    assert!(parse("dns_refresh_rate: 5").is_err());
    assert!(parse("dns_failure_refresh_rate: {max_interval: 5s}").is_err());
    assert!(parse("dns_failure_refresh_rate: {base_interval: 1s, jitter: 1s}").is_err());
    assert!(parse("dns_resolvers: [dns.example]").is_err());
    assert!(
        parse("dns_resolvers: [{socket_address: {address: 127.0.0.1, protocol: TCP}}]").is_err()
    );
}

#[test]
fn refresh_rate_must_exceed_one_millisecond() {
    let settings = parse("dns_refresh_rate: 1ms").unwrap();
    let err = settings.validate().unwrap_err();
    assert!(matches!(
        err,
        DnsConfigError::IntervalTooSmall {
            field: "dns_refresh_rate",
            ..
        }
    ));
    assert!(
        err.to_string()
            .starts_with("dns_refresh_rate must be greater than 1ms")
    );
    parse("dns_refresh_rate: 2ms").unwrap().validate().unwrap();
}

#[test]
fn base_interval_must_exceed_one_millisecond() {
    let settings = parse("dns_failure_refresh_rate: {base_interval: 0.001s}").unwrap();
    let err = settings.validate().unwrap_err();
    assert!(
        err.to_string()
            .starts_with("dns_failure_refresh_rate.base_interval"),
        "{err}"
    );
}

#[test]
fn max_interval_below_base_is_envoys_error() {
    let settings =
        parse("dns_failure_refresh_rate: {base_interval: 2s, max_interval: 1s}").unwrap();
    let err = settings.validate().unwrap_err();
    assert_eq!(
        err.to_string(),
        "dns_failure_refresh_rate must have max_interval greater than or equal to the base_interval"
    );
    parse("dns_failure_refresh_rate: {base_interval: 2s, max_interval: 2s}")
        .unwrap()
        .validate()
        .unwrap();
}

#[test]
fn stale_bound_must_be_above_zero() {
    let err = parse("dns_stale_bound: 0s")
        .unwrap()
        .validate()
        .unwrap_err();
    assert_eq!(err, DnsConfigError::StaleBoundZero);
    assert!(
        err.to_string()
            .starts_with("dns_stale_bound must be greater than 0"),
        "{err}"
    );
    assert!(parse("dns_stale_bound: -1s").is_err());
    assert!(parse("dns_stale_bound: 5").is_err());
    parse("dns_stale_bound: 1ms").unwrap().validate().unwrap();
}

#[test]
fn max_interval_defaults_to_ten_times_base() {
    let settings = parse("dns_failure_refresh_rate: {base_interval: 0.5s}").unwrap();
    let rate = settings.dns_failure_refresh_rate.unwrap();
    assert_eq!(rate.effective_max_interval(), Duration::from_secs(5));
}

#[test]
fn resolver_address_serializes_in_envoy_form() {
    let address = DnsResolverAddress("127.0.0.1:5353".parse().unwrap());
    let json = serde_json::to_string(&address).unwrap();
    assert_eq!(
        json,
        r#"{"socket_address":{"address":"127.0.0.1","port_value":5353}}"#
    );
}

#[test]
fn a_clusters_zero_stale_bound_is_refused_naming_the_field() {
    let text = "clusters:\n  - { name: a, type: STRICT_DNS, dns_stale_bound: 0s, load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: web.test, port_value: 80 } } } } ] } ] } }\n";
    let err = crate::config::Config::parse(text, std::path::Path::new("t.yaml")).unwrap_err();
    let crate::config::ConfigError::Invalid { field, .. } = &err else {
        panic!("{err}");
    };
    assert_eq!(field, "clusters[0].dns_stale_bound");
    assert!(
        err.to_string()
            .contains("dns_stale_bound must be greater than 0"),
        "{err}"
    );
}
