//! A minimal HTTP/1.0 GET for the member's `/metrics`, `/livez` and `/readyz`, and the
//! Prometheus text reader the tests share.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// GET `path` from `addr`: (status, body). HTTP/1.0 so the body is never chunked and
/// ends where the server closes the connection.
pub async fn http_get(addr: &str, path: &str) -> (u16, String) {
    let exchange = async {
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).await?;
        let mut resp = Vec::new();
        s.read_to_end(&mut resp).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&resp).into_owned())
    };
    let resp = tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .unwrap_or_else(|_| panic!("GET {addr}{path}: no answer within 10 s"))
        .unwrap_or_else(|e| panic!("GET {addr}{path}: {e}"));
    let status: u16 = resp.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("an HTTP status line");
    let body = resp.split_once("\r\n\r\n").map(|x| x.1.to_string()).unwrap_or_default();
    (status, body)
}

/// The value of a metric line (`name{labels} value`) summed over label sets that
/// contain every `label_filter`.
pub fn metric_value(body: &str, name: &str, label_filter: &[&str]) -> f64 {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && matches!(l.as_bytes().get(name.len()), Some(b' ') | Some(b'{')))
        .filter(|l| label_filter.iter().all(|f| l.contains(f)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
