//! Every compression codec a Kafka producer may use, end to end: a topic whose
//! producers compress with it, counted exactly by a member. librdkafka decodes only the
//! codecs it was built with, and one it was not built with ends in a consume error for
//! every batch (0 of 4 583 clicks of a zstd topic were counted before the `zstd`
//! feature), so each codec is proven on the real broker, not assumed.
//!
//! Also what a member does with a record batch the client cannot decode at all (here:
//! one whose bytes on the broker's disk no longer match their CRC): librdkafka reports
//! it and skips the batch, without saying which partition it came from, so the member
//! stops taking in records, commits nothing past what it read before, and says so —
//! readiness, a metric, the log — rather than count on and lose the batch's clicks.

use std::time::Duration;

use clickagg::config::Secret;
use clickagg::produce::{self, Spec};

use crate::helpers::stack::PrivateStack;
use crate::helpers::wait::wait_until;
use crate::helpers::{wait_ready, TestEnv};

const CONVERGE: Duration = Duration::from_secs(120);

/// Sends a topic compressed with `codec` (librdkafka's `compression.type`) and checks
/// that one member counts it exactly.
async fn a_topic_compressed_with(codec: &str, seed: u64) {
    let env = TestEnv::new(&format!("codec-{codec}")).await;
    let (records, truth) = env.plan(Spec { count: 6_000, seed, ..Spec::default() });
    let mut kafka = env.settings().kafka;
    kafka.properties.insert("compression.type".into(), Secret::new(codec));
    // Batches of many records, so that each is really compressed as one.
    kafka.properties.insert("linger.ms".into(), Secret::new("20"));
    produce::send(&kafka, &env.topic, 4, &records, None, |_| {}).await.expect("produce");
    let mut member = env.spawn_member("m");
    env.assert_counts_converge(&truth.counts, CONVERGE).await;
    assert_eq!(member.metric("clickagg_undecodable_batches_total", &[]).await, 0.0);
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncompressed_topic_counts_exactly() {
    a_topic_compressed_with("none", 501).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gzip_topic_counts_exactly() {
    a_topic_compressed_with("gzip", 502).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snappy_topic_counts_exactly() {
    a_topic_compressed_with("snappy", 503).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_lz4_topic_counts_exactly() {
    a_topic_compressed_with("lz4", 504).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zstd_topic_counts_exactly() {
    a_topic_compressed_with("zstd", 505).await;
}

/// The first record batch of `segment` (a Kafka log file) whose base offset is `from`
/// or more: its base offset, and the byte range of its records (past the v2 header), so
/// that a byte flipped there breaks its CRC and nothing else.
fn a_batch_in(segment: &[u8], from: i64) -> (i64, std::ops::Range<usize>) {
    let mut at = 0;
    while at + 12 <= segment.len() {
        let base = i64::from_be_bytes(segment[at..at + 8].try_into().unwrap());
        let len = i32::from_be_bytes(segment[at + 8..at + 12].try_into().unwrap()) as usize;
        // baseOffset (8) + batchLength (4) + the batch; its header is 61 bytes in all.
        let end = at + 12 + len;
        if base >= from {
            return (base, at + 61..end);
        }
        at = end;
    }
    panic!("no batch from offset {from} in a segment of {} bytes", segment.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_the_client_cannot_decode_stops_the_member_visibly_and_nothing_past_it_is_committed() {
    let stack = PrivateStack::start("undecodable", &["kafka"]).await;
    let env = TestEnv::with_stack("undecodable", &stack).await;
    let (records, _) = env.plan(Spec { count: 4_000, seed: 506, ..Spec::default() });
    // One partition, so the batch that is broken is in the partition that is read; two
    // sends, so that the second half starts a batch of its own.
    let (first, second) = records.split_at(2_000);
    env.send(first, 1, None).await;
    env.send(second, 1, None).await;
    // Flip a byte in the middle of the partition's log, in the records of a batch (the
    // broker serves the bytes as they are on disk; the client checks their CRC).
    let log = stack.dir().join("kafka/data").join(format!("{}-0", env.topic)).join("00000000000000000000.log");
    let mut bytes = std::fs::read(&log).expect("the partition's log segment");
    let (broken, range) = a_batch_in(&bytes, 1_000);
    let at = range.start + range.len() / 2;
    bytes[at] ^= 0xff;
    std::fs::write(&log, &bytes).expect("write the segment back");

    let mut member = env.spawn_member("m");
    wait_until("the member reports the batch it cannot decode", Duration::from_secs(90), || async {
        match member.metric("clickagg_undecodable_batches_total", &[]).await {
            n if n > 0.0 => Ok(()),
            n => Err(format!("{n} undecodable batches")),
        }
    })
    .await;
    let body = wait_ready(&member, 503, Duration::from_secs(15)).await;
    assert!(body.contains("cannot decode"), "{body}");
    assert_eq!(member.metric("clickagg_consumption_stopped", &[]).await, 1.0);
    // What it read before the batch is flushed and committed; nothing past the batch.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let committed = env.committed_offsets().await;
    let at_most = committed.get(&0).copied().unwrap_or(0);
    assert!(at_most <= broken, "committed {at_most}, past the undecodable batch at {broken}");
    let consumed = member.metric("clickagg_records_consumed_total", &[]).await;
    assert!(consumed > 0.0 && consumed <= broken as f64, "{consumed} records taken in, the batch at {broken}");
    // It stayed up (its partitions stay its own) until an operator acts.
    assert_eq!(member.terminate(Duration::from_secs(30)).await, 0);
}
