//! A throwaway CA and certificates signed by it, as PEM files in a directory removed on drop,
//! for tests of TLS to control planes.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};

use crate::kernel::TempDir;

/// A CA with its own directory.
pub struct TestCa {
    dir: TempDir,
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl TestCa {
    /// A new CA named `name`; its certificate is written to `ca.pem`.
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("test CA {name}"));
        let key = KeyPair::generate().expect("CA key");
        let ca = CertifiedIssuer::self_signed(params, key).expect("CA certificate");
        let this = Self {
            dir: TempDir::new(),
            ca,
        };
        this.write("ca.pem", &this.ca.pem());
        this
    }

    /// `ca.pem`.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.0.join("ca.pem")
    }

    /// A certificate for `names` usable for both server and client auth, written to
    /// `<file>.pem` and `<file>-key.pem`; returns both paths.
    pub fn leaf(&self, file: &str, names: &[&str]) -> (PathBuf, PathBuf) {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names).expect("leaf params");
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.ca).expect("leaf certificate");
        (
            self.write(&format!("{file}.pem"), &cert.pem()),
            self.write(&format!("{file}-key.pem"), &key.serialize_pem()),
        )
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir.0
    }

    fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.dir.0.join(name);
        std::fs::write(&path, contents)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        path
    }
}
