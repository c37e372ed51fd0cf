//! Checks of the deployment files that need no services (Docker cannot run where the
//! tests run): `docker-compose.yml` parses and has the services, health checks and
//! settings the issue asks for, and every `CLICKAGG__…` variable in it and in the
//! `Dockerfile` is accepted by the real settings loader, which rejects unknown keys.
//! A setting renamed in `src/config/` therefore fails here, not in a user's stack.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clickagg::config::{LogFormat, Settings};
use serde_yaml_ng::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(name: &str) -> String {
    let path = repo().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The compose file with YAML anchors resolved and `<<` merge keys applied, as
/// Compose itself reads it.
fn compose() -> Value {
    let mut doc: Value =
        serde_yaml_ng::from_str(&read("docker-compose.yml")).expect("docker-compose.yml is valid YAML");
    doc.apply_merge().expect("docker-compose.yml merge keys apply");
    doc
}

fn service<'a>(doc: &'a Value, name: &str) -> &'a Value {
    doc["services"].get(name).unwrap_or_else(|| panic!("docker-compose.yml has no service {name:?}"))
}

/// A scalar as Compose passes it to the container (numbers and booleans as text).
fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Null => String::new(),
        other => panic!("not a scalar: {other:?}"),
    }
}

/// A service's `environment`, in either of Compose's forms (mapping or `KEY=VALUE` list).
fn environment(svc: &Value) -> BTreeMap<String, String> {
    match svc.get("environment") {
        None => BTreeMap::new(),
        Some(Value::Mapping(m)) => m.iter().map(|(k, v)| (scalar(k), scalar(v))).collect(),
        Some(Value::Sequence(items)) => items
            .iter()
            .map(|item| {
                let item = scalar(item);
                let (k, v) = item.split_once('=').unwrap_or((&item, ""));
                (k.to_string(), v.to_string())
            })
            .collect(),
        Some(other) => panic!("environment is neither a mapping nor a list: {other:?}"),
    }
}

/// The health check's command as one string (`["CMD", …]`, `["CMD-SHELL", "…"]` or a string).
fn healthcheck(doc: &Value, name: &str) -> String {
    let hc = service(doc, name).get("healthcheck").unwrap_or_else(|| panic!("service {name:?} has no healthcheck"));
    assert_ne!(hc.get("disable"), Some(&Value::Bool(true)), "{name}: healthcheck disabled");
    match hc.get("test") {
        Some(Value::Sequence(parts)) => {
            let parts: Vec<String> = parts.iter().map(scalar).collect();
            assert!(
                matches!(parts.first().map(String::as_str), Some("CMD" | "CMD-SHELL")),
                "{name}: healthcheck test must start with CMD or CMD-SHELL: {parts:?}"
            );
            parts[1..].join(" ")
        }
        Some(Value::String(s)) => s.clone(),
        other => panic!("{name}: healthcheck has no test: {other:?}"),
    }
}

/// The command a service runs, as a list of words.
fn command(svc: &Value) -> Vec<String> {
    match svc.get("command") {
        Some(Value::Sequence(parts)) => parts.iter().map(scalar).collect(),
        Some(Value::String(s)) => s.split_whitespace().map(str::to_string).collect(),
        _ => Vec::new(),
    }
}

fn duration(v: &Value) -> Duration {
    humantime::parse_duration(&scalar(v)).unwrap_or_else(|e| panic!("not a duration {v:?}: {e}"))
}

/// Loads `vars` the way `clickagg` loads its environment: only `CLICKAGG__…` pairs
/// count, and an unknown key or a bad value is an error.
fn load(vars: &BTreeMap<String, String>) -> Result<Settings, String> {
    Settings::load_with_vars(None, vec![], vars.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .map_err(|e| e.to_string())
}

fn clickagg_vars(env: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    env.iter().filter(|(k, _)| k.starts_with("CLICKAGG__")).map(|(k, v)| (k.clone(), v.clone())).collect()
}

const CLICKAGG_SERVICES: &[&str] = &["migrate", "aggregator", "producer"];

#[test]
fn compose_has_the_services_with_health_checks() {
    let doc = compose();
    for name in ["kafka", "redis", "clickhouse", "migrate", "aggregator", "producer"] {
        service(&doc, name);
    }
    for name in ["kafka", "redis", "clickhouse", "aggregator"] {
        let test = healthcheck(&doc, name);
        assert!(!test.trim().is_empty(), "{name}: empty healthcheck");
    }
    assert!(healthcheck(&doc, "aggregator").contains("/readyz"), "the aggregator's health is its readiness");

    // Kafka: one KRaft node, broker and controller, no ZooKeeper.
    let kafka = service(&doc, "kafka");
    let image = scalar(&kafka["image"]);
    assert!(image.starts_with("apache/kafka:4."), "{image}");
    let kenv = environment(kafka);
    assert_eq!(kenv.get("KAFKA_PROCESS_ROLES").map(String::as_str), Some("broker,controller"));
    assert!(!kenv.keys().any(|k| k.contains("ZOOKEEPER")), "KRaft mode has no ZooKeeper");
    for rf in ["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] {
        assert_eq!(kenv.get(rf).map(String::as_str), Some("1"), "{rf}: a single broker cannot hold 3 replicas");
    }

    // Redis: AOF on and nothing evicted (an evicted dedup key double-counts).
    let redis_cmd = command(service(&doc, "redis"));
    let arg = |flag: &str| redis_cmd.iter().position(|a| a == flag).and_then(|i| redis_cmd.get(i + 1)).cloned();
    assert_eq!(arg("--appendonly").as_deref(), Some("yes"), "{redis_cmd:?}");
    assert_eq!(arg("--maxmemory-policy").as_deref(), Some("noeviction"), "{redis_cmd:?}");
    assert!(service(&doc, "redis").get("volumes").is_some(), "the AOF must outlive the container");

    // ClickHouse: a current release, pinned.
    let ch_image = scalar(&service(&doc, "clickhouse")["image"]);
    let tag = ch_image.strip_prefix("clickhouse/clickhouse-server:").expect("the official ClickHouse image");
    let major: u32 = tag.split('.').next().and_then(|m| m.parse().ok()).unwrap_or_else(|| panic!("pinned tag: {tag}"));
    assert!(major >= 24, "a current ClickHouse release, not {tag}");
}

#[test]
fn aggregator_is_built_from_the_dockerfile_and_scales_out() {
    let doc = compose();
    let agg = service(&doc, "aggregator");
    let replicas = agg["deploy"]["replicas"].as_u64().expect("aggregator deploy.replicas");
    assert!(replicas >= 2, "replicas = {replicas}");
    assert!(agg.get("container_name").is_none(), "a fixed container_name prevents replicas");
    if let Some(Value::Sequence(ports)) = agg.get("ports") {
        assert!(ports.is_empty(), "host ports collide between replicas: {ports:?}");
    }
    assert_eq!(command(agg).first().map(String::as_str), Some("run"));

    // Every clickagg service runs the image built from ./Dockerfile.
    for name in CLICKAGG_SERVICES {
        let build = service(&doc, name).get("build").unwrap_or_else(|| panic!("{name}: no build"));
        let (context, dockerfile) = match build {
            Value::String(ctx) => (ctx.clone(), "Dockerfile".to_string()),
            Value::Mapping(m) => (
                m.get("context").map(scalar).unwrap_or_else(|| ".".into()),
                m.get("dockerfile").map(scalar).unwrap_or_else(|| "Dockerfile".into()),
            ),
            other => panic!("{name}: build is {other:?}"),
        };
        let path = repo().join(&context).join(&dockerfile);
        assert_eq!(
            path.canonicalize().ok(),
            repo().join("Dockerfile").canonicalize().ok(),
            "{name}: builds {}",
            path.display()
        );
    }

    // Ordering: tables exist before any member writes, services are up before it connects.
    let depends = agg["depends_on"].as_mapping().expect("aggregator depends_on as a mapping with conditions");
    let condition = |dep: &str| depends.get(dep).and_then(|d| d.get("condition")).map(scalar);
    assert_eq!(condition("migrate").as_deref(), Some("service_completed_successfully"));
    assert_eq!(condition("kafka").as_deref(), Some("service_healthy"));
    assert_eq!(condition("redis").as_deref(), Some("service_healthy"));
    assert_eq!(command(service(&doc, "migrate")).first().map(String::as_str), Some("migrate"));
    assert_eq!(scalar(&service(&doc, "migrate")["restart"]), "no", "migrate runs once");

    // SIGTERM drains within pipeline.drain_timeout; Docker must not SIGKILL sooner.
    let settings = load(&clickagg_vars(&environment(agg))).expect("aggregator settings load");
    let grace = duration(agg.get("stop_grace_period").expect("aggregator stop_grace_period"));
    assert!(
        grace > settings.pipeline.drain_timeout + Duration::from_secs(5),
        "stop_grace_period {grace:?} must exceed pipeline.drain_timeout {:?} with a margin",
        settings.pipeline.drain_timeout
    );

    // The health check asks the port the member listens on.
    let port = settings.http.addr.port();
    assert!(
        settings.http.addr.ip().is_unspecified(),
        "http.addr {} is unreachable from outside the container",
        settings.http.addr
    );
    assert!(
        healthcheck(&doc, "aggregator").contains(&format!(":{port}/readyz")),
        "healthcheck port != http.addr port {port}"
    );
}

#[test]
fn every_clickagg_variable_in_compose_is_a_known_setting() {
    let doc = compose();
    let services = doc["services"].as_mapping().expect("services");
    let mut checked = 0;
    for (name, svc) in services {
        let name = scalar(name);
        let vars = clickagg_vars(&environment(svc));
        for (k, v) in &vars {
            // Compose would interpolate `$…`: the container would not get the value written here.
            assert!(!v.contains('$'), "{name}: {k} = {v:?} is interpolated by Compose");
        }
        if vars.is_empty() {
            continue;
        }
        let settings = load(&vars).unwrap_or_else(|e| panic!("service {name}: {e}"));
        checked += vars.len();

        // The loaded settings carry what the file says.
        let get = |k: &str| vars.get(k).map(String::as_str);
        if let Some(v) = get("CLICKAGG__KAFKA__BROKERS") {
            assert_eq!(settings.kafka.brokers, v);
        }
        if let Some(v) = get("CLICKAGG__KAFKA__TOPIC") {
            assert_eq!(settings.kafka.topic, v);
        }
        if let Some(v) = get("CLICKAGG__KAFKA__GROUP") {
            assert_eq!(settings.kafka.group, v);
        }
        if let Some(v) = get("CLICKAGG__REDIS__URL") {
            assert_eq!(settings.redis.url.expose(), v);
        }
        if let Some(v) = get("CLICKAGG__CLICKHOUSE__URL") {
            assert_eq!(settings.clickhouse.url.expose(), v);
        }
        if let Some(v) = get("CLICKAGG__CLICKHOUSE__USER") {
            assert_eq!(settings.clickhouse.user, v);
        }
        if let Some(v) = get("CLICKAGG__CLICKHOUSE__PASSWORD") {
            assert_eq!(settings.clickhouse.password.as_ref().map(|p| p.expose()), Some(v));
        }
        if let Some(v) = get("CLICKAGG__CLICKHOUSE__DATABASE") {
            assert_eq!(settings.clickhouse.database, v);
        }
        if let Some(v) = get("CLICKAGG__HTTP__ADDR") {
            assert_eq!(settings.http.addr.to_string(), v);
        }
        if get("CLICKAGG__LOG__FORMAT") == Some("json") {
            assert_eq!(settings.log.format, LogFormat::Json);
        }
        // Replicas share one environment: a shared static member ID would fence them.
        if CLICKAGG_SERVICES.contains(&name.as_str()) {
            assert!(
                settings.kafka.group_instance_id.is_none(),
                "{name}: kafka.group_instance_id is shared by every replica"
            );
        }
    }
    assert!(checked > 0, "no CLICKAGG__ variables found in docker-compose.yml");

    // What the aggregator is told must match what the other services are.
    let agg = clickagg_vars(&environment(service(&doc, "aggregator")));
    let settings = load(&agg).expect("aggregator settings");
    assert_eq!(settings.kafka.brokers, "kafka:9092");
    let kafka_env = environment(service(&doc, "kafka"));
    let advertised = kafka_env.get("KAFKA_ADVERTISED_LISTENERS").expect("KAFKA_ADVERTISED_LISTENERS");
    for broker in settings.kafka.brokers.split(',') {
        assert!(
            advertised.contains(&format!("://{broker}")),
            "broker {broker} is not advertised by kafka: {advertised}"
        );
    }
    let redis = url::Url::parse(settings.redis.url.expose()).expect("redis.url");
    assert_eq!(redis.host_str(), Some("redis"));
    let ch = url::Url::parse(settings.clickhouse.url.expose()).expect("clickhouse.url");
    assert_eq!(ch.host_str(), Some("clickhouse"));
    let ch_env = environment(service(&doc, "clickhouse"));
    assert_eq!(ch_env.get("CLICKHOUSE_USER"), Some(&settings.clickhouse.user), "ClickHouse user");
    assert_eq!(
        ch_env.get("CLICKHOUSE_PASSWORD").map(String::as_str),
        settings.clickhouse.password.as_ref().map(|p| p.expose()),
        "ClickHouse password"
    );
    for name in CLICKAGG_SERVICES {
        let vars = clickagg_vars(&environment(service(&doc, name)));
        assert_eq!(vars, agg, "{name} and aggregator disagree on settings");
    }
}

/// The demo can be repeated: the producer draws a fresh seed each run (a fixed one
/// re-sends the last run's click IDs, rightly dropped as duplicates) and adds its
/// counts to the truth in the `demo` volume, where `verify` (run in the same service)
/// reads it. `operability::the_compose_demo_can_be_run_twice_and_verifies_each_time`
/// runs this command twice against the real services.
#[test]
fn the_compose_demo_producer_can_be_repeated() {
    let doc = compose();
    let producer = service(&doc, "producer");
    let cmd = command(producer);
    assert_eq!(cmd.first().map(String::as_str), Some("produce"), "{cmd:?}");
    assert!(!cmd.iter().any(|w| w.starts_with("--seed")), "a fixed seed repeats the last run's clicks: {cmd:?}");
    assert!(cmd.iter().any(|w| w == "--add-to-truth"), "each run must add to the truth, not replace it: {cmd:?}");
    assert!(!cmd.iter().any(|w| w.starts_with("--truth")), "verify reads truth.csv in the working directory: {cmd:?}");
    let workdir = dockerfile()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("WORKDIR "))
        .next_back()
        .expect("the runtime stage's WORKDIR")
        .trim()
        .to_string();
    let volumes: Vec<String> =
        producer["volumes"].as_sequence().expect("producer volumes").iter().map(scalar).collect();
    assert!(
        volumes.iter().any(|v| v.split(':').nth(1) == Some(workdir.as_str())),
        "the demo volume must be the working directory {workdir}, where truth.csv is: {volumes:?}"
    );
}

#[test]
fn a_misspelt_variable_would_fail_the_check() {
    // The guard the compose check relies on: the loader rejects an unknown key.
    let vars = BTreeMap::from([("CLICKAGG__KAFKA__BROKER".to_string(), "kafka:9092".to_string())]);
    let e = load(&vars).expect_err("an unknown key must be rejected");
    assert!(e.contains("\"broker\""), "{e}");
}

/// `ENV` instructions of a Dockerfile: `ENV K=V [K2=V2 …]` and the old `ENV K V`,
/// with line continuations and simple quotes.
fn dockerfile_env(text: &str) -> BTreeMap<String, String> {
    let joined = text.replace("\\\n", " ");
    let mut out = BTreeMap::new();
    for line in joined.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("ENV ").or_else(|| line.strip_prefix("env ")) else { continue };
        let rest = rest.trim();
        let unquote = |s: &str| s.trim_matches('"').trim_matches('\'').to_string();
        let first = rest.split_whitespace().next().unwrap_or_default();
        if !first.contains('=') {
            let value = rest[first.len()..].trim();
            out.insert(first.to_string(), unquote(value));
            continue;
        }
        for pair in rest.split_whitespace() {
            let (k, v) = pair.split_once('=').unwrap_or_else(|| panic!("ENV {rest}: {pair} is not KEY=VALUE"));
            out.insert(k.to_string(), unquote(v));
        }
    }
    out
}

fn dockerfile() -> String {
    read("Dockerfile")
}

#[test]
fn dockerfile_env_settings_load() {
    let text = dockerfile();
    let vars = clickagg_vars(&dockerfile_env(&text));
    assert!(vars.contains_key("CLICKAGG__HTTP__ADDR"), "the image must listen beyond loopback: {vars:?}");
    let settings = load(&vars).unwrap_or_else(|e| panic!("Dockerfile ENV: {e}"));
    assert!(settings.http.addr.ip().is_unspecified(), "http.addr {}", settings.http.addr);
    let port = settings.http.addr.port();
    assert!(
        text.lines().any(|l| l
            .trim()
            .strip_prefix("EXPOSE")
            .is_some_and(|p| p.split_whitespace().any(|p| p == port.to_string()))),
        "the Dockerfile must EXPOSE {port}"
    );
}

#[test]
fn dockerfile_builds_the_binary_with_what_the_sources_embed() {
    let text = dockerfile();
    let instructions: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.starts_with('#')).collect();
    assert!(
        instructions.iter().any(|l| l.contains("cargo build --release --locked")),
        "a release build from Cargo.lock"
    );
    assert!(instructions.iter().any(|l| l.starts_with("ENTRYPOINT") && l.contains("clickagg")));
    assert!(
        instructions.iter().any(|l| l.starts_with("USER") && !l.contains("root") && !l.contains(" 0")),
        "runs as non-root"
    );
    let copied = |dir: &str| {
        instructions
            .iter()
            .any(|l| l.starts_with("COPY") && l.split_whitespace().any(|w| w.trim_end_matches('/') == dir))
    };

    // Directories read at compile time (include_str!/include_bytes! "../dir/…") must be
    // in the build stage, or the image build fails while `cargo build` here passes.
    let mut embedded = vec!["src".to_string()];
    for entry in std::fs::read_dir(repo().join("src")).expect("src/") {
        let path = entry.expect("src entry").path();
        if path.extension().is_some_and(|e| e == "rs") {
            embedded.extend(included_dirs(&path));
        }
    }
    embedded.sort();
    embedded.dedup();
    // The build script is read at build time too.
    if repo().join("build.rs").exists() {
        assert!(
            instructions.iter().any(|l| l.starts_with("COPY") && l.split_whitespace().any(|w| w == "build.rs")),
            "the Dockerfile does not COPY build.rs"
        );
    }
    assert!(embedded.len() > 1, "expected src/sink.rs to embed sql/");
    for dir in &embedded {
        assert!(copied(dir), "the Dockerfile does not COPY {dir}/, which the sources embed");
    }

    // And .dockerignore keeps build output and service data out of the context.
    let ignore = read(".dockerignore");
    for pattern in ["target", ".git", ".stack"] {
        assert!(
            ignore.lines().any(|l| l.trim().trim_end_matches('/').trim_start_matches('/') == pattern),
            ".dockerignore lacks {pattern}"
        );
    }
}

/// Top-level directories that `include_str!("../dir/…")` and friends in `file` read.
fn included_dirs(file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).expect("source file");
    let mut dirs = Vec::new();
    for macro_name in ["include_str!(\"", "include_bytes!(\""] {
        for (i, _) in text.match_indices(macro_name) {
            let arg = &text[i + macro_name.len()..];
            let arg = &arg[..arg.find('"').unwrap_or(0)];
            // Relative to src/: "../sql/x.sql" is sql/, "x.txt" is in src/ itself.
            if let Some(rest) = arg.strip_prefix("../") {
                if let Some((dir, _)) = rest.split_once('/') {
                    dirs.push(dir.to_string());
                }
            }
        }
    }
    dirs
}

/// What Prometheus and Grafana in the compose file read from the repository: every
/// bind-mounted path exists (Docker would otherwise create an empty directory in its
/// place and start without config), and Prometheus scrapes the port the aggregator
/// listens on.
#[test]
fn compose_monitoring_mounts_exist_and_prometheus_scrapes_the_members() {
    let doc = compose();
    for name in ["prometheus", "grafana"] {
        service(&doc, name);
    }
    for (name, svc) in doc["services"].as_mapping().expect("services") {
        let Some(Value::Sequence(volumes)) = svc.get("volumes") else { continue };
        for v in volumes.iter().map(scalar) {
            let source = v.split(':').next().unwrap_or_default();
            if source.starts_with('.') || source.starts_with('/') {
                assert!(repo().join(source).exists(), "{}: mounts {source}, which does not exist", scalar(name));
            }
        }
    }

    let prom: Value = serde_yaml_ng::from_str(&read("deploy/prometheus/prometheus.yml")).expect("prometheus.yml");
    let rule_files: Vec<String> = prom["rule_files"].as_sequence().expect("rule_files").iter().map(scalar).collect();
    assert!(rule_files.iter().any(|f| f == "alerts.yml"), "the alerts are not loaded: {rule_files:?}");
    let settings = load(&clickagg_vars(&environment(service(&doc, "aggregator")))).expect("aggregator settings");
    let job = prom["scrape_configs"]
        .as_sequence()
        .and_then(|jobs| jobs.iter().find(|j| j["job_name"].as_str() == Some("clickagg")))
        .expect("a scrape job named clickagg (the alerts match job=\"clickagg\")");
    let sd = &job["dns_sd_configs"][0];
    let names: Vec<String> = sd["names"].as_sequence().expect("dns_sd names").iter().map(scalar).collect();
    assert_eq!(names, ["aggregator"], "Prometheus must find every aggregator replica");
    assert_eq!(sd["port"].as_u64(), Some(u64::from(settings.http.addr.port())), "scrape port != http.addr port");
}

// ------------------------------------------------------------------ the Helm chart
//
// `scripts/helm-check` renders and validates the chart; what it cannot do is load the
// configuration a member would start with through clickagg's own loader. These
// tests rebuild that configuration from the values files the way the chart does
// (Helm merges each file over values.yaml; the ConfigMap is `config` as TOML with
// pipeline.drain_timeout from drainTimeoutSeconds; the StatefulSet's environment adds
// the group instance ID, http.addr and the secrets), so a misspelt or renamed
// setting, or values clickagg refuses, fail here.

const CHART: &str = "deploy/helm/clickagg";

/// `over` merged into `base` as Helm merges values files: maps key by key, anything
/// else replaced.
fn merge_values(base: &mut Value, over: &Value) {
    match (base, over) {
        (Value::Mapping(b), Value::Mapping(o)) => {
            for (k, v) in o {
                match b.get_mut(k) {
                    Some(slot) => merge_values(slot, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (slot, v) => *slot = v.clone(),
    }
}

fn chart_values(file: Option<&str>) -> Value {
    let mut values: Value = serde_yaml_ng::from_str(&read(&format!("{CHART}/values.yaml"))).expect("values.yaml");
    if let Some(file) = file {
        let over: Value = serde_yaml_ng::from_str(&read(&format!("{CHART}/{file}"))).expect(file);
        merge_values(&mut values, &over);
    }
    values
}

/// The environment variable of each Secret key (the chart's "clickagg.secretFileVars",
/// without `_FILE`): every setting clickagg reads from a `<VAR>_FILE`.
const CHART_SECRET_VARS: &[(&str, &str)] = &[
    ("kafka-sasl-password", "CLICKAGG__KAFKA__SASL_PASSWORD"),
    ("kafka-ssl-key-password", "CLICKAGG__KAFKA__SSL_KEY_PASSWORD"),
    ("kafka-oauth-client-secret", "CLICKAGG__KAFKA__OAUTH_CLIENT_SECRET"),
    ("redis-password", "CLICKAGG__REDIS__PASSWORD"),
    ("redis-url", "CLICKAGG__REDIS__URL"),
    ("clickhouse-password", "CLICKAGG__CLICKHOUSE__PASSWORD"),
    ("clickhouse-url", "CLICKAGG__CLICKHOUSE__URL"),
    ("dedup-fingerprint-key", "CLICKAGG__DEDUP__FINGERPRINT_KEY"),
];

/// A member's settings under the chart with `file` over its defaults.
fn chart_member_settings(file: Option<&str>) -> (Settings, Value) {
    let values = chart_values(file);
    let mut config = values["config"].clone();
    let drain = values["drainTimeoutSeconds"].as_u64().expect("drainTimeoutSeconds, whole seconds");
    let pipeline = config
        .as_mapping_mut()
        .expect("config is a map")
        .entry(Value::from("pipeline"))
        .or_insert_with(|| Value::Mapping(Default::default()));
    pipeline.as_mapping_mut().expect("config.pipeline").insert("drain_timeout".into(), format!("{drain}s").into());

    // Certificates are files of the tls Secret: stand-ins with a real PEM certificate.
    let dir = tempfile::tempdir().expect("temp dir");
    let mount = values["tls"]["mountPath"].as_str().expect("tls.mountPath").trim_end_matches('/').to_string();
    let pem = std::fs::read("/etc/ssl/certs/ca-certificates.crt").expect("the system's CA bundle, as a PEM file");
    for section in ["kafka", "redis", "clickhouse"] {
        let Some(Value::Mapping(table)) = config.get_mut(section) else { continue };
        for (key, value) in table.iter_mut() {
            let Value::String(path) = value else { continue };
            if let Some(file) = path.strip_prefix(&format!("{mount}/")) {
                let local = dir.path().join(file);
                std::fs::write(&local, &pem).expect("stand-in certificate");
                *value = Value::from(local.display().to_string());
                assert!(scalar(key).ends_with("_file") || scalar(key).ends_with("_location"), "{section}.{key:?}");
            }
        }
    }
    let path = dir.path().join("clickagg.toml");
    std::fs::write(&path, toml::to_string(&config).expect("config as TOML")).expect("clickagg.toml");

    let mut vars = BTreeMap::from([
        ("CLICKAGG__KAFKA__GROUP_INSTANCE_ID".to_string(), "clickagg-0".to_string()),
        ("CLICKAGG__HTTP__ADDR".to_string(), scalar(&config["http"]["addr"])),
    ]);
    // Each secret the Secret holds reaches clickagg as a file named by `<VAR>_FILE`, as
    // the chart mounts it: a stand-in file per key, ending in a newline like most
    // secrets written with `echo` or an editor (clickagg drops one).
    let keys: Vec<String> = match (&values["secret"]["existingSecret"], &values["secret"]["values"]) {
        (Value::String(s), _) if !s.is_empty() => {
            values["secret"]["keys"].as_sequence().expect("secret.keys").iter().map(scalar).collect()
        }
        (_, Value::Mapping(m)) => m.keys().map(scalar).collect(),
        _ => Vec::new(),
    };
    for key in keys {
        let var = CHART_SECRET_VARS.iter().find(|(k, _)| *k == key).unwrap_or_else(|| panic!("secret key {key}"));
        let stand_in = match key.as_str() {
            "redis-url" => "redis://stand-in:6379/",
            "clickhouse-url" => "https://clickhouse-stand-in:8443/",
            _ => "stand-in",
        };
        let file = dir.path().join(&key);
        std::fs::write(&file, format!("{stand_in}\n")).expect("stand-in secret file");
        vars.insert(format!("{}_FILE", var.1), file.display().to_string());
    }
    let settings = Settings::load_with_vars(Some(&path), vec![], vars.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .unwrap_or_else(|e| panic!("{CHART} with {file:?}: {e}"));
    (settings, values)
}

#[test]
fn the_helm_charts_configuration_loads_and_its_grace_period_covers_the_drain() {
    for file in [None, Some("values-cluster.yaml"), Some("ci/all-on-values.yaml")] {
        let (settings, values) = chart_member_settings(file);
        let grace =
            values["drainTimeoutSeconds"].as_u64().unwrap() + values["terminationGraceMarginSeconds"].as_u64().unwrap();
        assert!(
            Duration::from_secs(grace) >= settings.pipeline.drain_timeout + Duration::from_secs(5),
            "{file:?}: terminationGracePeriodSeconds {grace} vs pipeline.drain_timeout {:?}",
            settings.pipeline.drain_timeout
        );
        assert_eq!(settings.kafka.group_instance_id.as_deref(), Some("clickagg-0"), "{file:?}");
        assert!(settings.http.enabled && settings.http.addr.ip().is_unspecified(), "{file:?}: {}", settings.http.addr);
    }
    let (cluster, _) = chart_member_settings(Some("values-cluster.yaml"));
    assert!(cluster.redis.is_cluster(), "values-cluster.yaml: a Redis Cluster");
    assert_eq!(cluster.kafka.brokers.split(',').count(), 3, "values-cluster.yaml: 3 brokers");
    assert_eq!(cluster.clickhouse.cluster.as_deref(), Some("clickagg_cluster"));
    assert_eq!(cluster.clickhouse.quorum(), 2);
    // The secrets came from their files, without the newline that ends them.
    assert_eq!(cluster.kafka.sasl_password.as_ref().map(|p| p.expose()), Some("stand-in"));
    assert_eq!(cluster.dedup.fingerprint_key.expose(), "stand-in");
}

#[test]
fn the_helm_charts_secret_files_and_alerts_are_the_ones_deployed() {
    // The same key → variable table as the chart's template and scripts/helm-check.py.
    let helpers = read(&format!("{CHART}/templates/_helpers.tpl"));
    for (key, var) in CHART_SECRET_VARS {
        assert!(helpers.contains(&format!("{key}: {var}_FILE")), "_helpers.tpl lacks {key}: {var}_FILE");
    }
    use clickagg::config::secret_files::{var_name, SECRET_KEYS};
    let vars: Vec<String> = SECRET_KEYS.iter().map(|k| var_name(k)).collect();
    let chart: Vec<String> = CHART_SECRET_VARS.iter().map(|(_, v)| v.to_string()).collect();
    assert_eq!(chart, vars, "the chart's secret keys are not the settings clickagg reads from files");
    assert_eq!(
        read(&format!("{CHART}/files/alerts.yml")),
        read("deploy/prometheus/alerts.yml"),
        "the chart's alerts.yml is not deploy/prometheus/alerts.yml: copy it"
    );
}
