//! A request's hash for RING_HASH and MAGLEV, as Envoy's router computes it from a route's
//! `hash_policy`: each policy that finds its input adds its XXH64 (the hash so far rotated left
//! by one, then XORed, so two equal inputs do not cancel); `terminal` stops at the first policy
//! that leaves a hash. A cookie policy with a `ttl` generates the cookie when the request has
//! none (its value the hex XXH64 of the client's and the service's addresses, so one
//! connection's requests agree) and the response sets it.

use std::net::SocketAddr;

use http::{HeaderMap, HeaderValue, Uri, header};
use proxy_core::lb::{
    hash_policy::{CookieHash, HashInput, HashPolicy},
    xxhash::xxhash64,
};

/// A route leg's hash policies (empty: no hash, each pick random).
#[derive(Clone, Debug, Default)]
pub struct RequestHash {
    policies: Vec<HashPolicy>,
}

/// What the policies made of one request.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Hashed {
    /// The hash (`None`: no policy found its input).
    pub hash: Option<u64>,
    /// A generated cookie for the response's `Set-Cookie`.
    pub set_cookie: Option<HeaderValue>,
}

/// Where a request came from and went to (for `source_ip` and generated cookies).
#[derive(Clone, Copy, Debug)]
pub struct Peers {
    /// The client.
    pub client: SocketAddr,
    /// The service address it dialled.
    pub service: SocketAddr,
}

impl RequestHash {
    /// Hash policies already validated (an invalid one finds no input and adds nothing).
    pub fn new(policies: Vec<HashPolicy>) -> Self {
        Self { policies }
    }

    /// Whether there is no policy.
    pub fn is_empty(&self) -> bool {
        self.policies.is_empty()
    }

    /// The request's hash, and the cookie to set when one was generated.
    pub fn compute(&self, headers: &HeaderMap, uri: &Uri, peers: Peers) -> Hashed {
        let mut out = Hashed::default();
        for policy in &self.policies {
            let Ok(input) = policy.input() else { continue };
            let found = match input {
                HashInput::Header(name) => header_hash(headers, name),
                HashInput::Cookie(c) => cookie_value(headers, &c.name)
                    .or_else(|| {
                        let (value, set) = generate(c, peers)?;
                        out.set_cookie = Some(set);
                        Some(value)
                    })
                    .map(|v| xxhash64(v.as_bytes(), 0)),
                HashInput::QueryParameter(name) => {
                    query_value(uri, name).map(|v| xxhash64(v.as_bytes(), 0))
                }
                HashInput::SourceIp => Some(xxhash64(peers.client.ip().to_string().as_bytes(), 0)),
            };
            if let Some(new) = found {
                let old = out.hash.map_or(0, |h| h.rotate_left(1));
                out.hash = Some(old ^ new);
            }
            if policy.terminal && out.hash.is_some() {
                break;
            }
        }
        out
    }
}

/// A header's values: one is hashed as it is, several sorted and hashed as one string.
fn header_hash(headers: &HeaderMap, name: &str) -> Option<u64> {
    let mut values: Vec<&[u8]> = headers
        .get_all(name)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    Some(xxhash64(&values.concat(), 0))
}

/// The first cookie named `name` in the `Cookie` headers, surrounding quotes removed.
fn cookie_value(headers: &HeaderMap, name: &str) -> Option<String> {
    for line in headers.get_all(header::COOKIE) {
        let Ok(line) = line.to_str() else { continue };
        for pair in line.split(';') {
            let Some((k, v)) = pair.trim().split_once('=') else {
                continue;
            };
            if k.trim() == name {
                let v = v.trim();
                let v = v
                    .strip_prefix('"')
                    .and_then(|v| v.strip_suffix('"'))
                    .unwrap_or(v);
                return Some(v.to_owned());
            }
        }
    }
    None
}

/// The first value of query parameter `name`, as sent (not decoded).
fn query_value<'u>(uri: &'u Uri, name: &str) -> Option<&'u str> {
    uri.query()?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then_some(v)
    })
}

/// With a `ttl`: the cookie's value for this connection and its `Set-Cookie` line
/// (`name="value"`, `Max-Age` unless a session cookie, `Path` when given, `HttpOnly`).
fn generate(cookie: &CookieHash, peers: Peers) -> Option<(String, HeaderValue)> {
    let ttl = cookie.ttl?;
    let value = format!(
        "{:016x}",
        xxhash64(format!("{}{}", peers.client, peers.service).as_bytes(), 0)
    );
    let max_age = match ttl.as_secs() {
        0 => String::new(),
        secs => format!("; Max-Age={secs}"),
    };
    let path = match cookie.path.as_str() {
        "" => String::new(),
        path => format!("; Path={path}"),
    };
    let line = format!("{}=\"{value}\"{max_age}{path}; HttpOnly", cookie.name);
    Some((value, HeaderValue::from_str(&line).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policies(yaml: &str) -> RequestHash {
        RequestHash::new(serde_norway::from_str(yaml).unwrap())
    }

    const PEERS: Peers = Peers {
        client: SocketAddr::new(
            std::net::IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 7)),
            40_000,
        ),
        service: SocketAddr::new(
            std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 77, 0, 1)),
            80,
        ),
    };

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| (k.parse().unwrap(), HeaderValue::from_str(v).unwrap()))
            .collect()
    }

    fn hash(p: &RequestHash, h: &[(&str, &str)], uri: &str) -> Hashed {
        p.compute(&headers(h), &uri.parse().unwrap(), PEERS)
    }

    #[test]
    fn each_input_is_the_xxhash_of_its_value() {
        let x = |s: &str| Some(xxhash64(s.as_bytes(), 0));
        let header = policies("[{header: {header_name: x-user}}]");
        assert_eq!(hash(&header, &[("x-user", "alice")], "/").hash, x("alice"));
        assert_eq!(hash(&header, &[], "/").hash, None);
        // Several values: sorted, then hashed as one.
        let two = hash(&header, &[("x-user", "b"), ("x-user", "a")], "/");
        assert_eq!(two.hash, x("ab"));
        let query = policies("[{query_parameter: {name: u}}]");
        assert_eq!(hash(&query, &[], "/p?a=1&u=bob&u=eve").hash, x("bob"));
        assert_eq!(hash(&query, &[], "/p?uu=1").hash, None);
        let source = policies("[{connection_properties: {source_ip: true}}]");
        assert_eq!(hash(&source, &[], "/").hash, x("10.0.0.7"));
        let cookie = policies("[{cookie: {name: s}}]");
        assert_eq!(
            hash(&cookie, &[("cookie", "a=1; s=\"v1\"")], "/").hash,
            x("v1")
        );
        // Without a ttl nothing is generated.
        assert_eq!(hash(&cookie, &[("cookie", "a=1")], "/"), Hashed::default());
    }

    #[test]
    fn hashes_combine_and_terminal_stops() {
        let x = |s: &str| xxhash64(s.as_bytes(), 0);
        let both = policies("[{header: {header_name: a}}, {header: {header_name: b}}]");
        let h = hash(&both, &[("a", "1"), ("b", "2")], "/").hash;
        assert_eq!(h, Some(x("1").rotate_left(1) ^ x("2")));
        // Two equal inputs do not cancel out.
        assert_ne!(hash(&both, &[("a", "1"), ("b", "1")], "/").hash, Some(0));
        let terminal =
            policies("[{header: {header_name: a}, terminal: true}, {header: {header_name: b}}]");
        assert_eq!(
            hash(&terminal, &[("a", "1"), ("b", "2")], "/").hash,
            Some(x("1"))
        );
        // A terminal policy without its input does not stop the next one.
        assert_eq!(hash(&terminal, &[("b", "2")], "/").hash, Some(x("2")));
    }

    #[test]
    fn a_cookie_with_a_ttl_is_generated_when_absent() {
        let ttl = policies("[{cookie: {name: s, ttl: 3600s, path: /}}]");
        let out = hash(&ttl, &[], "/");
        let value = format!("{:016x}", xxhash64(b"10.0.0.7:40000127.77.0.1:80", 0));
        let line = format!("s=\"{value}\"; Max-Age=3600; Path=/; HttpOnly");
        assert_eq!(out.set_cookie.unwrap(), line.as_str());
        assert_eq!(out.hash, Some(xxhash64(value.as_bytes(), 0)));
        // The next request sends it back: the same hash, nothing set.
        let back = hash(&ttl, &[("cookie", &format!("s=\"{value}\""))], "/");
        assert_eq!((back.hash, back.set_cookie), (out.hash, None));
        // A session cookie (ttl 0) has no Max-Age.
        let session = policies("[{cookie: {name: s, ttl: 0s}}]");
        let line = hash(&session, &[], "/").set_cookie.unwrap();
        assert_eq!(line, format!("s=\"{value}\"; HttpOnly").as_str());
    }

    /// A chain's resolver `LoadBalancer`: its policy becomes the target cluster's, its
    /// `HashPolicies` the leg's (only with a hashing policy); the service's `hash_policy` fills
    /// a leg that has none.
    fn table(load_balancer: &str) -> crate::route::RouteTable {
        let entries = proxy_chain::Entries::from_json(&format!(
            r#"[{{"Kind": "service-defaults", "Name": "web", "Protocol": "http"}},
               {{"Kind": "service-resolver", "Name": "web", "LoadBalancer": {load_balancer}}}]"#
        ))
        .unwrap();
        let request = proxy_chain::CompileRequest::new("web", "dc1", "consul");
        let chain = proxy_chain::compile(&request, &entries).unwrap();
        let (_tx, rx) = tokio::sync::watch::channel(proxy_core::health::Routing::default());
        let cluster =
            crate::cluster::ClusterHandle::new("web", rx, true, std::time::Duration::ZERO);
        crate::route::RouteTable::from_chain(&chain, &|_| Some(cluster.clone())).unwrap()
    }

    #[test]
    fn a_resolvers_load_balancer_sets_the_policy_and_the_hash() {
        use proxy_core::lb::Balancer;
        let maglev = table(
            r#"{"Policy": "maglev", "HashPolicies": [{"Field": "header", "FieldValue": "x-user"}]}"#,
        );
        let leg = &maglev.routes[0].legs[0];
        assert_eq!(
            leg.clusters[0].balancer(),
            Balancer::Maglev { table_size: 65_537 }
        );
        let h = hash(&leg.hash, &[("x-user", "alice")], "/").hash;
        assert_eq!(h, Some(xxhash64(b"alice", 0)));
        // The service's own list does not replace the resolver's.
        let service: Vec<HashPolicy> =
            serde_norway::from_str("[{query_parameter: {name: u}}]").unwrap();
        let maglev = maglev.with_hash_policy(&service);
        let kept = hash(
            &maglev.routes[0].legs[0].hash,
            &[("x-user", "alice")],
            "/?u=1",
        );
        assert_eq!(kept.hash, h);
        // A policy that does not hash: no hash, and the service's list then applies.
        let least =
            table(r#"{"Policy": "least_request", "LeastRequestConfig": {"ChoiceCount": 3}}"#);
        let leg = &least.routes[0].legs[0];
        assert_eq!(
            leg.clusters[0].balancer(),
            Balancer::LeastRequest { choice_count: 3 }
        );
        assert!(leg.hash.is_empty());
        let filled = least.with_hash_policy(&service);
        let h = hash(&filled.routes[0].legs[0].hash, &[], "/?u=1").hash;
        assert_eq!(h, Some(xxhash64(b"1", 0)));
    }
}
