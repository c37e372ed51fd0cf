//! The auth and HA of managed platforms, end to end on real servers: Kafka's SASL
//! OAUTHBEARER with OpenID Connect client credentials (tokens from a local token
//! endpoint, validated by the broker against its JWKS), Redis behind Sentinel through a
//! real failover of the master, and client certificates for Redis and ClickHouse.

use std::time::Duration;

use clickagg::produce::Spec;

use crate::helpers::stack::{free_port, PrivateStack};
use crate::helpers::wait::wait_until;
use crate::helpers::{wait_ready, TestEnv};

const CONVERGE: Duration = Duration::from_secs(180);

/// The token endpoint's count of tokens issued and refused (`scripts/oidc`).
async fn tokens(oidc_port: &str) -> (u64, u64) {
    let (status, body) = crate::helpers::http::http_get(&format!("127.0.0.1:{oidc_port}"), "/stats").await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("stats JSON");
    (v["issued"].as_u64().unwrap(), v["refused"].as_u64().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_oauthbearer_with_oidc_client_credentials_counts_exactly_and_refreshes_its_token() {
    // Tokens live 15 s, so a member running past them must fetch new ones (at 80 %).
    let stack = PrivateStack::start_configured(
        "oauth",
        &["kafka"],
        &["KAFKA_OAUTH_PORT", "OIDC_PORT"],
        &[("OIDC_TOKEN_LIFETIME", "15")],
    )
    .await;
    let mut env = TestEnv::with_stack("oauth", &stack).await;
    let oidc = stack.port("OIDC_PORT");
    let endpoint = format!("http://127.0.0.1:{oidc}/token");
    let oauth_listener = format!("127.0.0.1:{}", stack.port("KAFKA_OAUTH_PORT"));
    let member_env = |secret: &str| -> Vec<(String, String)> {
        [
            ("CLICKAGG__KAFKA__BROKERS", oauth_listener.as_str()),
            ("CLICKAGG__KAFKA__SECURITY_PROTOCOL", "sasl_plaintext"),
            ("CLICKAGG__KAFKA__SASL_MECHANISM", "OAUTHBEARER"),
            ("CLICKAGG__KAFKA__OAUTH_TOKEN_ENDPOINT_URL", endpoint.as_str()),
            ("CLICKAGG__KAFKA__OAUTH_CLIENT_ID", "clickagg"),
            ("CLICKAGG__KAFKA__OAUTH_CLIENT_SECRET", secret),
            ("CLICKAGG__KAFKA__OAUTH_SCOPE", "kafka"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .to_vec()
    };
    // The producer writes over the plaintext listener; only the member uses OAUTHBEARER.
    let (records, truth) = env.plan(Spec { count: 20_000, seed: 601, ..Spec::default() });
    let producer = env.spawn_producer(&records, 4, 800);

    // A wrong secret: the token endpoint refuses it, no token, no connection.
    env.extra_env = member_env("not-the-secret");
    let mut refused = env.spawn_member("refused");
    wait_until("the token endpoint refuses the wrong secret", Duration::from_secs(60), || async {
        match tokens(&oidc).await {
            (0, r) if r > 0 => Ok(()),
            seen => Err(format!("issued, refused: {seen:?}")),
        }
    })
    .await;
    refused.kill9().await;

    env.extra_env = member_env("clickagg-oidc-secret");
    let mut member = env.spawn_member("m");
    wait_until("the member has a token", Duration::from_secs(60), || async {
        match tokens(&oidc).await {
            (i, _) if i > 0 => Ok(()),
            seen => Err(format!("issued, refused: {seen:?}")),
        }
    })
    .await;
    let first = tokens(&oidc).await.0;
    producer.finished().await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    // The producer ran 25 s: the member's clients took new tokens before theirs expired.
    wait_until("tokens are refreshed before they expire", Duration::from_secs(30), || async {
        match tokens(&oidc).await.0 {
            now if now > first => Ok(()),
            now => Err(format!("{now} tokens issued, {first} at the start")),
        }
    })
    .await;
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

/// The data node of the stack's Sentinel deployment that is the master now (1 or 2).
async fn sentinel_master(sentinel_port: &str, data_ports: &[String]) -> (usize, String) {
    let client = redis::Client::open(format!("redis://127.0.0.1:{sentinel_port}/")).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.expect("a Sentinel answers");
    let (_, port): (String, String) =
        redis::cmd("SENTINEL").arg("get-master-addr-by-name").arg("clickagg").query_async(&mut conn).await.unwrap();
    let node = data_ports.iter().position(|p| *p == port).expect("the master is a data node") + 1;
    (node, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_behind_sentinel_fails_over_mid_run_and_counts_exactly() {
    let data: Vec<String> = (0..2).map(|_| free_port().to_string()).collect();
    let sentinels: Vec<String> = (0..3).map(|_| free_port().to_string()).collect();
    let stack = PrivateStack::start_configured(
        "sentinel",
        &["redis-sentinel"],
        &[],
        &[("REDIS_SENTINEL_DATA_PORT", &data.join(",")), ("REDIS_SENTINEL_PORT", &sentinels.join(","))],
    )
    .await;
    let mut env = TestEnv::new("sentinel").await;
    env.redis_sentinels =
        Some(sentinels.iter().map(|p| format!("redis://127.0.0.1:{p}/")).collect::<Vec<_>>().join(","));
    let (master, port) = sentinel_master(&sentinels[0], &data).await;
    env.redis_url = format!("redis://127.0.0.1:{port}/");
    // Retries and cross-partition copies: what a cache that forgot a claim would count twice.
    let spec = Spec { count: 60_000, seed: 602, duplicate_ratio: 0.2, cross_partition_ratio: 0.3, ..Spec::default() };
    let (records, truth) = env.plan(spec);
    let producer = env.spawn_producer(&records, 4, 2_500);
    let mut member = env.spawn_member("m");
    wait_until("the member counts through the first master", Duration::from_secs(90), || async {
        match member.metric("clickagg_records_consumed_total", &[]).await {
            n if n > 10_000.0 => Ok(()),
            n => Err(format!("{n} records consumed")),
        }
    })
    .await;

    // The master dies; the Sentinels promote its replica within seconds.
    stack.kill(&format!("redis-sentinel:{master}")).await;
    let promoted = wait_until("the Sentinels promote the replica", Duration::from_secs(60), || async {
        match sentinel_master(&sentinels[1], &data).await {
            (node, port) if node != master => Ok(port),
            seen => Err(format!("master still {seen:?}")),
        }
    })
    .await;
    // Claims wait for one replica (redis.wait_replicas is 1 behind Sentinel), so the old
    // master must come back, as the new one's replica, before claims go on.
    stack.up(&format!("redis-sentinel:{master}")).await;
    producer.finished().await;
    env.redis_url = format!("redis://127.0.0.1:{promoted}/");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert!(member.metric("clickagg_redis_errors_total", &[]).await > 0.0, "the member saw the master go");
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_with_client_certificates_counts_exactly_and_without_one_is_not_ready() {
    let stack =
        PrivateStack::start_configured("rmtls", &["redis"], &["REDIS_TLS_PORT"], &[("REDIS_TLS_CLIENT_CERTS", "1")])
            .await;
    let mut env = TestEnv::with_stack("redismtls", &stack).await;
    let tls = stack.dir().join("redis/tls");
    env.extra_env.extend(
        [
            ("CLICKAGG__REDIS__URL", format!("rediss://127.0.0.1:{}/", stack.port("REDIS_TLS_PORT"))),
            ("CLICKAGG__REDIS__TLS_CA_FILE", tls.join("cert.pem").display().to_string()),
        ]
        .map(|(k, v)| (k.to_string(), v)),
    );
    let (records, truth) = env.plan(Spec { count: 10_000, seed: 603, ..Spec::default() });
    env.send(&records, 4, None).await;

    let mut without = env.spawn_member("without");
    let body = wait_ready(&without, 503, Duration::from_secs(30)).await;
    assert!(body.contains("redis"), "{body}");
    without.kill9().await;

    env.extra_env.extend(
        [
            ("CLICKAGG__REDIS__TLS_CERT_FILE", tls.join("client.pem")),
            ("CLICKAGG__REDIS__TLS_KEY_FILE", tls.join("client.key")),
        ]
        .map(|(k, v)| (k.to_string(), v.display().to_string())),
    );
    let mut member = env.spawn_member("m");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(member.http_get("/readyz").await.0, 200);
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clickhouse_with_client_certificates_counts_exactly_and_without_one_is_not_ready() {
    // ClickHouse 18.16: the stack's current engine serves no HTTPS.
    let stack = PrivateStack::start_configured(
        "chmtls",
        &["clickhouse18"],
        &["CLICKHOUSE18_HTTPS_PORT"],
        &[("CLICKHOUSE18_TLS_CLIENT_CERTS", "1")],
    )
    .await;
    // Migrated over plain HTTP: the test's own client presents no certificate.
    let mut env = TestEnv::with_stack("chmtls", &stack).await;
    let tls = stack.dir().join("clickhouse18/tls");
    env.clickhouse_url = format!("https://127.0.0.1:{}", stack.port("CLICKHOUSE18_HTTPS_PORT"));
    env.clickhouse_ca = Some(tls.join("cert.pem"));
    let (records, truth) = env.plan(Spec { count: 10_000, seed: 604, ..Spec::default() });
    env.send(&records, 4, None).await;

    let mut without = env.spawn_member("without");
    let body = wait_ready(&without, 503, Duration::from_secs(30)).await;
    assert!(body.contains("clickhouse"), "{body}");
    without.kill9().await;

    env.extra_env.extend(
        [
            ("CLICKAGG__CLICKHOUSE__TLS_CERT_FILE", tls.join("client.pem")),
            ("CLICKAGG__CLICKHOUSE__TLS_KEY_FILE", tls.join("client.key")),
        ]
        .map(|(k, v)| (k.to_string(), v.display().to_string())),
    );
    let mut member = env.spawn_member("m");
    // The counts are read over plain HTTP, by the test.
    env.clickhouse_url = stack.clickhouse_url().unwrap();
    env.clickhouse_ca = None;
    env.extra_env.retain(|(k, _)| !k.starts_with("CLICKAGG__CLICKHOUSE__TLS"));
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}
