//! Envoy's `transport_socket` of a STATIC cluster that an xDS config source names
//! (`envoy_grpc.cluster_name`, REST `cluster_names`): `envoy.transport_sockets.tls` with an
//! `UpstreamTlsContext` of files, reduced to [`TlsSettings`]. Accepted only there: the data
//! path does not speak TLS, so anywhere else it would be accepted without effect.

use serde::{Deserialize, Serialize};

use super::DataSource;
use crate::tls::TlsSettings;

/// The only transport socket accepted.
pub const TLS_SOCKET: &str = "envoy.transport_sockets.tls";
/// The only `typed_config` type accepted.
pub const UPSTREAM_TLS_CONTEXT: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext";

/// Envoy's `config.core.v3.TransportSocket`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TransportSocket {
    /// Must be `envoy.transport_sockets.tls`.
    pub name: String,
    /// The TLS context.
    pub typed_config: UpstreamTlsContext,
}

/// Envoy's `UpstreamTlsContext` subset: files and the SNI.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamTlsContext {
    /// Must be the `UpstreamTlsContext` type URL.
    #[serde(rename = "@type")]
    pub type_url: String,
    /// Certificates and trust.
    pub common_tls_context: CommonTlsContext,
    /// The name sent as SNI and verified in the server's certificate; default: the host of
    /// the cluster's address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sni: Option<String>,
}

/// Envoy's `CommonTlsContext` subset.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CommonTlsContext {
    /// At most one client certificate, for mutual TLS.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tls_certificates: Vec<TlsCertificate>,
    /// How the server's certificate is verified: required (no system trust store is used).
    pub validation_context: CertificateValidationContext,
}

/// Envoy's `TlsCertificate` subset.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TlsCertificate {
    /// PEM certificate chain.
    pub certificate_chain: DataSource,
    /// PEM private key.
    pub private_key: DataSource,
}

/// Envoy's `CertificateValidationContext` subset.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CertificateValidationContext {
    /// PEM CA certificates the server's certificate must chain to.
    pub trusted_ca: DataSource,
}

impl TransportSocket {
    /// The TLS settings, or why the socket is not one this daemon speaks.
    pub fn settings(&self) -> Result<TlsSettings, String> {
        if self.name != TLS_SOCKET {
            return Err(format!(
                "transport_socket.name {:?} is not supported, only {TLS_SOCKET}",
                self.name
            ));
        }
        let context = &self.typed_config;
        if context.type_url != UPSTREAM_TLS_CONTEXT {
            return Err(format!(
                "transport_socket.typed_config must be an {UPSTREAM_TLS_CONTEXT}, not {:?}",
                context.type_url
            ));
        }
        let common = &context.common_tls_context;
        let certificate = match common.tls_certificates.as_slice() {
            [] => None,
            [one] => Some(one),
            _ => return Err("transport_socket: at most one tls_certificates entry".into()),
        };
        let settings = TlsSettings {
            ca_file: common.validation_context.trusted_ca.filename.clone(),
            cert_file: certificate.map(|c| c.certificate_chain.filename.clone()),
            key_file: certificate.map(|c| c.private_key.filename.clone()),
            server_name: context.sni.clone(),
        };
        settings.validate().map_err(|e| e.to_string())?;
        Ok(settings)
    }
}
