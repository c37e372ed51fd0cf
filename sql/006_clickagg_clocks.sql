-- The record clock of a partition at batch boundaries (guide, "What counts", record
-- time): the state of the clock just before `boundary`, written by the flush of every
-- reader that crossed it (before the offset commit that passes it).
--
-- A reader starting at a boundary takes its clock from here instead of recomputing it
-- from the whole partition, and finds where to start rebuilding dedup state (the
-- latest boundary whose clock lies more than a window before its own). Every reader
-- computes the same values from the log, so writing a row again changes nothing.
-- has_clock 0: no timestamped record before the boundary; has_pending 1: the last
-- record jumped far ahead of the clock and waits for the next to confirm it.
CREATE TABLE IF NOT EXISTS clickagg_clocks
(
    topic       String,
    partition   UInt32,
    boundary    UInt64,
    clock       UInt32,
    has_clock   UInt8,
    pending     UInt32,
    has_pending UInt8,
    written_at  DateTime('UTC') DEFAULT now()
)
ENGINE = ReplacingMergeTree
ORDER BY (topic, partition, boundary);
