//! The TLS files the settings name — a private CA, a client certificate and its key —
//! read and checked once, then kept for the life of the process.
//!
//! Validation reads them (a bad file is refused before anything starts), and every
//! client built later takes the copy read then: a file rotated or removed while a member
//! runs changes nothing until it restarts, and can never make a client panic. A new
//! certificate is picked up by a restart, as by most servers.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// The PEM contents of one section's TLS files.
#[derive(Debug)]
pub struct TlsFiles {
    /// The CA that signed the server's certificate, if not a public one.
    pub ca: Option<Vec<u8>>,
    /// The client certificate and its PKCS#8 private key, for servers that verify clients.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

type Key = (Option<PathBuf>, Option<PathBuf>, Option<PathBuf>);

fn loaded() -> &'static Mutex<HashMap<Key, Arc<TlsFiles>>> {
    static LOADED: OnceLock<Mutex<HashMap<Key, Arc<TlsFiles>>>> = OnceLock::new();
    LOADED.get_or_init(Default::default)
}

/// The files of `section` (`redis`, `clickhouse`): `ca`, and `cert` with `key`; read
/// and checked the first time, the same copy every later time. The error names the
/// setting (`<section>.tls_ca_file`, …) and the file.
pub fn load(
    section: &str,
    ca: Option<&Path>,
    cert: Option<&Path>,
    key: Option<&Path>,
) -> Result<Arc<TlsFiles>, String> {
    let k: Key = (ca.map(Path::to_path_buf), cert.map(Path::to_path_buf), key.map(Path::to_path_buf));
    if let Some(files) = loaded().lock().expect("not poisoned").get(&k) {
        return Ok(files.clone());
    }
    let read = |setting: &str, path: &Path| {
        std::fs::read(path).map_err(|e| format!("{section}.{setting} {}: {e}", path.display()))
    };
    let ca = match ca {
        Some(path) => {
            let pem = read("tls_ca_file", path)?;
            native_tls::Certificate::from_pem(&pem)
                .map_err(|e| format!("{section}.tls_ca_file {} is not a PEM certificate: {e}", path.display()))?;
            Some(pem)
        }
        None => None,
    };
    let identity = match (cert, key) {
        (Some(cert), Some(key)) => {
            let (cert_pem, key_pem) = (read("tls_cert_file", cert)?, read("tls_key_file", key)?);
            native_tls::Identity::from_pkcs8(&cert_pem, &key_pem).map_err(|e| {
                format!(
                    "{section}.tls_cert_file {} and {section}.tls_key_file {} are not a PEM certificate and its \
                     PKCS#8 key (BEGIN PRIVATE KEY; convert with `openssl pkcs8 -topk8 -nocrypt`): {e}",
                    cert.display(),
                    key.display()
                )
            })?;
            Some((cert_pem, key_pem))
        }
        (None, None) => None,
        _ => {
            return Err(format!("{section}.tls_cert_file and {section}.tls_key_file go together: set both or neither"))
        }
    };
    let files = Arc::new(TlsFiles { ca, identity });
    loaded().lock().expect("not poisoned").insert(k, files.clone());
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_read_once_and_a_file_removed_later_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        // Any PEM certificate will do; a self-signed one made by the test's openssl is
        // not needed, since native-tls only parses it here.
        std::fs::write(&ca, include_str!("../../tests/fixtures/tls/ca.pem")).unwrap();
        let first = load("clickhouse", Some(&ca), None, None).unwrap();
        std::fs::remove_file(&ca).unwrap();
        let again = load("clickhouse", Some(&ca), None, None).expect("the copy read at start");
        assert!(Arc::ptr_eq(&first, &again));
    }

    #[test]
    fn bad_files_name_the_setting() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let e = load("redis", Some(&missing), None, None).unwrap_err();
        assert!(e.starts_with("redis.tls_ca_file"), "{e}");
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not a certificate").unwrap();
        let e = load("clickhouse", Some(&junk), None, None).unwrap_err();
        assert!(e.contains("is not a PEM certificate"), "{e}");
        let e = load("redis", None, Some(&junk), None).unwrap_err();
        assert!(e.contains("go together"), "{e}");
        let e = load("redis", None, Some(&junk), Some(&junk)).unwrap_err();
        assert!(e.contains("PKCS#8"), "{e}");
    }
}
