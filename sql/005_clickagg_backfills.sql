-- Which one-off backfills `clickagg migrate` has completed (e.g. a roll-up filled from
-- the minute rows that existed before it). A backfill is idempotent (its rows carry
-- batch identities and versions), so one interrupted before its row here is simply
-- run again by the next `clickagg migrate`.
CREATE TABLE IF NOT EXISTS clickagg_backfills
(
    name    String,
    done_at DateTime('UTC') DEFAULT now()
)
ENGINE = ReplacingMergeTree
ORDER BY name;
