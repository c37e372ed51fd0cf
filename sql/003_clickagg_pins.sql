-- Cross-partition dedup decisions, recorded by the flush that writes the counts they
-- shape (before those counts, and before the offset commit that passes them).
--
-- When producers do not key by click ID, copies of one click can sit on different
-- partitions, and which copy counts depends on the order the live members read them in:
-- not a function of the log. A re-read (replay, reset, restart) honours these rows
-- instead of deciding again. verdict 1: a duplicate of a copy counted on another
-- partition (never counts); 2: counted although another partition held the click,
-- more than a dedup window away.
CREATE TABLE IF NOT EXISTS clickagg_pins
(
    topic      String,
    partition  UInt32,
    offset     UInt64,
    verdict    UInt8,
    written_at DateTime('UTC') DEFAULT now()
)
ENGINE = ReplacingMergeTree
ORDER BY (topic, partition, offset);
