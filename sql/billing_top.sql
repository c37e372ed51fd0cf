-- Billing counts of the top ads: the `top` ads with the most clicks in the range
-- (ties: the lower ad_id first), with their clicks per bucket (minute, hour or day,
-- UTC). Read like sql/billing.sql (sealed days, sealed hours, minute rows, each through
-- FINAL); see there why that is exact and what the parameters mean.
--
-- One pass: the innermost query reads what sql/billing.sql reads, with the minute rows
-- already summed per (ad, bucket) (many batch rows each) and the sealed rows as they
-- are (one per topic, ad and hour or day); the middle one gathers each ad's rows into
-- arrays with its total and keeps the `top` ads; ARRAY JOIN turns their arrays back
-- into rows, summed per bucket for those ads only. Summing every ad's buckets before
-- ranking cost ClickHouse 18.16 more than reading them (a sealed day, 8 600 ads by
-- hour: 153 ms against 93 ms); ranking in a separate read (`ad_id IN (top ads)`) would
-- read the range twice.
--
-- Parameters: those of sql/billing.sql, and
--   top         how many ads, e.g. 10
--
-- Run it with a current clickhouse-client (nothing sealed):
--
--   clickhouse-client --database clickagg \
--     --param_sealed_days='[]' --param_sealed_hours='[]' --param_covered='[]' \
--     --param_from='2026-11-30 00:00:00' --param_to='2026-12-01 00:00:00' \
--     --param_by=day --param_all_ads=1 --param_ads='[]' --param_topic='' --param_top=10 \
--     < sql/billing_top.sql
--
-- The rows come ordered by ad_id; `clickagg query --top N` lists the ads by their
-- total, largest first. On ClickHouse 18.16 use `clickagg query --print-sql ...`.
--
-- On a cluster (`clickagg migrate --cluster`) every table is Distributed and sharded by
-- ad_id: every ad's rows are on one shard, the inner GROUP BY is merged across shards,
-- and the ranking runs once over the merged totals.
SELECT ad_id, bucket, sum(bucket_clicks) AS clicks
FROM
(
    SELECT ad_id, groupArray(bucket) AS buckets, groupArray(clicks) AS counts, sum(clicks) AS total
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
        SELECT ad_id, bucket, sum(clicks) AS clicks
        FROM
        (
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
    )
    GROUP BY ad_id
    ORDER BY total DESC, ad_id
    LIMIT {top:UInt64}
)
ARRAY JOIN buckets AS bucket, counts AS bucket_clicks
GROUP BY ad_id, bucket
ORDER BY ad_id, bucket
