//! The tables: the migrations in `sql/`, applied by `clickagg migrate`, and their
//! cluster form (replicated local tables and a `Distributed` table over them).
//!
//! Gaps in the numbering are migrations that were retired: `004` (hour and day batch
//! roll-ups written by every flush) and `005` (the record of their one-off backfill),
//! replaced by the sealed hours of `008`. An upgraded database keeps those tables
//! until an operator drops them (guide, "Sealed hours").

use super::{
    quote_ident, quote_literal, Sink, SinkError, ADJUSTMENTS, CLOSED, CLOSES, SEALED_DAY, SEALED_HOUR, SEALS,
    SEAL_PROGRESS, TABLE, TOUCHED,
};

/// The DDL in `sql/`, applied in order by `clickagg migrate`.
pub const MIGRATIONS: &[(&str, &str)] = &[
    ("001_ad_clicks_minute.sql", include_str!("../../sql/001_ad_clicks_minute.sql")),
    ("002_clickagg_topics.sql", include_str!("../../sql/002_clickagg_topics.sql")),
    ("003_clickagg_pins.sql", include_str!("../../sql/003_clickagg_pins.sql")),
    ("006_clickagg_clocks.sql", include_str!("../../sql/006_clickagg_clocks.sql")),
    ("007_clickagg_settings.sql", include_str!("../../sql/007_clickagg_settings.sql")),
    ("008_sealed_hours.sql", include_str!("../../sql/008_sealed_hours.sql")),
    ("009_billing_periods.sql", include_str!("../../sql/009_billing_periods.sql")),
];

/// On a ClickHouse cluster, how the rows of each table the migrations create are spread
/// over the shards (the `Distributed` table's sharding key). Billing reads `FINAL` per
/// shard and sums across shards, so every version of a row and every row of one (ad,
/// time bucket) must land on the same shard: all of them share the `ad_id`, in the
/// minute table and the sealed ones alike. The pins of a partition stay together for
/// its reads; a topic's batch-size registrations on one shard make the earliest one
/// visible to every member that reads them; a topic's seal records, markers and
/// progress are read whole.
pub const SHARDING: &[(&str, &str)] = &[
    (TABLE, "cityHash64(ad_id)"),
    ("clickagg_pins", "cityHash64(topic, partition)"),
    ("clickagg_topics", "cityHash64(topic)"),
    ("clickagg_clocks", "cityHash64(topic, partition)"),
    ("clickagg_settings", "cityHash64(topic)"),
    (SEALED_HOUR, "cityHash64(ad_id)"),
    (SEALED_DAY, "cityHash64(ad_id)"),
    (SEALS, "cityHash64(topic)"),
    (TOUCHED, "cityHash64(topic)"),
    (SEAL_PROGRESS, "cityHash64(topic)"),
    (CLOSED, "cityHash64(topic)"),
    (CLOSES, "cityHash64(topic)"),
    (ADJUSTMENTS, "cityHash64(topic)"),
];

impl Sink {
    /// Creates the database and applies every migration; safe to run any number of times.
    /// On a cluster (`clickhouse.cluster`) every table is created `ON CLUSTER`: a
    /// replicated table `<name>_local` on every node and a `Distributed` table `<name>`
    /// over them, which everything else reads and writes ([`cluster_statements`]).
    pub async fn migrate(&self) -> Result<Vec<&'static str>, SinkError> {
        let on_cluster = self.cluster.as_deref().map(|c| format!(" ON CLUSTER {}", quote_ident(c))).unwrap_or_default();
        let create_db = format!("CREATE DATABASE IF NOT EXISTS {}{on_cluster}", quote_ident(&self.database));
        self.timed(self.server.query(&create_db).execute()).await?;
        let version: String = self.timed(self.server.query("SELECT version()").fetch_one()).await?;
        let mut applied = Vec::new();
        for (name, sql) in MIGRATIONS {
            for statement in statements(sql) {
                let statement = for_server(&statement, &version);
                match &self.cluster {
                    None => self.execute(&statement).await?,
                    Some(cluster) => {
                        let forms = cluster_statements(&statement, &self.database, cluster)
                            .map_err(|e| SinkError::Fatal(format!("migration {name}: {e}")))?;
                        for statement in forms {
                            self.execute(&statement).await?;
                        }
                    }
                }
            }
            applied.push(*name);
        }
        Ok(applied)
    }
}

/// A migration statement as a server of `version` (`SELECT version()`) takes it: on a
/// release before 21.x (18.16) the minute table is partitioned by month with the
/// default granules, not by day (`sql/001`): 18.16 opens every part of a `FINAL` range
/// at once, each with its own buffers, and an exact read over a few years of day
/// partitions (905 of a 12-year backfill) exceeds its per-query memory (3.73 GiB
/// measured), where month partitions keep it to one part a month. Current releases read
/// `FINAL` per partition and in parallel, and a day's partition is what a read of
/// recent hours touches.
pub fn for_server(statement: &str, version: &str) -> String {
    let major: u32 = version.split('.').next().and_then(|m| m.parse().ok()).unwrap_or(u32::MAX);
    if major >= 21 || !statement.starts_with(&format!("CREATE TABLE IF NOT EXISTS {TABLE}\n")) {
        return statement.to_string();
    }
    statement
        .replace("PARTITION BY toYYYYMMDD(minute)", "PARTITION BY toYYYYMM(minute)")
        .replace("\nSETTINGS index_granularity = 1024", "")
}

/// The cluster form of one migration statement: a `CREATE TABLE IF NOT EXISTS <t> (…)
/// ENGINE = <E>(<args>) …` becomes, `ON CLUSTER cluster`, the replicated table
/// `<t>_local` (engine `Replicated<E>` keeping its arguments, its data in ZooKeeper under
/// `/clickhouse/tables/{shard}/<database>/<t>_local`, one replica per node `{replica}`:
/// the cluster's macros) and the `Distributed` table `<t>` over it, sharded by
/// [`SHARDING`]. The columns, sorting key and partitioning stay those of the single-node
/// file, so the two forms cannot drift apart. Any other statement has no cluster form.
pub fn cluster_statements(statement: &str, database: &str, cluster: &str) -> Result<Vec<String>, String> {
    let rest = statement
        .strip_prefix("CREATE TABLE IF NOT EXISTS ")
        .ok_or_else(|| format!("only CREATE TABLE IF NOT EXISTS has a cluster form, not {:.40}…", statement))?;
    let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
    let columns_and_engine = &rest[name.len()..];
    let at = columns_and_engine.find("ENGINE = ").ok_or_else(|| format!("table {name} has no ENGINE = clause"))?;
    let (columns, engine_clause) = columns_and_engine.split_at(at);
    let engine_clause = &engine_clause["ENGINE = ".len()..];
    let engine_end = engine_clause.find(char::is_whitespace).unwrap_or(engine_clause.len());
    let (engine, settings) = engine_clause.split_at(engine_end);
    let (engine_name, args) = match engine.split_once('(') {
        Some((n, a)) => (n, a.trim_end_matches(')')),
        None => (engine, ""),
    };
    if !engine_name.ends_with("MergeTree") {
        return Err(format!("table {name} has engine {engine_name}, which has no replicated form"));
    }
    let key = SHARDING
        .iter()
        .find(|(t, _)| *t == name)
        .map(|(_, k)| *k)
        .ok_or_else(|| format!("table {name} has no sharding key in sink::SHARDING"))?;
    let local = format!("{name}_local");
    let (db, on) = (quote_ident(database), format!("ON CLUSTER {}", quote_ident(cluster)));
    let zk_path = quote_literal(&format!("/clickhouse/tables/{{shard}}/{database}/{local}"));
    let args = if args.is_empty() { String::new() } else { format!(", {args}") };
    Ok(vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {db}.{local} {on}{columns}ENGINE = Replicated{engine_name}({zk_path}, '{{replica}}'{args}){settings}"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {db}.{name} {on} AS {db}.{local} ENGINE = Distributed({}, {db}, {local}, {key})",
            quote_ident(cluster)
        ),
    ])
}

/// Splits a migration file into statements (`;` at the end of a line ends one).
pub(super) fn statements(sql: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in sql.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with("--") || trimmed.is_empty() {
            continue;
        }
        current.push_str(line);
        current.push('\n');
        if trimmed.ends_with(';') {
            out.push(current.trim().trim_end_matches(';').to_string());
            current.clear();
        }
    }
    if !current.trim().is_empty() {
        out.push(current.trim().to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_minute_table_is_by_day_on_current_servers_and_by_month_before_21() {
        let minute = &statements(MIGRATIONS[0].1)[0];
        for current in ["26.9.2.1", "21.8.15.7", "25.8.1.1"] {
            assert_eq!(for_server(minute, current), *minute, "{current}");
        }
        let old = for_server(minute, "18.16.1");
        assert!(old.contains("PARTITION BY toYYYYMM(minute)") && !old.contains("index_granularity"), "{old}");
        // Only the minute table changes.
        let topics = &statements(MIGRATIONS[1].1)[0];
        assert_eq!(for_server(topics, "18.16.1"), *topics);
    }

    #[test]
    fn every_table_the_migrations_create_has_a_cluster_form() {
        let mut tables = Vec::new();
        for (name, sql) in MIGRATIONS {
            for statement in statements(sql) {
                let forms = cluster_statements(&statement, "db", "c").unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(forms.len(), 2);
                assert!(
                    forms[0].contains("ENGINE = Replicated") && forms[0].contains("ON CLUSTER `c`"),
                    "{}",
                    forms[0]
                );
                assert!(forms[1].contains("ENGINE = Distributed(`c`, `db`, "), "{}", forms[1]);
                tables.push(forms[1].split(' ').nth(5).unwrap().to_string());
            }
        }
        assert_eq!(
            tables,
            [
                "`db`.ad_clicks_minute",
                "`db`.clickagg_topics",
                "`db`.clickagg_pins",
                "`db`.clickagg_clocks",
                "`db`.clickagg_settings",
                "`db`.ad_clicks_sealed_hour",
                "`db`.ad_clicks_sealed_day",
                "`db`.clickagg_seals",
                "`db`.clickagg_touched",
                "`db`.clickagg_seal_progress",
                "`db`.clickagg_closed",
                "`db`.clickagg_closes",
                "`db`.clickagg_adjustments"
            ]
        );
        for table in [TABLE, SEALED_HOUR, SEALED_DAY] {
            assert!(SHARDING.iter().any(|(t, k)| *t == table && *k == "cityHash64(ad_id)"), "{table}");
        }
    }

    #[test]
    fn a_cluster_table_keeps_the_columns_keys_and_engine_arguments_of_the_single_node_one() {
        let minute = &statements(MIGRATIONS[0].1)[0];
        let forms = cluster_statements(minute, "clickagg", "clickagg_cluster").unwrap();
        assert!(forms[0].starts_with("CREATE TABLE IF NOT EXISTS `clickagg`.ad_clicks_minute_local ON CLUSTER `clickagg_cluster`\n(\n    ad_id       UInt64,"), "{}", forms[0]);
        assert!(forms[0].contains(
            "ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/clickagg/ad_clicks_minute_local', '{replica}', version)\nPARTITION BY toYYYYMMDD(minute)\nORDER BY (ad_id, minute, topic, partition, batch_start)\nSETTINGS index_granularity = 1024"
        ), "{}", forms[0]);
        // On 18.16 (the cluster stack's engine) by month, with the default granules.
        let old = cluster_statements(&for_server(minute, "18.16.1"), "clickagg", "clickagg_cluster").unwrap();
        assert!(
            old[0].ends_with(
                "version)\nPARTITION BY toYYYYMM(minute)\nORDER BY (ad_id, minute, topic, partition, batch_start)"
            ),
            "{}",
            old[0]
        );
        assert_eq!(
            forms[1],
            "CREATE TABLE IF NOT EXISTS `clickagg`.ad_clicks_minute ON CLUSTER `clickagg_cluster` AS `clickagg`.ad_clicks_minute_local \
             ENGINE = Distributed(`clickagg_cluster`, `clickagg`, ad_clicks_minute_local, cityHash64(ad_id))"
        );
        // An engine without arguments gets only the replication ones.
        let topics = cluster_statements(&statements(MIGRATIONS[1].1)[0], "d", "c").unwrap();
        assert!(topics[0].contains("ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/d/clickagg_topics_local', '{replica}')\nORDER BY topic"), "{}", topics[0]);
        assert!(cluster_statements("ALTER TABLE t ADD COLUMN x UInt8", "d", "c").is_err());
    }

    #[test]
    fn migrations_split_into_statements_without_comments() {
        let s = statements(MIGRATIONS[0].1);
        assert_eq!(s.len(), 1);
        assert!(s[0].starts_with("CREATE TABLE IF NOT EXISTS ad_clicks_minute"));
        assert!(!s[0].ends_with(';'));
    }
}
