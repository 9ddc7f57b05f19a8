//! `/stats/prometheus`: a strict reader of the text exposition format checks the page, and the
//! selectors an Envoy cluster dashboard runs find samples in it.
#![expect(
    clippy::float_cmp,
    reason = "the values compared are counts and sums of whole milliseconds, exact in f64"
)]

use super::*;

/// One parsed sample: series name, labels (unescaped), value.
type Sample = (String, Vec<(String, String)>, f64);

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && !n.starts_with(|c: char| c.is_ascii_digit())
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// The labels of a sample line's `{...}`, unescaped (`\\`, `\"`, `\n`).
fn parse_labels(body: &str, line: &str) -> Result<Vec<(String, String)>, String> {
    let mut labels = Vec::new();
    let mut chars = body.chars().peekable();
    while chars.peek().is_some() {
        let name: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if !valid_name(&name) || chars.next() != Some('"') {
            return Err(format!("bad label: {line}"));
        }
        let mut value = String::new();
        loop {
            match chars.next().ok_or(format!("unterminated: {line}"))? {
                '"' => break,
                '\\' => match chars.next() {
                    Some('\\') => value.push('\\'),
                    Some('"') => value.push('"'),
                    Some('n') => value.push('\n'),
                    _ => return Err(format!("bad escape: {line}")),
                },
                c => value.push(c),
            }
        }
        labels.push((name, value));
        match chars.next() {
            None => break,
            Some(',') => {}
            Some(_) => return Err(format!("bad separator: {line}")),
        }
    }
    Ok(labels)
}

/// A strict reader of the text exposition format (0.0.4) the page claims: every family has one
/// `# HELP` then one `# TYPE` line (counter, gauge, untyped or histogram) before its samples,
/// which are contiguous; a counter's name ends in `_total`; a histogram's samples are its
/// `_bucket` (with `le`), `_sum` and `_count`; names are valid metric names; label values are
/// quoted with `\\`, `\"` and `\n` escapes.
fn parse_exposition(text: &str) -> Result<Vec<Sample>, String> {
    let mut typed: BTreeMap<String, String> = BTreeMap::new();
    let mut helped: Option<String> = None;
    let mut current: Option<(String, String)> = None;
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (family, help) = rest.split_once(' ').ok_or(format!("bad HELP: {line}"))?;
            if help.trim().is_empty() || typed.contains_key(family) {
                return Err(format!("bad or late HELP: {line}"));
            }
            helped = Some(family.to_owned());
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (family, kind) = rest.split_once(' ').ok_or(format!("bad TYPE: {line}"))?;
            let known = matches!(kind, "counter" | "gauge" | "untyped" | "histogram");
            if !valid_name(family) || !known || (kind == "counter" && !family.ends_with("_total")) {
                return Err(format!("bad TYPE: {line}"));
            }
            if helped.take().as_deref() != Some(family) {
                return Err(format!("TYPE without its HELP: {line}"));
            }
            if typed.insert(family.to_owned(), kind.to_owned()).is_some() {
                return Err(format!("second TYPE for {family}"));
            }
            current = Some((family.to_owned(), kind.to_owned()));
            continue;
        }
        let (series, value) = line.rsplit_once(' ').ok_or(format!("bad line: {line}"))?;
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().map_err(|_| format!("bad value: {line}"))?,
        };
        let (name, labels) = match series.split_once('{') {
            None => (series, Vec::new()),
            Some((name, rest)) => {
                let body = rest
                    .strip_suffix('}')
                    .ok_or(format!("bad labels: {line}"))?;
                (name, parse_labels(body, line)?)
            }
        };
        let Some((family, kind)) = &current else {
            return Err(format!("sample before any TYPE: {line}"));
        };
        let belongs = match kind.as_str() {
            "histogram" => ["_bucket", "_sum", "_count"]
                .iter()
                .any(|s| name.strip_suffix(s) == Some(family.as_str())),
            _ => name == family,
        };
        let le = labels.iter().any(|(k, _)| k == "le");
        if !belongs || (name.ends_with("_bucket") && !le) {
            return Err(format!("sample of {name} outside its family: {line}"));
        }
        samples.push((name.to_owned(), labels, value));
    }
    Ok(samples)
}

#[test]
fn the_exposition_parser_refuses_what_prometheus_refuses() {
    for bad in [
        "# HELP a_total h\n# TYPE a_total counter\n# HELP a_total h\n# TYPE a_total gauge\na_total 1\n",
        "a 1\n",
        "# HELP a h\n# TYPE a untyped\na{x=\"1} 1\n",
        "# HELP a h\n# TYPE a untyped\na{x=\"\\q\"} 1\n",
        "# HELP a h\n# TYPE a summary\na 1\n",
        "# HELP a h\n# TYPE a gauge\n# HELP b h\n# TYPE b gauge\na 1\n",
        "# TYPE a gauge\na 1\n",
        "# HELP a h\n# TYPE a counter\na 1\n",
        "# HELP h h\n# TYPE h histogram\nh_bucket 1\n",
    ] {
        assert!(parse_exposition(bad).is_err(), "{bad:?}");
    }
}

/// `/stats/prometheus` parses as the text exposition format, with a HELP line for every family,
/// every cluster, service and server stat present under its label, and label values escaped
/// by the library (checked with the worst characters a name may hold).
#[tokio::test]
async fn prometheus_parses_with_help_and_one_type_per_family() {
    let state = running(&format!(
        "clusters:\n{}{}services:\n  - {{ name: web, address: 127.77.0.1, port: 80, cluster: c }}\n",
        static_cluster("c.x", 81),
        static_cluster("c", 82),
    ))
    .await;
    let text = prometheus(&state, &StatsQuery::all());
    let samples = parse_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let of = |family: &str, cluster: &str| {
        samples.iter().find(|(f, labels, _)| {
            f == family && labels == &[("envoy_cluster_name".to_owned(), cluster.to_owned())]
        })
    };
    // `c` and `c.x`: a stat of `c.x` must not be read as a stat `x.…` of `c`.
    for cluster in ["c", "c.x"] {
        let found = of("envoy_cluster_membership_total", cluster);
        assert_eq!(found.map(|s| s.2), Some(1.0), "{cluster}\n{text}");
    }
    assert!(
        of("envoy_cluster_x_membership_total", "c").is_none(),
        "{text}"
    );
    assert!(
        samples
            .iter()
            .any(|(f, l, v)| f == "envoy_server_services" && l.is_empty() && *v == 1.0),
        "{text}"
    );
    assert!(
        text.contains("# HELP envoy_cluster_upstream_cx_total Connections made"),
        "{text}"
    );
    assert!(
        text.contains("# TYPE envoy_cluster_upstream_cx_total counter\n"),
        "{text}"
    );
    assert!(
        text.contains("# TYPE envoy_cluster_upstream_cx_connect_fail untyped\n"),
        "{text}"
    );
    assert!(
        text.contains("# TYPE envoy_cluster_membership_total gauge\n"),
        "{text}"
    );
    // The library's escaping, read back by the strict reader.
    let line = super::super::prometheus::one_service_gauge("a\\b\"c\nd");
    let parsed = parse_exposition(&line).unwrap_or_else(|e| panic!("{e}\n{line}"));
    assert_eq!(
        parsed,
        [(
            "t".to_owned(),
            vec![("service".to_owned(), "a\\b\"c\nd".to_owned())],
            3.0
        )]
    );
}

/// The selectors an Envoy cluster dashboard runs (metric names and labels, as Envoy 1.40's
/// `/stats/prometheus` has them: checked side by side with a running Envoy) each find a
/// sample of cluster `web` once it carried proxy path traffic: connections, connect times,
/// requests, response classes, request times, membership.
#[tokio::test]
async fn an_envoy_cluster_dashboard_finds_its_series() {
    let state = running(&format!("clusters:\n{}", static_cluster("web", 81))).await;
    let traffic = state.upstreams["web"].traffic();
    let host = "127.0.0.1:81".parse().unwrap();
    let open = traffic.open(host);
    open.connected();
    traffic.connect_result(host, true);
    traffic.connect_result(host, false);
    for status in [200, 200, 404, 503] {
        traffic.responses.sent();
        traffic.responses.count(status);
        traffic.responses.time.record(Duration::from_millis(3));
    }
    let text = prometheus(&state, &StatsQuery::all());
    let samples = parse_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let web = ("envoy_cluster_name", "web");
    let dashboard: &[(&str, &[(&str, &str)])] = &[
        ("envoy_cluster_upstream_cx_total", &[web]),
        ("envoy_cluster_upstream_cx_active", &[web]),
        ("envoy_cluster_upstream_cx_connect_fail", &[web]),
        ("envoy_cluster_upstream_cx_none_healthy", &[web]),
        (
            "envoy_cluster_upstream_cx_connect_ms_bucket",
            &[web, ("le", "5")],
        ),
        ("envoy_cluster_upstream_cx_connect_ms_count", &[web]),
        ("envoy_cluster_upstream_cx_connect_ms_sum", &[web]),
        ("envoy_cluster_upstream_rq_total", &[web]),
        (
            "envoy_cluster_upstream_rq",
            &[web, ("envoy_response_code", "404")],
        ),
        ("envoy_cluster_upstream_rq_completed", &[web]),
        (
            "envoy_cluster_upstream_rq_xx",
            &[web, ("envoy_response_code_class", "2")],
        ),
        (
            "envoy_cluster_upstream_rq_xx",
            &[web, ("envoy_response_code_class", "4")],
        ),
        (
            "envoy_cluster_upstream_rq_xx",
            &[web, ("envoy_response_code_class", "5")],
        ),
        ("envoy_cluster_upstream_rq_time_bucket", &[web, ("le", "5")]),
        (
            "envoy_cluster_upstream_rq_time_bucket",
            &[web, ("le", "+Inf")],
        ),
        ("envoy_cluster_upstream_rq_time_count", &[web]),
        ("envoy_cluster_upstream_rq_time_sum", &[web]),
        ("envoy_cluster_membership_healthy", &[web]),
        ("envoy_cluster_membership_total", &[web]),
        ("envoy_cluster_upstream_cx_overflow", &[web]),
        ("envoy_cluster_upstream_rq_pending_overflow", &[web]),
        ("envoy_cluster_lb_healthy_panic", &[web]),
    ];
    for (name, want) in dashboard {
        let found = samples.iter().find(|(n, labels, _)| {
            n == name
                && want
                    .iter()
                    .all(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v))
        });
        assert!(found.is_some(), "{name}{want:?} finds nothing:\n{text}");
    }
    let value = |name: &str, extra: (&str, &str)| {
        samples
            .iter()
            .find(|(n, l, _)| n == name && l.iter().any(|(k, v)| (k.as_str(), v.as_str()) == extra))
            .map(|s| s.2)
    };
    let class = |c| {
        value(
            "envoy_cluster_upstream_rq_xx",
            ("envoy_response_code_class", c),
        )
    };
    assert_eq!(
        (class("2"), class("4"), class("5")),
        (Some(2.0), Some(1.0), Some(1.0))
    );
    assert_eq!(
        value("envoy_cluster_upstream_rq_time_bucket", ("le", "1")),
        Some(0.0)
    );
    assert_eq!(
        value("envoy_cluster_upstream_rq_time_bucket", ("le", "5")),
        Some(4.0)
    );
    assert_eq!(value("envoy_cluster_upstream_rq_time_sum", web), Some(12.0));
    assert_eq!(
        value("envoy_cluster_upstream_cx_connect_ms_count", web),
        Some(1.0)
    );
    assert_eq!(value("envoy_cluster_upstream_rq_total", web), Some(4.0));
    drop(open);
}
