-- Sealed hours and days (guide, "Sealed hours"): the minute rows of an hour that has
-- settled, compacted into one row per (topic, ad, hour), and the same per day. Written
-- by the sealer (`clickagg seal`, and one member of the group at a time), read by
-- `query` for the sealed part of a range. Derived data: each row is recomputed from
-- ad_clicks_minute whenever the minute rows of its hour change.
--
-- `version` is a function of the rows the seal was computed from and grows with every
-- change of them (src/seal/mod.rs): a later computation always outranks an earlier one,
-- whichever is written last. Every row of one seal carries the seal's version, and a
-- seal that no longer finds an ad writes it as 0 clicks, so FINAL gives one seal's
-- rows, never a mixture that adds an ad twice.
CREATE TABLE IF NOT EXISTS ad_clicks_sealed_hour
(
    topic     String,
    hour      DateTime('UTC'),
    ad_id     UInt64,
    clicks    UInt64,
    version   UInt64,
    sealed_at DateTime('UTC') DEFAULT now()
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(hour)
ORDER BY (topic, hour, ad_id)
SETTINGS index_granularity = 1024;

-- A day is sealed from its 24 sealed hours: per ad their sum, versioned by the sum of
-- the versions of the ad's hour rows.
CREATE TABLE IF NOT EXISTS ad_clicks_sealed_day
(
    topic     String,
    day       DateTime('UTC'),
    ad_id     UInt64,
    clicks    UInt64,
    version   UInt64,
    sealed_at DateTime('UTC') DEFAULT now()
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(day)
ORDER BY (topic, day, ad_id)
SETTINGS index_granularity = 1024;

-- One record per seal computation, written after its rows: `grain` 'hour' or 'day',
-- the bucket's start, the seal's version, `computed_at` (server time taken before the
-- rows it was computed from were read: a minute row whose marker is older than that,
-- by more than seal.slack, is in it), and for hours the per-partition positions the
-- sealer saw (JSON; why the hour was due). An hour or day is sealed once it has a
-- record; `query` reads it from the sealed table while no marker newer than its latest
-- computation exists (and, for a day, while its record matches its hours' versions).
CREATE TABLE IF NOT EXISTS clickagg_seals
(
    topic       String,
    grain       String,
    bucket      DateTime('UTC'),
    version     UInt64,
    computed_at DateTime('UTC'),
    positions   String,
    sealed_at   DateTime('UTC') DEFAULT now()
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(bucket)
ORDER BY (topic, grain, bucket);

-- Which hours the writes of minute rows touched: every write (a member's or a
-- replay's flush) adds, after its minute rows and before the offset commit that passes
-- them, one marker per (hour, partition) its rows fall in, with the highest stored
-- version among them. The sealer re-seals the sealed hours named by markers written
-- since its last round; `query` reads a sealed hour from the minute rows while a
-- marker newer than its seal exists; `clickagg status` reads each partition's last
-- durable flush here.
--
-- ReplacingMergeTree(written_at): merges keep the latest marker per (topic, hour,
-- partition), so the table stays at about one row per hour and partition, and "was
-- hour H written since T" has the same answer before and after merges.
CREATE TABLE IF NOT EXISTS clickagg_touched
(
    topic      String,
    hour       DateTime('UTC'),
    partition  UInt32,
    version    UInt64,
    written_at DateTime('UTC') DEFAULT now()
)
ENGINE = ReplacingMergeTree(written_at)
ORDER BY (topic, hour, partition);

-- The sealer's progress per topic, written at the end of each step of a round:
-- `frontier`, the first hour not sealed yet (every hour before it is sealed, or lay in
-- whole days without minute rows when the frontier passed them), and `scanned_from`,
-- the server time at the start of the last complete round (every marker older than it
-- by more than seal.slack has been re-sealed). Readers take the maximum of each: any
-- value a completed step wrote is true, so a lagging sealer's older row only costs
-- work done again.
CREATE TABLE IF NOT EXISTS clickagg_seal_progress
(
    topic        String,
    frontier     DateTime('UTC'),
    scanned_from DateTime('UTC'),
    written_at   DateTime('UTC') DEFAULT now()
)
ENGINE = ReplacingMergeTree(written_at)
ORDER BY topic;
