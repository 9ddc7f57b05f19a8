//! What RING_HASH and MAGLEV hash on the proxy path: Envoy's `RouteAction.hash_policy` (a
//! header, a cookie, a query parameter or the source IP; `terminal` stops at the first policy
//! that produced a hash), set on a `mode: proxy` service in Envoy's form, or translated from a
//! Consul service-resolver's `LoadBalancer.HashPolicies` as Consul's xDS does.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::duration;

/// One hash policy: exactly one of `header`, `cookie`, `query_parameter`,
/// `connection_properties`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HashPolicy {
    /// Hash a request header's value (several values: sorted, then hashed together).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<HeaderHash>,
    /// Hash a cookie's value; with a `ttl`, a request without the cookie gets one generated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cookie: Option<CookieHash>,
    /// Hash a query parameter's (first) value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_parameter: Option<QueryParameterHash>,
    /// Hash the client's IP address (`source_ip: true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection_properties: Option<ConnectionProperties>,
    /// Stop at this policy when a hash has been produced (the later ones are not evaluated).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub terminal: bool,
}

/// Envoy's `HashPolicy.Header`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderHash {
    /// The request header's name.
    pub header_name: String,
}

/// Envoy's `HashPolicy.Cookie`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CookieHash {
    /// The cookie's name.
    pub name: String,
    /// Set: a request without the cookie gets one (`Set-Cookie` on its response) with this
    /// `Max-Age`; `0s` makes it a session cookie. Unset: no cookie is generated.
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub ttl: Option<Duration>,
    /// The generated cookie's `Path` (none when empty).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub path: String,
}

/// Envoy's `HashPolicy.QueryParameter`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct QueryParameterHash {
    /// The query parameter's name.
    pub name: String,
}

/// Envoy's `HashPolicy.ConnectionProperties`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectionProperties {
    /// Hash the client's IP address.
    #[serde(default)]
    pub source_ip: bool,
}

/// What one policy hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HashInput<'a> {
    /// A request header.
    Header(&'a str),
    /// A cookie (and the generated cookie's lifetime and path).
    Cookie(&'a CookieHash),
    /// A query parameter.
    QueryParameter(&'a str),
    /// The client's IP address.
    SourceIp,
}

impl HashPolicy {
    /// What the policy hashes, or why it is not a valid policy.
    pub fn input(&self) -> Result<HashInput<'_>, &'static str> {
        let set = [
            self.header.is_some(),
            self.cookie.is_some(),
            self.query_parameter.is_some(),
            self.connection_properties.is_some(),
        ];
        if set.iter().filter(|s| **s).count() != 1 {
            return Err(
                "needs exactly one of header, cookie, query_parameter and connection_properties",
            );
        }
        if let Some(h) = &self.header {
            return token(&h.header_name, "header.header_name")
                .map(|()| HashInput::Header(&h.header_name));
        }
        if let Some(c) = &self.cookie {
            token(&c.name, "cookie.name")?;
            if c.path
                .bytes()
                .any(|b| !(0x21..0x7f).contains(&b) || b == b';')
            {
                return Err("cookie.path must be visible ASCII without ';'");
            }
            return Ok(HashInput::Cookie(c));
        }
        if let Some(q) = &self.query_parameter {
            if q.name.is_empty() {
                return Err("query_parameter.name must not be empty");
            }
            return Ok(HashInput::QueryParameter(&q.name));
        }
        match &self.connection_properties {
            Some(p) if p.source_ip => Ok(HashInput::SourceIp),
            _ => Err("connection_properties hashes nothing without source_ip: true"),
        }
    }

    /// Consul's translation of one resolver hash policy (Consul's proxy-chain validation has
    /// passed): `SourceIP` to `connection_properties`, `Field` to a header, cookie or query
    /// parameter; a cookie's `Session` is a `ttl` of 0, its `TTL` the `ttl`. `None` for a field
    /// Consul skips.
    pub fn from_consul(p: &proxy_chain::entries::HashPolicy) -> Option<Self> {
        let mut out = Self {
            terminal: p.terminal,
            ..Self::default()
        };
        if p.source_ip {
            out.connection_properties = Some(ConnectionProperties { source_ip: true });
            return Some(out);
        }
        let name = p.field_value.clone();
        match p.field.as_str() {
            "header" => out.header = Some(HeaderHash { header_name: name }),
            "query_parameter" => out.query_parameter = Some(QueryParameterHash { name }),
            "cookie" => {
                let config = p.cookie_config.as_ref();
                let nanos = config.map_or(0, |c| c.ttl.as_nanos());
                let ttl = if config.is_some_and(|c| c.session) {
                    Some(Duration::ZERO)
                } else {
                    (nanos > 0).then(|| Duration::from_nanos(nanos as u64))
                };
                let path = config.map(|c| c.path.clone()).unwrap_or_default();
                out.cookie = Some(CookieHash { name, ttl, path });
            }
            _ => return None,
        }
        Some(out)
    }
}

/// `Ok` when `name` is a non-empty HTTP token (what a header or cookie name may be).
fn token(name: &str, field: &'static str) -> Result<(), &'static str> {
    let tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if name.is_empty() || !name.bytes().all(tchar) {
        return Err(match field {
            "header.header_name" => "header.header_name must be a non-empty HTTP header name",
            _ => "cookie.name must be a non-empty HTTP token",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(yaml: &str) -> HashPolicy {
        serde_norway::from_str(yaml).unwrap()
    }

    #[test]
    fn exactly_one_valid_input() {
        assert_eq!(
            policy("header: {header_name: x-user}").input(),
            Ok(HashInput::Header("x-user"))
        );
        assert_eq!(
            policy("connection_properties: {source_ip: true}\nterminal: true").input(),
            Ok(HashInput::SourceIp)
        );
        let both = policy("header: {header_name: a}\nquery_parameter: {name: b}");
        assert!(both.input().unwrap_err().contains("exactly one"));
        assert!(policy("terminal: true").input().is_err());
        assert!(
            policy("header: {header_name: 'a b'}")
                .input()
                .unwrap_err()
                .contains("header name")
        );
        assert!(
            policy("cookie: {name: ''}")
                .input()
                .unwrap_err()
                .contains("cookie.name")
        );
        assert!(policy("cookie: {name: s, path: '/a;b'}").input().is_err());
        assert!(
            policy("connection_properties: {source_ip: false}")
                .input()
                .is_err()
        );
        assert!(serde_norway::from_str::<HashPolicy>("filter_state: {key: k}").is_err());
    }

    #[test]
    fn consul_policies_translate_as_consuls_xds_does() {
        let consul = |json: &str| {
            let p: proxy_chain::entries::HashPolicy = serde_json::from_str(json).unwrap();
            HashPolicy::from_consul(&p)
        };
        let source = consul(r#"{"SourceIP": true, "Terminal": true}"#).unwrap();
        assert_eq!(
            (source.input(), source.terminal),
            (Ok(HashInput::SourceIp), true)
        );
        let session = consul(r#"{"Field": "cookie", "FieldValue": "s", "CookieConfig": {"Session": true, "Path": "/"}}"#).unwrap();
        let cookie = session.cookie.unwrap();
        assert_eq!(
            (cookie.ttl, cookie.path.as_str()),
            (Some(Duration::ZERO), "/")
        );
        let plain = consul(r#"{"Field": "cookie", "FieldValue": "s"}"#).unwrap();
        assert_eq!(plain.cookie.unwrap().ttl, None);
        let ttl =
            consul(r#"{"Field": "cookie", "FieldValue": "s", "CookieConfig": {"TTL": "10s"}}"#)
                .unwrap();
        assert_eq!(ttl.cookie.unwrap().ttl, Some(Duration::from_secs(10)));
        let query = consul(r#"{"Field": "query_parameter", "FieldValue": "u"}"#).unwrap();
        assert_eq!(query.input(), Ok(HashInput::QueryParameter("u")));
    }
}
