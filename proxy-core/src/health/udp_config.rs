//! `udp_health_check`: this daemon's UDP checker (Envoy has none), a payload or a DNS query,
//! spelled as the TCP checker spells its payloads.

use serde::{Deserialize, Serialize};

use super::{
    config::{HealthConfigError, Payload, decode_hex},
    spec::{DnsProbe, UdpSpec},
    udp,
};

/// A UDP check: exactly one of `send` (with optional `receive` blocks) and `dns`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UdpHealthCheck {
    /// The datagram sent (hex, as the TCP checker spells it; may be empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub send: Option<Payload>,
    /// Blocks that must each appear, in order, in one reply; empty means any reply.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub receive: Vec<Payload>,
    /// A DNS query instead of a payload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<DnsHealthCheck>,
}

/// `udp_health_check.dns`: the question, and the RCODE a healthy server answers with.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DnsHealthCheck {
    /// The name asked for; required.
    #[serde(default)]
    pub name: String,
    /// `A` (default), `AAAA`, `CNAME`, `MX`, `NS`, `PTR`, `SOA`, `SRV` or `TXT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_type: Option<String>,
    /// `NOERROR` (default), `NXDOMAIN`, `SERVFAIL`, `REFUSED`, `FORMERR` or `NOTIMP`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_rcode: Option<String>,
}

impl UdpHealthCheck {
    pub(super) fn validate(&self) -> Result<UdpSpec, HealthConfigError> {
        let forms = usize::from(self.send.is_some()) + usize::from(self.dns.is_some());
        if forms != 1 {
            return Err(HealthConfigError::UdpForm(forms));
        }
        let Some(dns) = &self.dns else {
            let send = self.send.as_ref().map_or("", |p| p.text.as_str());
            return Ok(UdpSpec::Payload {
                send: decode_hex(send, "udp_health_check.send.text")?,
                receive: self
                    .receive
                    .iter()
                    .map(|p| decode_hex(&p.text, "udp_health_check.receive.text"))
                    .collect::<Result<_, _>>()?,
            });
        };
        if !self.receive.is_empty() {
            return Err(HealthConfigError::UdpReceiveWithDns);
        }
        let qname = udp::dns_qname(&dns.name).map_err(|reason| HealthConfigError::BadDnsName {
            name: dns.name.clone(),
            reason,
        })?;
        let qtype = one_of(
            "udp_health_check.dns.query_type",
            dns.query_type.as_deref().unwrap_or("A"),
            udp::QUERY_TYPES,
        )?;
        let rcode = one_of(
            "udp_health_check.dns.expected_rcode",
            dns.expected_rcode.as_deref().unwrap_or("NOERROR"),
            udp::RCODES,
        )?;
        Ok(UdpSpec::Dns(DnsProbe {
            qname,
            qtype,
            rcode,
        }))
    }
}

/// The value named `value` in `table` (names compared ignoring ASCII case).
fn one_of<T: Copy>(
    field: &'static str,
    value: &str,
    table: &[(&str, T)],
) -> Result<T, HealthConfigError> {
    table
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(value))
        .map(|(_, v)| *v)
        .ok_or_else(|| HealthConfigError::NotOneOf {
            field,
            value: value.to_owned(),
            allowed: table
                .iter()
                .map(|(name, _)| *name)
                .collect::<Vec<_>>()
                .join(", "),
        })
}
