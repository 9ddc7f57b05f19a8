//! The query of `/stats` and `/stats/prometheus`, read as Envoy reads it: `filter=<regex>` keeps
//! the stats whose name the regular expression matches somewhere (RE2 syntax, unanchored, as
//! Envoy's), `usedonly` keeps the stats that were ever non-zero, `format=json|prometheus|text`
//! picks the form. Values are percent-decoded; other parameters are ignored, as Envoy ignores
//! them. A filter that does not compile is a 400 that names the error.

use regex::{Regex, RegexBuilder};

/// The most memory a compiled `filter` may take (the pattern comes from whoever can reach the
/// admin interface: the `regex` crate matches in linear time, and this bounds its size).
const FILTER_SIZE_LIMIT: usize = 1 << 20;

/// The form of a stats page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// `name: value` lines.
    Text,
    /// Envoy's JSON.
    Json,
    /// Prometheus' text exposition.
    Prometheus,
}

/// A stats request's parameters.
#[derive(Debug)]
pub(crate) struct StatsQuery {
    filter: Option<Regex>,
    used_only: bool,
    /// `format=`, when given.
    pub(crate) format: Option<Format>,
}

impl StatsQuery {
    /// Everything, in the page's default form.
    #[cfg(test)]
    pub(crate) fn all() -> Self {
        Self {
            filter: None,
            used_only: false,
            format: None,
        }
    }

    /// Reads `query` (the part of the target after `?`); an error says what is wrong with it.
    pub(crate) fn parse(query: &str) -> Result<Self, String> {
        let mut parsed = Self {
            filter: None,
            used_only: false,
            format: None,
        };
        for param in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = param.split_once('=').unwrap_or((param, ""));
            let value = percent_decode(value).map_err(|why| format!("{key}: {why}"))?;
            match key {
                "filter" if !value.is_empty() => {
                    let regex = RegexBuilder::new(&value)
                        .size_limit(FILTER_SIZE_LIMIT)
                        .build()
                        .map_err(|err| format!("invalid regex in filter {value:?}: {err}"))?;
                    parsed.filter = Some(regex);
                }
                "usedonly" => parsed.used_only = true,
                "format" => {
                    parsed.format = Some(match value.as_str() {
                        "json" => Format::Json,
                        "prometheus" => Format::Prometheus,
                        "text" => Format::Text,
                        other => {
                            return Err(format!(
                                "unsupported format {other:?}: json, prometheus or text"
                            ));
                        }
                    });
                }
                _ => {}
            }
        }
        Ok(parsed)
    }

    /// Whether the stat `name` is shown; `used`: it was ever non-zero.
    pub(crate) fn keeps(&self, name: &str, used: bool) -> bool {
        (used || !self.used_only) && self.filter.as_ref().is_none_or(|f| f.is_match(name))
    }
}

/// `%XX` escapes decoded (`+` stays a plus: it is a regex operator in `filter`); the result
/// must be UTF-8.
fn percent_decode(value: &str) -> Result<String, String> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent escape at byte {i}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "not UTF-8 once decoded".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_is_an_unanchored_regex_and_usedonly_drops_the_never_used() {
        let q = StatsQuery::parse("filter=%5Ecluster%5C.web%5C.upstream_cx_t&usedonly").unwrap();
        assert!(q.keeps("cluster.web.upstream_cx_total", true));
        assert!(!q.keeps("cluster.web.upstream_cx_total", false), "usedonly");
        assert!(!q.keeps("cluster.web2.upstream_cx_total", true));
        let q = StatsQuery::parse("filter=rq_(2|5)xx").unwrap();
        assert!(q.keeps("cluster.a.upstream_rq_5xx", false));
        assert!(!q.keeps("cluster.a.upstream_rq_4xx", false));
        let q = StatsQuery::parse("filter=a+b&bogus=1&usedonly=1").unwrap();
        assert!(
            q.keeps("xaab", true),
            "+ is the regex's, unknown parameters are ignored"
        );
        assert!(StatsQuery::parse("filter=").unwrap().keeps("x", false));
    }

    #[test]
    fn bad_filters_formats_and_escapes_are_errors_that_say_so() {
        for (query, says) in [
            ("filter=(", "invalid regex in filter \"(\""),
            ("filter=%zz", "filter: bad percent escape"),
            ("filter=%ff", "not UTF-8"),
            ("format=xml", "unsupported format \"xml\""),
            ("filter=a%7B1000%7D%7B1000%7D", "invalid regex"),
        ] {
            let err = StatsQuery::parse(query).unwrap_err();
            assert!(err.contains(says), "{query}: {err}");
        }
        assert_eq!(
            StatsQuery::parse("format=json").unwrap().format,
            Some(Format::Json)
        );
    }
}
