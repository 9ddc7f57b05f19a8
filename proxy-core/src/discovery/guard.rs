//! Host addresses no source may hand the data path, whatever it is (a static list, DNS, Consul,
//! EDS): the unspecified address, broadcast, multicast, port 0, and the daemon's own listener and
//! admin addresses (a connect there would loop, or reach the admin interface from the cgroup).
//! Refused hosts are left out of the cluster, logged once per change, and counted in the
//! cluster's `hosts_refused` gauge; the others are used.

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use crate::discovery::HostSet;

/// An IPv4-mapped IPv6 address as its IPv4 address.
fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        IpAddr::V4(_) => ip,
    }
}

/// What a cluster refuses besides the address kinds that are never a host.
#[derive(Clone, Debug, Default)]
pub struct HostGuard {
    own: Arc<[SocketAddr]>,
}

impl HostGuard {
    /// Refuses also `own`: the daemon's listeners and admin address (an unspecified address
    /// stands for every local one, and then covers loopback).
    #[must_use]
    pub fn new(own: Vec<SocketAddr>) -> Self {
        Self { own: own.into() }
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
    use crate::discovery::Host;

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
            "169.254.10.1:80",
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
}
