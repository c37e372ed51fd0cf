-- Billing counts of the top ads: the `top` ads with the most clicks in [from, to)
-- (ties: the lower ad_id first), with their clicks per bucket (minute, hour or day,
-- UTC) in that range. Read through FINAL like sql/billing.sql; see there why that is
-- exact.
--
-- Parameters: those of sql/billing.sql (table, time, from, to, by, all_ads, ads, topic;
-- the ads filter narrows the candidates), and
--   top         how many ads, e.g. 10
--   rank_table  the table that ranks the ads: the coarsest that covers [from, to)
--   rank_time   exactly (ad_clicks_day over whole days, whatever the buckets), and
--               its time column; the buckets of the top ads come from `table`
--
-- Run it with a current clickhouse-client:
--
--   clickhouse-client --database clickagg \
--     --param_table=ad_clicks_day --param_time=day \
--     --param_from='2026-11-30 00:00:00' --param_to='2026-12-01 00:00:00' \
--     --param_by=day --param_all_ads=1 --param_ads='[]' --param_topic='' --param_top=10 \
--     --param_rank_table=ad_clicks_day --param_rank_time=day \
--     < sql/billing_top.sql
--
-- The rows come ordered by ad_id; `clickagg query --top N` lists the ads by their
-- total, largest first. On ClickHouse 18.16 use `clickagg query --print-sql ...`.
--
-- GLOBAL IN: on a cluster (`clickagg migrate --cluster`) the table is Distributed, and
-- the top ads must be the cluster's, computed once and sent to every shard, not each
-- shard's own (ClickHouse refuses a plain IN over a Distributed table there). On a
-- single server GLOBAL IN is IN.
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
  AND ({topic:String} = '' OR topic = {topic:String})
  AND ad_id GLOBAL IN (
      SELECT ad_id
      FROM {rank_table:Identifier} FINAL
      WHERE {rank_time:Identifier} >= {from:DateTime('UTC')}
        AND {rank_time:Identifier} < {to:DateTime('UTC')}
        AND ({all_ads:UInt8} OR ad_id IN (SELECT arrayJoin({ads:Array(UInt64)})))
        AND ({topic:String} = '' OR topic = {topic:String})
      GROUP BY ad_id
      ORDER BY sum(clicks) DESC, ad_id
      LIMIT {top:UInt64})
GROUP BY ad_id, bucket
ORDER BY ad_id, bucket
