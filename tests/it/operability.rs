//! Running clickagg as a service: graceful shutdown, what `/metrics` and `/readyz`
//! report, secrets that never print, and secured connections.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use clickagg::aggregate::BucketKey;
use clickagg::click::RejectReason;
use clickagg::position::BatchOffsets;
use clickagg::produce::Spec;
use clickagg::source::{RangeReader, Ranges};

use crate::helpers::{equals, wait_until, PrivateStack, TestEnv};

const CONVERGE: Duration = Duration::from_secs(180);

/// Distinct valid clicks per bucket among the records below `ends` (per partition),
/// recounted from the topic: what must be in ClickHouse behind committed offsets.
async fn counts_below(env: &TestEnv, ends: &BTreeMap<i32, i64>) -> BTreeMap<BucketKey, u64> {
    let ranges = Ranges { partitions: ends.iter().map(|(&p, &e)| (p, (0, e))).collect() };
    let s = env.settings();
    let mut reader =
        RangeReader::new(&s.kafka, "prefix-reader", &ranges, clickagg::schema_registry::decoder(&s).unwrap(), 5_000)
            .unwrap();
    let mut seen = HashSet::new();
    let mut counts = BTreeMap::new();
    while let Some(batch) = reader.next_batch().await.unwrap() {
        for r in batch {
            if let Ok(c) = r.outcome {
                if seen.insert(c.click_id) {
                    *counts.entry(BucketKey { ad_id: c.ad_id, minute: c.minute }).or_default() += 1;
                }
            }
        }
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_run_flushes_commits_only_durable_clicks_and_a_restart_rereads_at_most_the_open_batch() {
    let env = TestEnv::new("sigterm").await;
    let (records, truth) = env.plan(Spec { count: 80_000, seed: 41, ..Spec::default() });
    let producer = env.spawn_producer(&records, 4, 10_000);
    let mut first = env.spawn_member("first");
    first.wait_for_line("partitions assigned", 0, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(first.terminate(Duration::from_secs(30)).await, 0, "SIGTERM drains and exits 0");

    // What the member had read when it drained, from its last log line about it.
    let line = first.lines().into_iter().find(|l| l.contains("drained: everything read")).expect("drain log line");
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    let last_read: BTreeMap<i32, i64> = serde_json::from_str(v["last_read"].as_str().unwrap()).unwrap();
    let committed = env.committed_offsets().await;
    let n = BatchOffsets::new(env.batch_offsets).unwrap();
    for (p, &last) in &last_read {
        let c = committed[p];
        // The drain commits exactly what it flushed: the position after the last record
        // read; a restart reads from the boundary below it, at most the open batch back.
        assert_eq!(c, last + 1, "partition {p}: committed {c}, last read {last}");
        assert!(n.start_of(c) >= n.start_of(last), "partition {p}: committed {c}, last read {last}");
    }
    // Every click behind the committed offsets is in ClickHouse.
    let behind = counts_below(&env, &committed).await;
    let billing = env.billing().await;
    for (k, &c) in &behind {
        let have = billing.get(k).copied().unwrap_or(0);
        assert!(have >= c, "{k:?}: {c} clicks behind the committed offsets, {have} in ClickHouse");
    }

    producer.finished().await;
    let mut second = env.spawn_member("second");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    // The restart began at the batch boundary at or below each committed offset: it read
    // each partition from there, the open batch again and nothing before it (records
    // after the last counted click may still be in flight, hence the wait).
    let high: i64 = env.high_watermarks().await.values().sum();
    let from: i64 = committed.values().map(|&c| n.start_of(c)).sum();
    wait_until("the restarted member reads exactly from the boundaries below the commits", CONVERGE, || async {
        equals(second.metric("clickagg_records_consumed_total", &[]).await as i64, high - from)
    })
    .await;
    assert_eq!(second.terminate(Duration::from_secs(30)).await, 0);
}

/// Found by the chaos run: a member restarted during a ClickHouse outage and stopped
/// before ClickHouse came back had read nothing, yet exited 1 ("shut down while
/// waiting for ClickHouse"), which an orchestrator reads as a failed stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_clickhouse_is_unreachable_at_start_exits_0_with_nothing_to_drain() {
    let env = TestEnv::new("sigtermstart").await;
    // Nothing listens there: the member waits as for a server still starting.
    let unreachable = format!("http://127.0.0.1:{}", crate::helpers::stack::free_port());
    let mut member = env.spawn("m", &["run"], &[("CLICKAGG__CLICKHOUSE__URL", &unreachable)]);
    member.wait_for_line("reaching ClickHouse failed; retrying", 0, Duration::from_secs(30)).await;
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0, "{}", member.tail(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_readiness_report_what_happened_in_a_run() {
    let env = TestEnv::new("metrics").await;
    let (records, truth) = env.plan(Spec { count: 30_000, malformed_ratio: 0.03, seed: 42, ..Spec::default() });
    env.send(&records, 4, None).await;
    let mut member = env.spawn_member("m");
    assert_eq!(member.http_get("/livez").await.0, 200);
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    // Records after the last counted click (duplicates, bad records) may still be in flight.
    wait_until("every record consumed", CONVERGE, || async {
        equals(member.metric("clickagg_records_consumed_total", &[]).await as usize, records.len())
    })
    .await;

    let (status, body) = member.http_get("/readyz").await;
    assert_eq!((status, body.trim()), (200, "ready"));
    let (_, m) = member.http_get("/metrics").await;
    let get = |name: &str, labels: &[&str]| crate::helpers::metric_value(&m, name, labels);
    assert_eq!(get("clickagg_records_consumed_total", &[]) as u64, records.len() as u64);
    assert_eq!(get("clickagg_clicks_counted_total", &[]) as u64, truth.clicks);
    assert_eq!(get("clickagg_duplicates_dropped_total", &[]) as u64, truth.duplicates);
    assert_eq!(get("clickagg_dead_letters_produced_total", &[]) as u64, truth.malformed_total());
    for reason in RejectReason::ALL {
        let want = truth.malformed.get(&reason).copied().unwrap_or(0);
        assert_eq!(get("clickagg_invalid_records_total", &[&format!("reason=\"{reason}\"")]) as u64, want, "{reason}");
    }
    let rows = get("clickagg_rows_flushed_total", &[]);
    assert!(rows > 0.0 && get("clickagg_flush_duration_seconds_count", &[]) > 0.0);
    assert!(m.contains("clickagg_flush_duration_seconds_bucket{le=\"0.005\"}"), "explicit histogram buckets");
    assert_eq!(get("clickagg_assigned_partitions", &[]), 4.0);
    assert!(get("clickagg_rebalances_total", &["kind=\"assign\""]) >= 1.0);
    for p in 0..4 {
        assert!(m.contains(&format!("clickagg_committed_offset{{partition=\"{p}\"}}")), "committed offset of {p}");
    }
    // Lag comes from librdkafka statistics every 5 s.
    wait_until("a consumer lag metric", Duration::from_secs(20), || async {
        let (_, m) = member.http_get("/metrics").await;
        if m.contains("clickagg_consumer_lag{partition=") {
            Ok(())
        } else {
            Err("no clickagg_consumer_lag series yet".into())
        }
    })
    .await;
    assert!(!m.contains("ad_id=") && !m.contains("click_id="), "no unbounded labels");
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

/// More members than partitions: the one without a partition is a standby, and ready
/// (Redis and ClickHouse answer), so a surge pod of a rolling update or a spare replica
/// does not hold a rollout or fire ClickaggMemberNotReady. Its status still shows it
/// owns nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_without_partitions_in_a_group_larger_than_the_topic_is_ready() {
    let env = TestEnv::new("standby").await;
    let (records, truth) = env.plan(Spec { count: 2_000, seed: 50, ..Spec::default() });
    env.send(&records, 1, None).await;
    let mut a = env.spawn_member("a");
    a.wait_for_line("partitions assigned", 0, Duration::from_secs(60)).await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    let mut b = env.spawn_member("b");
    // Both in the group (the group's own description), the one partition with one of them.
    let (a_id, b_id) = (client_id(&a).await, client_id(&b).await);
    wait_until("both members are in the group", CONVERGE, || async {
        let mut cmd = env.command(&["status", "--format", "json"], &[]);
        let out = tokio::task::spawn_blocking(move || cmd.output().unwrap()).await.unwrap();
        let s: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("{e}: {out:?}"))?;
        let members: Vec<&str> =
            s["members"].as_array().unwrap().iter().filter_map(|m| m["client_id"].as_str()).collect();
        let owners: Vec<&str> =
            s["partitions"].as_array().unwrap().iter().filter_map(|p| p["owner"].as_str()).collect();
        if members.len() == 2
            && members.contains(&a_id.as_str())
            && members.contains(&b_id.as_str())
            && owners.len() == 1
        {
            Ok(())
        } else {
            Err(format!("members {members:?}, owners {owners:?}"))
        }
    })
    .await;
    let mut standbys = 0;
    for m in [&b, &a] {
        let (code, body) = wait_until("the member is ready", Duration::from_secs(30), || async {
            match m.http_get("/readyz").await {
                (200, body) => Ok((200, body)),
                (code, body) => Err(format!("{code} {body}")),
            }
        })
        .await;
        assert_eq!((code, body.trim()), (200, "ready"), "{}", m.label);
        assert_eq!(m.metric("clickagg_ready", &[]).await, 1.0, "{}", m.label);
        let status: serde_json::Value = serde_json::from_str(&m.http_get("/status.json").await.1).unwrap();
        assert_eq!(status["ready"], true, "{status}");
        let owned = status["partitions"].as_array().unwrap().len();
        assert_eq!(status["assigned_partitions"].as_u64(), Some(owned as u64), "{status}");
        assert_eq!(m.metric("clickagg_assigned_partitions", &[]).await, owned as f64);
        standbys += usize::from(owned == 0);
    }
    assert_eq!(standbys, 1, "one of the two members owns the topic's only partition");
    assert_eq!(b.terminate(Duration::from_secs(30)).await, 0);
    assert_eq!(a.terminate(Duration::from_secs(30)).await, 0);
}

async fn client_id(member: &crate::helpers::Member) -> String {
    let s: serde_json::Value = serde_json::from_str(&member.http_get("/status.json").await.1).unwrap();
    s["member"]["client_id"].as_str().unwrap().to_string()
}

/// The compose demo (`docker-compose.yml`'s `producer`, then `verify --expected
/// truth.csv` in the same volume) run twice into the same topic: each run must verify,
/// the second as well as the first. Docker is not needed: the producer's command is read
/// from the compose file and run with this test's settings (fewer records), in one
/// working directory that stands for the `demo` volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compose_demo_can_be_run_twice_and_verifies_each_time() {
    let compose: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(include_str!("../../docker-compose.yml")).expect("docker-compose.yml");
    let mut produce: Vec<String> = compose["services"]["producer"]["command"]
        .as_sequence()
        .expect("the producer's command as a list")
        .iter()
        .map(|w| w.as_str().expect("a word").to_string())
        .collect();
    assert_eq!(produce[0], "produce");
    let count = produce.iter().position(|w| w == "--count").expect("--count") + 1;
    produce[count] = "20000".into();
    let verify = ["verify", "--expected", "truth.csv"];
    let env = TestEnv::new("composedemo").await;
    let volume = env.log_dir.join("demo-volume");
    std::fs::create_dir_all(&volume).unwrap();
    let run = |label: String, args: Vec<String>| {
        let mut cmd = env.command(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[]);
        cmd.current_dir(&volume);
        async move {
            let out = tokio::task::spawn_blocking(move || cmd.output().unwrap()).await.unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            (label, out.status.code().unwrap_or(-1), text)
        }
    };
    let mut member = env.spawn_member("aggregator");
    for round in 1..=2 {
        let (label, code, out) = run(format!("produce-{round}"), produce.clone()).await;
        assert_eq!(code, 0, "{label}: {out}");
        wait_until(&format!("run {round} verifies"), CONVERGE, || async {
            let (_, code, out) = run(format!("verify-{round}"), verify.map(String::from).to_vec()).await;
            if code == 0 {
                Ok(())
            } else {
                Err(format!("exit {code}: {out}"))
            }
        })
        .await;
    }
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

/// Secrets from the TOML file, a `<VAR>_FILE` file, the environment and flags reach
/// their services and never any output: logs, errors, `clickagg config`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_from_file_environment_and_flags_never_appear_in_any_output() {
    // A private Redis whose only user is an ACL user with a password.
    let stack = PrivateStack::start("secrets", &["redis"]).await;
    let mut env = TestEnv::with_stack("secrets", &stack).await;
    let redis_secret = format!("redis-pw-{:x}", rand::random::<u64>());
    {
        let mut c =
            redis::Client::open(env.redis_url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
        let _: () = redis::cmd("ACL")
            .arg(&["SETUSER", "clickagg", "on", &format!(">{redis_secret}"), "~*", "+@all"][..])
            .query_async(&mut c)
            .await
            .unwrap();
        let _: () = redis::cmd("ACL").arg(&["SETUSER", "default", "off"][..]).query_async(&mut c).await.unwrap();
    }
    // Kafka over SASL/PLAIN (the stack's SASL listener); its password only in the file.
    let kafka_secret = "clickagg-local-secret";
    let clickhouse_secret = "clickagg-local-password";
    let config = env.log_dir.join("clickagg.toml");
    std::fs::write(&config, format!("[kafka]\nsasl_password = \"{kafka_secret}\"\n")).unwrap();
    // The Redis password as a mounted Secret hands it over: a file, ending in a newline.
    let secret_file = |name: &str, content: &str| {
        let path = env.log_dir.join(name);
        std::fs::write(&path, format!("{content}\n")).unwrap();
        path.display().to_string()
    };
    let redis_password_file = secret_file("redis-password", &redis_secret);
    env.extra_env.extend(
        [
            ("CLICKAGG__KAFKA__BROKERS", "127.0.0.1:9094"),
            ("CLICKAGG__KAFKA__SECURITY_PROTOCOL", "sasl_plaintext"),
            ("CLICKAGG__KAFKA__SASL_MECHANISM", "PLAIN"),
            ("CLICKAGG__KAFKA__SASL_USERNAME", "clickagg"),
            ("CLICKAGG__REDIS__USERNAME", "clickagg"),
            ("CLICKAGG__REDIS__PASSWORD_FILE", redis_password_file.as_str()),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    let config_arg = config.display().to_string();
    let flags =
        ["--config", config_arg.as_str(), "--clickhouse-user", "clickagg", "--clickhouse-password", clickhouse_secret];
    let secrets = [kafka_secret, clickhouse_secret, redis_secret.as_str()];
    let assert_clean = |what: &str, output: &str| {
        for s in &secrets {
            assert!(!output.contains(s), "{what} printed a secret:\n{output}");
        }
    };

    let (records, truth) = env.plan(Spec { count: 20_000, seed: 43, ..Spec::default() });
    env.send(&records, 4, None).await;
    let mut member = env.spawn("m", &[&flags[..], &["run"]].concat(), &[]);
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
    assert_clean("run", &member.output());

    let mut config = env.spawn("config", &[&flags[..], &["config"]].concat(), &[]);
    assert_eq!(config.wait(Duration::from_secs(30)).await, 0);
    let printed = config.output();
    assert_clean("config", &printed);
    assert!(
        printed.contains("sasl_password = \"[redacted]\"") && printed.contains("password = \"[redacted]\""),
        "{printed}"
    );

    // Wrong credentials fail clearly, and the wrong secret does not leak either.
    let wrong_redis_file = secret_file("wrong-redis-password", "wrong-redis-hunter2");
    for (label, extra) in [
        ("bad-clickhouse", ("CLICKAGG__CLICKHOUSE__PASSWORD", "wrong-ch-hunter2")),
        ("bad-redis", ("CLICKAGG__REDIS__PASSWORD_FILE", wrong_redis_file.as_str())),
        ("bad-kafka", ("CLICKAGG__KAFKA__SASL_PASSWORD", "wrong-kafka-hunter2")),
    ] {
        let args: Vec<&str> = if label == "bad-clickhouse" {
            vec!["--config", &config_arg, "--clickhouse-user", "clickagg", "run"]
        } else {
            [&flags[..], &["run"]].concat()
        };
        let mut bad = env.spawn(label, &args, &[extra]);
        if label == "bad-redis" {
            // Redis refuses at the first poll batch; give it records to claim.
            env.send(&records[..10], 4, None).await;
        }
        let code = bad.wait(Duration::from_secs(90)).await;
        let out = bad.output();
        assert_eq!(code, 1, "{label} should stop with a clear error:\n{out}");
        assert!(!out.contains("hunter2"), "{label} printed the wrong secret:\n{out}");
        assert_clean(label, &out);
    }

    // A secret file that cannot be read, or a secret given twice, is a bad setting (exit
    // 2) for every command, named with the variable and the path.
    let missing = env.log_dir.join("no-such-secret").display().to_string();
    for (label, args) in [("missing-file-config", vec!["config"]), ("missing-file-migrate", vec!["migrate"])] {
        let mut bad = env.spawn(label, &args, &[("CLICKAGG__REDIS__PASSWORD_FILE", &missing)]);
        assert_eq!(bad.wait(Duration::from_secs(30)).await, 2, "{}", bad.output());
        assert!(bad.output().contains(&format!("CLICKAGG__REDIS__PASSWORD_FILE names {missing}")), "{}", bad.output());
    }
    let mut twice = env.spawn("twice", &["config"], &[("CLICKAGG__REDIS__PASSWORD", "wrong-redis-hunter2")]);
    assert_eq!(twice.wait(Duration::from_secs(30)).await, 2, "{}", twice.output());
    assert!(twice.output().contains("CLICKAGG__REDIS__PASSWORD and CLICKAGG__REDIS__PASSWORD_FILE are both set"));
    assert!(!twice.output().contains("hunter2"));
    assert_clean("twice", &twice.output());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_sha_256_and_512_connect_producer_and_member() {
    let mut env = TestEnv::new("scram").await;
    let (_, truth) = env.plan(Spec { count: 5_000, seed: 44, ..Spec::default() });
    // Produce over SCRAM-SHA-256 with the CLI, consume over SCRAM-SHA-512.
    let sasl = |mechanism: &str| {
        vec![
            ("CLICKAGG__KAFKA__BROKERS".to_string(), "127.0.0.1:9094".to_string()),
            ("CLICKAGG__KAFKA__SECURITY_PROTOCOL".to_string(), "sasl_plaintext".to_string()),
            ("CLICKAGG__KAFKA__SASL_MECHANISM".to_string(), mechanism.to_string()),
            ("CLICKAGG__KAFKA__SASL_USERNAME".to_string(), "clickagg".to_string()),
            ("CLICKAGG__KAFKA__SASL_PASSWORD".to_string(), "clickagg-local-secret".to_string()),
        ]
    };
    env.extra_env = sasl("SCRAM-SHA-256");
    let truth_file = env.log_dir.join("truth.csv");
    let truth_arg = truth_file.display().to_string();
    let mut producer =
        env.spawn("produce", &["produce", "--count", "5000", "--seed", "44", "--truth", &truth_arg], &[]);
    assert_eq!(producer.wait(Duration::from_secs(120)).await, 0, "{}", producer.output());
    let produced = clickagg::produce::Truth::read_csv(&truth_file).unwrap();
    assert_eq!(produced.values().sum::<u64>(), truth.clicks, "the CLI's generator matches the library's");

    env.extra_env = sasl("SCRAM-SHA-512");
    let mut member = env.spawn_member("m");
    env.assert_counts_converge(&produced, CONVERGE).await;
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_private_ca_counts_exactly() {
    let stack = PrivateStack::start_with("rediss", &["redis"], &["REDIS_TLS_PORT"]).await;
    let mut env = TestEnv::with_stack("rediss", &stack).await;
    env.redis_url = format!("rediss://127.0.0.1:{}/", stack.port("REDIS_TLS_PORT"));
    let ca = stack.dir().join("redis/tls/cert.pem");
    env.extra_env.push(("CLICKAGG__REDIS__TLS_CA_FILE".into(), ca.display().to_string()));
    let (records, truth) = env.plan(Spec { count: 10_000, seed: 45, ..Spec::default() });
    env.send(&records, 4, None).await;
    let mut member = env.spawn_member("m");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(member.http_get("/readyz").await.0, 200, "the readiness probe reaches Redis over TLS too");
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);

    // Without the CA the server certificate is not trusted: a clear, fatal error.
    env.extra_env.retain(|(k, _)| k != "CLICKAGG__REDIS__TLS_CA_FILE");
    env.send(&records[..10], 4, None).await;
    let mut untrusted = env.spawn_member("untrusted");
    let code = untrusted.wait(Duration::from_secs(60)).await;
    assert_ne!(code, 0, "{}", untrusted.output());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_clickhouse_with_a_private_ca_and_a_password_counts_exactly() {
    // ClickHouse 18.16: the current engine of the stack serves no HTTPS (guide,
    // "ClickHouse versions").
    let stack = PrivateStack::start_with("chs", &["clickhouse18"], &["CLICKHOUSE18_HTTPS_PORT"]).await;
    let mut env = TestEnv::with_stack("chhttps", &stack).await;
    env.clickhouse_url = format!("https://127.0.0.1:{}", stack.port("CLICKHOUSE18_HTTPS_PORT"));
    env.clickhouse_ca = Some(stack.dir().join("clickhouse18/tls/cert.pem"));
    env.extra_env.extend(
        [("CLICKAGG__CLICKHOUSE__USER", "clickagg"), ("CLICKAGG__CLICKHOUSE__PASSWORD", "clickagg-local-password")]
            .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    let (records, truth) = env.plan(Spec { count: 10_000, seed: 46, ..Spec::default() });
    env.send(&records, 4, None).await;
    let mut member = env.spawn_member("m");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_over_tls_with_a_private_ca_counts_exactly_and_an_untrusted_broker_is_fatal() {
    let stack = PrivateStack::start_with("kssl", &["kafka"], &["KAFKA_SSL_PORT"]).await;
    let mut env = TestEnv::with_stack("kafkatls", &stack).await;
    let ca = stack.dir().join("kafka/tls/cert.pem").display().to_string();
    let ssl = format!("127.0.0.1:{}", stack.port("KAFKA_SSL_PORT"));
    env.extra_env.extend(
        [("CLICKAGG__KAFKA__BROKERS", ssl.as_str()), ("CLICKAGG__KAFKA__SECURITY_PROTOCOL", "ssl")]
            .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    let (records, truth) = env.plan(Spec { count: 10_000, seed: 47, ..Spec::default() });
    env.send(&records, 4, None).await;

    let mut untrusted = env.spawn_member("untrusted");
    let code = untrusted.wait(Duration::from_secs(90)).await;
    assert_eq!(code, 1, "a broker certificate nobody vouches for is fatal:\n{}", untrusted.output());

    env.extra_env.push(("CLICKAGG__KAFKA__SSL_CA_LOCATION".into(), ca));
    let mut member = env.spawn_member("m");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

/// A member must refuse the setups under which exactly-once cannot hold, naming the
/// setting to change, rather than count wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsafe_setups_are_refused_with_the_setting_to_change() {
    let stack = PrivateStack::start("unsafe", &["redis"]).await;
    let env = TestEnv::with_stack("unsafe", &stack).await;
    let (records, _) = env.plan(Spec { count: 100, seed: 48, ..Spec::default() });

    // A compacted click topic: compaction deletes the originals retries are judged by.
    let compacted = format!("{}-compacted", env.topic);
    let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
        rdkafka::ClientConfig::new().set("bootstrap.servers", &env.brokers).create().unwrap();
    let topic = rdkafka::admin::NewTopic::new(&compacted, 1, rdkafka::admin::TopicReplication::Fixed(1))
        .set("cleanup.policy", "compact");
    admin.create_topics([&topic], &rdkafka::admin::AdminOptions::new()).await.unwrap();
    let mut m = env.spawn("compacted", &["run"], &[("CLICKAGG__KAFKA__TOPIC", compacted.as_str())]);
    assert_eq!(m.wait(Duration::from_secs(60)).await, 1, "{}", m.output());
    assert!(m.output().contains("cleanup.policy=compact"), "{}", m.output());

    // An override of a consumer property exactly-once depends on.
    let config = env.log_dir.join("override.toml");
    std::fs::write(&config, "[kafka.properties]\n\"isolation.level\" = \"read_uncommitted\"\n").unwrap();
    let config_arg = config.display().to_string();
    let mut m = env.spawn("override", &["--config", &config_arg, "run"], &[]);
    assert_eq!(m.wait(Duration::from_secs(60)).await, 2, "{}", m.output());
    assert!(m.output().contains("kafka.properties.\"isolation.level\" must not be set"), "{}", m.output());

    // A Redis that may evict dedup state.
    let mut redis = env.redis().await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query_async(&mut redis)
        .await
        .unwrap();
    env.send(&records, 4, None).await;
    let mut m = env.spawn_member("evicting");
    assert_eq!(m.wait(Duration::from_secs(60)).await, 1, "{}", m.output());
    assert!(m.output().contains("maxmemory-policy allkeys-lru"), "{}", m.output());
}

/// The batch size is part of every batch's identity: two members started at once with
/// different sizes must not both write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_size_registered_in_the_same_second_by_a_racing_member_wins_or_loses_for_both() {
    // The interleaving that let two members with different batch sizes both run: A finds
    // no registration, writes 1000 and reads it back; B, which had also found none,
    // writes 500 in the same second. The earliest registration wins, ties to the smaller
    // value: 500. A must not have passed on a read made before B's write landed.
    let env = TestEnv::new("batchreg").await;
    let sink = env.sink();
    sink.migrate().await.unwrap();
    let topic = env.topic.clone();
    let a = {
        let (sink, topic) = (sink.clone(), topic.clone());
        tokio::spawn(async move { sink.register_batch_offsets(&topic, 1000).await.is_ok() })
    };
    // B's write, the moment A's row is there, stamped with A's second.
    let second = wait_until("A's registration is written", Duration::from_secs(10), || async {
        let rows = sink
            .client()
            .query("SELECT toUInt32(registered_at) FROM clickagg_topics WHERE topic = ?")
            .bind(&topic)
            .fetch_all::<u32>()
            .await
            .map_err(|e| e.to_string())?;
        rows.first().copied().ok_or_else(|| "no row yet".to_string())
    })
    .await;
    let literal = topic.replace('\\', "\\\\").replace('\'', "\\'");
    sink.execute(&format!(
        "INSERT INTO clickagg_topics (topic, batch_offsets, registered_at) VALUES ('{literal}', 500, toDateTime({second}))"
    ))
    .await
    .unwrap();
    let b = sink.register_batch_offsets(&topic, 500).await.is_ok();
    let a = a.await.unwrap();
    assert!(b, "the earliest registration (a tie, the smaller value) passes");
    assert!(!a, "A refuses: its read-back must see a write that sorts first and landed in its second");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_members_started_at_once_with_different_batch_sizes_only_one_runs() {
    let env = TestEnv::new("batchrace").await;
    let (records, _) = env.plan(Spec { count: 1_000, seed: 49, ..Spec::default() });
    env.send(&records, 4, None).await;
    let a = env.spawn("a", &["run"], &[("CLICKAGG__PIPELINE__BATCH_OFFSETS", "1000")]);
    let b = env.spawn("b", &["run"], &[("CLICKAGG__PIPELINE__BATCH_OFFSETS", "500")]);
    // One of them refuses within a minute; the other runs until stopped.
    let refused = wait_until("one member refuses the other batch size", Duration::from_secs(60), || async {
        let (ao, bo) = (a.output(), b.output());
        match (ao.contains("refusing to use"), bo.contains("refusing to use")) {
            (true, false) => Ok("a"),
            (false, true) => Ok("b"),
            (true, true) => Err("both refused".into()),
            (false, false) => Err("neither refused yet".into()),
        }
    })
    .await;
    let (mut loser, mut winner) = if refused == "a" { (a, b) } else { (b, a) };
    assert_eq!(loser.wait(Duration::from_secs(30)).await, 1);
    assert_eq!(winner.terminate(Duration::from_secs(30)).await, 0, "{}", winner.output());
    assert!(!winner.output().contains("refusing to use"));
}

/// Issue 21: a rolling update, one member at a time (start the new member, wait until
/// it is ready and a few seconds more, SIGTERM the old one), four members over four partitions
/// replaced one at a time while traffic flows. The counts must be exact, and no
/// partition may go without a commit for longer than the session timeout plus the
/// drain timeout (6 s + 5 s here, as `TestEnv` sets them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_of_four_members_counts_exactly_and_no_partition_stalls_past_session_plus_drain() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;
    const LIMIT: Duration = Duration::from_secs(6 + 5);
    let env = TestEnv::new("rolling").await;
    // About 70 s of traffic at 1 200 records/s: through all four replacements.
    let (records, truth) = env.plan(Spec { count: 84_000, seed: 57, ..Spec::default() });
    let producer = env.spawn_producer(&records, 4, 1_200);
    let mut old: Vec<_> = (0..4).map(|i| env.spawn_member(&format!("old-{i}"))).collect();
    for m in &old {
        m.wait_for_line("partitions assigned", 0, Duration::from_secs(60)).await;
    }
    // Every partition committed once: the group is settled before the update starts.
    wait_until("every partition has a commit", CONVERGE, || async {
        let c = env.committed_offsets().await;
        if c.len() == 4 && c.values().all(|&o| o > 0) {
            Ok(())
        } else {
            Err(format!("{c:?}"))
        }
    })
    .await;

    let updating = AtomicBool::new(true);
    let began = Instant::now();
    // Samples the group's commits every 500 ms while the update runs: per partition, the
    // times its committed offset moved.
    let sample = async {
        let mut moved: BTreeMap<i32, Vec<Duration>> = BTreeMap::new();
        let mut last = BTreeMap::new();
        while updating.load(Ordering::Relaxed) {
            let at = began.elapsed();
            for (p, o) in env.committed_offsets().await {
                if last.insert(p, o) != Some(o) {
                    moved.entry(p).or_default().push(at);
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        moved
    };
    let update = async {
        let mut new = Vec::new();
        for (i, m) in old.iter_mut().enumerate() {
            let n = env.spawn_member(&format!("new-{i}"));
            wait_until("the new member is ready", Duration::from_secs(60), || async {
                match n.http_get("/readyz").await {
                    (200, _) => Ok(()),
                    (code, body) => Err(format!("{code} {body}")),
                }
            })
            .await;
            // The chart's minReadySeconds, scaled down: the new member joins the group
            // (one rebalance) before the old one leaves it (another).
            tokio::time::sleep(Duration::from_secs(4)).await;
            assert_eq!(m.terminate(Duration::from_secs(30)).await, 0, "old-{i} drains and exits 0");
            new.push(n);
        }
        // A few seconds of traffic after the last replacement: its partitions must move too.
        tokio::time::sleep(Duration::from_secs(LIMIT.as_secs() + 2)).await;
        let ended = began.elapsed();
        updating.store(false, Ordering::Relaxed);
        (new, ended)
    };
    let (moved, (mut new, ended)) = tokio::join!(sample, update);
    assert!(!producer.is_finished(), "traffic must flow through the whole update: send more records");
    producer.finished().await;
    env.assert_counts_converge(&truth.counts, CONVERGE).await;

    // The longest time each partition went without a commit, from the update's start
    // to its end (the last gap runs to the end).
    let mut longest = BTreeMap::new();
    for p in 0..4 {
        let times = moved.get(&p).cloned().unwrap_or_default();
        let mut gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
        gaps.push(times.first().copied().unwrap_or(ended));
        gaps.push(ended - times.last().copied().unwrap_or_default());
        longest.insert(p, gaps.into_iter().max().unwrap());
    }
    eprintln!("rolling update over {ended:?}: longest stall per partition {longest:?}");
    for (p, stall) in &longest {
        assert!(*stall <= LIMIT, "partition {p} went {stall:?} without a commit (limit {LIMIT:?}): {longest:?}");
    }
    for n in &mut new {
        assert_eq!(n.terminate(Duration::from_secs(30)).await, 0);
    }
}
