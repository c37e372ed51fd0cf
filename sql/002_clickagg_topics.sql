-- The batch size each topic is aggregated with. It is part of every batch's identity
-- (batch_start = offset - offset % batch_offsets), so `clickagg run` and `replay`
-- refuse to write a topic with a different value than the one recorded here.
CREATE TABLE IF NOT EXISTS clickagg_topics
(
    topic         String,
    batch_offsets UInt64,
    registered_at DateTime('UTC') DEFAULT now()
)
ENGINE = MergeTree
ORDER BY topic;
