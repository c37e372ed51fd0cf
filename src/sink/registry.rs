//! What ClickHouse records per topic besides counts: its batch size, the settings that
//! decide what counts (with the position each version took over), and its Kafka ID.

use std::collections::BTreeMap;
use std::time::Duration;

use clickhouse::Row;
use serde::Deserialize;

use super::{Sink, SinkError, TABLE};

/// One recorded settings version of a topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RulesVersion {
    pub version: u32,
    pub rules: crate::config::Rules,
    /// Per partition, the first offset decided under this version (a batch boundary);
    /// version 1 holds from the start of every partition.
    pub effective: BTreeMap<i32, i64>,
    /// The Kafka topic's ID when this version was recorded.
    pub topic_id: Option<String>,
}

/// The settings versions of a topic, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RulesHistory {
    pub versions: Vec<RulesVersion>,
    /// How old (server seconds) the first registration is.
    pub first_age_secs: Option<i64>,
}

impl RulesHistory {
    pub fn latest(&self) -> Option<&RulesVersion> {
        self.versions.last()
    }

    /// The version that decides `offset` of `partition`.
    pub fn at(&self, partition: i32, offset: i64) -> Option<&RulesVersion> {
        self.versions.iter().rev().find(|v| v.version == 1 || v.effective.get(&partition).is_none_or(|&e| offset >= e))
    }

    /// Where the latest version starts deciding `partition` (0: from the start).
    pub fn latest_from(&self, partition: i32) -> i64 {
        self.latest().filter(|v| v.version > 1).and_then(|v| v.effective.get(&partition).copied()).unwrap_or(0)
    }
}

/// How old (server seconds) the earliest batch-size registration must be before a
/// member decides on it: registrations have whole-second times, so one written in the
/// same second by a racing member is visible a second later, plus a second for its
/// insert to complete.
pub const REGISTRATION_SETTLE_SECS: i64 = 2;

/// How long the deletion of a settings change may take: the mutation, and the wait
/// until it is done.
const MUTATION_LIMIT: std::time::Duration = std::time::Duration::from_secs(300);

impl Sink {
    /// Records `batch_offsets` for `topic`, or checks it against the recorded value.
    ///
    /// Two members starting at once with different values must not both pass: each
    /// writes its value first (when it finds none) and then reads every registration
    /// back, and the earliest one (ties broken by the smaller value) is the topic's;
    /// anyone else refuses. The earliest is decided only once it is
    /// [`REGISTRATION_SETTLE_SECS`] old by the server's clock: a racing member's write
    /// that sorts before it (the same second, a smaller value) has landed by then. Read
    /// at once, a member could pass on its own row alone and the racer on its smaller one.
    pub async fn register_batch_offsets(&self, topic: &str, batch_offsets: u64) -> Result<(), SinkError> {
        #[derive(Row, Deserialize)]
        struct R {
            batch_offsets: u64,
            age_secs: i64,
        }
        let registered = || async {
            self.timed(
                self.client
                    .query(
                        "SELECT batch_offsets, toInt64(now()) - toInt64(registered_at) AS age_secs \
                         FROM clickagg_topics WHERE topic = ? ORDER BY registered_at, batch_offsets LIMIT 1",
                    )
                    .bind(topic)
                    .fetch_all::<R>(),
            )
            .await
        };
        let mut first = registered().await?.into_iter().next();
        if first.is_none() {
            let sql = "INSERT INTO clickagg_topics (topic, batch_offsets) VALUES (?, ?)";
            self.timed(self.client.query(sql).bind(topic).bind(batch_offsets).execute()).await?;
            first = registered().await?.into_iter().next();
        }
        while let Some(r) = first.as_ref().filter(|r| r.age_secs < REGISTRATION_SETTLE_SECS) {
            let wait = (REGISTRATION_SETTLE_SECS - r.age_secs.max(0)) as u64;
            tokio::time::sleep(Duration::from_secs(wait)).await;
            first = registered().await?.into_iter().next();
        }
        match first {
            Some(r) if r.batch_offsets == batch_offsets => Ok(()),
            Some(r) => Err(SinkError::Fatal(format!(
                "topic {topic:?} is aggregated into {}.{TABLE} with batch_offsets = {}; \
                 refusing to use {batch_offsets}: batches cut with another size would overlap the stored ones. \
                 Set pipeline.batch_offsets to the recorded value, or write into a new database.",
                self.database, r.batch_offsets
            ))),
            None => Err(SinkError::Transient(format!("the registration of {topic:?} is not visible yet"))),
        }
    }

    /// The settings versions recorded for `topic`, oldest first ([`RulesHistory`]); when
    /// none is recorded yet, `ours` becomes version 1 (with the topic's ID). Members
    /// racing on a new topic all read the same winner: the earliest registration (ties:
    /// the smaller JSON), decided once it is [`REGISTRATION_SETTLE_SECS`] old.
    pub async fn register_rules(
        &self,
        topic: &str,
        ours: &crate::config::Rules,
        topic_id: Option<&str>,
    ) -> Result<RulesHistory, SinkError> {
        let mut history = self.rules_history(topic).await?;
        if history.versions.is_empty() {
            self.record_rules(topic, 1, ours, &BTreeMap::new(), topic_id.unwrap_or_default()).await?;
            history = self.rules_history(topic).await?;
        }
        while let Some(age) = history.first_age_secs.filter(|&a| a < REGISTRATION_SETTLE_SECS) {
            tokio::time::sleep(Duration::from_secs((REGISTRATION_SETTLE_SECS - age.max(0)) as u64)).await;
            history = self.rules_history(topic).await?;
        }
        if history.versions.is_empty() {
            return Err(SinkError::Transient(format!("the settings registration of {topic:?} is not visible yet")));
        }
        Ok(history)
    }

    /// Deletes the billing rows of `topic` for every batch at or past `from` (per
    /// partition) and waits until they are gone. A settings change calls
    /// it before it records the new version: rows past the committed offsets were decided
    /// under the old settings (an open batch a stopping member flushed, a killed member's
    /// flush, a replay's), and a reader under the new ones replaces a row only for a
    /// bucket it counts something in. Nothing committed lies there: readers write them
    /// again.
    pub async fn delete_rows_from(&self, topic: &str, from: &BTreeMap<i32, i64>) -> Result<(), SinkError> {
        if from.is_empty() {
            return Ok(());
        }
        let within: Vec<String> =
            from.iter().map(|(&p, &o)| format!("(partition = {} AND batch_start >= {})", p.max(0), o.max(0))).collect();
        let condition = format!("topic = {} AND ({})", super::quote_literal(topic), within.join(" OR "));
        // The minute rows are the only ones flushes write (sealed hours and days are
        // computed from them, again whenever they change).
        for table in [TABLE] {
            let (sql, mutated) = match &self.cluster {
                None => (format!("ALTER TABLE {table} DELETE WHERE {condition}"), table.to_string()),
                Some(cluster) => (
                    format!(
                        "ALTER TABLE {}.{table}_local ON CLUSTER {} DELETE WHERE {condition}",
                        super::quote_ident(&self.database),
                        super::quote_ident(cluster)
                    ),
                    format!("{table}_local"),
                ),
            };
            // A server may run the mutation before it answers (`clickhouse-local`, which
            // serves the stack's current engine, took 28-34 s over 198 month parts): the
            // statement may take as long as the wait below, not just request_timeout.
            match tokio::time::timeout(MUTATION_LIMIT, self.client.query(&sql).execute()).await {
                Ok(r) => r.map_err(super::classify)?,
                Err(_) => {
                    return Err(SinkError::Transient(format!(
                        "deleting rows of {table}: no answer within {MUTATION_LIMIT:?}"
                    )))
                }
            }
            // A mutation runs in the background: wait until it is done (no server of every
            // supported version knows `mutations_sync`). It touches only rows written before
            // it, so nothing a reader writes afterwards goes. Asked after a pause in which a
            // mutation this small is done, so that the answer does not depend on the moment
            // (scripts/current-clickhouse compares it with a current server's).
            let pending = format!(
                "SELECT count() FROM system.mutations WHERE database = currentDatabase() AND table = {} AND is_done = 0",
                super::quote_literal(&mutated)
            );
            let deadline = std::time::Instant::now() + MUTATION_LIMIT;
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                let left: u64 = self.timed(self.client.query(&pending).fetch_one::<u64>()).await?;
                if left == 0 {
                    break;
                }
                if std::time::Instant::now() > deadline {
                    return Err(SinkError::Transient(format!(
                        "deleting rows of {table}: the mutation is not done yet"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Records a settings version of `topic`.
    pub async fn record_rules(
        &self,
        topic: &str,
        version: u32,
        rules: &crate::config::Rules,
        effective: &BTreeMap<i32, i64>,
        topic_id: &str,
    ) -> Result<(), SinkError> {
        let rules = serde_json::to_string(rules).expect("rules serialize");
        let effective = serde_json::to_string(effective).expect("offsets serialize");
        let sql = "INSERT INTO clickagg_settings (topic, version, rules, effective, topic_id) VALUES (?, ?, ?, ?, ?)";
        self.timed(
            self.client.query(sql).bind(topic).bind(version).bind(rules).bind(effective).bind(topic_id).execute(),
        )
        .await
    }

    /// The Kafka ID recorded for `topic` (a settings row of version 0), if any.
    pub async fn recorded_topic_id(&self, topic: &str) -> Result<Option<String>, SinkError> {
        let ids: Vec<String> = self
            .timed(
                self.client
                    .query(
                        "SELECT topic_id FROM clickagg_settings WHERE topic = ? AND topic_id != '' \
                         ORDER BY registered_at, topic_id LIMIT 1",
                    )
                    .bind(topic)
                    .fetch_all::<String>(),
            )
            .await?;
        Ok(ids.into_iter().next())
    }

    /// Records the Kafka ID of `topic` (as a settings row of version 0, which holds no
    /// settings).
    pub async fn record_topic_id(&self, topic: &str, id: &str) -> Result<(), SinkError> {
        let sql =
            "INSERT INTO clickagg_settings (topic, version, rules, effective, topic_id) VALUES (?, 0, '', '{}', ?)";
        self.timed(self.client.query(sql).bind(topic).bind(id).execute()).await
    }

    /// Every settings version recorded for `topic`; of racing registrations of one
    /// version, the earliest (ties: the smaller JSON).
    pub async fn rules_history(&self, topic: &str) -> Result<RulesHistory, SinkError> {
        #[derive(Row, Deserialize)]
        struct R {
            version: u32,
            rules: String,
            effective: String,
            topic_id: String,
            age_secs: i64,
        }
        let rows: Vec<R> = self
            .timed(
                self.client
                    .query(
                        "SELECT version, rules, effective, topic_id, toInt64(now()) - toInt64(registered_at) AS age_secs \
                         FROM clickagg_settings WHERE topic = ? AND version > 0 ORDER BY version, registered_at, rules",
                    )
                    .bind(topic)
                    .fetch_all::<R>(),
            )
            .await?;
        let mut history = RulesHistory::default();
        for r in rows {
            if history.versions.last().is_some_and(|v| v.version == r.version) {
                continue;
            }
            let bad = |what: &str, e: serde_json::Error| {
                SinkError::Fatal(format!(
                    "clickagg_settings of {topic:?}, version {}: unreadable {what}: {e}",
                    r.version
                ))
            };
            history.first_age_secs.get_or_insert(r.age_secs);
            history.versions.push(RulesVersion {
                version: r.version,
                rules: serde_json::from_str(&r.rules).map_err(|e| bad("rules", e))?,
                effective: serde_json::from_str(&r.effective).map_err(|e| bad("offsets", e))?,
                topic_id: Some(r.topic_id).filter(|id| !id.is_empty()),
            });
        }
        Ok(history)
    }
}
