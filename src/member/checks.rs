//! What a member checks before it joins the group: Redis answers, the topic keeps what
//! the member needs, the recorded dedup settings are its own, and the topic is the one
//! the tables were filled from.

use std::time::Duration;

use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::config::Settings;
use crate::planner::{stopped_while, PipelineError};
use crate::retry::Retry;
use crate::sink::Sink;
use crate::source;

/// Checks the dedup cache's eviction policy, waiting while Redis is unreachable (a
/// member may start while a Redis Cluster fails over) instead of exiting.
pub(super) async fn wait_for_redis(
    cache: &mut crate::cache::SharedCache,
    max_backoff: Duration,
    shutdown: &CancellationToken,
) -> Result<(), PipelineError> {
    let mut retry = Retry::new(max_backoff, shutdown);
    loop {
        let checked = async {
            cache.check_eviction_policy().await?;
            cache.open().await.map(drop)
        };
        match checked.await {
            Ok(()) => return Ok(()),
            Err(e) => retry
                .after(e, |e| warn!(error = %e, "waiting for Redis"))
                .await
                .map_err(|stopped| stopped_while(stopped.map(PipelineError::from), "reaching Redis"))?,
        }
    }
}

/// Checks the click topic's settings against the definition of what counts: a
/// compacted topic is refused (compaction deletes earlier records with the same key, so
/// a re-read would no longer see the originals its duplicates were judged by); a
/// retention shorter than the window plus `dedup.max_record_lag`, and record
/// timestamps accepted without a bound ahead, are named in a loud warning (what they do
/// to the counts is in the guide, "What counts").
pub(super) async fn check_topic_config(s: &Settings) -> Result<(), PipelineError> {
    // A topic that does not exist yet is created with the broker's defaults.
    let Ok(configs) = source::topic_configs(&s.kafka, &s.kafka.topic).await else { return Ok(()) };
    let topic = &s.kafka.topic;
    if let Some(policy) = configs.get("cleanup.policy").filter(|p| p.contains("compact")) {
        return Err(PipelineError::Fatal(format!(
            "kafka topic {topic} has cleanup.policy={policy}: compaction deletes the originals that decide which \
             retries are duplicates, so a re-read would count differently; set cleanup.policy=delete on the topic"
        )));
    }
    let needed = s.dedup_window() + s.dedup.max_record_lag;
    if let Some(ms) = configs.get("retention.ms").and_then(|v| v.parse::<i64>().ok()).filter(|&ms| ms >= 0) {
        if (ms as u128) < needed.as_millis() {
            warn!(
                topic = %topic,
                retention_ms = ms,
                needed_ms = needed.as_millis() as u64,
                "RETENTION SHORTER THAN THE DEDUP WINDOW: retention.ms of the click topic is shorter than \
                 dedup.window + dedup.max_record_lag; once it deletes an original, a re-read or a warm-up no \
                 longer sees it and counts a retry that followed within the window. Raise retention.ms."
            );
        }
    }
    let create_time = configs.get("message.timestamp.type").is_none_or(|t| t == "CreateTime");
    let ahead = configs.get("message.timestamp.after.max.ms").and_then(|v| v.parse::<i64>().ok());
    if create_time && ahead.is_none_or(|ms| ms > i64::from(crate::dedup::CLOCK_JUMP) * 1000) {
        warn!(
            topic = %topic,
            after_max_ms = ?ahead,
            "UNBOUNDED RECORD TIMESTAMPS: the click topic accepts producer timestamps far ahead of the broker's \
             clock (message.timestamp.after.max.ms); a single such record does not move a partition's clock, but \
             two in a row do, and every later record of the partition is then judged at that time. Set \
             message.timestamp.after.max.ms to 3600000 or less."
        );
    }
    Ok(())
}

/// Refuses to run with decision settings other than the topic's (`clickagg_settings`,
/// registering ours when none are recorded). Returns the recorded versions, for the
/// planning of each partition's start.
pub(super) async fn check_recorded_rules(
    s: &Settings,
    sink: &Sink,
) -> Result<crate::sink::RulesHistory, PipelineError> {
    let ours = s.rules();
    // The topic's ID is checked once the group has assigned partitions (`Stages`): the
    // broker is known to answer then, and a member with bad credentials stops at once.
    let history = sink.register_rules(&s.kafka.topic, &ours, None).await?;
    let latest = history.latest().expect("registration leaves at least one version");
    let differences = ours.differences(&latest.rules);
    if !differences.is_empty() {
        let list: Vec<String> = differences
            .iter()
            .map(|(name, mine, recorded)| format!("{name} is {mine} here but {recorded} in the topic's record"))
            .collect();
        return Err(PipelineError::Fatal(format!(
            "the settings that decide which clicks count differ from those recorded for topic {} (settings \
             version {}): {}. Run every member with the recorded settings, or change them on purpose with \
             `clickagg settings change` (guide: docs/src/operate/changing-what-counts.md).",
            s.kafka.topic,
            latest.version,
            list.join("; ")
        )));
    }
    Ok(history)
}

/// Refuses to write a topic whose offsets are behind the batches already stored for it:
/// the topic was deleted and recreated, and its new offsets would reuse old batch IDs.
pub(super) async fn check_topic_not_recreated(s: &Settings, sink: &Sink) -> Result<(), PipelineError> {
    let stored = sink.max_batch_start(&s.kafka.topic).await?;
    if stored.is_empty() {
        return Ok(());
    }
    let k = s.kafka.clone();
    let topic = s.kafka.topic.clone();
    let marks = tokio::task::spawn_blocking(move || -> Result<Vec<(i32, i64)>, KafkaError> {
        let c = source::lookup_consumer(&k)?;
        let mut out = Vec::new();
        for p in source::partitions(&c, &topic, Duration::from_secs(10))? {
            out.push((p, c.fetch_watermarks(&topic, p, Duration::from_secs(10))?.1));
        }
        Ok(out)
    })
    .await
    .map_err(|e| PipelineError::Fatal(e.to_string()))?;
    let marks = match marks {
        Ok(m) => m,
        // The topic may not exist yet (auto-created on first produce): nothing to compare.
        Err(_) => return Ok(()),
    };
    for (p, high) in marks {
        if let Some(&start) = stored.get(&p) {
            if start > high {
                return Err(PipelineError::Fatal(format!(
                    "ClickHouse holds batch {start} of {}/{p}, but the partition's log ends at offset {high}: \
                     the topic looks deleted and recreated, and its new offsets would overwrite old batches. \
                     Write the new topic into another database (clickhouse.database) or under another topic name.",
                    s.kafka.topic
                )));
            }
        }
    }
    Ok(())
}
