//! Envoy's `Endpoint.health_check_config` on the file's endpoints: active checks of one host may
//! go to another address or port than its traffic, carry another `Host`, or not run at all. The
//! same fields reach a host from EDS (`discovery::xds::cla`); both become a
//! [`HealthCheckTarget`].

use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

use super::{Address, host_guard::HostGuard};
use crate::host::HealthCheckTarget;

/// Envoy's `Endpoint.HealthCheckConfig`.
#[derive(Clone, Debug, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointHealthCheck {
    /// The port active checks connect to instead of the endpoint's (0 or unset: the endpoint's,
    /// or `address`'s when that is set).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub port_value: u16,
    /// Another address for active checks: an IP and a port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<Address>,
    /// The HTTP `Host` (gRPC `:authority`) of checks of this endpoint, over the check's `host`
    /// (or the cluster name).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub hostname: String,
    /// Do not check this endpoint actively: it routes without a check.
    #[serde(default, skip_serializing_if = "is_false")]
    pub disable_active_health_check: bool,
}

#[expect(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's skip_serializing_if passes a reference"
)]
fn is_zero(v: &u16) -> bool {
    *v == 0
}

#[expect(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's skip_serializing_if passes a reference"
)]
fn is_false(v: &bool) -> bool {
    !*v
}

impl EndpointHealthCheck {
    /// The checked form. Call on a validated configuration (the address is an IP).
    pub fn target(&self) -> HealthCheckTarget {
        let address = self.address.as_ref().map(|a| &a.socket_address);
        HealthCheckTarget {
            address: address.and_then(|sa| sa.address.parse().ok()),
            address_port: address.map(|sa| sa.port_value).filter(|p| *p != 0),
            port: Some(self.port_value).filter(|p| *p != 0),
            hostname: Some(self.hostname.clone()).filter(|h| !h.is_empty()),
            disabled: self.disable_active_health_check,
        }
    }

    /// Refuses an `address` that is not an IP (checks are not resolved) or that no host may
    /// have. Returns the field (below `health_check_config`) and the reason.
    pub fn validate(&self, guard: &HostGuard) -> Result<(), (&'static str, String)> {
        let Some(address) = &self.address else {
            return Ok(());
        };
        let sa = &address.socket_address;
        let Ok(ip) = sa.address.parse::<IpAddr>() else {
            return Err((
                "address.socket_address.address",
                format!(
                    "{:?} is not an IP address (checks are not resolved)",
                    sa.address
                ),
            ));
        };
        match guard.refuses(SocketAddr::new(ip, sa.port_value)) {
            Some(why) => Err((
                "address.socket_address",
                format!("{ip}:{} is {why}, which is never checked", sa.port_value),
            )),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SocketAddress;

    fn check(port: u16, address: Option<(&str, u16)>) -> EndpointHealthCheck {
        EndpointHealthCheck {
            port_value: port,
            address: address.map(|(a, p)| Address {
                socket_address: SocketAddress {
                    address: a.into(),
                    port_value: p,
                    protocol: None,
                },
            }),
            ..EndpointHealthCheck::default()
        }
    }

    #[test]
    fn the_target_follows_envoys_order() {
        let host: SocketAddr = "10.0.0.1:80".parse().unwrap();
        let at = |c: &EndpointHealthCheck| c.target().addr(host).to_string();
        assert_eq!(at(&check(0, None)), "10.0.0.1:80");
        assert_eq!(at(&check(9000, None)), "10.0.0.1:9000");
        assert_eq!(at(&check(0, Some(("10.0.0.9", 81)))), "10.0.0.9:81");
        assert_eq!(at(&check(0, Some(("10.0.0.9", 0)))), "10.0.0.9:80");
        assert_eq!(at(&check(9000, Some(("10.0.0.9", 81)))), "10.0.0.9:9000");
    }

    #[test]
    fn an_address_must_be_an_ip_a_host_may_have() {
        let guard = HostGuard::new(Vec::new());
        let (field, why) = check(0, Some(("health.test", 80)))
            .validate(&guard)
            .unwrap_err();
        assert_eq!(field, "address.socket_address.address");
        assert!(why.contains("not an IP address"), "{why}");
        let (_, why) = check(0, Some(("169.254.169.254", 80)))
            .validate(&guard)
            .unwrap_err();
        assert!(why.contains("never checked"), "{why}");
        assert!(check(0, Some(("10.0.0.9", 80))).validate(&guard).is_ok());
    }

    #[test]
    fn the_file_takes_envoys_fields_and_checks_the_address() {
        let file = |check: &str| {
            format!(
                "clusters:\n  - name: c\n    load_assignment:\n      endpoints:\n        - lb_endpoints:\n            - endpoint:\n                address: {{ socket_address: {{ address: 127.0.0.5, port_value: 80 }} }}\n                hostname: web-1\n                health_check_config: {check}\n"
            )
        };
        let config = crate::config::Config::parse(
            &file("{ port_value: 9000, hostname: h, disable_active_health_check: true }"),
            std::path::Path::new("t.yaml"),
        )
        .expect("valid");
        let hosts = config.clusters[0].static_hosts();
        assert_eq!(hosts[0].hostname(), Some("web-1"));
        assert_eq!(hosts[0].health_check().addr(hosts[0].addr).port(), 9000);
        assert!(hosts[0].health_check().disabled);
        let err = crate::config::Config::parse(
            &file("{ address: { socket_address: { address: health.test, port_value: 80 } } }"),
            std::path::Path::new("t.yaml"),
        )
        .expect_err("not an IP");
        let text = err.to_string();
        assert!(
            text.contains("health_check_config.address.socket_address.address")
                && text.contains("not an IP address"),
            "{text}"
        );
    }
}
