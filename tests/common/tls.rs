//! A throwaway public-key infrastructure for TLS tests: a CA, a server certificate for
//! `127.0.0.1`/`localhost` and a client certificate, made in the test with rcgen (so the suite
//! needs no `openssl` binary) and written as PEM files into a temp dir.
//!
//! Every call to [`TestPki::generate`] makes a new CA, so two of them do not trust each other:
//! that is how a test gets "the wrong CA".

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// The PEM files of one CA and the two certificates it signed.
#[derive(Debug)]
pub struct TestPki {
    dir: tempfile::TempDir,
}

impl TestPki {
    /// A new CA (`ca.pem`), a server certificate and key (`server.pem`, `server.key`) with SANs
    /// `127.0.0.1` and `localhost`, and a client certificate and key (`client.pem`,
    /// `client.key`), all written into a new temp dir.
    pub fn generate() -> TestPki {
        let dir = tempfile::Builder::new()
            .prefix("keywatch-pki-")
            .tempdir()
            .expect("create a temp dir for the test PKI");

        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params
            .distinguished_name
            // A name of its own: with the same name, a certificate of another test CA would be
            // refused for a bad signature rather than, as in real life, an unknown issuer.
            .push(
                DnType::CommonName,
                format!("keywatch test CA {:016x}", fastrand::u64(..)),
            );
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_key = KeyPair::generate().expect("generate the CA key");
        let ca = CertifiedIssuer::self_signed(ca_params, ca_key).expect("self-sign the CA");
        write(dir.path(), "ca.pem", &ca.pem());

        let leaf = |names: Vec<String>, common_name: &str, usage: ExtendedKeyUsagePurpose| {
            let mut params = CertificateParams::new(names).expect("leaf params");
            params
                .distinguished_name
                .push(DnType::CommonName, common_name);
            params.is_ca = IsCa::ExplicitNoCa;
            params.key_usages = vec![
                KeyUsagePurpose::DigitalSignature,
                KeyUsagePurpose::KeyEncipherment,
            ];
            params.extended_key_usages = vec![usage];
            let key = KeyPair::generate().expect("generate a leaf key");
            let cert = params.signed_by(&key, &ca).expect("sign a leaf");
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = leaf(
            vec!["127.0.0.1".into(), "localhost".into()],
            "keywatch test server",
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        write(dir.path(), "server.pem", &server_cert);
        write(dir.path(), "server.key", &server_key);
        let (client_cert, client_key) = leaf(
            Vec::new(),
            "keywatch test client",
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        write(dir.path(), "client.pem", &client_cert);
        write(dir.path(), "client.key", &client_key);
        TestPki { dir }
    }

    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    pub fn server_cert_file(&self) -> PathBuf {
        self.dir.path().join("server.pem")
    }

    pub fn server_key_file(&self) -> PathBuf {
        self.dir.path().join("server.key")
    }

    pub fn client_cert_file(&self) -> PathBuf {
        self.dir.path().join("client.pem")
    }

    pub fn client_key_file(&self) -> PathBuf {
        self.dir.path().join("client.key")
    }

    /// The certificates as redis-rs takes them: the CA as the only root, and the client
    /// certificate (servers that do not ask for one ignore it).
    pub fn redis_certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig {
                client_cert: read(&self.client_cert_file()),
                client_key: read(&self.client_key_file()),
            }),
            root_cert: Some(read(&self.ca_file())),
        }
    }

    /// A `redis.tls` block for rule files: `{ ca_file: ..., cert_file: ..., key_file: ... }`, or
    /// with the CA alone when `client_cert` is false.
    pub fn rules_block(&self, client_cert: bool) -> String {
        let mut block = format!("{{ ca_file: \"{}\"", self.ca_file().display());
        if client_cert {
            block += &format!(
                ", cert_file: \"{}\", key_file: \"{}\"",
                self.client_cert_file().display(),
                self.client_key_file().display()
            );
        }
        block + " }"
    }
}

fn write(dir: &Path, name: &str, pem: &str) {
    let path = dir.join(name);
    std::fs::write(&path, pem).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}
