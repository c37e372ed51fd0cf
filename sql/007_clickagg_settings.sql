-- The settings that decide which clicks count (guide, "What counts"): the dedup window,
-- the fingerprint key (by an identifier, never the key), the shard count and the
-- validation limits, recorded per topic like the batch size. Version 1 holds from the
-- start of every partition; each later version (`clickagg settings change`) from the
-- offsets in `effective` (JSON: partition -> first offset decided under it, a batch
-- boundary). A member with other settings refuses to start; a replay decides every
-- range under the version recorded for it. A row of version 0 holds no settings but
-- the Kafka topic's ID (`topic_id`), recorded by the first member that saw it: a topic
-- deleted and recreated under the same name has another, and members refuse it.
CREATE TABLE IF NOT EXISTS clickagg_settings
(
    topic         String,
    version       UInt32,
    rules         String,
    effective     String,
    topic_id      String,
    registered_at DateTime('UTC') DEFAULT now()
)
ENGINE = MergeTree
ORDER BY (topic, version);
