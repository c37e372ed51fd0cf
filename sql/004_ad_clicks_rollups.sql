-- Hourly and daily roll-ups of ad_clicks_minute, for billing reads that would otherwise
-- scan every minute row. Same batch identity, same exactness: a batch's row for an
-- hour (or day) is its cumulative count summed over the minutes of that hour, cut at
-- the same offsets and versioned the same way as its minute rows, so a retried,
-- replayed or zombie write repeats a row or loses to a higher version.
--
-- `clickagg migrate` backfills each roll-up from the minute rows (through FINAL) when
-- it creates it empty while minute rows exist.
CREATE TABLE IF NOT EXISTS ad_clicks_hour
(
    ad_id       UInt64,
    hour        DateTime('UTC'),
    topic       String,
    partition   UInt32,
    batch_start UInt64,
    clicks      UInt64,
    version     UInt64,
    written_at  DateTime('UTC') DEFAULT now()
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(hour)
ORDER BY (ad_id, hour, topic, partition, batch_start);

CREATE TABLE IF NOT EXISTS ad_clicks_day
(
    ad_id       UInt64,
    day         DateTime('UTC'),
    topic       String,
    partition   UInt32,
    batch_start UInt64,
    clicks      UInt64,
    version     UInt64,
    written_at  DateTime('UTC') DEFAULT now()
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(day)
ORDER BY (ad_id, day, topic, partition, batch_start);
