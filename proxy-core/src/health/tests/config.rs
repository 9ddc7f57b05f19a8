//! Parsing, defaults and validation errors of the health configuration.

use std::time::Duration;

use crate::health::{
    cluster_config::{ClusterHealthConfig, OutlierDetection},
    config::{HealthCheck, HealthConfigError},
    spec::{CheckKind, DnsProbe, StatusRange, UdpSpec},
};

const EXAMPLE: &str = r"
health_checks:
  - timeout: 1s
    interval: 0.5s
    initial_jitter: 100ms
    interval_jitter: 0.25s
    interval_jitter_percent: 10
    unhealthy_threshold: 3
    healthy_threshold: 2
    healthy_edge_interval: 1.5s
    http_health_check:
      path: /healthz
      expected_statuses: [{start: 200, end: 300}]
      retriable_statuses: [{start: 503, end: 504}]
      service_name_matcher: {prefix: web}
outlier_detection:
  consecutive_5xx: 3
  base_ejection_time: 10s
common_lb_config:
  healthy_panic_threshold: {value: 0}
";

#[test]
#[expect(
    clippy::float_cmp,
    reason = "a parsed literal compared with the same literal"
)]
fn example_config_parses_with_defaults_applied() {
    let cfg: ClusterHealthConfig = serde_norway::from_str(EXAMPLE).unwrap();
    let spec = cfg.validate("web").unwrap().unwrap();
    assert_eq!(spec.timeout, Duration::from_secs(1));
    assert_eq!(spec.interval, Duration::from_millis(500));
    assert_eq!(spec.initial_jitter, Duration::from_millis(100));
    assert_eq!(spec.no_traffic_interval, Duration::from_secs(60));
    assert_eq!(spec.no_traffic_healthy_interval, Duration::from_secs(60));
    assert_eq!(spec.unhealthy_interval, Duration::from_millis(500));
    assert_eq!(spec.unhealthy_edge_interval, Duration::from_millis(500));
    assert_eq!(spec.healthy_edge_interval, Duration::from_millis(1500));
    let CheckKind::Http(http) = &spec.kind else {
        panic!("expected http")
    };
    assert_eq!(http.host, "web", "Host defaults to the cluster name");
    assert_eq!(
        http.expected_statuses,
        vec![StatusRange {
            start: 200,
            end: 300
        }]
    );
    let od = cfg.outlier_detection.as_ref().unwrap();
    assert_eq!(od.consecutive_5xx, 3);
    assert_eq!(od.interval, Duration::from_secs(10));
    assert_eq!(od.max_ejection_time(), Duration::from_secs(300));
    assert_eq!(od.max_ejection_percent, 10);
    assert_eq!(cfg.common_lb_config.healthy_panic_threshold.value, 0.0);
    // Serialize shows the effective config and round-trips.
    let json = serde_json::to_string(&cfg).unwrap();
    assert!(json.contains(r#""no_traffic_interval":"60s""#), "{json}");
    let back: ClusterHealthConfig = serde_json::from_str(&json).unwrap();
    assert_eq!(back, cfg);
}

#[test]
#[expect(
    clippy::float_cmp,
    reason = "a parsed literal compared with the same literal"
)]
fn defaults_match_envoy() {
    let cfg: ClusterHealthConfig = serde_norway::from_str("{}").unwrap();
    assert_eq!(cfg.common_lb_config.healthy_panic_threshold.value, 50.0);
    assert!(cfg.validate("c").unwrap().is_none());
    let od: OutlierDetection = serde_norway::from_str("{}").unwrap();
    assert_eq!(od, OutlierDetection::default());
    assert_eq!(od.consecutive_5xx, 5);
    assert_eq!(od.base_ejection_time, Duration::from_secs(30));
    assert_eq!(od.enforcing_consecutive_5xx, 100);
    let hc: HealthCheck = serde_norway::from_str(
        "{timeout: 1s, interval: 1s, unhealthy_threshold: 1, healthy_threshold: 1, http_health_check: {path: /}}",
    )
    .unwrap();
    let CheckKind::Http(http) = hc.validate("c").unwrap().kind else {
        panic!()
    };
    assert_eq!(
        http.expected_statuses,
        vec![StatusRange {
            start: 200,
            end: 201
        }]
    );
}

fn check(yaml: &str) -> Result<(), HealthConfigError> {
    let hc: HealthCheck = serde_norway::from_str(yaml).unwrap();
    hc.validate("c").map(|_| ())
}

#[test]
fn validation_names_the_field() {
    let tcp = "tcp_health_check: {}";
    let base = "unhealthy_threshold: 1, healthy_threshold: 1";
    assert_eq!(
        check(&format!("{{interval: 1s, {base}, {tcp}}}")),
        Err(HealthConfigError::Missing("timeout"))
    );
    assert_eq!(
        check(&format!("{{timeout: 1s, {base}, {tcp}}}")),
        Err(HealthConfigError::Missing("interval"))
    );
    assert_eq!(
        check(&format!("{{timeout: 0s, interval: 1s, {base}, {tcp}}}")),
        Err(HealthConfigError::NotPositive("timeout"))
    );
    assert_eq!(
        check(&format!(
            "{{timeout: 1s, interval: 1s, healthy_threshold: 1, {tcp}}}"
        )),
        Err(HealthConfigError::Missing("unhealthy_threshold"))
    );
    assert_eq!(
        check(&format!(
            "{{timeout: 1s, interval: 1s, unhealthy_threshold: 1, {tcp}}}"
        )),
        Err(HealthConfigError::Missing("healthy_threshold"))
    );
    assert_eq!(
        check(&format!("{{timeout: 1s, interval: 1s, {base}}}")),
        Err(HealthConfigError::CheckerCount(0))
    );
    let two = "tcp_health_check: {}, grpc_health_check: {}";
    assert_eq!(
        check(&format!("{{timeout: 1s, interval: 1s, {base}, {two}}}")),
        Err(HealthConfigError::CheckerCount(2))
    );
    let bad_hex = "tcp_health_check: {send: {text: zz}}";
    assert!(matches!(
        check(&format!("{{timeout: 1s, interval: 1s, {base}, {bad_hex}}}")),
        Err(HealthConfigError::BadHex {
            field: "tcp_health_check.send.text",
            ..
        })
    ));
    let bad_range = "http_health_check: {path: /, expected_statuses: [{start: 300, end: 200}]}";
    assert!(matches!(
        check(&format!(
            "{{timeout: 1s, interval: 1s, {base}, {bad_range}}}"
        )),
        Err(HealthConfigError::BadRange { .. })
    ));
}

fn udp(form: &str) -> Result<UdpSpec, HealthConfigError> {
    let yaml = format!(
        "{{timeout: 1s, interval: 1s, unhealthy_threshold: 1, healthy_threshold: 1, udp_health_check: {form}}}"
    );
    let hc: HealthCheck = serde_norway::from_str(&yaml).unwrap();
    match hc.validate("c")?.kind {
        CheckKind::Udp(spec) => Ok(spec),
        other => panic!("not a UDP check: {other:?}"),
    }
}

#[test]
fn a_udp_check_is_a_payload_or_a_dns_query() {
    assert_eq!(
        udp("{send: {text: 50494e47}, receive: [{text: 504f}]}"),
        Ok(UdpSpec::Payload {
            send: b"PING".to_vec(),
            receive: vec![b"PO".to_vec()],
        })
    );
    assert_eq!(
        udp("{dns: {name: db.example, query_type: aaaa, expected_rcode: NXDOMAIN}}"),
        Ok(UdpSpec::Dns(DnsProbe {
            qname: b"\x02db\x07example\x00".to_vec(),
            qtype: 28,
            rcode: 3,
        }))
    );
    let Ok(UdpSpec::Dns(defaults)) = udp("{dns: {name: db.example.}}") else {
        panic!("a DNS check");
    };
    assert_eq!((defaults.qtype, defaults.rcode), (1, 0), "A and NOERROR");
    assert_eq!(udp("{}"), Err(HealthConfigError::UdpForm(0)));
    assert_eq!(
        udp("{send: {text: 00}, dns: {name: a}}"),
        Err(HealthConfigError::UdpForm(2))
    );
    assert_eq!(
        udp("{dns: {name: a}, receive: [{text: 00}]}"),
        Err(HealthConfigError::UdpReceiveWithDns)
    );
    assert!(matches!(
        udp("{send: {text: 0}}"),
        Err(HealthConfigError::BadHex {
            field: "udp_health_check.send.text",
            ..
        })
    ));
    assert!(matches!(
        udp("{dns: {name: 'a..b'}}"),
        Err(HealthConfigError::BadDnsName {
            reason: "it has an empty label",
            ..
        })
    ));
    assert!(matches!(
        udp("{dns: {}}"),
        Err(HealthConfigError::BadDnsName { .. })
    ));
    let err = udp("{dns: {name: a, query_type: HINFO}}").unwrap_err();
    assert_eq!(
        err.to_string(),
        "health check field `udp_health_check.dns.query_type` is \"HINFO\"; expected one of A, NS, CNAME, SOA, PTR, MX, TXT, AAAA, SRV"
    );
    assert!(matches!(
        udp("{dns: {name: a, expected_rcode: OK}}"),
        Err(HealthConfigError::NotOneOf {
            field: "udp_health_check.dns.expected_rcode",
            ..
        })
    ));
    let two = "{timeout: 1s, interval: 1s, unhealthy_threshold: 1, healthy_threshold: 1, \
               tcp_health_check: {}, udp_health_check: {send: {text: 00}}}";
    assert_eq!(check(two), Err(HealthConfigError::CheckerCount(2)));
}

/// A 1 ns interval passed and spun a CPU: every timer interval has a 1 ms floor, as DNS
/// refreshes have.
#[test]
fn every_timer_interval_has_a_one_millisecond_floor() {
    let base = "timeout: 1s, unhealthy_threshold: 1, healthy_threshold: 1, tcp_health_check: {}";
    for field in [
        "interval",
        "no_traffic_interval",
        "no_traffic_healthy_interval",
        "unhealthy_interval",
        "unhealthy_edge_interval",
        "healthy_edge_interval",
    ] {
        let interval = if field == "interval" {
            ""
        } else {
            "interval: 1s, "
        };
        assert_eq!(
            check(&format!("{{{interval}{field}: 0.000000001s, {base}}}")),
            Err(HealthConfigError::BelowTimerFloor {
                field,
                value: Duration::from_nanos(1)
            }),
            "{field}"
        );
        assert_eq!(
            check(&format!("{{{interval}{field}: 0.001s, {base}}}")),
            Ok(()),
            "{field} at the floor"
        );
    }
    let od: ClusterHealthConfig =
        serde_norway::from_str("outlier_detection: {interval: 0.000000001s}").unwrap();
    let err = od.validate("c").unwrap_err();
    assert_eq!(
        err,
        HealthConfigError::BelowTimerFloor {
            field: "outlier_detection.interval",
            value: Duration::from_nanos(1)
        }
    );
    assert!(err.to_string().contains("at least 1ms"), "{err}");
}

#[test]
fn unknown_fields_and_bad_durations_are_rejected() {
    assert!(serde_norway::from_str::<HealthCheck>("{timeout: 1s, colour: red}").is_err());
    assert!(serde_norway::from_str::<HealthCheck>("{timeout: 5}").is_err());
    assert!(serde_norway::from_str::<HealthCheck>("{timeout: 1.5 ms}").is_err());
    // The configuration's one duration grammar: what a cluster's `connect_timeout` takes, a
    // health check's `timeout` takes too (they disagreed on `"1.5ms"`).
    let hc: HealthCheck = serde_norway::from_str("{timeout: 1.5ms}").unwrap();
    assert_eq!(hc.timeout, Some(std::time::Duration::from_micros(1500)));
}

#[test]
fn tcp_payloads_decode_from_hex() {
    let hc: HealthCheck = serde_norway::from_str(
        "{timeout: 1s, interval: 1s, unhealthy_threshold: 1, healthy_threshold: 1, \
         tcp_health_check: {send: {text: 50494e47}, receive: [{text: 504f}, {text: 4E47}]}}",
    )
    .unwrap();
    let CheckKind::Tcp(tcp) = hc.validate("c").unwrap().kind else {
        panic!()
    };
    assert_eq!(tcp.send, b"PING");
    assert_eq!(tcp.receive, vec![b"PO".to_vec(), b"NG".to_vec()]);
}

#[test]
fn cluster_level_validation() {
    let two: ClusterHealthConfig =
        serde_norway::from_str("health_checks: [{timeout: 1s}, {timeout: 1s}]").unwrap();
    assert_eq!(
        two.validate("c"),
        Err(HealthConfigError::TooManyHealthChecks(2))
    );
    let pct: ClusterHealthConfig =
        serde_norway::from_str("outlier_detection: {max_ejection_percent: 101}").unwrap();
    assert!(matches!(
        pct.validate("c"),
        Err(HealthConfigError::BadPercent { .. })
    ));
    let panic: ClusterHealthConfig =
        serde_norway::from_str("common_lb_config: {healthy_panic_threshold: {value: 150}}")
            .unwrap();
    assert!(matches!(
        panic.validate("c"),
        Err(HealthConfigError::BadPercent { .. })
    ));
}

/// `service_name_matcher` with two patterns used the first and ignored the other; with none it
/// matched only an empty header. Envoy's pattern is a required oneof: both are refused.
#[test]
fn a_service_name_matcher_needs_exactly_one_pattern() {
    let base = "timeout: 1s, interval: 1s, unhealthy_threshold: 1, healthy_threshold: 1";
    for (matcher, found) in [
        ("{exact: web, prefix: we}", 2),
        ("{prefix: we, suffix: eb, contains: e}", 3),
        ("{}", 0),
        ("{ignore_case: true}", 0),
    ] {
        let http = format!("http_health_check: {{path: /, service_name_matcher: {matcher}}}");
        let result = check(&format!("{{{base}, {http}}}"));
        assert_eq!(
            result,
            Err(HealthConfigError::MatcherPatterns(found)),
            "{matcher}"
        );
        let text = result.unwrap_err().to_string();
        assert!(text.contains("service_name_matcher"), "{text}");
    }
    let one = "http_health_check: {path: /, service_name_matcher: {suffix: eb}}";
    assert_eq!(check(&format!("{{{base}, {one}}}")), Ok(()));
}

/// A Consul or DNS SRV cluster's health checks and outlier detection passed `proxy check`
/// unchecked (a check without a timeout, a 900 % ejection share): they are checked as any
/// cluster's, naming the field.
#[test]
fn a_custom_clusters_health_settings_are_checked_at_load() {
    let consul = "cluster_type: { name: proxy.clusters.consul, typed_config: { service: web } }";
    let srv = "cluster_type: { name: proxy.clusters.dns_srv, typed_config: { service_names: [_web._tcp.test] } }";
    for (custom, settings, field, says) in [
        (
            consul,
            "health_checks: [{ interval: 1s, tcp_health_check: {} }]",
            "health_checks[0]",
            "`timeout` is required",
        ),
        (
            srv,
            "outlier_detection: { max_ejection_percent: 900 }",
            "outlier_detection",
            "max_ejection_percent",
        ),
    ] {
        let text = format!("clusters:\n  - {{ name: web, {custom}, {settings} }}\n");
        let err =
            crate::config::Config::parse(&text, std::path::Path::new("t.yaml")).expect_err(&text);
        assert_eq!(
            err.field(),
            Some(format!("clusters[0].{field}").as_str()),
            "{err}"
        );
        assert!(err.to_string().contains(says), "{err}");
    }
}
