//! Filter parsing and evaluation.

use std::collections::BTreeMap;

use super::{Filter, FilterError, HealthStatus, Host};

fn host() -> Host {
    Host {
        node: "node-1".into(),
        node_address: "10.0.0.1".into(),
        datacenter: "dc1".into(),
        node_meta: BTreeMap::from([("rack".into(), "r1".into())]),
        service_id: "web-1".into(),
        service_name: "web".into(),
        service_address: "10.0.0.11".into(),
        service_port: 8080,
        service_meta: BTreeMap::from([
            ("version".into(), "2".into()),
            ("env".into(), "prod".into()),
        ]),
        service_tags: vec!["canary".into(), "v2".into()],
        checks: vec![HealthStatus::Passing, HealthStatus::Warning],
    }
}

fn eval(expr: &str) -> bool {
    Filter::parse(expr)
        .unwrap_or_else(|e| panic!("{expr}: {e}"))
        .matches(&host())
}

#[test]
fn equality_on_metadata_and_scalars() {
    assert!(eval("Service.Meta.version == 2"));
    assert!(eval("Service.Meta.version == \"2\""));
    assert!(eval("Service.Meta.version == `2`"));
    assert!(!eval("Service.Meta.version == 1"));
    assert!(eval("Service.Meta.version != 1"));
    assert!(eval("ServiceMeta.env == prod"));
    assert!(eval("Node.Meta.rack == r1"));
    assert!(eval("NodeMeta.rack != r2"));
    assert!(eval("Service.Port == 8080"));
    assert!(eval(
        "Service.ID == web-1 and Service.Service == web and Node.Node == node-1"
    ));
    assert!(eval(
        "Node.Datacenter == dc1 and Datacenter == dc1 and Address == 10.0.0.1"
    ));
    assert!(eval(
        "ServiceAddress == 10.0.0.11 and ServiceName == web and ServiceID == web-1"
    ));
}

#[test]
fn missing_keys_match_no_positive_form() {
    assert!(!eval("Service.Meta.missing == x"));
    assert!(eval("Service.Meta.missing != x"));
    assert!(eval("Service.Meta.missing is empty"));
    assert!(!eval("Service.Meta.missing is not empty"));
    assert!(!eval("Service.Meta.missing matches \".*\""));
    assert!(eval("Service.Meta.missing not matches \".*\""));
}

#[test]
fn collections() {
    assert!(eval("canary in Service.Tags"));
    assert!(eval("\"v2\" in ServiceTags"));
    assert!(eval("v1 not in Service.Tags"));
    assert!(eval("Service.Tags contains canary"));
    assert!(eval("Service.Tags not contains prod"));
    assert!(eval("Service.Tags is not empty"));
    assert!(eval("version in Service.Meta"));
    assert!(eval("Service.Meta contains env"));
    assert!(eval("Node.Meta is not empty"));
    assert!(eval("passing in Checks.Status"));
    assert!(eval("critical not in Checks.Status"));
    assert!(eval("Checks.Status contains warning"));
    assert!(eval("eb in Service.Service"), "substring on strings");
}

#[test]
fn regex_matches() {
    assert!(eval("Service.Meta.version matches \"^[0-9]+$\""));
    assert!(eval("Service.ID matches `web-\\d`"));
    assert!(eval("Service.Service not matches \"^api\""));
}

#[test]
fn boolean_structure_and_precedence() {
    assert!(eval(
        "Service.Meta.version == 1 or Service.Meta.version == 2"
    ));
    assert!(!eval(
        "Service.Meta.version == 1 and Service.Meta.env == prod"
    ));
    assert!(eval("not Service.Meta.version == 1"));
    assert!(eval(
        "Service.Meta.version == 1 or Service.Meta.env == prod and canary in Service.Tags"
    ));
    assert!(!eval(
        "(Service.Meta.version == 1 or Service.Meta.env == prod) and v1 in Service.Tags"
    ));
    assert!(eval(
        "not (Service.Meta.version == 1 or Service.Meta.env == qa)"
    ));
    assert!(eval(
        "Service.Meta.version == 2 and not (Service.Tags is empty)"
    ));
}

#[test]
fn escapes_in_double_quoted_strings() {
    let mut h = host();
    h.service_meta.insert("note".into(), "say \"hi\"".into());
    assert!(
        Filter::parse("Service.Meta.note == \"say \\\"hi\\\"\"")
            .unwrap()
            .matches(&h)
    );
}

fn parse_err(expr: &str) -> FilterError {
    Filter::parse(expr).expect_err(expr)
}

#[test]
fn unsupported_input_is_an_error_not_a_match() {
    assert_eq!(parse_err(""), FilterError::Empty);
    assert_eq!(
        parse_err("Service.Meta.version =="),
        FilterError::UnexpectedEnd("a value")
    );
    assert!(matches!(
        parse_err("Service.Meta.version = 2"),
        FilterError::InvalidCharacter { found: '=', .. }
    ));
    assert_eq!(
        parse_err("Service.Colour == red"),
        FilterError::UnknownSelector("Service.Colour".into())
    );
    assert_eq!(
        parse_err("Service.Meta.a.b == x"),
        FilterError::UnknownSelector("Service.Meta.a.b".into())
    );
    assert_eq!(
        parse_err("\"Service.ID\" == x"),
        FilterError::UnknownSelector("Service.ID".into())
    );
    assert!(matches!(
        parse_err("Service.Tags == canary"),
        FilterError::UnsupportedOperator { op: "==", .. }
    ));
    assert!(matches!(
        parse_err("Checks.Status == passing"),
        FilterError::UnsupportedOperator { .. }
    ));
    assert!(matches!(
        parse_err("Service.Meta matches x"),
        FilterError::UnsupportedOperator { op: "matches", .. }
    ));
    assert!(matches!(
        parse_err("Service.ID matches \"(\""),
        FilterError::InvalidRegex { .. }
    ));
    assert_eq!(
        parse_err("Service.ID == \"x"),
        FilterError::UnterminatedString(14)
    );
    assert!(matches!(
        parse_err("Service.ID == x y"),
        FilterError::UnexpectedToken { .. }
    ));
    assert!(matches!(
        parse_err("(Service.ID == x"),
        FilterError::UnexpectedEnd("`)`")
    ));
    assert!(matches!(
        parse_err("Service.ID > 3"),
        FilterError::InvalidCharacter { found: '>', .. }
    ));
    assert!(matches!(
        parse_err("Service.ID is full"),
        FilterError::UnexpectedToken { .. }
    ));
    assert!(matches!(
        parse_err("and == x"),
        FilterError::UnexpectedToken { .. }
    ));
}

#[test]
fn consul_corpus_filters_parse() {
    for expr in [
        "Service.Meta.version == bypass",
        "Service.Meta.version != bypass",
        "Service.Meta.version == canary",
        "ServiceMeta.env == prod",
        "Service.Meta.version == 1",
    ] {
        Filter::parse(expr).unwrap_or_else(|e| panic!("{expr}: {e}"));
    }
}

/// Nesting and length as a config entry may carry them: refused, never a stack overflow.
#[test]
fn deep_or_long_expressions_are_refused() {
    let deep = format!("{}Service.ID == a{}", "(".repeat(2000), ")".repeat(2000));
    assert_eq!(parse_err(&deep), FilterError::TooDeep(64));
    let nots = format!("{}Service.ID == a", "not ".repeat(2000));
    assert_eq!(parse_err(&nots), FilterError::TooDeep(64));
    let long = vec!["Service.ID == a"; 2000].join(" and ");
    assert_eq!(parse_err(&long), FilterError::TooLong(4096));
    // Within the bounds, both parse.
    let ok = format!("{}Service.ID == a{}", "(".repeat(60), ")".repeat(60));
    assert!(Filter::parse(&ok).is_ok());
    assert!(Filter::parse(&vec!["Service.ID == a"; 500].join(" or ")).is_ok());
}
