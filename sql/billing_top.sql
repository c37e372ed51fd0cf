-- Billing counts of the top ads: the `top` ads with the most clicks in [from, to)
-- (ties: the lower ad_id first), with their clicks per bucket (minute, hour or day,
-- UTC) in that range. Read through FINAL like sql/billing.sql; see there why that is
-- exact.
--
-- One pass: the innermost query is sql/billing.sql (every ad's buckets, through FINAL,
-- which ClickHouse 18.16 merges single-threaded: the expensive part); the middle one
-- gathers each ad's buckets into arrays with its total and keeps the `top` ads; ARRAY
-- JOIN turns their arrays back into rows. Ranking in a separate read (`ad_id IN (top
-- ads)`) would read the range through FINAL twice.
--
-- Parameters: those of sql/billing.sql (table, time, from, to, by, all_ads, ads, topic;
-- the ads filter narrows the candidates), and
--   top         how many ads, e.g. 10
--
-- Run it with a current clickhouse-client:
--
--   clickhouse-client --database clickagg \
--     --param_table=ad_clicks_day --param_time=day \
--     --param_from='2026-11-30 00:00:00' --param_to='2026-12-01 00:00:00' \
--     --param_by=day --param_all_ads=1 --param_ads='[]' --param_topic='' --param_top=10 \
--     < sql/billing_top.sql
--
-- The rows come ordered by ad_id; `clickagg query --top N` lists the ads by their
-- total, largest first. On ClickHouse 18.16 use `clickagg query --print-sql ...`.
--
-- On a cluster (`clickagg migrate --cluster`) the table is Distributed and sharded by
-- ad_id: every ad's rows are on one shard, the inner GROUP BY is merged across shards,
-- and the ranking runs once over the merged totals.
SELECT ad_id, bucket, clicks
FROM
(
    SELECT ad_id, groupArray(bucket) AS buckets, groupArray(bucket_clicks) AS counts, sum(bucket_clicks) AS total
    FROM
    (
        SELECT
            ad_id,
            toUInt32(multiIf(
                {by:String} = 'day', toStartOfDay({time:Identifier}),
                {by:String} = 'hour', toStartOfHour({time:Identifier}),
                {time:Identifier})) AS bucket,
            sum(clicks) AS bucket_clicks
        FROM {table:Identifier} FINAL
        WHERE {time:Identifier} >= {from:DateTime('UTC')}
          AND {time:Identifier} < {to:DateTime('UTC')}
          AND ({all_ads:UInt8} OR ad_id IN (SELECT arrayJoin({ads:Array(UInt64)})))
          AND ({topic:String} = '' OR topic = {topic:String})
        GROUP BY ad_id, bucket
    )
    GROUP BY ad_id
    ORDER BY total DESC, ad_id
    LIMIT {top:UInt64}
)
ARRAY JOIN buckets AS bucket, counts AS clicks
ORDER BY ad_id, bucket
