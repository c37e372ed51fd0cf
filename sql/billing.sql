-- Billing counts: clicks per ad and bucket (minute, hour or day, UTC) in [from, to).
--
-- Three sources, summed: whole days from the sealed days, whole hours from the sealed
-- hours, and everything else (partial hours at the ends of the range, hours not sealed
-- yet, hours written since their seal, minute buckets) from the minute rows. Which
-- (topic, day) and (topic, hour) come from the sealed tables is decided by
-- `clickagg query` from the seal records and the touched-hour markers (src/sealing/split.rs):
-- a sealed hour is read only while no minute row was written to it after its seal, so
-- the sum equals the minute rows alone. `covered` lists the (topic, hour) pairs inside
-- the minute range that the sealed part holds or that hold no minute rows; the minute
-- part leaves those out.
--
-- Exact by construction: a row replaced by a later version (a retried, replayed or
-- zombie flush; a re-seal) must never be summed twice, so every table is read through
-- FINAL, which keeps only the highest version per sorting key even before the
-- background merges ran; the minute rows of a bucket's batches are then summed. Every
-- filter is on a sorting-key column, so it gives the same rows whether the server
-- applies it before or after the FINAL merge (the minute part filters its range, topic
-- and ads in PREWHERE, so only the rows in range reach the merge, and leaves out the
-- covered hours in WHERE: ClickHouse 18.16 evaluates a PREWHERE on every row of the
-- granules it reads, and the minute table is sorted by ad first, so a `NOT IN` there
-- cost 180 ms on a 10 M-row month for a 7-hour range in scripts/bench-query).
--
-- The ad filter is `all_ads OR ad_id IN (...)`, not `empty(ads) OR has(ads, ad_id)`:
-- ClickHouse 18.16 folds a literal 0/1 but not empty(...) when it picks granules by
-- the primary key, and with the latter one ad over one day reads the whole range of
-- every ad (6 M rows instead of 40 k in scripts/bench-query).
--
-- Parameters:
--   sealed_days   (topic, day) pairs read from ad_clicks_sealed_day ([] for none; only
--                 when by = 'day')
--   sealed_hours  (topic, hour) pairs read from ad_clicks_sealed_hour (by 'hour' or 'day')
--   covered       the (topic, hour) pairs of those days and hours, and of hours known
--                 to hold no minute rows, that lie in [from, to): left out of the minute
--                 rows read
--   from, to      the minute rows read: [from, to), UTC ('2026-11-30 00:00:00' or Unix
--                 seconds); from = to reads none
--   by            'minute', 'hour' or 'day'
--   all_ads       1: every ad, `ads` is ignored; 0: only the ads in `ads`
--   ads           the ads when all_ads = 0, e.g. '[17,42]' ('[]' otherwise)
--   topic         '' for every topic, or one Kafka topic (the sealed pairs name theirs)
--
-- With nothing sealed (sealed_days, sealed_hours and covered all '[]') it is the plain
-- read of the minute rows; run it so with a current clickhouse-client, which sends the
-- parameters to the server:
--
--   clickhouse-client --database clickagg \
--     --param_sealed_days='[]' --param_sealed_hours='[]' --param_covered='[]' \
--     --param_from='2026-11-30 00:00:00' --param_to='2026-12-01 00:00:00' \
--     --param_by=hour --param_all_ads=1 --param_ads='[]' --param_topic='' \
--     < sql/billing.sql
--
-- `clickagg query --print-sql ...` prints it with the sealed part of its range and
-- every value written in, ready for `clickhouse-client` (ClickHouse 18.16 knows no
-- query parameters). `clickagg query` runs this same file.
SELECT ad_id, bucket, sum(clicks) AS clicks
FROM
(
    -- if sealed_days (clickagg leaves this part out when no day of the range is sealed)
    SELECT ad_id, toUInt32(day) AS bucket, clicks
    FROM ad_clicks_sealed_day FINAL
    WHERE (topic, day) IN (SELECT tupleElement(s, 1), tupleElement(s, 2)
                           FROM (SELECT arrayJoin({sealed_days:Array(Tuple(String, DateTime('UTC')))}) AS s))
      AND ({all_ads:UInt8} OR ad_id IN (SELECT arrayJoin({ads:Array(UInt64)})))
    UNION ALL
    -- end if
    -- if sealed_hours (left out when no hour of the range is sealed)
    SELECT ad_id, toUInt32(multiIf({by:String} = 'day', toStartOfDay(hour), hour)) AS bucket, clicks
    FROM ad_clicks_sealed_hour FINAL
    WHERE (topic, hour) IN (SELECT tupleElement(s, 1), tupleElement(s, 2)
                            FROM (SELECT arrayJoin({sealed_hours:Array(Tuple(String, DateTime('UTC')))}) AS s))
      AND ({all_ads:UInt8} OR ad_id IN (SELECT arrayJoin({ads:Array(UInt64)})))
    UNION ALL
    -- end if
    SELECT
        ad_id,
        toUInt32(multiIf(
            {by:String} = 'day', toStartOfDay(minute),
            {by:String} = 'hour', toStartOfHour(minute),
            minute)) AS bucket,
        clicks
    FROM ad_clicks_minute FINAL
    PREWHERE minute >= {from:DateTime('UTC')}
      AND minute < {to:DateTime('UTC')}
      AND ({topic:String} = '' OR topic = {topic:String})
      AND ({all_ads:UInt8} OR ad_id IN (SELECT arrayJoin({ads:Array(UInt64)})))
    -- if covered (left out when no hour of the range is covered by a seal)
    WHERE (topic, toStartOfHour(minute)) NOT IN (SELECT tupleElement(c, 1), tupleElement(c, 2)
                                               FROM (SELECT arrayJoin({covered:Array(Tuple(String, DateTime('UTC')))}) AS c))
    -- end if
)
GROUP BY ad_id, bucket
ORDER BY ad_id, bucket
