-- Billing counts: clicks per ad and bucket (minute, hour or day, UTC) in [from, to).
--
-- Exact by construction: a batch row replaced by a later version (a retried, replayed
-- or zombie flush) must never be summed twice, so the table is read through FINAL,
-- which keeps only the highest version per (ad_id, time, topic, partition,
-- batch_start) even before the background merges ran; the batches of a bucket are then
-- summed. The same holds for the hourly and daily roll-ups (sql/004), which answer the
-- same question with fewer rows when the buckets and the range are whole hours or days. Every filter is on a sorting-key column, so it gives the same rows whether
-- the server applies it before or after the FINAL merge. (argMax(clicks, version) per
-- batch row is exact too, but it holds every key of the range in memory.)
--
-- The ad filter is `all_ads OR ad_id IN (...)`, not `empty(ads) OR has(ads, ad_id)`:
-- ClickHouse 18.16 folds a literal 0/1 but not empty(...) when it picks granules by
-- the primary key, and with the latter one ad over one day reads the whole range of
-- every ad (6 M rows instead of 40 k in scripts/bench-query).
--
-- Parameters:
--   table, time  the table and its time column: ad_clicks_minute/minute,
--                ad_clicks_hour/hour (by hour or day over whole hours) or
--                ad_clicks_day/day (by day over whole days)
--   from, to  bucket range [from, to), UTC: '2026-11-30 00:00:00' or Unix seconds
--   by        'minute', 'hour' or 'day'
--   all_ads   1: every ad, `ads` is ignored; 0: only the ads in `ads`
--   ads       the ads when all_ads = 0, e.g. '[17,42]' ('[]' otherwise)
--   topic     '' for every topic, or one Kafka topic
--
-- Run it with a current clickhouse-client, which sends the parameters to the server:
--
--   clickhouse-client --database clickagg \
--     --param_table=ad_clicks_hour --param_time=hour \
--     --param_from='2026-11-30 00:00:00' --param_to='2026-12-01 00:00:00' \
--     --param_by=hour --param_all_ads=1 --param_ads='[]' --param_topic='' \
--     < sql/billing.sql
--
-- ClickHouse 18.16 knows no query parameters: there, `clickagg query --print-sql ...`
-- prints this query with the values written in, ready for `clickhouse-client`.
-- `clickagg query` runs this same file (it writes the values in client-side).
SELECT
    ad_id,
    toUInt32(multiIf(
        {by:String} = 'day', toStartOfDay({time:Identifier}),
        {by:String} = 'hour', toStartOfHour({time:Identifier}),
        {time:Identifier})) AS bucket,
    sum(clicks) AS clicks
FROM {table:Identifier} FINAL
WHERE {time:Identifier} >= {from:DateTime('UTC')}
  AND {time:Identifier} < {to:DateTime('UTC')}
  AND ({all_ads:UInt8} OR ad_id IN (SELECT arrayJoin({ads:Array(UInt64)})))
  AND ({topic:String} = '' OR topic = {topic:String})
GROUP BY ad_id, bucket
ORDER BY ad_id, bucket
