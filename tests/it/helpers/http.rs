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
/// contain every `label_filter`. Panics, naming the metrics there are, when no series
/// matches: a renamed metric or label must fail the test, not read as 0 (the product
/// exports every counter at 0 from the start).
pub fn metric_value(body: &str, name: &str, label_filter: &[&str]) -> f64 {
    series_sum(body, name, label_filter).unwrap_or_else(|| {
        let mut names: Vec<&str> = body
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| l.split(['{', ' ']).next())
            .collect();
        names.dedup();
        panic!("no series {name} with labels {label_filter:?} in /metrics; its metrics are: {}", names.join(", "))
    })
}

/// The sum over the matching series; `None` when there is none.
fn series_sum(body: &str, name: &str, label_filter: &[&str]) -> Option<f64> {
    let values: Vec<f64> = body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && matches!(l.as_bytes().get(name.len()), Some(b' ') | Some(b'{')))
        .filter(|l| label_filter.iter().all(|f| l.contains(f)))
        .map(|l| {
            let v = l.rsplit(' ').next().unwrap_or_default();
            v.parse::<f64>().unwrap_or_else(|_| panic!("metric line {l:?}: {v:?} is not a number"))
        })
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &str = "# TYPE clickagg_x_total counter\nclickagg_x_total{reason=\"a\"} 2\n\
                        clickagg_x_total{reason=\"b\"} 3\nclickagg_y 0\n";

    #[test]
    fn a_metric_sums_over_its_matching_series() {
        assert_eq!(metric_value(BODY, "clickagg_x_total", &[]), 5.0);
        assert_eq!(metric_value(BODY, "clickagg_x_total", &["reason=\"b\""]), 3.0);
        assert_eq!(metric_value(BODY, "clickagg_y", &[]), 0.0);
    }

    #[test]
    #[should_panic(expected = "no series clickagg_renamed_total")]
    fn a_missing_metric_is_an_error_not_zero() {
        metric_value(BODY, "clickagg_renamed_total", &[]);
    }

    #[test]
    #[should_panic(expected = "no series clickagg_x_total with labels")]
    fn a_missing_label_value_is_an_error_not_zero() {
        metric_value(BODY, "clickagg_x_total", &["reason=\"c\""]);
    }
}
