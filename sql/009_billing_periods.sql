-- Closed billing periods and their adjustments (guide, "Billing periods and disputes").
--
-- `clickagg close --period day|month <date>` freezes a period's totals per ad: the
-- rows of `clickagg_closed`, all of one close carrying its `close_id` (a hash of the
-- topic, the period and the totals), then one record in `clickagg_closes` naming that
-- close_id. A period is closed once it has a record; its closed totals are the rows
-- of the first record's close_id (the earliest `closed_at`, then the lowest close_id),
-- which nothing changes or deletes. A close killed before its record wrote rows no
-- record names; closing again writes the same rows (same totals, same close_id) or
-- rows under another close_id, and the record names the one it completed.
CREATE TABLE IF NOT EXISTS clickagg_closed
(
    topic     String,
    period    String,
    start     DateTime('UTC'),
    close_id  UInt64,
    ad_id     UInt64,
    clicks    UInt64
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(start)
ORDER BY (topic, period, start, close_id, ad_id);

-- `computed_at`: server time taken before the totals were read (a minute row whose
-- marker is older than that, by more than seal.slack, is in them); `positions` (JSON):
-- per partition, the group's committed offset when the period was closed; `forced`: 1
-- when closed with --force before the sealer had sealed the whole period.
CREATE TABLE IF NOT EXISTS clickagg_closes
(
    topic       String,
    period      String,
    start       DateTime('UTC'),
    close_id    UInt64,
    ads         UInt64,
    clicks      UInt64,
    positions   String,
    forced      UInt8,
    computed_at DateTime('UTC'),
    closed_at   DateTime('UTC') DEFAULT now()
)
ENGINE = MergeTree
ORDER BY (topic, period, start);

-- Signed corrections of a closed period: per ad, the `seq`-th change found since the
-- close, `delta` clicks (current total minus closed total minus earlier adjustments),
-- `batches` (JSON: the batch rows of the ad and period written since the last look,
-- "partition:batch_start"). Written by the sealer's rounds after the period's minute
-- rows change. The key (topic, period, start, ad_id, seq) makes a detection run twice
-- (after a kill -9, or by two sealers) write one row: ReplacingMergeTree(detected_at)
-- keeps the one computed from the later read, which accounts for everything the other
-- saw.
CREATE TABLE IF NOT EXISTS clickagg_adjustments
(
    topic       String,
    period      String,
    start       DateTime('UTC'),
    ad_id       UInt64,
    seq         UInt32,
    delta       Int64,
    batches     String,
    detected_at DateTime('UTC')
)
ENGINE = ReplacingMergeTree(detected_at)
PARTITION BY toYYYYMM(start)
ORDER BY (topic, period, start, ad_id, seq);
