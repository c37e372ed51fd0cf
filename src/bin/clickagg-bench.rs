//! `clickagg-bench`: the raw ceilings `scripts/bench` sets the pipeline against, and the
//! memory of the dedup cache. A measuring tool, not part of the product.
//!
//! ```text
//! clickagg-bench consume --brokers B --topic T --records N
//!     an rdkafka consumer that only counts records: the broker's and client's ceiling
//! clickagg-bench claims --redis-url U --claims N
//!     the Redis function the pipeline calls, with the same chunks and pipelining,
//!     and nothing else: Redis's ceiling for clickagg's claims
//! clickagg-bench memory --redis-url U --keys N --layout new|old --flush-all
//!     FLUSHALL (a Redis of its own!), then N dedup keys; bytes per key from used_memory
//! ```

use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use clickagg::config::{KafkaSettings, Settings};
use clickagg::dedup::{Claim, ClaimMode, Fingerprinter, SharedCache, Sighting};
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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Consume { brokers, topic, records } => consume(brokers, topic, records).await,
        Command::Claims { redis_url, claims, chunk } => claims_rate(redis_url, claims, chunk).await,
        Command::Memory { redis_url, keys, layout, flush_all } => {
            anyhow::ensure!(flush_all, "memory empties the Redis first: pass --flush-all for a Redis of its own");
            memory(redis_url, keys, layout).await
        }
    }
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
            let sighting = Sighting { partition: (i % 4) as i32, offset: (i / 4) as i64, clock: now };
            Claim { fingerprint: fp, sighting, mode: ClaimMode::default() }
        })
        .collect()
}

fn cache(redis_url: &str, prefix: &str, shards: u32) -> anyhow::Result<SharedCache> {
    let mut s = Settings::default();
    s.redis.url = clickagg::config::SecretUrl::new(redis_url.to_string());
    Ok(SharedCache::new(s.redis_client()?, prefix, "bench", shards, 1, s.dedup_window(), Duration::from_secs(30)))
}

/// Claims as the member makes them, one poll batch (`chunk`) per call, two in flight.
async fn claims_rate(redis_url: String, n: u64, chunk: usize) -> anyhow::Result<()> {
    let prefix = format!("clickagg-bench-{}:", rand::random::<u32>());
    let all = claims(n, &Fingerprinter::new("bench"));
    let health = clickagg::health::Health::new();
    let (claimer, mut verdicts) =
        clickagg::dedup::Claimer::start(cache(&redis_url, &prefix, 1 << 16)?, Duration::from_secs(1), health);
    let started = Instant::now();
    let mut sent = 0;
    let mut received = 0;
    let chunks: Vec<Vec<Claim>> = all.chunks(chunk).map(<[Claim]>::to_vec).collect();
    let total = chunks.len();
    let mut chunks = chunks.into_iter();
    while received < total {
        while sent < total && sent - received < 2 {
            claimer.claim(chunks.next().expect("counted"));
            sent += 1;
        }
        verdicts.recv().await.expect("claimer running")?;
        received += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "redis claims: {n} claims in {secs:.2} s = {:.0} claims/s (chunks of {chunk}, 2 in flight)",
        n as f64 / secs
    );
    // Leave no benchmark keys behind.
    let client = redis::Client::open(redis_url.as_str())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    // SCAN, not KEYS: the shared Redis may hold millions of other keys.
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
    for batch in keys.chunks(1_000) {
        let _: () = redis::cmd("UNLINK").arg(batch).query_async(&mut conn).await?;
    }
    Ok(())
}

async fn used_memory(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<u64> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(conn).await?;
    let line = info.lines().find(|l| l.starts_with("used_memory:")).ok_or_else(|| anyhow::anyhow!("no used_memory"))?;
    Ok(line["used_memory:".len()..].trim().parse()?)
}

/// Bytes of Redis memory per dedup key, for `keys` keys of one layout.
async fn memory(redis_url: String, keys: u64, layout: Layout) -> anyhow::Result<()> {
    let client = redis::Client::open(redis_url.as_str())?;
    // No response timeout: FLUSHALL of millions of keys takes seconds.
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
    let mut conn = client.get_multiplexed_async_connection_with_config(&config).await?;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await?;
    let _: () = redis::cmd("MEMORY").arg("PURGE").query_async(&mut conn).await?;
    let before = used_memory(&mut conn).await?;
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
            let mut cache = cache(&redis_url, "clickagg:dedup:", shards)?;
            let fingerprints = Fingerprinter::new("bench");
            let now = chrono::Utc::now().timestamp() as u32;
            for start in (0..keys).step_by(2_000) {
                let chunk: Vec<Claim> = (start..(start + 2_000).min(keys))
                    .map(|i| {
                        let id = format!("{:032x}", rng.random::<u128>());
                        let sighting = Sighting { partition: (i % 4) as i32, offset: (i / 4) as i64, clock: now };
                        Claim { fingerprint: fingerprints.of(&id), sighting, mode: ClaimMode::default() }
                    })
                    .collect();
                cache.claim(&chunk).await?;
            }
        }
    }
    let after = used_memory(&mut conn).await?;
    let dbsize: u64 = redis::cmd("DBSIZE").query_async(&mut conn).await?;
    println!(
        "{} layout: {keys} keys in {dbsize} Redis keys, {:.1} bytes per key (used_memory {} -> {})",
        if layout == Layout::Old { "old" } else { "new" },
        (after - before) as f64 / keys as f64,
        before,
        after
    );
    Ok(())
}
