//! Client TLS towards control planes (xDS, Consul): the settings, and a rustls client config
//! built from PEM files that are read again at every connection, so rotated files are taken
//! at the next (re)connection without a restart.
//!
//! Trust comes only from the configured CA file (no system store). Errors name the file and the
//! cause, never its content: a key file's bytes never reach a message.

use std::{
    fmt, io,
    path::{Path, PathBuf},
    sync::Arc,
};

use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::{
    CertificateDer, PrivateKeyDer, ServerName,
    pem::{self, PemObject},
};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::net::TcpStream;
use tokio_rustls::{TlsConnector, client::TlsStream};

#[cfg(test)]
pub(crate) mod testing;
#[cfg(test)]
mod tests;

/// Client TLS settings of one control-plane connection.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    /// PEM file of the CA certificates the server's certificate must chain to; the only trust
    /// roots used.
    pub ca_file: PathBuf,
    /// PEM file of the client certificate chain (leaf first) for mutual TLS; needs `key_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    /// PEM file of the client's private key (PKCS#8, PKCS#1 or SEC1) for mutual TLS; needs
    /// `cert_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
    /// The name to send as SNI and to verify in the server's certificate instead of the host
    /// of the server's address (a DNS name or an IP address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
}

/// Which file of [`TlsSettings`] an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsFile {
    /// `ca_file`.
    Ca,
    /// `cert_file`.
    ClientCert,
    /// `key_file`.
    ClientKey,
}

impl fmt::Display for TlsFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Ca => "CA file",
            Self::ClientCert => "client certificate file",
            Self::ClientKey => "client key file",
        })
    }
}

/// Why a TLS client config could not be built, or a handshake failed.
#[derive(Debug, Error)]
pub enum TlsError {
    /// Only one of `cert_file` and `key_file` is set.
    #[error("tls: cert_file and key_file must be set together for mutual TLS, or both left out")]
    HalfClientCert,
    /// The server name is neither a DNS name nor an IP address.
    #[error("tls: server name {name:?} is neither a valid DNS name nor an IP address")]
    ServerName {
        /// The name.
        name: String,
    },
    /// A file could not be read.
    #[error("tls: {file} {path} cannot be read, is the path right and readable by the daemon?")]
    Read {
        /// Which file.
        file: TlsFile,
        /// Its path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A certificate file holds a broken PEM section.
    #[error("tls: {file} {path} is not valid PEM: {source}")]
    CertPem {
        /// Which file.
        file: TlsFile,
        /// Its path.
        path: PathBuf,
        /// The parser's words (certificates are public).
        #[source]
        source: pem::Error,
    },
    /// A certificate file holds no `CERTIFICATE` section.
    #[error("tls: {file} {path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")]
    NoCertificate {
        /// Which file.
        file: TlsFile,
        /// Its path.
        path: PathBuf,
    },
    /// A CA certificate is not a usable trust anchor.
    #[error("tls: CA file {path}: certificate {index} is not a usable trust anchor: {source}")]
    BadCa {
        /// The CA file.
        path: PathBuf,
        /// Position of the certificate in the file, from 0.
        index: usize,
        /// rustls's reason.
        #[source]
        source: rustls::Error,
    },
    /// The key file holds no private key, or a broken one (its content is never shown).
    #[error("tls: client key file {path} holds no usable PEM private key (PKCS#8, PKCS#1 or SEC1)")]
    NoKey {
        /// The key file.
        path: PathBuf,
    },
    /// The key is of an unsupported type or does not match the certificate.
    #[error("tls: client key file {key} does not fit the certificate in {cert}: {source}")]
    KeyMismatch {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// rustls's reason.
        #[source]
        source: rustls::Error,
    },
    /// The protocol versions of the ring provider could not be set up (a build problem).
    #[error("tls: the ring crypto provider refused the default protocol versions: {0}")]
    Provider(#[source] rustls::Error),
    /// The TLS handshake failed (wrong CA, expired certificate, wrong name, refused client
    /// certificate, ...: the cause is in the source).
    #[error("tls: handshake with {server_name} failed")]
    Handshake {
        /// The name verified.
        server_name: String,
        /// tokio-rustls's error, wrapping rustls's reason.
        #[source]
        source: io::Error,
    },
}

/// A client config built from [`TlsSettings`], and the name to verify.
#[derive(Clone, Debug)]
pub struct ClientTls {
    /// The rustls config (trust roots, client certificate, ALPN).
    pub config: Arc<ClientConfig>,
    /// The server name sent as SNI and verified in the certificate.
    pub server_name: ServerName<'static>,
}

impl TlsSettings {
    /// Checks what can be checked without reading the files: the pairing of `cert_file` and
    /// `key_file`, and the `server_name` override.
    pub fn validate(&self) -> Result<(), TlsError> {
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(TlsError::HalfClientCert);
        }
        if let Some(name) = &self.server_name {
            server_name(name)?;
        }
        Ok(())
    }

    /// Reads the files (again: call this per connection) and builds a client config for a
    /// server whose address has host `host` (used when `server_name` is unset), offering the
    /// ALPN protocols `alpn` (e.g. `h2` for gRPC).
    pub fn client_config(&self, host: &str, alpn: &[&[u8]]) -> Result<ClientTls, TlsError> {
        self.validate()?;
        let server_name = server_name(self.server_name.as_deref().unwrap_or(host))?;
        let roots = load_roots(&self.ca_file)?;
        let builder = ClientConfig::builder_with_provider(ring_provider())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Provider)?
            .with_root_certificates(roots);
        let mut config = match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => {
                let chain = load_certs(TlsFile::ClientCert, cert)?;
                let private_key = load_key(key)?;
                builder
                    .with_client_auth_cert(chain, private_key)
                    .map_err(|source| TlsError::KeyMismatch {
                        cert: cert.clone(),
                        key: key.clone(),
                        source,
                    })?
            }
            _ => builder.with_no_client_auth(),
        };
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(ClientTls {
            config: Arc::new(config),
            server_name,
        })
    }
}

impl ClientTls {
    /// Runs the TLS handshake over `tcp`.
    pub async fn connect(&self, tcp: TcpStream) -> Result<TlsStream<TcpStream>, TlsError> {
        TlsConnector::from(Arc::clone(&self.config))
            .connect(self.server_name.clone(), tcp)
            .await
            .map_err(|source| TlsError::Handshake {
                server_name: self.server_name.to_str().into_owned(),
                source,
            })
    }
}

/// rustls's ring provider: deprecated since 0.23.48 for lacking post-quantum key exchange,
/// which only the aws-lc-rs provider has, and that one needs cmake and nasm to build.
#[expect(
    deprecated,
    reason = "the ring provider is the one this project builds; see the doc comment"
)]
pub(crate) fn ring_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A DNS name or an IP address (brackets of an IPv6 URI host are removed).
fn server_name(name: &str) -> Result<ServerName<'static>, TlsError> {
    let bare = name
        .strip_prefix('[')
        .and_then(|n| n.strip_suffix(']'))
        .unwrap_or(name);
    ServerName::try_from(bare.to_owned()).map_err(|_| TlsError::ServerName {
        name: name.to_owned(),
    })
}

fn read(file: TlsFile, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        file,
        path: path.to_owned(),
        source,
    })
}

fn load_certs(file: TlsFile, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(file, path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::CertPem {
            file,
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            file,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

fn load_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for (index, cert) in load_certs(TlsFile::Ca, path)?.into_iter().enumerate() {
        roots.add(cert).map_err(|source| TlsError::BadCa {
            path: path.to_owned(),
            index,
            source,
        })?;
    }
    Ok(roots)
}

fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read(TlsFile::ClientKey, path)?;
    // The parser's error may quote a line of the file: it is dropped, not shown.
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|_| TlsError::NoKey {
        path: path.to_owned(),
    })
}
