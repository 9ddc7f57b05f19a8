//! Configuration of the proxy path: listener addresses, how original destinations are found,
//! draining, shutdown and HTTP options. The daemon configuration's `proxy:` section; every field
//! has a named default. ORIGINAL_DST settings (`cleanup_interval`,
//! `original_dst_lb_config.use_http_header`) are set on the ORIGINAL_DST cluster, as in Envoy.

use std::{net::SocketAddr, num::NonZeroUsize, time::Duration};

use serde::{Deserialize, Serialize};

use crate::config::duration;

/// Named defaults.
pub mod defaults {
    use std::{net::SocketAddr, time::Duration};

    /// The listeners connect4/6 redirect to: loopback, port 15001, one per family.
    pub fn listeners() -> Vec<SocketAddr> {
        vec![
            SocketAddr::from(([127, 0, 0, 1], 15001)),
            SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, 15001)),
        ]
    }

    /// Envoy's ORIGINAL_DST `cleanup_interval` default: 5000 ms.
    pub fn cleanup_interval() -> Duration {
        Duration::from_millis(5000)
    }

    /// How long connections to a removed host may go on.
    pub fn drain_timeout() -> Duration {
        Duration::from_secs(30)
    }

    /// How long a graceful shutdown waits for open connections.
    pub fn shutdown_timeout() -> Duration {
        Duration::from_secs(30)
    }

    /// Upstream connect timeout (Consul's compiled default `ConnectTimeout`).
    pub fn connect_timeout() -> Duration {
        Duration::from_secs(5)
    }

    /// How long an idle pooled HTTP connection to a cluster host is kept.
    pub fn pool_idle_timeout() -> Duration {
        Duration::from_secs(60)
    }

    /// How long an epoll engine thread must have slept for it to give way once on waking
    /// (`proxy.yield_after_idle`): 50 us. Below it the proxy is busy and its wakeups are best
    /// run at once; see ARCHITECTURE.md, "The epoll engine".
    pub fn yield_after_idle() -> Duration {
        Duration::from_micros(50)
    }

    /// How long a PROXY protocol header may take to arrive (Envoy waits for it without a
    /// separate limit; a bound keeps idle sockets from piling up).
    pub fn proxy_protocol_timeout() -> Duration {
        Duration::from_secs(5)
    }
}

/// The proxy path's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyConfig {
    /// Addresses the proxy listens on. connect4/6 redirect proxy-mode connections here (one per
    /// family: the first IPv4 and the first IPv6 address are published to the kernel).
    #[serde(default = "defaults::listeners")]
    pub listeners: Vec<SocketAddr>,
    /// Also accept connections redirected by iptables `REDIRECT`: when the kernel map has no
    /// entry, ask the socket for `SO_ORIGINAL_DST` / `IP6T_SO_ORIGINAL_DST`. Off by default.
    #[serde(default)]
    pub iptables_redirect: bool,
    /// Expect a PROXY protocol header on connections from `proxy_protocol_trusted_sources`,
    /// which then carries the original destination: `off` (default), `v1`, `v2` or `any`. A
    /// connection from a trusted source without a valid header is refused; one from any other
    /// peer is served only if the kernel (or NAT) recorded its destination, as without this.
    #[serde(default)]
    pub proxy_protocol: ProxyProtocolMode,
    /// The peers whose PROXY protocol headers are believed (addresses or CIDRs, e.g. the load
    /// balancer in front). Required with `proxy_protocol`: a header names where the daemon
    /// connects, so a peer that may send one, a local process included, could make it connect
    /// anywhere. Loopback is not trusted unless listed.
    #[serde(default)]
    pub proxy_protocol_trusted_sources: Vec<Cidr>,
    /// Time a PROXY protocol header may take to arrive. Default 5 s.
    #[serde(default = "defaults::proxy_protocol_timeout", with = "duration")]
    pub proxy_protocol_timeout: Duration,
    /// When STRICT_DNS or EDS removes a host, connections to it may go on for this long, then
    /// they are closed (LOGICAL_DNS never drains). Default 30 s.
    #[serde(default = "defaults::drain_timeout", with = "duration")]
    pub drain_timeout: Duration,
    /// Graceful shutdown: after the listeners close, open connections get this long to finish.
    /// Default 30 s.
    #[serde(default = "defaults::shutdown_timeout", with = "duration")]
    pub shutdown_timeout: Duration,
    /// ORIGINAL_DST: hosts unused for this long are flushed, with their pooled connections.
    /// Default 5000 ms (Envoy's). Not read from the `proxy:` section: the daemon takes it from
    /// the ORIGINAL_DST cluster's `cleanup_interval`.
    #[serde(skip, default = "defaults::cleanup_interval")]
    pub cleanup_interval: Duration,
    /// ORIGINAL_DST over HTTP: take the destination from `x-envoy-original-dst-host` when a
    /// request carries it (not sanitised, as in Envoy: enable only for trusted clients). Not
    /// read from the `proxy:` section: the daemon takes it from the ORIGINAL_DST cluster's
    /// `original_dst_lb_config.use_http_header`.
    #[serde(skip)]
    pub use_http_header: bool,
    /// Close a connection as soon as its host fails health checking or is ejected (tcp only,
    /// like Envoy's `close_connections_on_host_health_failure`). Default false.
    #[serde(default)]
    pub close_connections_on_host_health_failure: bool,
    /// Upstream connect timeout, for a cluster without its own `connect_timeout`. Default 5 s.
    #[serde(default = "defaults::connect_timeout", with = "duration")]
    pub connect_timeout: Duration,
    /// ORIGINAL_DST: the ORIGINAL_DST cluster's `connect_timeout`, when it has one. Not read
    /// from the `proxy:` section.
    #[serde(skip)]
    pub original_dst_connect_timeout: Option<Duration>,
    /// Idle pooled HTTP connections to cluster hosts are closed after this long. Default 60 s.
    #[serde(default = "defaults::pool_idle_timeout", with = "duration")]
    pub pool_idle_timeout: Duration,
    /// How bytes move once both sockets of a TCP connection are connected: `copy` (userspace
    /// copy loop, default) or `kernel` (hand the pair to the kernel's proxy-pair splicing, with
    /// the copy loop as the fallback when the kernel refuses a pair; HTTP is always copied).
    #[serde(default)]
    pub splice: SpliceMode,
    /// What runs plain TCP connections (`splice: copy`, no PROXY protocol): `epoll` (default;
    /// the proxy's own event loop, one thread per `--concurrency`, each with its own
    /// `SO_REUSEPORT` socket per listener) or `tokio` (a task per connection on the daemon's
    /// runtime). HTTP, PROXY protocol and `splice: kernel` always run on tokio.
    #[serde(default)]
    pub event_loop: EventLoop,
    /// An epoll engine thread that slept at least this long in `epoll_wait` yields its CPU
    /// once before it handles what woke it, so that the task that woke it (usually a client or
    /// backend about to wait for an answer) finishes first and the rest of the exchange stays
    /// on one CPU instead of waking an idle one. Default 50 us; `0s` turns it off. A yield
    /// that is not given back within 200 us (another task keeps the CPU busy) stops the
    /// yielding for a second.
    #[serde(default = "defaults::yield_after_idle", with = "duration")]
    pub yield_after_idle: Duration,
    /// Threads of the epoll engine; `None` (default): one per CPU the process may run on. Not
    /// read from the `proxy:` section: the daemon takes it from `--concurrency`.
    #[serde(skip)]
    pub engine_threads: Option<NonZeroUsize>,
    /// The cluster for connections whose original destination is not a service (those that
    /// iptables `REDIRECT` or a PROXY header brought): typically an ORIGINAL_DST cluster. Unset:
    /// they are refused and counted `downstream_cx_no_route`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_cluster: Option<String>,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            listeners: defaults::listeners(),
            iptables_redirect: false,
            proxy_protocol: ProxyProtocolMode::Off,
            proxy_protocol_timeout: defaults::proxy_protocol_timeout(),
            proxy_protocol_trusted_sources: Vec::new(),
            drain_timeout: defaults::drain_timeout(),
            shutdown_timeout: defaults::shutdown_timeout(),
            cleanup_interval: defaults::cleanup_interval(),
            use_http_header: false,
            close_connections_on_host_health_failure: false,
            connect_timeout: defaults::connect_timeout(),
            original_dst_connect_timeout: None,
            pool_idle_timeout: defaults::pool_idle_timeout(),
            splice: SpliceMode::Copy,
            event_loop: EventLoop::Epoll,
            yield_after_idle: defaults::yield_after_idle(),
            engine_threads: None,
            fallback_cluster: None,
        }
    }
}

impl ProxyConfig {
    /// The PROXY protocol's sources and timeout are set only with `proxy_protocol` on: off, no
    /// header is read, and they would do nothing.
    pub(super) fn validate_unread(&self) -> Result<(), super::error::Invalid> {
        if self.proxy_protocol != ProxyProtocolMode::Off {
            return Ok(());
        }
        let field = if !self.proxy_protocol_trusted_sources.is_empty() {
            "proxy.proxy_protocol_trusted_sources"
        } else if self.proxy_protocol_timeout != defaults::proxy_protocol_timeout() {
            "proxy.proxy_protocol_timeout"
        } else {
            return Ok(());
        };
        Err(super::error::Invalid::new(
            field,
            "applies with proxy.proxy_protocol, which is off (no PROXY header is read); set \
             proxy_protocol or remove it",
        ))
    }
}

/// Which PROXY protocol versions the listener requires.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProxyProtocolMode {
    /// No header is read.
    #[default]
    Off,
    /// The text header (`PROXY TCP4 ...\r\n`).
    V1,
    /// The binary header.
    V2,
    /// Either.
    Any,
}

/// An address range: `10.0.0.0/8`, `2001:db8::/32`, or one address (`192.0.2.7`). An IPv4
/// range also holds the IPv4-mapped IPv6 form of its addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: std::net::IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Whether `ip` is in the range.
    #[must_use]
    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        use std::net::IpAddr;
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 @ IpAddr::V4(_) => v4,
        };
        let keep = |bits: u32| -> u128 {
            if self.prefix == 0 {
                0
            } else {
                u128::MAX << (bits - u32::from(self.prefix))
            }
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = keep(32);
                (u128::from(u32::from(net)) & mask) == (u128::from(u32::from(ip)) & mask)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = keep(128);
                (u128::from(net) & mask) == (u128::from(ip) & mask)
            }
            _ => false,
        }
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (addr, prefix) = match s.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (s, None),
        };
        let addr: std::net::IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?} is not an address or CIDR (e.g. 10.0.0.0/8)"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{s:?}: the prefix length must be 0-{max}"))?,
        };
        Ok(Self { addr, prefix })
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// How bytes move between a client and its upstream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpliceMode {
    /// The userspace copy loop.
    #[default]
    Copy,
    /// Kernel splicing of the client/upstream pair.
    Kernel,
}

/// What runs plain TCP connections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventLoop {
    /// The proxy's epoll engine.
    #[default]
    Epoll,
    /// A tokio task per connection.
    Tokio,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Trusted sources or a header timeout with the PROXY protocol off were accepted and did
    /// nothing: each is refused at its line.
    #[test]
    fn proxy_protocol_settings_without_the_protocol_are_refused() {
        let parse = |text: &str| crate::config::Config::parse(text, std::path::Path::new("t.yaml"));
        for field in [
            "proxy_protocol_trusted_sources: [10.0.0.0/8]",
            "proxy_protocol_timeout: 2s",
        ] {
            let err = parse(&format!("proxy:\n  {field}\n")).expect_err(field);
            let name = field.split(':').next().unwrap_or_default();
            assert_eq!(err.field(), Some(format!("proxy.{name}").as_str()), "{err}");
            assert!(err.to_string().contains("which is off"), "{err}");
            let on = format!("proxy:\n  proxy_protocol: v1\n  {field}\n");
            let trusted = "  proxy_protocol_trusted_sources: [192.0.2.1]\n";
            let on = if name.ends_with("sources") {
                on
            } else {
                format!("{on}{trusted}")
            };
            parse(&on).expect(&on);
        }
    }

    #[test]
    fn defaults_and_strictness() {
        let c: ProxyConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(c, ProxyConfig::default());
        assert_eq!(c.cleanup_interval, Duration::from_millis(5000));
        let text =
            r#"{"drain_timeout": "250ms", "proxy_protocol": "v2", "listeners": ["127.0.0.1:1"]}"#;
        let c: ProxyConfig = serde_json::from_str(text).unwrap();
        assert_eq!(c.drain_timeout, Duration::from_millis(250));
        assert_eq!(c.proxy_protocol, ProxyProtocolMode::V2);
        assert_eq!(c.event_loop, EventLoop::Epoll);
        let tokio: ProxyConfig = serde_json::from_str(r#"{"event_loop": "tokio"}"#).unwrap();
        assert_eq!(tokio.event_loop, EventLoop::Tokio);
        assert!(serde_json::from_str::<ProxyConfig>(r#"{"event_loop": "uring"}"#).is_err());
        assert_eq!(c.yield_after_idle, Duration::from_micros(50));
        let off: ProxyConfig = serde_json::from_str(r#"{"yield_after_idle": "0s"}"#).unwrap();
        assert_eq!(off.yield_after_idle, Duration::ZERO);
        let ms: ProxyConfig = serde_json::from_str(r#"{"yield_after_idle": "1ms"}"#).unwrap();
        assert_eq!(ms.yield_after_idle, Duration::from_millis(1));
        let us = serde_json::to_value(ProxyConfig::default()).unwrap();
        assert_eq!(
            us["yield_after_idle"], "0.000050s",
            "written back in Envoy's form"
        );
        let err = serde_json::from_str::<ProxyConfig>(r#"{"yield_after_idle": "50us"}"#);
        let err = err.unwrap_err().to_string();
        assert!(err.contains("expected a duration such as"), "{err}");
        assert_eq!(c.listeners, vec![SocketAddr::from(([127, 0, 0, 1], 1))]);
        let err = serde_json::from_str::<ProxyConfig>(r#"{"drain_timeoutt": "1s"}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
        // ORIGINAL_DST settings belong to the cluster, as in Envoy.
        let err = serde_json::from_str::<ProxyConfig>(r#"{"cleanup_interval": "1s"}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
    }

    #[test]
    fn cidrs_parse_and_match_both_families() {
        let net: Cidr = "10.1.0.0/16".parse().unwrap();
        assert!(net.contains("10.1.2.3".parse().unwrap()));
        assert!(
            net.contains("::ffff:10.1.2.3".parse().unwrap()),
            "IPv4-mapped"
        );
        assert!(!net.contains("10.2.0.1".parse().unwrap()));
        assert!(!net.contains("::1".parse().unwrap()));
        let one: Cidr = "192.0.2.7".parse().unwrap();
        assert!(one.contains("192.0.2.7".parse().unwrap()));
        assert!(!one.contains("192.0.2.8".parse().unwrap()));
        let v6: Cidr = "2001:db8::/32".parse().unwrap();
        assert!(v6.contains("2001:db8:1::9".parse().unwrap()));
        assert!(!v6.contains("2001:db9::1".parse().unwrap()));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("203.0.113.1".parse().unwrap()));
        for bad in ["10.0.0.0/33", "::/129", "ten/8", "10.0.0.0/x", ""] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
        assert_eq!(net.to_string(), "10.1.0.0/16");
    }
}
