//! What the Avro and Protobuf records' schema IDs refer to: a Confluent-compatible
//! Schema Registry (`source.schema_registry.url`), or a directory of schema files named
//! by ID (`source.schema_files`: `<id>.avsc`, `<id>.proto`).
//!
//! I/O only. A schema ID is fetched once (`GET /schemas/ids/{id}` of the Confluent API,
//! with the schemas it references, or its file) and compiled for the topic's format;
//! the answer is kept for the life of the process, because a registry never gives an
//! ID to another schema (a directory must be kept the same way: a file, once written,
//! is never changed). Decoding a record given its schema is pure (`click::wire`).
//!
//! What goes wrong is classified: a registry that does not answer, answers 5xx or
//! times out is an outage — transient, retried with backoff while consumption waits
//! (`/readyz` says so), never a dead letter; 401/403 (and other 4xx but 404) are fatal
//! (the member stops naming the setting); a 404 for the ID is the record's own fault —
//! `unknown_schema`, a dead letter — as is a schema the topic's format cannot use.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::click::{Known, Schema, WireFormat};
use crate::config::{ConfigError, Format, SchemaRegistrySettings, Settings, SourceSettings};
use crate::record::{Decoder, RegistryError, Schemas};
use crate::retry::{Retry, Stopped};
use crate::telemetry as t;

type Https = hyper_tls::HttpsConnector<HttpConnector>;

/// Where schemas come from, and the schemas it answered, by ID.
pub struct SchemaRegistry {
    origin: Origin,
    format: WireFormat,
    known: RwLock<HashMap<u32, Known>>,
}

enum Origin {
    Registry(Http),
    Files(PathBuf),
}

struct Http {
    client: Client<Https, Empty<Bytes>>,
    /// Base URL without user info or trailing slash.
    base: String,
    /// The `Authorization` header, if any.
    auth: Option<String>,
    timeout: Duration,
}

/// The answer to `GET /schemas/ids/{id}`.
#[derive(Deserialize)]
struct SchemaById {
    schema: String,
    #[serde(default, rename = "schemaType")]
    schema_type: Option<String>,
    #[serde(default)]
    references: Vec<Reference>,
}

#[derive(Deserialize)]
struct Reference {
    name: String,
    subject: String,
    version: i64,
}

/// The answer to `GET /subjects/{subject}/versions/{version}` (what a reference names).
#[derive(Deserialize)]
struct SchemaVersion {
    schema: String,
    #[serde(default)]
    references: Vec<Reference>,
}

/// References deeper than this are refused: a cycle, or no schema a producer meant.
const MAX_REFERENCES: usize = 64;

impl SchemaRegistry {
    /// The schema source `source` names for a topic of `format`.
    pub fn new(source: &SourceSettings, format: WireFormat) -> Result<SchemaRegistry, ConfigError> {
        let origin = match &source.schema_files {
            Some(dir) => Origin::Files(dir.clone()),
            None => Origin::Registry(Http::new(&source.schema_registry)?),
        };
        Ok(SchemaRegistry { origin, format, known: RwLock::new(HashMap::new()) })
    }

    pub fn format(&self) -> WireFormat {
        self.format
    }

    /// What the registry said of `id`, if it was asked.
    pub fn known(&self, id: u32) -> Option<Known> {
        self.known.read().expect("not poisoned").get(&id).cloned()
    }
}

/// The decoder every reader of these settings uses (a member, a replay, reconcile,
/// explain): these limits, this fingerprint key, this format (`source.format`) and, for
/// Avro and Protobuf, the schemas from the registry or the files `s` names.
pub fn decoder(s: &Settings) -> Result<Decoder, ConfigError> {
    let format = match s.source.format {
        Format::Json => None,
        Format::Avro => Some(WireFormat::Avro),
        Format::Protobuf => Some(WireFormat::Protobuf),
    };
    let schemas: Option<Arc<dyn Schemas>> = match format {
        Some(f) => Some(Arc::new(SchemaRegistry::new(&s.source, f)?)),
        None => None,
    };
    Ok(Decoder {
        limits: s.validation.limits(),
        fingerprints: crate::dedup::Fingerprinter::new(s.dedup.fingerprint_key.expose()),
        schemas,
    })
}

impl Schemas for SchemaRegistry {
    fn format(&self) -> WireFormat {
        SchemaRegistry::format(self)
    }

    fn known(&self, id: u32) -> Option<Known> {
        SchemaRegistry::known(self, id)
    }

    fn resolve<'a>(
        &'a self,
        ids: Vec<u32>,
        max_backoff: Duration,
        shutdown: &'a CancellationToken,
        answering: &'a (dyn Fn(bool) + Send + Sync),
    ) -> futures_util::future::BoxFuture<'a, Result<(), Stopped<RegistryError>>> {
        Box::pin(SchemaRegistry::resolve(self, ids, max_backoff, shutdown, move |outage| answering(outage.is_none())))
    }
}

impl Http {
    fn new(s: &SchemaRegistrySettings) -> Result<Http, ConfigError> {
        let shown = s.url.as_ref().map(ToString::to_string).unwrap_or_default();
        let raw = s
            .url
            .as_ref()
            .ok_or_else(|| ConfigError::Invalid("source.schema_registry.url is needed for Avro and Protobuf".into()))?;
        let mut url = url::Url::parse(raw.expose())
            .map_err(|e| ConfigError::Invalid(format!("source.schema_registry.url {shown}: {e}")))?;
        let decoded = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
        let user = (!url.username().is_empty()).then(|| decoded(url.username())).or_else(|| s.username.clone());
        let password = url.password().map(decoded).or_else(|| s.password.as_ref().map(|p| p.expose().to_string()));
        let _ = url.set_username("");
        let _ = url.set_password(None);
        let auth = user.map(|u| {
            use base64::Engine;
            let token =
                base64::engine::general_purpose::STANDARD.encode(format!("{u}:{}", password.unwrap_or_default()));
            format!("Basic {token}")
        });
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_keepalive(Some(Duration::from_secs(60)));
        http.set_connect_timeout(Some(s.timeout));
        let connector = match &s.tls_ca_file {
            Some(path) => {
                let pem = std::fs::read(path).map_err(|e| {
                    ConfigError::Invalid(format!("source.schema_registry.tls_ca_file {}: {e}", path.display()))
                })?;
                let ca = native_tls::Certificate::from_pem(&pem).map_err(|e| {
                    ConfigError::Invalid(format!(
                        "source.schema_registry.tls_ca_file {}: not a PEM certificate: {e}",
                        path.display()
                    ))
                })?;
                let tls = native_tls::TlsConnector::builder()
                    .add_root_certificate(ca)
                    .build()
                    .map_err(|e| ConfigError::Invalid(format!("source.schema_registry.tls_ca_file: {e}")))?;
                hyper_tls::HttpsConnector::from((http, tls.into()))
            }
            None => hyper_tls::HttpsConnector::new_with_connector(http),
        };
        let client = Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector);
        Ok(Http { client, base: url.as_str().trim_end_matches('/').to_string(), auth, timeout: s.timeout })
    }
}

impl SchemaRegistry {
    /// Makes sure every ID in `ids` is known, asking the registry for those that are
    /// not; an outage is waited out with backoff (reported to `on_outage`, with the
    /// error, and once it ends, with `None`). Stops on a fatal answer or a shutdown.
    pub async fn resolve(
        &self,
        ids: impl IntoIterator<Item = u32>,
        max_backoff: Duration,
        shutdown: &CancellationToken,
        mut on_outage: impl FnMut(Option<&RegistryError>),
    ) -> Result<(), Stopped<RegistryError>> {
        let mut missing: Vec<u32> = ids.into_iter().filter(|&id| self.known(id).is_none()).collect();
        missing.sort_unstable();
        missing.dedup();
        for id in missing {
            let mut retry = Retry::new(max_backoff, shutdown);
            let known = loop {
                match self.fetch(id).await {
                    Ok(known) => break known,
                    Err(e) => {
                        metrics::counter!(t::SCHEMA_REGISTRY_ERRORS).increment(1);
                        retry
                            .after(e, |e| {
                                tracing::warn!(error = %e, schema_id = id, "fetching a schema failed; retrying");
                                on_outage(Some(e));
                            })
                            .await?;
                    }
                }
            };
            if retry.failures() > 0 {
                on_outage(None);
            }
            if let Known::Unusable(why) = &known {
                tracing::warn!(schema_id = id, why, "records under this schema ID are dead letters (unknown_schema)");
            }
            metrics::counter!(t::SCHEMAS_FETCHED).increment(1);
            self.known.write().expect("not poisoned").insert(id, known);
        }
        Ok(())
    }

    /// One ID's answer: its schema compiled, or why its records cannot be read.
    async fn fetch(&self, id: u32) -> Result<Known, RegistryError> {
        match &self.origin {
            Origin::Registry(http) => http.fetch(id, self.format).await,
            Origin::Files(dir) => from_files(dir, id, self.format),
        }
    }
}

/// A schema from `<dir>/<id>.avsc` or `<dir>/<id>.proto`; a Protobuf schema imports the
/// other `.proto` files of the directory by their names.
fn from_files(dir: &Path, id: u32, format: WireFormat) -> Result<Known, RegistryError> {
    let ext = match format {
        WireFormat::Avro => "avsc",
        WireFormat::Protobuf => "proto",
    };
    let path = dir.join(format!("{id}.{ext}"));
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Known::Unusable(format!("no schema file {}", path.display())));
        }
        // A directory on a mount that hiccups is an outage like a registry's.
        Err(e) => return Err(RegistryError::Unavailable(format!("{}: {e}", path.display()))),
    };
    let mut imports = Vec::new();
    if format == WireFormat::Protobuf {
        let entries =
            std::fs::read_dir(dir).map_err(|e| RegistryError::Unavailable(format!("{}: {e}", dir.display())))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let by_id = name.strip_suffix(".proto").is_some_and(|stem| stem.bytes().all(|b| b.is_ascii_digit()));
            if name.ends_with(".proto") && !by_id {
                let text = std::fs::read_to_string(entry.path())
                    .map_err(|e| RegistryError::Unavailable(format!("{}: {e}", entry.path().display())))?;
                imports.push((name, text));
            }
        }
    }
    Ok(match Schema::compile(format, &text, &imports) {
        Ok(schema) => Known::Schema(Arc::new(schema)),
        Err(why) => Known::Unusable(why),
    })
}

impl Http {
    async fn fetch(&self, id: u32, format: WireFormat) -> Result<Known, RegistryError> {
        let Some(body) = self.get(&format!("/schemas/ids/{id}")).await? else {
            return Ok(Known::Unusable("the registry has no schema with this ID".into()));
        };
        let answer: SchemaById = serde_json::from_slice(&body)
            .map_err(|e| RegistryError::Fatal(format!("schema {id}: an answer that is not the Confluent API: {e}")))?;
        let kind = answer.schema_type.as_deref().unwrap_or("AVRO");
        if !kind.eq_ignore_ascii_case(format.schema_type()) {
            return Ok(Known::Unusable(format!("a {kind} schema, but source.format reads {}", format.schema_type())));
        }
        let mut references = Vec::new();
        let mut queue: Vec<Reference> = answer.references;
        while let Some(r) = queue.pop() {
            if references.len() >= MAX_REFERENCES {
                return Ok(Known::Unusable(format!("more than {MAX_REFERENCES} schema references")));
            }
            let path = format!("/subjects/{}/versions/{}", urlencode(&r.subject), r.version);
            let Some(body) = self.get(&path).await? else {
                return Ok(Known::Unusable(format!(
                    "its reference {} (subject {}) is not in the registry",
                    r.name, r.subject
                )));
            };
            let v: SchemaVersion = serde_json::from_slice(&body)
                .map_err(|e| RegistryError::Fatal(format!("{path}: an answer that is not the Confluent API: {e}")))?;
            if !references.iter().any(|(n, _): &(String, String)| *n == r.name) {
                references.push((r.name, v.schema));
                queue.extend(v.references);
            }
        }
        Ok(match Schema::compile(format, &answer.schema, &references) {
            Ok(schema) => Known::Schema(Arc::new(schema)),
            Err(why) => Known::Unusable(why),
        })
    }

    /// `GET base + path`: the body of a 200, `None` for a 404.
    async fn get(&self, path: &str) -> Result<Option<Bytes>, RegistryError> {
        let mut request = hyper::Request::get(format!("{}{path}", self.base))
            .header("accept", "application/vnd.schemaregistry.v1+json, application/json");
        if let Some(auth) = &self.auth {
            request = request.header("authorization", auth);
        }
        let request = request.body(Empty::new()).map_err(|e| RegistryError::Fatal(e.to_string()))?;
        let exchange = async {
            let response = self.client.request(request).await.map_err(|e| RegistryError::Unavailable(e.to_string()))?;
            let status = response.status();
            let body =
                response.into_body().collect().await.map_err(|e| RegistryError::Unavailable(e.to_string()))?.to_bytes();
            Ok::<_, RegistryError>((status, body))
        };
        let (status, body) = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| RegistryError::Unavailable(format!("no answer within {:?}", self.timeout)))??;
        let said = || String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        match status.as_u16() {
            200 => Ok(Some(body)),
            404 => Ok(None),
            401 | 403 => Err(RegistryError::Fatal(format!(
                "{path}: {status} ({}); check source.schema_registry.username and password",
                said()
            ))),
            // Overloaded, a proxy without its backend, a registry still starting.
            408 | 429 | 500..=599 => Err(RegistryError::Unavailable(format!("{path}: {status} ({})", said()))),
            _ => Err(RegistryError::Fatal(format!(
                "{path}: {status} ({}); check source.schema_registry.url (the Confluent API's base)",
                said()
            ))),
        }
    }
}

/// A subject name as one path segment.
fn urlencode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}
