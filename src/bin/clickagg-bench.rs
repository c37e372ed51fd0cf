//! `clickagg-bench`: the raw ceilings `scripts/bench` sets the pipeline against, and the
//! memory of the dedup cache. A measuring tool, not part of the product.
//!
//! ```text
//! clickagg-bench consume --brokers B --topic T --records N
//!     an rdkafka consumer that only counts records: the broker's and client's ceiling
//! clickagg-bench claims --redis-url U --claims N
//!     the Redis function the pipeline calls, with the same chunks and pipelining,
//!     and nothing else: Redis's ceiling for clickagg's claims, and the Redis CPU time
//!     each claim costs (masters and replicas, from INFO cpu)
//! clickagg-bench memory --redis-url U --keys N --layout new|old --flush-all
//!     FLUSHALL (a Redis of its own!), then N dedup keys; bytes per key from used_memory
//! clickagg-bench private-memory --clicks N
//!     the private dedup state of one partition (a member re-reading what the cache
//!     cannot decide, a replay): N distinct clicks sighted within one window; bytes
//!     per click held, from the process's resident memory
//! clickagg-bench decode --records N --rounds R
//!     the decoder alone, on the generator's records (clicks, duplicates, 1 % bad) in
//!     JSON, Avro and Protobuf, fingerprint included, as a member decodes them: the
//!     median over R rounds of the time per record, the formats interleaved per round
//! ```
//!
//! `--redis-url` takes a comma-separated list of every node of a Redis Cluster too
//! (`scripts/stack env cluster`): claims then go through the cluster client with the
//! member's defaults (16 key groups, WAIT for one replica; `--groups`, `--wait-replicas`),
//! and memory is summed over the masters (replicas hold as much again).

use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use clickagg::cache::SharedCache;
use clickagg::config::{KafkaSettings, Settings};
use clickagg::dedup::{Claim, ClaimBatch, ClaimMode, Fingerprinter, ReaderClaim, Secs, Sighting};
use futures_util::StreamExt;
use rand::{Rng, SeedableRng};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::{Offset, TopicPartitionList};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Layout {
    /// clickagg 0.1: `SET <prefix><click_id> <topic>/<partition>/<offset> NX GET EX`.
    Old,
    /// Sharded hashes of fingerprints, written by `claim.lua`.
    New,
}

#[derive(Subcommand)]
enum Command {
    Consume {
        #[arg(long, default_value = "127.0.0.1:9092")]
        brokers: String,
        #[arg(long)]
        topic: String,
        #[arg(long)]
        records: u64,
    },
    Claims {
        #[arg(long, default_value = "redis://127.0.0.1:6379/")]
        redis_url: String,
        #[arg(long, default_value_t = 2_000_000)]
        claims: u64,
        #[arg(long, default_value_t = 2_000)]
        chunk: usize,
        /// Claims sent first and not timed: the cache a member's window keeps full. The
        /// sizing rule fills each shard hash with 64-128 entries, and a claim into such
        /// a hash costs Redis more than one into a nearly empty one.
        #[arg(long, default_value_t = 0)]
        prefill: u64,
        /// dedup.shards of the cache.
        #[arg(long, default_value_t = 1 << 16)]
        shards: u32,
        /// Key groups on a Redis Cluster (redis.slot_groups).
        #[arg(long)]
        groups: Option<u32>,
        /// Replicas each claim waits for (redis.wait_replicas).
        #[arg(long)]
        wait_replicas: Option<u32>,
    },
    Memory {
        #[arg(long)]
        redis_url: String,
        #[arg(long, default_value_t = 10_000_000)]
        keys: u64,
        #[arg(long, value_enum)]
        layout: Layout,
        /// Confirms the Redis is this benchmark's alone: it is emptied first.
        #[arg(long)]
        flush_all: bool,
    },
    PrivateMemory {
        #[arg(long, default_value_t = 10_000_000)]
        clicks: u64,
    },
    Decode {
        #[arg(long, default_value_t = 200_000)]
        records: u64,
        #[arg(long, default_value_t = 9)]
        rounds: usize,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Consume { brokers, topic, records } => consume(brokers, topic, records).await,
        Command::Claims { redis_url, claims, chunk, prefill, shards, groups, wait_replicas } => {
            claims_rate(redis_url, claims, chunk, prefill, shards, groups, wait_replicas).await
        }
        Command::Memory { redis_url, keys, layout, flush_all } => {
            anyhow::ensure!(flush_all, "memory empties the Redis first: pass --flush-all for a Redis of its own");
            memory(redis_url, keys, layout).await
        }
        Command::PrivateMemory { clicks } => private_memory(clicks),
        Command::Decode { records, rounds } => {
            decode_costs(records, rounds);
            Ok(())
        }
    }
}

/// The decoder's cost per record in each format (see the module's doc).
fn decode_costs(records: u64, rounds: usize) {
    if cfg!(debug_assertions) {
        eprintln!("decode: a debug build; measure with `cargo build --release --bin clickagg-bench`");
    }
    use clickagg::click::{decode_wire_with, decode_with, Known, Limits, Schema, WireFormat};
    use clickagg::produce::{plan, schema_text, Encoding, Spec};
    let limits = Limits::default();
    let fingerprints = Fingerprinter::new("bench-key");
    let spec = Spec { count: records, start_ms: 1_764_489_600_000, ..Spec::default() };
    let formats = [
        ("json", Encoding::Json, None),
        ("avro", Encoding::Avro { id: 1, revision: 2 }, Some(WireFormat::Avro)),
        ("protobuf", Encoding::Protobuf { id: 1, revision: 2 }, Some(WireFormat::Protobuf)),
    ];
    let inputs: Vec<_> = formats
        .iter()
        .map(|&(name, encoding, wire)| {
            let (planned, _) = plan(&Spec { encoding, ..spec.clone() });
            let known = wire.map(|f| {
                Known::Schema(std::sync::Arc::new(Schema::compile(f, &schema_text(encoding).unwrap().1, &[]).unwrap()))
            });
            (name, wire, known, planned)
        })
        .collect();
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); inputs.len()];
    for _ in 0..rounds {
        for (i, (_, wire, known, planned)) in inputs.iter().enumerate() {
            let started = Instant::now();
            let mut ok = 0u64;
            for r in planned {
                let payload = (!r.payload.is_empty()).then_some(r.payload.as_slice());
                let id_of = |id: &str| fingerprints.of(id);
                let outcome = match wire {
                    None => decode_with(payload, Some(r.timestamp_ms), &limits, id_of),
                    Some(f) => decode_wire_with(*f, payload, Some(r.timestamp_ms), &limits, |_| known.clone(), id_of),
                };
                ok += u64::from(outcome.is_ok());
            }
            samples[i].push(started.elapsed().as_secs_f64() * 1e9 / planned.len() as f64);
            std::hint::black_box(ok);
        }
    }
    for ((name, _, _, planned), mut s) in inputs.iter().zip(samples) {
        s.sort_by(f64::total_cmp);
        let bytes: usize = planned.iter().map(|r| r.payload.len()).sum();
        println!(
            "decode {name:<9} median {:>6.0} ns/record (min {:.0}, max {:.0}; {rounds} rounds of {} records, {:.0} bytes each)",
            s[s.len() / 2],
            s[0],
            s[s.len() - 1],
            planned.len(),
            bytes as f64 / planned.len() as f64
        );
    }
}

/// The resident memory of this process, in bytes (Linux).
fn resident_bytes() -> anyhow::Result<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = statm.split_whitespace().nth(1).ok_or_else(|| anyhow::anyhow!("statm"))?.parse()?;
    Ok(pages * 4096)
}

/// Sights `clicks` distinct fingerprints on one partition within one window and reports
/// the resident memory it took per click held.
fn private_memory(clicks: u64) -> anyhow::Result<()> {
    let fingerprints = Fingerprinter::new("bench");
    let before = resident_bytes()?;
    let started = Instant::now();
    let mut scope = clickagg::dedup::PrivateScope::new(Secs::new(86_400));
    for i in 0..clicks {
        let fp = fingerprints.of(&format!("click-{i}"));
        // A day of record time: everything stays within the window.
        scope.sight(0, fp.0, Secs::new(1_700_000_000 + (i * 86_400 / clicks.max(1)) as u32), None);
    }
    let after = resident_bytes()?;
    let held = scope.len() as f64;
    println!(
        "private dedup state: {} clicks held, {:.1} bytes per click ({:.0} MB), {:.2} s ({:.0} ns per sighting)",
        scope.len(),
        (after.saturating_sub(before)) as f64 / held,
        (after.saturating_sub(before)) as f64 / 1e6,
        started.elapsed().as_secs_f64(),
        started.elapsed().as_nanos() as f64 / clicks.max(1) as f64
    );
    Ok(())
}

/// Reads `records` records from the start of every partition and only counts them.
async fn consume(brokers: String, topic: String, records: u64) -> anyhow::Result<()> {
    let k = KafkaSettings { brokers, topic: topic.clone(), ..KafkaSettings::default() };
    let group = format!("clickagg-bench-{}", rand::random::<u32>());
    let consumer: StreamConsumer = clickagg::source::assigned_consumer_config(&k, &group).create()?;
    let parts = clickagg::source::partitions(&consumer, &topic, Duration::from_secs(10))?;
    let mut tpl = TopicPartitionList::new();
    for p in parts {
        tpl.add_partition_offset(&topic, p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let mut stream = consumer.stream();
    let mut seen = 0u64;
    let mut started = None;
    while seen < records {
        match stream.next().await {
            Some(Ok(_)) => {
                started.get_or_insert_with(Instant::now);
                seen += 1;
            }
            Some(Err(e)) => anyhow::bail!("consume: {e}"),
            None => break,
        }
    }
    let secs = started.map_or(0.0, |s| s.elapsed().as_secs_f64());
    println!("bare consume: {seen} records in {secs:.2} s = {:.0} records/s", seen as f64 / secs);
    Ok(())
}

/// The claims a pipeline makes for `n` records: 90 % new click IDs, 10 % repeats of a
/// recent one, on 4 partitions in offset order, at the current record time.
fn claims(n: u64, fingerprints: &Fingerprinter) -> Vec<Claim> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let now = chrono::Utc::now().timestamp() as u32;
    let mut recent = Vec::new();
    (0..n)
        .map(|i| {
            let fp = if rng.random_bool(0.1) && !recent.is_empty() {
                recent[rng.random_range(0..recent.len())]
            } else {
                let fp = fingerprints.of(&format!("{:032x}", rng.random::<u128>()));
                if recent.len() < 1_000 {
                    recent.push(fp);
                } else {
                    recent[(i % 1_000) as usize] = fp;
                }
                fp
            };
            let sighting = Sighting::at((i % 4) as i32, (i / 4) as i64, Secs::new(now));
            Claim { fingerprint: fp, sighting, mode: ClaimMode::default() }
        })
        .collect()
}

/// The cache a member with these settings would use (a cluster for a list of URLs).
fn cache(
    redis_url: &str,
    prefix: &str,
    shards: u32,
    groups: Option<u32>,
    wait_replicas: Option<u32>,
) -> anyhow::Result<SharedCache> {
    let mut s = Settings::default();
    s.redis.url = clickagg::config::SecretUrl::new(redis_url.to_string());
    s.redis.key_prefix = prefix.to_string();
    s.redis.timeout = Duration::from_secs(30);
    s.redis.slot_groups = groups.filter(|_| s.redis.is_cluster());
    s.redis.wait_replicas = wait_replicas;
    s.kafka.topic = "bench".into();
    s.dedup.shards = shards;
    s.validate()?;
    Ok(clickagg::cache::SharedCache::connect(&s.redis, &s.rules(), &s.kafka.topic)?)
}

/// One connection per node of `redis_url` (one, or every node of a cluster).
async fn nodes(redis_url: &str) -> anyhow::Result<Vec<(String, redis::aio::MultiplexedConnection)>> {
    let mut out = Vec::new();
    for url in redis_url.split(',') {
        // No response timeout: FLUSHALL of millions of keys takes seconds.
        let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
        let conn = redis::Client::open(url)?.get_multiplexed_async_connection_with_config(&config).await?;
        out.push((url.to_string(), conn));
    }
    Ok(out)
}

/// A field of `INFO <section>`, as a number.
async fn info(conn: &mut redis::aio::MultiplexedConnection, section: &str, field: &str) -> anyhow::Result<f64> {
    let text: String = redis::cmd("INFO").arg(section).query_async(conn).await?;
    let prefix = format!("{field}:");
    let line = text.lines().find(|l| l.starts_with(&prefix)).ok_or_else(|| anyhow::anyhow!("no {field}"))?;
    Ok(line[prefix.len()..].trim().parse()?)
}

async fn is_master(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<bool> {
    let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(conn).await?;
    Ok(redis::from_redis_value_ref::<String>(&role[0])? == "master")
}

/// CPU seconds (user + system) every node of `redis_url` has used, masters and
/// replicas apart.
async fn cpu_seconds(redis_url: &str) -> anyhow::Result<(f64, f64)> {
    let (mut masters, mut replicas) = (0.0, 0.0);
    for (_, mut conn) in nodes(redis_url).await? {
        let cpu = info(&mut conn, "cpu", "used_cpu_user").await? + info(&mut conn, "cpu", "used_cpu_sys").await?;
        if is_master(&mut conn).await? {
            masters += cpu;
        } else {
            replicas += cpu;
        }
    }
    Ok((masters, replicas))
}

/// Claims as the member makes them, one poll batch (`chunk`) per call, two in flight.
async fn claims_rate(
    redis_url: String,
    n: u64,
    chunk: usize,
    prefill: u64,
    shards: u32,
    groups: Option<u32>,
    wait_replicas: Option<u32>,
) -> anyhow::Result<()> {
    let prefix = format!("clickagg-bench-{}:", rand::random::<u32>());
    let mut untimed = claims(prefill + n, &Fingerprinter::new("bench"));
    let timed = untimed.split_off(prefill as usize);
    let health = clickagg::health::Health::new();
    let memory_before = masters_memory(&redis_url).await?;
    let cache = cache(&redis_url, &prefix, shards, groups, wait_replicas)?;
    let layout = format!("{} key group(s), {shards} shard hashes", cache.groups());
    let in_flight = clickagg::config::PipelineSettings::default().claims_in_flight;
    let (claimer, mut verdicts) = clickagg::cache::Claimer::start(cache, Duration::from_secs(1), in_flight, health);
    // Sends `claims` in chunks, `in_flight` calls ahead of the verdicts, until every
    // call is answered.
    let mut send_all = async |claims: Vec<Claim>| -> anyhow::Result<()> {
        let chunks: Vec<Vec<Claim>> = claims.chunks(chunk).map(<[Claim]>::to_vec).collect();
        let total = chunks.len();
        let mut chunks = chunks.into_iter();
        let (mut sent, mut received) = (0, 0);
        while received < total {
            while sent < total && sent - received < in_flight + 1 {
                let claims = chunks.next().expect("counted");
                let claims = claims.into_iter().map(|claim| ReaderClaim { claim, generation: 0 }).collect();
                claimer.claim(ClaimBatch { claims, marks: Vec::new() });
                sent += 1;
            }
            verdicts.recv().await.expect("claimer running")?;
            received += 1;
        }
        Ok(())
    };
    if prefill > 0 {
        send_all(untimed).await?;
        println!(
            "redis claims: {prefill} claims sent first, not timed ({:.1} per shard hash)",
            prefill as f64 / shards as f64
        );
    }
    let cpu_before = cpu_seconds(&redis_url).await?;
    let started = Instant::now();
    send_all(timed).await?;
    let secs = started.elapsed().as_secs_f64();
    let cpu_after = cpu_seconds(&redis_url).await?;
    let (master_cpu, replica_cpu) = (cpu_after.0 - cpu_before.0, cpu_after.1 - cpu_before.1);
    println!(
        "redis claims: {n} claims in {secs:.2} s = {:.0} claims/s (chunks of {chunk}, {in_flight} in flight, {layout}); \
         Redis CPU per claim: masters {:.2} us, replicas {:.2} us = {:.0} claims per master CPU-second; \
         master CPU busy {:.1} % of the time",
        n as f64 / secs,
        master_cpu * 1e6 / n as f64,
        replica_cpu * 1e6 / n as f64,
        n as f64 / master_cpu,
        master_cpu * 100.0 / secs
    );
    // Most claims are new clicks (`claims` repeats one in ten): memory per claim is
    // close to memory per cache entry.
    let grown = masters_memory(&redis_url).await?.saturating_sub(memory_before);
    println!(
        "redis claims: used_memory grew {} MB, {:.1} B per claim sent",
        grown >> 20,
        grown as f64 / (prefill + n) as f64
    );
    // Leave no benchmark keys behind, on every master (each scans its own keys). SCAN,
    // not KEYS: a shared Redis may hold millions of other keys.
    for (_, mut conn) in nodes(&redis_url).await? {
        if !is_master(&mut conn).await? {
            continue;
        }
        let mut keys: Vec<String> = Vec::new();
        let mut cursor = 0u64;
        loop {
            let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{prefix}*"))
                .arg("COUNT")
                .arg(10_000)
                .query_async(&mut conn)
                .await?;
            keys.extend(found);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        for key in keys {
            let _: () = redis::cmd("UNLINK").arg(key).query_async(&mut conn).await?;
        }
    }
    Ok(())
}

async fn used_memory(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<u64> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(conn).await?;
    let line = info.lines().find(|l| l.starts_with("used_memory:")).ok_or_else(|| anyhow::anyhow!("no used_memory"))?;
    Ok(line["used_memory:".len()..].trim().parse()?)
}

/// `used_memory` summed over the masters of `redis_url` (the one server, or a cluster's).
async fn masters_memory(redis_url: &str) -> anyhow::Result<u64> {
    let mut total = 0;
    for (_, mut conn) in nodes(redis_url).await? {
        if is_master(&mut conn).await? {
            total += used_memory(&mut conn).await?;
        }
    }
    Ok(total)
}

/// Bytes of Redis memory per dedup key, for `keys` keys of one layout.
async fn memory(redis_url: String, keys: u64, layout: Layout) -> anyhow::Result<()> {
    let cluster = redis_url.contains(',');
    anyhow::ensure!(!cluster || layout == Layout::New, "the old layout is measured on a single Redis");
    for (_, mut conn) in nodes(&redis_url).await? {
        if is_master(&mut conn).await? {
            let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await?;
            let _: () = redis::cmd("MEMORY").arg("PURGE").query_async(&mut conn).await?;
        }
    }
    let before = masters_memory(&redis_url).await?;
    let first = redis_url.split(',').next().expect("one URL at least");
    let client = redis::Client::open(first)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    match layout {
        Layout::Old => {
            for start in (0..keys).step_by(10_000) {
                let mut pipe = redis::pipe();
                for i in start..(start + 10_000).min(keys) {
                    let a: u64 = rng.random();
                    let b: u64 = rng.random();
                    // A UUID-shaped click ID and an owner token, as clickagg 0.1 stored them.
                    let id = format!(
                        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
                        a >> 32,
                        (a >> 16) & 0xffff,
                        a & 0xfff,
                        (b >> 48) & 0x3fff | 0x8000,
                        b & 0xffff_ffff_ffff
                    );
                    pipe.cmd("SET")
                        .arg(format!("clickagg:dedup:{id}"))
                        .arg(format!("clicks/{}/{}", i % 4, i / 4))
                        .arg("NX")
                        .arg("GET")
                        .arg("EX")
                        .arg(86_400)
                        .ignore();
                }
                let _: () = pipe.query_async(&mut conn).await?;
            }
        }
        Layout::New => {
            // About 100 entries per hash, as `dedup.shards` should be sized.
            let shards = (keys / 100).next_power_of_two().clamp(1 << 12, 1 << 24) as u32;
            // No WAIT: memory, not durability, is measured here.
            let mut cache = cache(&redis_url, "clickagg:dedup:", shards, None, Some(0))?;
            let fingerprints = Fingerprinter::new("bench");
            let now = chrono::Utc::now().timestamp() as u32;
            for start in (0..keys).step_by(2_000) {
                let chunk: Vec<Claim> = (start..(start + 2_000).min(keys))
                    .map(|i| {
                        let id = format!("{:032x}", rng.random::<u128>());
                        let sighting = Sighting::at((i % 4) as i32, (i / 4) as i64, Secs::new(now));
                        Claim { fingerprint: fingerprints.of(&id), sighting, mode: ClaimMode::default() }
                    })
                    .collect();
                cache.claim(&chunk).await?;
            }
        }
    }
    let after = masters_memory(&redis_url).await?;
    let mut dbsize = 0u64;
    for (_, mut conn) in nodes(&redis_url).await? {
        if is_master(&mut conn).await? {
            dbsize += redis::cmd("DBSIZE").query_async::<u64>(&mut conn).await?;
        }
    }
    println!(
        "{} layout{}: {keys} keys in {dbsize} Redis keys, {:.1} bytes per key (used_memory of the masters {} -> {})",
        if layout == Layout::Old { "old" } else { "new" },
        if cluster { " on a Redis Cluster (replicas hold as much again)" } else { "" },
        (after - before) as f64 / keys as f64,
        before,
        after
    );
    Ok(())
}
