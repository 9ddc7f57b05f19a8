//! Host addresses no source may hand the data path, whatever it is (a static list, DNS, Consul,
//! EDS): the unspecified address, broadcast, multicast, link-local addresses (169.254.0.0/16,
//! fe80::/10: a cloud's metadata service at 169.254.169.254 among them), port 0, the daemon's own
//! listener and admin addresses (a connect there would loop, or reach the admin interface from
//! the cgroup) and its services' own addresses (VIP:port: a connect there is not rewritten again
//! and goes nowhere). Refused hosts are left out of the cluster, logged once per change, and
//! counted in the cluster's `hosts_refused` gauge; the others are used. `proxy check` refuses
//! them in a STATIC cluster's endpoints.
//!
//! A whole host set larger than the kernel maps take (`kernel_maps`) is refused too: the
//! cluster keeps its last hosts (see `upstream`).

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use crate::host::HostSet;

/// An IPv4-mapped IPv6 address as its IPv4 address.
pub(crate) fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        IpAddr::V4(_) => ip,
    }
}

/// 169.254.0.0/16 or fe80::/10.
fn is_link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    }
}

/// What a cluster refuses besides the address kinds that are never a host.
#[derive(Clone, Debug, Default)]
pub struct HostGuard {
    own: Arc<[SocketAddr]>,
    /// Sorted: every host of every cluster is looked up here, so a scan would cost hosts
    /// times services.
    vips: Arc<[SocketAddr]>,
    /// The kernel maps' sizes a host set must fit; `None`: no limit.
    maps: Option<crate::config::MapSizes>,
}

impl HostGuard {
    /// Refuses also `own`: the daemon's listeners and admin address (an unspecified address
    /// stands for every local one, and then covers loopback).
    #[must_use]
    pub fn new(own: Vec<SocketAddr>) -> Self {
        Self {
            own: own.into(),
            vips: Arc::default(),
            maps: None,
        }
    }

    /// The guard of a configuration: its admin and proxy listener addresses, and its services'
    /// VIP:port.
    #[must_use]
    pub fn for_config(config: &crate::config::Config) -> Self {
        let mut own: Vec<SocketAddr> = config.admin.address.tcp().into_iter().collect();
        own.extend(&config.proxy.listeners);
        let mut vips: Vec<SocketAddr> = config
            .services
            .iter()
            .map(|s| SocketAddr::new(canonical_ip(s.address), s.port))
            .collect();
        vips.sort_unstable();
        Self {
            own: own.into(),
            vips: vips.into(),
            maps: Some(config.kernel_maps),
        }
    }

    /// Why a set of `hosts` hosts does not fit the kernel maps, if it does not.
    #[must_use]
    pub fn too_many(&self, hosts: usize) -> Option<String> {
        self.maps.as_ref()?.hosts_refusal(hosts)
    }

    /// Why `addr` cannot be a host, if it cannot.
    #[must_use]
    pub fn refuses(&self, addr: SocketAddr) -> Option<&'static str> {
        let ip = canonical_ip(addr.ip());
        if addr.port() == 0 {
            return Some("port 0");
        }
        if ip.is_unspecified() {
            return Some("the unspecified address");
        }
        if ip.is_multicast() {
            return Some("a multicast address");
        }
        if let IpAddr::V4(v4) = ip
            && v4.is_broadcast()
        {
            return Some("the broadcast address");
        }
        if is_link_local(ip) {
            return Some("a link-local address");
        }
        if self
            .vips
            .binary_search(&SocketAddr::new(ip, addr.port()))
            .is_ok()
        {
            return Some("a service address (VIP) of this daemon");
        }
        let own = self.own.iter().any(|o| {
            let o_ip = canonical_ip(o.ip());
            o.port() == addr.port() && (o_ip == ip || (o_ip.is_unspecified() && ip.is_loopback()))
        });
        own.then_some("the daemon's own listener or admin address")
    }

    /// `hosts` without the refused ones, and those refused with why.
    #[must_use]
    pub fn filter(&self, hosts: HostSet) -> (HostSet, Vec<(SocketAddr, &'static str)>) {
        let mut refused = Vec::new();
        let kept = hosts
            .into_iter()
            .filter(|h| match self.refuses(h.addr) {
                Some(why) => {
                    refused.push((h.addr, why));
                    false
                }
                None => true,
            })
            .collect();
        (kept, refused)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::Host;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn refuses_what_is_never_a_host_and_the_daemon_itself() {
        let guard = HostGuard::new(vec![a("127.0.0.1:15000"), a("0.0.0.0:15001")]);
        for (addr, why) in [
            ("0.0.0.0:80", "unspecified"),
            ("[::]:80", "unspecified"),
            ("255.255.255.255:80", "broadcast"),
            ("224.0.0.1:80", "multicast"),
            ("[ff02::1]:80", "multicast"),
            ("[::ffff:224.0.0.1]:80", "multicast"),
            ("10.0.0.1:0", "port 0"),
            ("127.0.0.1:15000", "own"),
            ("[::ffff:127.0.0.1]:15000", "own"),
            ("127.0.0.5:15001", "own"),
            ("169.254.169.254:80", "link-local"),
            ("169.254.10.1:80", "link-local"),
            ("[fe80::1]:80", "link-local"),
            ("[::ffff:169.254.169.254]:80", "link-local"),
        ] {
            let got = guard
                .refuses(a(addr))
                .unwrap_or_else(|| panic!("{addr} accepted"));
            assert!(got.contains(why), "{addr}: {got}");
        }
        for ok in [
            "127.0.0.1:8080",
            "10.0.0.1:15000",
            "[::1]:443",
            "127.77.0.1:80",
        ] {
            assert_eq!(guard.refuses(a(ok)), None, "{ok}");
        }
        let (kept, refused) = guard.filter(vec![
            Host::new(a("10.0.0.1:80")),
            Host::new(a("0.0.0.0:80")),
        ]);
        assert_eq!(kept.len(), 1);
        assert_eq!(refused, [(a("0.0.0.0:80"), "the unspecified address")]);
    }

    #[test]
    fn refuses_the_daemons_own_services() {
        let config = crate::config::Config::parse(
            "admin: { address: \"127.0.0.1:15999\" }\nclusters:\n  - name: a\n    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 8080 } } } } ] } ] }\nservices:\n  - { name: s, address: 127.77.0.1, port: 80, cluster: a }\n",
            std::path::Path::new("t.yaml"),
        )
        .expect("valid");
        let guard = HostGuard::for_config(&config);
        assert_eq!(
            guard.refuses(a("127.77.0.1:80")),
            Some("a service address (VIP) of this daemon")
        );
        assert_eq!(
            guard.refuses(a("[::ffff:127.77.0.1]:80")),
            Some("a service address (VIP) of this daemon")
        );
        assert!(guard.refuses(a("127.0.0.1:15999")).is_some(), "admin");
        assert_eq!(guard.refuses(a("127.77.0.1:81")), None, "another port");
    }

    #[test]
    fn every_one_of_many_services_is_refused_and_nothing_between_them() {
        use std::fmt::Write as _;
        let mut text = String::from(
            "clusters:\n  - name: a\n    load_assignment: { endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 8080 } } } } ] } ] }\nservices:\n",
        );
        // Out of address order, on two ports.
        for i in (0..300_u32).rev() {
            let port = 80 + i % 2;
            let _ = writeln!(
                text,
                "  - {{ name: s{i}, address: 127.77.{}.{}, port: {port}, cluster: a }}",
                i / 200,
                i % 200 + 1
            );
        }
        let config =
            crate::config::Config::parse(&text, std::path::Path::new("t.yaml")).expect("valid");
        let guard = HostGuard::for_config(&config);
        for i in 0..300_u32 {
            let port = 80 + i % 2;
            let vip = format!("127.77.{}.{}", i / 200, i % 200 + 1);
            assert!(
                guard.refuses(a(&format!("{vip}:{port}"))).is_some(),
                "{vip}:{port}"
            );
            assert_eq!(
                guard.refuses(a(&format!("{vip}:{}", 161 - port))),
                None,
                "{vip}, other port"
            );
        }
        assert_eq!(guard.refuses(a("127.77.1.101:80")), None, "past the last");
    }
}
