//! Secrets: values that are never printed, never serialized in clear, and never quoted
//! in an error — passwords, keys, and URLs that may carry credentials.

use std::fmt;

use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A secret value: never printed, never serialized in clear.
#[derive(Clone)]
pub struct Secret(SecretString);

impl Secret {
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(SecretString::from(s.into()))
    }

    /// The only way to read the value: at the call that hands it to a client library.
    pub fn expose(&self) -> &str {
        self.0.expose_secret()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("[redacted]")
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Environment values that look like numbers or booleans (`PASSWORD=12345`)
        // arrive typed; a secret is whatever text was written.
        struct Text;
        impl serde::de::Visitor<'_> for Text {
            type Value = String;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<String, E> {
                Ok(v.to_string())
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<String, E> {
                Ok(v.to_string())
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<String, E> {
                Ok(v.to_string())
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<String, E> {
                Ok(v.to_string())
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<String, E> {
                Ok(v.to_string())
            }
        }
        d.deserialize_any(Text).map(Secret::new)
    }
}

/// A URL that may carry secrets: a password in its user info (`redis://user:pass@host`),
/// in a query parameter (`?password=`, `?token=`) or in a fragment. Displayed, logged and
/// serialized with all of them replaced by `[redacted]` ([`redact_url`]).
#[derive(Clone)]
pub struct SecretUrl(Secret);

impl SecretUrl {
    pub fn new(s: impl Into<String>) -> SecretUrl {
        SecretUrl(Secret::new(s))
    }

    pub fn expose(&self) -> &str {
        self.0.expose()
    }

    /// The URL as it may be shown: see [`redact_url`]. A comma-separated list (the seed
    /// nodes of a Redis Cluster) is redacted URL by URL.
    pub fn redacted(&self) -> String {
        self.expose().split(',').map(|u| redact_url(u.trim())).collect::<Vec<_>>().join(",")
    }

    /// The URLs of a comma-separated list (one URL: itself).
    pub fn list(&self) -> Vec<&str> {
        self.expose().split(',').map(str::trim).filter(|u| !u.is_empty()).collect()
    }
}

/// `url` with the password of its user info, the value of every query parameter and its
/// fragment replaced by `[redacted]`. What stays shows where a client connects and which
/// parameters are set: scheme, user name, host, port, path, parameter names. A query
/// parameter without `=` could be a bare token, so it is replaced whole.
pub fn redact_url(url: &str) -> String {
    // Unparseable: show nothing of it rather than risk printing a secret.
    let Ok(mut u) = url::Url::parse(url) else { return "[unparseable URL redacted]".to_string() };
    if u.password().is_some() && u.set_password(Some("[redacted]")).is_err() {
        return "[URL redacted]".to_string();
    }
    if let Some(query) = u.query() {
        let redacted: Vec<String> = query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| match p.split_once('=') {
                Some((name, _)) => format!("{name}=[redacted]"),
                None => "[redacted]".to_string(),
            })
            .collect();
        u.set_query(Some(&redacted.join("&")));
    }
    if u.fragment().is_some() {
        u.set_fragment(Some("[redacted]"));
    }
    u.to_string()
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl Serialize for SecretUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.redacted())
    }
}

impl<'de> Deserialize<'de> for SecretUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(SecretUrl::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_seed_node_url_is_redacted() {
        let url = SecretUrl::new("redis://:pw1-hunter2@a:7001/,redis://u:pw2-hunter2@b:7002/?token=t-hunter2");
        let shown = url.to_string();
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("a:7001") && shown.contains("u:%5Bredacted%5D@b:7002"), "{shown}");
    }

    #[test]
    fn query_values_and_unparseable_urls_are_redacted() {
        assert_eq!(redact_url("http://h/?bare-hunter2&x=1"), "http://h/?[redacted]&x=[redacted]");
        assert_eq!(redact_url("not a url hunter2"), "[unparseable URL redacted]");
    }
}
