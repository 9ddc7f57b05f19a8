//! Test PKI: a CA and server or client certificates made with rcgen, written to a directory
//! that is removed on drop, and a one-shot TLS server to test clients against.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
};
use rustls::{RootCertStore, ServerConfig, server::WebPkiClientVerifier};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

/// What the one-shot server writes after a good handshake.
pub(crate) const GREETING: &[u8] = b"hello";

/// A certificate and its key, both PEM.
pub(crate) struct Leaf {
    pub(crate) cert: String,
    pub(crate) key: String,
}

/// A CA and a scratch directory.
pub(crate) struct TestPki {
    dir: PathBuf,
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl TestPki {
    /// A new CA named `name`, with an empty directory.
    pub(crate) fn new(name: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let unique = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "proxy-core-tls-{}-{unique}-{name}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("create the test PKI directory");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("test CA {name}"));
        let key = KeyPair::generate().expect("CA key");
        let ca = CertifiedIssuer::self_signed(params, key).expect("CA certificate");
        Self { dir, ca }
    }

    /// The CA certificate, PEM.
    pub(crate) fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    /// A certificate for `names` signed by this CA: a server's, or a client's when `client`;
    /// expired in 2001 when `expired`.
    pub(crate) fn leaf(&self, names: &[&str], client: bool, expired: bool) -> Leaf {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names).expect("leaf params");
        params.extended_key_usages = vec![if client {
            ExtendedKeyUsagePurpose::ClientAuth
        } else {
            ExtendedKeyUsagePurpose::ServerAuth
        }];
        if expired {
            params.not_before = rcgen::date_time_ymd(2000, 1, 1);
            params.not_after = rcgen::date_time_ymd(2001, 1, 1);
        }
        let key = KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.ca).expect("leaf certificate");
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    /// Writes `contents` to `name` in the directory; returns the path.
    pub(crate) fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, contents).expect("write a test PKI file");
        path
    }

    /// The directory's path.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A server config presenting `leaf`, requiring a client certificate signed by `client_ca`
/// (PEM) when given, offering `alpn`.
pub(crate) fn server_config(
    leaf: &Leaf,
    client_ca: Option<&str>,
    alpn: &[&[u8]],
) -> Arc<ServerConfig> {
    let provider = crate::tls::ring_provider();
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .expect("protocol versions");
    let builder = match client_ca {
        Some(pem) => {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                roots.add(cert.expect("client CA PEM")).expect("client CA");
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .expect("client verifier");
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let chain = CertificateDer::pem_slice_iter(leaf.cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .expect("server certificate PEM");
    let key = PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).expect("server key PEM");
    let mut config = builder
        .with_single_cert(chain, key)
        .expect("server certificate and key");
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

/// A TLS server on loopback that serves `connections` connections, one after the other:
/// after a good handshake it writes [`GREETING`] and closes. Returns its address.
pub(crate) async fn serve(config: Arc<ServerConfig>, connections: usize) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local address");
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    tokio::spawn(async move {
        for _ in 0..connections {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            if let Ok(mut tls) = acceptor.accept(tcp).await {
                let _ = tls.write_all(GREETING).await;
                let _ = tls.shutdown().await;
            }
        }
    });
    addr
}

/// Connects to `addr` with `settings` (host 127.0.0.1) and reads to the end: the greeting,
/// or the error chain as one line.
pub(crate) async fn exchange(
    settings: &crate::tls::TlsSettings,
    addr: SocketAddr,
) -> Result<Vec<u8>, String> {
    let tls = settings
        .client_config("127.0.0.1", &[])
        .map_err(|e| chain(&e))?;
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| chain(&e))?;
    let mut stream = tls.connect(tcp).await.map_err(|e| chain(&e))?;
    let mut read = Vec::new();
    stream.read_to_end(&mut read).await.map_err(|e| chain(&e))?;
    Ok(read)
}

/// `error: cause: cause`.
pub(crate) fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text = format!("{text}: {cause}");
        source = cause.source();
    }
    text
}
