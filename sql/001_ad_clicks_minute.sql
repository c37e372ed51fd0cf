-- Billing counts, one row per (ad, minute, batch). Applied by `clickagg migrate`,
-- idempotently; runs on ClickHouse 18.16 and on current releases.
--
-- By UTC day, in granules of 1 024 rows: a read of a time range for every ad (a top-N
-- query's unsealed hours, a seal) reads only the days it names, and a read of one ad
-- only its few granules of each. On servers before 21.x (18.16) `clickagg migrate`
-- creates it by month with the default granules instead (`sink::schema`): 18.16
-- opens every part of a FINAL range at once, and a read over years of day partitions
-- exceeds its per-query memory. A table that exists is never rebuilt.
--
-- A batch is the offset range [batch_start, batch_start + N) of one Kafka partition.
-- `clicks` is the cumulative count of the bucket in that batch up to offset `version`.
-- A retried, replayed or zombie flush writes the same (clicks, version) or a smaller
-- version, which loses: ReplacingMergeTree(version) keeps the row with the highest
-- version per sorting key. Read with FINAL (or argMax(clicks, version)) and sum over
-- batches; see billing.sql.
CREATE TABLE IF NOT EXISTS ad_clicks_minute
(
    ad_id       UInt64,
    minute      DateTime('UTC'),
    topic       String,
    partition   UInt32,
    batch_start UInt64,
    clicks      UInt64,
    version     UInt64,
    -- When the row was written; for operators, not part of any decision.
    written_at  DateTime('UTC') DEFAULT now()
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMMDD(minute)
ORDER BY (ad_id, minute, topic, partition, batch_start)
SETTINGS index_granularity = 1024;
