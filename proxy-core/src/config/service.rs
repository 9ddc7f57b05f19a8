//! Services: the addresses applications dial, and what serves them.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::{Cluster, error::Invalid};

/// A service address (VIP, port, protocol) served by a cluster.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Service {
    /// Unique name, used in stats and `/clusters`.
    pub name: String,
    /// The VIP applications dial. On a host, keep it in 127.0.0.0/8 (e.g. 127.77.0.0/16) so
    /// that a connect which is not rewritten still stays on the machine.
    pub address: IpAddr,
    /// The port applications dial.
    pub port: u16,
    /// `TCP` (default) or `UDP`.
    #[serde(default)]
    pub protocol: Protocol,
    /// Name of the cluster whose hosts serve this service. Exactly one of `cluster` and `chain`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cluster: String,
    /// Name of the Consul service whose discovery chain (from `config_entries`) serves this
    /// service: splits become weights, failover targets lower priorities, redirects and subsets
    /// choose hosts. Each target maps to the cluster named like its service (`<service>.<dc>`
    /// for another datacenter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chain: Option<String>,
    /// Opt-in behaviour beyond Consul's for this service's chain (all off by default).
    #[serde(default)]
    pub chain_options: crate::chain::ChainOptions,
    /// `direct` (default): the kernel connects the application straight to a chosen host.
    /// `proxy`: the connection goes through the daemon's proxy listener.
    #[serde(default)]
    pub mode: ServiceMode,
    /// The HTTP upgrades (WebSocket and others) a proxy-mode HTTP service lets through, as
    /// Envoy's `upgrade_configs`: a request whose `Upgrade` type is not listed, or listed with
    /// `enabled: false`, is answered 403. Default: `websocket` enabled, what Consul configures
    /// for every HTTP service; `[]` refuses every upgrade. Only a proxy-mode service with a
    /// `chain` may change it.
    #[serde(default = "default_upgrade_configs")]
    pub upgrade_configs: Vec<UpgradeConfig>,
    /// Proxy path only (`mode: proxy` with a cluster): how many connects one connection may
    /// make, each to a host not tried yet while the cluster has one, before the client is reset
    /// and `upstream_cx_connect_attempts_exceeded` counted (Envoy's tcp_proxy
    /// `max_connect_attempts`). At least 1; unset is 1, one connect and no retry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connect_attempts: Option<u32>,
    /// Proxy path only: what the cluster's RING_HASH or MAGLEV hashes, Envoy's `hash_policy`
    /// list (`header: {header_name}`, `cookie: {name, ttl, path}`, `query_parameter: {name}`,
    /// `connection_properties: {source_ip: true}`, each with an optional `terminal`). A service
    /// with a `cluster` is TCP and may hash only the source IP; a chain's routes use it where
    /// their resolver sets no `HashPolicies`. Empty (default): each pick hashes a random number.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hash_policy: Vec<crate::lb::hash_policy::HashPolicy>,
    /// Kernel path, consistent hashing only (MAGLEV or RING_HASH, from the clusters or the
    /// chain's resolvers): what tells the clients apart, so that each keeps its host. `netns`,
    /// `cgroup`, `process`, `user` or `socket`; unset is `process` ([`HashKey`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash_key: Option<HashKey>,
}

/// What consistent hashing on the kernel path keys on: which clients share a host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HashKey {
    /// The client's network namespace: one host per container (every process of a host that is
    /// not a container shares one).
    Netns,
    /// The client's cgroup v2 (a systemd unit, a container).
    Cgroup,
    /// The client's process (its threads share it): each process keeps its host while it lives.
    /// The default.
    #[default]
    Process,
    /// The client's user id: every process of one user shares a host.
    User,
    /// The client's socket: each TCP connection hashes anew (no affinity beyond the
    /// connection); a UDP socket keeps its host.
    Socket,
}

/// One upgrade type of [`Service::upgrade_configs`] (Envoy's `UpgradeConfig`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UpgradeConfig {
    /// The `Upgrade` header value it applies to, compared without regard to case
    /// (`websocket`, `spdy/3.1`, ...).
    pub upgrade_type: String,
    /// Whether such requests go through (default true); `false` refuses them with 403.
    #[serde(default = "enabled")]
    pub enabled: bool,
}

/// `websocket`, enabled: what Consul's generated HTTP connection managers allow.
pub fn default_upgrade_configs() -> Vec<UpgradeConfig> {
    vec![UpgradeConfig {
        upgrade_type: "websocket".to_owned(),
        enabled: true,
    }]
}

fn enabled() -> bool {
    true
}

/// Longest accepted `upgrade_type` (real ones are a few characters).
const MAX_UPGRADE_TYPE: usize = 64;

impl Service {
    /// Checks `upgrade_configs`: HTTP services only (mode: proxy with a chain), each type an
    /// HTTP token (with an optional `/version`), no type twice, and neither `CONNECT` nor `h2c`.
    pub(super) fn validate_upgrades(&self, i: usize) -> Result<(), Invalid> {
        let at = |j: usize| format!("services[{i}].upgrade_configs[{j}].upgrade_type");
        let http = self.mode == ServiceMode::Proxy && self.chain.is_some();
        if !http && self.upgrade_configs != default_upgrade_configs() {
            return Err(Invalid::new(
                format!("services[{i}].upgrade_configs"),
                "applies to HTTP services on the proxy path (mode: proxy with a chain) only; this service's bytes are not read as HTTP",
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (j, u) in self.upgrade_configs.iter().enumerate() {
            let kind = u.upgrade_type.to_ascii_lowercase();
            if let Some(why) = bad_upgrade_type(&kind) {
                return Err(Invalid::new(at(j), why));
            }
            if !seen.insert(kind) {
                return Err(Invalid::new(
                    at(j),
                    format!("{:?} is listed twice", u.upgrade_type),
                ));
            }
        }
        Ok(())
    }
}

impl Service {
    /// Checks `hash_policy`: each policy valid, only on the proxy path, and on a TCP service
    /// (a `cluster`, not a chain) only the source IP, the one input a TCP connection has.
    pub(super) fn validate_hash_policy(&self, i: usize) -> Result<(), Invalid> {
        use crate::lb::hash_policy::HashInput;
        for (j, policy) in self.hash_policy.iter().enumerate() {
            let at = format!("services[{i}].hash_policy[{j}]");
            let input = policy.input().map_err(|why| Invalid::new(&at, why))?;
            if self.mode == ServiceMode::Direct {
                return Err(Invalid::new(
                    at,
                    "applies to the proxy path (mode: proxy); the kernel path's MAGLEV hashes \
                     the client's network namespace",
                ));
            }
            if self.chain.is_none() && input != HashInput::SourceIp {
                return Err(Invalid::new(
                    at,
                    "a service with a cluster is TCP: it can hash only the source IP \
                     (connection_properties: {source_ip: true}); headers, cookies and query \
                     parameters need HTTP routes (a chain)",
                ));
            }
        }
        Ok(())
    }

    /// The connects one proxied connection may make (`max_connect_attempts`, 1 when unset).
    pub fn connect_attempts(&self) -> u32 {
        self.max_connect_attempts.unwrap_or(1)
    }

    /// `max_connect_attempts` is at least 1 and only on a service the proxy connects for with a
    /// choice of hosts: the kernel path makes no connect of its own (the application's connect
    /// gets the refusal), a chain's HTTP routes retry by their retry policy, and an
    /// ORIGINAL_DST connection has one host, its destination.
    pub(super) fn validate_connect_attempts(
        &self,
        at: &str,
        original_dst: bool,
    ) -> Result<(), Invalid> {
        let Some(attempts) = self.max_connect_attempts else {
            return Ok(());
        };
        let refused = if attempts == 0 {
            "must be at least 1 (1 is a single connect, no retry)"
        } else if self.mode == ServiceMode::Direct {
            "the kernel path does not retry (the application's own connect gets the refusal); \
             set mode: proxy or remove max_connect_attempts"
        } else if self.chain.is_some() {
            "a chain serves HTTP routes, which retry by their retry policy; remove \
             max_connect_attempts"
        } else if original_dst {
            "an ORIGINAL_DST connection has one host, its original destination: there is no \
             other host to try; remove max_connect_attempts"
        } else {
            return Ok(());
        };
        Err(Invalid::new(at, refused))
    }
}

impl Service {
    /// `hash_key` only where the kernel hashes for this service: mode direct, and for a
    /// `cluster` service a cluster whose `lb_policy` is MAGLEV or RING_HASH (a chain's policy
    /// is checked when the chain compiles, `crate::chain::runs_in`). Anywhere else it would be
    /// silently ignored.
    pub(super) fn validate_hash_key(
        &self,
        at: &str,
        cluster: Option<&Cluster>,
    ) -> Result<(), Invalid> {
        if self.hash_key.is_none() {
            return Ok(());
        }
        if self.mode == ServiceMode::Proxy {
            return Err(Invalid::new(
                at,
                "applies to the kernel path (mode: direct); the proxy path hashes by its own \
                 policies; remove hash_key",
            ));
        }
        match cluster {
            Some(c) if !c.lb_policy.hashes() => Err(Invalid::new(
                at,
                format!(
                    "applies to consistent hashing, but cluster {:?} has lb_policy {:?}; set \
                     lb_policy: MAGLEV or RING_HASH, or remove hash_key",
                    c.name, c.lb_policy
                ),
            )),
            _ => Ok(()),
        }
    }

    /// `chain_options` set only where they act: on a chain the kernel path runs. A service with
    /// a cluster has no chain to split or fail over, and the proxy path picks a leg by weight
    /// and fails over when a target has no routable host, whatever these say.
    pub(super) fn validate_chain_options(&self, at: &str) -> Result<(), Invalid> {
        if self.chain_options == crate::chain::ChainOptions::default() {
            return Ok(());
        }
        if self.chain.is_none() {
            return Err(Invalid::new(
                at,
                "applies to a service with a chain; this service has a cluster, with no splits or \
                 failover targets; remove chain_options",
            ));
        }
        if self.mode == ServiceMode::Proxy {
            return Err(Invalid::new(
                at,
                "applies to the kernel path (mode: direct) only: the proxy path splits requests by \
                 weight and fails over when a target has no routable host, whatever \
                 chain_options say; remove chain_options or use mode: direct",
            ));
        }
        Ok(())
    }
}

/// Why `kind` (lowercase) cannot be an upgrade type, if it cannot.
fn bad_upgrade_type(kind: &str) -> Option<&'static str> {
    let tchar = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    let (name, version) = kind.split_once('/').unwrap_or((kind, "a"));
    if kind.len() > MAX_UPGRADE_TYPE
        || name.is_empty()
        || version.is_empty()
        || !name.chars().all(tchar)
        || !version.chars().all(tchar)
    {
        return Some(
            "must be an Upgrade protocol token of at most 64 characters, like websocket or spdy/3.1",
        );
    }
    match kind {
        "connect" => Some(
            "CONNECT is a method, not an upgrade, and the HTTP path does not tunnel CONNECT requests",
        ),
        "h2c" => Some(
            "h2c upgrades are not proxied (the request is served over HTTP/1.1); HTTP/2 cleartext clients use prior knowledge",
        ),
        _ => None,
    }
}

/// Transport protocol of a service.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    /// TCP.
    #[default]
    Tcp,
    /// UDP (connected sockets through connect4/6).
    Udp,
}

/// Which path serves a service.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ServiceMode {
    /// Kernel path: connect4/6 rewrite the destination to a chosen host.
    #[default]
    Direct,
    /// Proxy path: connect4/6 redirect to the daemon's listener.
    Proxy,
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::{Config, ConfigError};

    const HEAD: &str = "clusters:\n  - name: a\nservices:\n";

    fn parse(services: &str) -> Result<Config, ConfigError> {
        Config::parse(&format!("{HEAD}{services}"), Path::new("test.yaml"))
    }

    #[test]
    fn websocket_is_allowed_by_default() {
        let config = parse("  - {name: s, address: 127.77.0.1, port: 80, cluster: a}\n").unwrap();
        assert_eq!(
            config.services[0].upgrade_configs,
            default_upgrade_configs()
        );
        assert_eq!(
            default_upgrade_configs(),
            [UpgradeConfig {
                upgrade_type: "websocket".to_owned(),
                enabled: true
            }]
        );
    }

    #[test]
    fn bad_upgrade_configs_are_refused() {
        let proxy = "  - name: s\n    address: 127.77.0.1\n    port: 80\n    chain: s\n    mode: proxy\n    upgrade_configs:\n";
        let cases = [
            (
                "      - {upgrade_type: ''}\n",
                "upgrade_configs[0].upgrade_type",
                "token",
            ),
            (
                "      - {upgrade_type: 'web socket'}\n",
                "upgrade_configs[0].upgrade_type",
                "token",
            ),
            (
                "      - {upgrade_type: spdy/}\n",
                "upgrade_configs[0].upgrade_type",
                "token",
            ),
            (
                "      - {upgrade_type: CONNECT}\n",
                "upgrade_configs[0].upgrade_type",
                "CONNECT",
            ),
            (
                "      - {upgrade_type: h2c}\n",
                "upgrade_configs[0].upgrade_type",
                "h2c",
            ),
            (
                "      - {upgrade_type: websocket}\n      - {upgrade_type: WebSocket, enabled: false}\n",
                "upgrade_configs[1].upgrade_type",
                "listed twice",
            ),
            (
                "      - {upgrade_type: websocket, on: true}\n",
                "upgrade_configs[0].on",
                "unknown field",
            ),
        ];
        for (list, field, text) in cases {
            let err = parse(&format!("{proxy}{list}")).unwrap_err();
            let msg = err.to_string();
            assert_eq!(
                err.field(),
                Some(format!("services[0].{field}").as_str()),
                "{msg}"
            );
            assert!(msg.contains(text), "{list}: {msg}");
        }
        let direct =
            "  - {name: s, address: 127.77.0.1, port: 80, cluster: a, upgrade_configs: []}\n";
        let err = parse(direct).unwrap_err();
        assert_eq!(err.field(), Some("services[0].upgrade_configs"));
        assert!(err.to_string().contains("not read as HTTP"), "{err}");
    }

    const PROXY_CLUSTERS: &str = "\
clusters:
  - name: web
    load_assignment:
      endpoints:
        - lb_endpoints:
            - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 8080 } } }
  - name: passthrough
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
proxy:
  listeners: [127.0.0.1:15901]
services:
";

    fn parse_proxied(services: &str) -> Result<Config, ConfigError> {
        Config::parse(&format!("{PROXY_CLUSTERS}{services}"), Path::new("t.yaml"))
    }

    #[test]
    fn connect_attempts_default_to_one_and_are_taken_on_the_proxy_path() {
        let config = parse_proxied(
            "  - { name: a, address: 127.77.0.1, port: 80, cluster: web, mode: proxy }\n  - { name: b, address: 127.77.0.2, port: 80, cluster: web, mode: proxy, max_connect_attempts: 3 }\n",
        )
        .expect("valid");
        assert_eq!(config.services[0].max_connect_attempts, None);
        assert_eq!(config.services[0].connect_attempts(), 1);
        assert_eq!(config.services[1].connect_attempts(), 3);
    }

    #[test]
    fn connect_attempts_where_they_cannot_apply_are_refused_at_their_line() {
        for (service, why) in [
            (
                "{ name: a, address: 127.77.0.1, port: 80, cluster: web, mode: proxy, max_connect_attempts: 0 }",
                "must be at least 1",
            ),
            (
                "{ name: a, address: 127.77.0.1, port: 80, cluster: web, max_connect_attempts: 2 }",
                "the kernel path does not retry",
            ),
            (
                "{ name: a, address: 127.77.0.1, port: 80, cluster: passthrough, mode: proxy, max_connect_attempts: 2 }",
                "one host, its original destination",
            ),
            (
                "{ name: a, address: 127.77.0.1, port: 80, cluster: web, mode: proxy, max_connect_attempts: -1 }",
                "expected u32",
            ),
        ] {
            let err = parse_proxied(&format!("  - {service}\n")).expect_err(service);
            let ConfigError::Invalid { field, at, .. } = &err else {
                panic!("{service}: {err}");
            };
            assert_eq!(field, "services[0].max_connect_attempts", "{service}");
            assert_eq!(at.line, 13, "{service}: {err}");
            assert!(err.to_string().contains(why), "{service}: {err}");
        }
    }

    #[test]
    fn hash_policy_is_checked_per_service() {
        let ok = parse_proxied(
            "  - { name: a, address: 127.77.0.1, port: 80, cluster: web, mode: proxy, hash_policy: [{ connection_properties: { source_ip: true }, terminal: true }] }\n",
        )
        .expect("a TCP service may hash the source IP");
        assert!(ok.services[0].hash_policy[0].terminal);
        for (service, why) in [
            (
                "{ name: a, address: 127.77.0.1, port: 80, cluster: web, mode: proxy, hash_policy: [{ header: { header_name: x-user } }] }",
                "can hash only the source IP",
            ),
            (
                "{ name: a, address: 127.77.0.1, port: 80, cluster: web, hash_policy: [{ connection_properties: { source_ip: true } }] }",
                "applies to the proxy path",
            ),
            (
                "{ name: a, address: 127.77.0.1, port: 80, cluster: web, mode: proxy, hash_policy: [{ terminal: true }] }",
                "exactly one of header, cookie",
            ),
        ] {
            let err = parse_proxied(&format!("  - {service}\n")).expect_err(service);
            let ConfigError::Invalid { field, .. } = &err else {
                panic!("{service}: {err}");
            };
            assert_eq!(field, "services[0].hash_policy[0]", "{service}");
            assert!(err.to_string().contains(why), "{service}: {err}");
        }
    }

    #[test]
    fn a_hash_key_where_nothing_hashes_is_refused_at_its_line() {
        for (service, why) in [
            (
                "{ name: a, address: 127.77.0.1, port: 80, cluster: web, hash_key: user }",
                "cluster \"web\" has lb_policy Random",
            ),
            (
                "{ name: a, address: 127.77.0.1, port: 80, cluster: web, mode: proxy, hash_key: user }",
                "applies to the kernel path",
            ),
            (
                "{ name: a, address: 127.77.0.1, port: 80, cluster: web, hash_key: thread }",
                "unknown variant `thread`",
            ),
        ] {
            let err = parse_proxied(&format!("  - {service}\n")).expect_err(service);
            let ConfigError::Invalid { field, at, .. } = &err else {
                panic!("{service}: {err}");
            };
            assert_eq!(field, "services[0].hash_key", "{service}");
            assert_eq!(at.line, 13, "{service}: {err}");
            assert!(err.to_string().contains(why), "{service}: {err}");
        }
    }

    #[test]
    fn chain_options_where_they_cannot_act_are_refused_at_their_line() {
        let options = "chain_options: { health_aware_splits: true }";
        let kernel = format!("{{ name: s, address: 127.77.0.1, port: 80, chain: a, {options} }}");
        let config = parse(&format!("  - {kernel}\n")).expect("a kernel-path chain takes them");
        assert!(config.services[0].chain_options.health_aware_splits);
        for (service, why) in [
            (
                format!("{{ name: s, address: 127.77.0.1, port: 80, cluster: a, {options} }}"),
                "applies to a service with a chain",
            ),
            (
                format!(
                    "{{ name: s, address: 127.77.0.1, port: 80, chain: a, mode: proxy, {options} }}"
                ),
                "applies to the kernel path (mode: direct) only",
            ),
            (
                "{ name: s, address: 127.77.0.1, port: 80, chain: a, mode: proxy, chain_options: { failover_threshold_percent: 50 } }".to_owned(),
                "the proxy path splits requests by weight",
            ),
        ] {
            let err = parse(&format!("  - {service}\n")).expect_err(&service);
            let ConfigError::Invalid { field, at, .. } = &err else {
                panic!("{service}: {err}");
            };
            assert_eq!(field, "services[0].chain_options", "{service}");
            assert_eq!(at.line, 4, "{service}: {err}");
            assert!(err.to_string().contains(why), "{service}: {err}");
        }
    }
}
