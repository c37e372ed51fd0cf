//! Loading the settings: layers, unknown keys, durations, the old names.

// figment's `Jail` closures return its (large) error type; that is its API, not ours.
#![allow(clippy::result_large_err)]

use super::*;
use figment::Jail;

#[test]
fn layers_apply_in_order_defaults_file_env_flags() {
    Jail::expect_with(|jail| {
        jail.create_file("c.toml", "[kafka]\nbrokers = \"file:9092\"\ntopic = \"from-file\"\ngroup = \"g-file\"\n")?;
        jail.set_env("CLICKAGG__KAFKA__TOPIC", "from-env");
        jail.set_env("CLICKAGG__KAFKA__GROUP", "g-env");
        let s = Settings::load(Some(Path::new("c.toml")), vec![("kafka.group", "g-flag".into())]).unwrap();
        assert_eq!(s.kafka.brokers, "file:9092");
        assert_eq!(s.kafka.topic, "from-env");
        assert_eq!(s.kafka.group, "g-flag");
        assert_eq!(s.pipeline.batch_offsets, 10_000);
        Ok(())
    });
}

#[test]
fn unknown_keys_are_rejected_from_files_and_environment() {
    Jail::expect_with(|jail| {
        jail.create_file("c.toml", "[kafka]\nbrokerz = \"x\"\n")?;
        let e = Settings::load(Some(Path::new("c.toml")), vec![]).unwrap_err().to_string();
        assert!(e.contains("brokerz"), "{e}");
        Ok(())
    });
    Jail::expect_with(|jail| {
        jail.set_env("CLICKAGG__PIPELINE__BATCH_OFSETS", "5");
        let e = Settings::load(None, vec![]).unwrap_err().to_string();
        assert!(e.contains("batch_ofsets"), "{e}");
        Ok(())
    });
}

#[test]
fn durations_parse_from_humane_strings() {
    Jail::expect_with(|jail| {
        jail.set_env("CLICKAGG__DEDUP__WINDOW", "36h");
        jail.set_env("CLICKAGG__PIPELINE__FLUSH_INTERVAL", "250ms");
        let s = Settings::load(None, vec![]).unwrap();
        assert_eq!(s.dedup_window(), Duration::from_secs(36 * 3600));
        assert_eq!(s.pipeline.flush_interval, Duration::from_millis(250));
        Ok(())
    });
}

#[test]
fn the_deprecated_dedup_ttl_still_sets_the_window_unless_the_window_is_set() {
    Jail::expect_with(|jail| {
        jail.set_env("CLICKAGG__REDIS__DEDUP_TTL", "12h");
        assert_eq!(Settings::load(None, vec![]).unwrap().dedup_window(), Duration::from_secs(12 * 3600));
        jail.set_env("CLICKAGG__DEDUP__WINDOW", "30h");
        assert_eq!(Settings::load(None, vec![]).unwrap().dedup_window(), Duration::from_secs(30 * 3600));
        Ok(())
    });
}

#[test]
fn several_redis_urls_are_the_seed_nodes_of_a_cluster_and_claims_wait_for_a_replica() {
    let single = Settings::default();
    assert!(!single.redis.is_cluster());
    assert_eq!(single.redis.wait(), None, "a single Redis answers alone unless told otherwise");
    let vars = [("CLICKAGG__REDIS__URL", "redis://a:7001/,redis://b:7002/")];
    let s = Settings::load_with_vars(None, vec![], vars).unwrap();
    assert!(s.redis.is_cluster());
    assert_eq!(s.redis.url.list(), ["redis://a:7001/", "redis://b:7002/"]);
    assert_eq!(s.redis.wait(), Some(crate::config::RedisWait { replicas: 1, timeout: Duration::from_secs(1) }));
    assert_eq!(s.redis.groups(), 16);
    let one_seed = [("CLICKAGG__REDIS__URL", "redis://a:7001/"), ("CLICKAGG__REDIS__CLUSTER", "true")];
    let s = Settings::load_with_vars(None, vec![], one_seed).unwrap();
    assert!(s.redis.is_cluster());
    let tuned = [
        ("CLICKAGG__REDIS__URL", "redis://a:7001/,redis://b:7002/"),
        ("CLICKAGG__REDIS__SLOT_GROUPS", "64"),
        ("CLICKAGG__REDIS__WAIT_REPLICAS", "0"),
    ];
    let s = Settings::load_with_vars(None, vec![], tuned).unwrap();
    assert_eq!((s.redis.groups(), s.redis.wait()), (64, None));
}

fn endpoint(url: &str, password: Option<&str>) -> Result<ClickHouseEndpoint, String> {
    let s = ClickHouseSettings {
        url: SecretUrl::new(url),
        password: password.map(Secret::new),
        ..ClickHouseSettings::default()
    };
    s.endpoint()
}

#[test]
fn clickhouse_credentials_in_the_url_become_the_clients_user_and_password() {
    let e = endpoint("https://svc%40corp:p%2Bw%3Ahunter2@ch.example:8443/", None).unwrap();
    assert_eq!((e.url.as_str(), e.user.as_str()), ("https://ch.example:8443/", "svc@corp"));
    assert_eq!(e.password.unwrap().expose(), "p+w:hunter2");
    let e = endpoint("http://127.0.0.1:8123/?user=svc&password=a%26b+hunter2", None).unwrap();
    assert_eq!((e.url.as_str(), e.user.as_str()), ("http://127.0.0.1:8123/", "svc"));
    assert_eq!(e.password.unwrap().expose(), "a&b hunter2");
    let e = endpoint("http://127.0.0.1:8123", Some("from-setting")).unwrap();
    assert_eq!((e.url.as_str(), e.user.as_str()), ("http://127.0.0.1:8123/", "default"));
    assert_eq!(e.password.unwrap().expose(), "from-setting");
}

#[test]
fn a_clickhouse_url_the_client_would_misread_is_refused_without_printing_it() {
    for (url, password, says) in [
        ("http://ch:8123/?password=hunter2&max_threads=8", None, "only user and password"),
        ("http://u:hunter2@ch:8123/", Some("other"), "keep one"),
        ("http://u:hunter2@ch:8123/?password=hunter2", None, "twice"),
        ("ftp://u:hunter2@ch/", None, "http:// or https://"),
        ("hunter2", None, "not a URL"),
    ] {
        let e = endpoint(url, password).unwrap_err();
        assert!(e.contains(says) && !e.contains("hunter2"), "{url}: {e}");
    }
}

#[test]
fn secrets_never_print() {
    let mut s = Settings::default();
    s.clickhouse.password = Some(Secret::new("ch-hunter2"));
    s.kafka.sasl_password = Some(Secret::new("sasl-hunter2"));
    s.redis.url = SecretUrl::new("redis://user:redis-hunter2@127.0.0.1:6379/");
    s.kafka.properties.insert("sasl.oauthbearer.config".into(), Secret::new("prop-hunter2"));
    let printed = format!("{s:?}\n{}", s.to_redacted_toml());
    assert!(!printed.contains("hunter2"), "{printed}");
    assert!(printed.contains("redis://user:%5Bredacted%5D@127.0.0.1:6379/") || printed.contains("[redacted]"));
}

#[test]
fn passwords_and_query_values_in_both_urls_never_print() {
    let redis = "rediss://u:redis-pw-hunter2@cache:6380/0?protocol=resp3&token=redis-q-hunter2#frag-hunter2";
    for clickhouse in
        ["https://ch:ch-pw-hunter2@clickhouse:8443/", "https://clickhouse:8443/?user=ch&password=ch-q-hunter2"]
    {
        let vars = [("CLICKAGG__REDIS__URL", redis), ("CLICKAGG__CLICKHOUSE__URL", clickhouse)];
        let s = Settings::load_with_vars(None, vec![], vars).unwrap();
        let printed = format!("{s:?}\n{}", s.to_redacted_toml());
        assert!(!printed.contains("hunter2"), "{printed}");
        // Where the services are stays visible, and which parameters are set.
        for visible in
            ["u:%5Bredacted%5D@cache:6380/0?protocol=[redacted]&token=[redacted]#[redacted]", "clickhouse:8443"]
        {
            assert!(printed.contains(visible), "{visible} in {printed}");
        }
    }
}

#[test]
fn a_secret_that_looks_like_a_number_is_still_a_secret() {
    Jail::expect_with(|jail| {
        jail.set_env("CLICKAGG__CLICKHOUSE__PASSWORD", "12345");
        jail.set_env("CLICKAGG__KAFKA__SASL_PASSWORD", "true");
        let s = Settings::load(None, vec![]).unwrap();
        assert_eq!(s.clickhouse.password.unwrap().expose(), "12345");
        assert_eq!(s.kafka.sasl_password.unwrap().expose(), "true");
        Ok(())
    });
}
