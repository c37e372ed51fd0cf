//! The schema registry `scripts/stack up` runs (Apicurio Registry, through its
//! Confluent-compatible API): schemas are registered as a producer's serializer would,
//! and the records carry the IDs the registry gave them.

use std::net::TcpStream;
use std::time::Duration;

use clickagg::produce::{schema_text, Encoding};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The Confluent API's base URL: `CLICKAGG_STACK_REGISTRY_URL`, or `scripts/stack`'s
/// default. (Not `CLICKAGG__SOURCE__SCHEMA_REGISTRY__URL`: the members inherit the
/// environment, and the schema-file tests must not get a registry as well.)
pub fn registry_url() -> String {
    std::env::var("CLICKAGG_STACK_REGISTRY_URL").unwrap_or_else(|_| "http://127.0.0.1:18081/apis/ccompat/v7".into())
}

/// `host:port` and the base path of [`registry_url`].
fn parts() -> (String, String) {
    let url = url::Url::parse(&registry_url()).expect("CLICKAGG_STACK_REGISTRY_URL is a URL");
    let addr = format!("{}:{}", url.host_str().unwrap(), url.port_or_known_default().unwrap());
    (addr, url.path().trim_end_matches('/').to_string())
}

/// Panics (fails the test) unless the registry accepts connections.
pub fn require_registry() {
    let (addr, _) = parts();
    let ok = addr.parse().ok().and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(3)).ok()).is_some();
    assert!(ok, "the schema registry is not reachable at {addr}: start the services with `scripts/stack up`");
}

/// Registers the generator's schema of `e` under `subject` (a new version when the
/// subject has another) and returns the ID the registry gave it. The ID inside `e` is
/// ignored.
pub async fn register(subject: &str, e: Encoding) -> u32 {
    let (_, text) = schema_text(e).expect("an Avro or Protobuf encoding");
    let mut body = serde_json::json!({ "schema": text });
    if matches!(e, Encoding::Protobuf { .. }) {
        body["schemaType"] = "PROTOBUF".into();
    }
    let path = format!("/subjects/{subject}/versions");
    let (status, answer) = post(&path, &body.to_string()).await;
    assert_eq!(status, 200, "POST {path}: {answer}");
    let answer: serde_json::Value = serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{answer}: {e}"));
    answer["id"].as_u64().unwrap_or_else(|| panic!("no id in {answer}")) as u32
}

/// POST a Confluent API request: (status, body). HTTP/1.0, so the body ends where the
/// server closes the connection.
async fn post(path: &str, body: &str) -> (u16, String) {
    let (addr, base) = parts();
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(&addr).await?;
        let request = format!(
            "POST {base}{path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/vnd.schemaregistry.v1+json\r\n\
             Accept: application/vnd.schemaregistry.v1+json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(request.as_bytes()).await?;
        let mut resp = Vec::new();
        s.read_to_end(&mut resp).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&resp).into_owned())
    };
    let resp = tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .unwrap_or_else(|_| panic!("POST {addr}{base}{path}: no answer within 30 s"))
        .unwrap_or_else(|e| panic!("POST {addr}{base}{path}: {e}"));
    let status: u16 = resp.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("an HTTP status line");
    let body = resp.split_once("\r\n\r\n").map(|x| x.1.to_string()).unwrap_or_default();
    (status, body)
}
