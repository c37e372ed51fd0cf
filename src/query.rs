//! `clickagg query`: billing counts from ClickHouse, per ad and minute, hour or day,
//! through the one billing read (`sink::billing`: sealed days and hours where they are
//! current, minute rows for the rest), printed as a table, CSV or JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::{anyhow, Context, Result};
use chrono::{DateTime, Utc};
use clap::{Args, ValueEnum};

use crate::config::Settings;
use crate::sealing::period::{parse_period, Period, PeriodKind};
use crate::sealing::Grain;
use crate::sink::billing::{billing_sql, check, unsealed, BillingRequest};
pub use crate::sink::billing::{BillingRow, BILLING_SQL, BILLING_TOP_SQL};
use crate::sink::Sink;
use crate::time::parse_time;

/// The bucket width of the counts. Buckets are UTC: the table stores UTC minutes and
/// billing days must not move with a server's or analyst's time zone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum By {
    Minute,
    Hour,
    Day,
}

impl By {
    /// The value of the SQL files' `{by:String}` parameter.
    pub fn as_sql(self) -> &'static str {
        match self {
            By::Minute => "minute",
            By::Hour => "hour",
            By::Day => "day",
        }
    }

    /// The grain of the buckets.
    pub fn grain(self) -> Grain {
        match self {
            By::Minute => Grain::Minute,
            By::Hour => Grain::Hour,
            By::Day => Grain::Day,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Aligned columns and a total line, for people.
    Table,
    /// `ad_id,bucket,clicks` with a header line, no total.
    Csv,
    /// One JSON array of `{"ad_id", "bucket", "clicks"}` objects.
    Json,
}

/// Billing counts from ClickHouse: clicks per ad and bucket in `[--from, --to)`.
///
/// Rows are ordered by ad, then bucket. With `--top N` only the N ads with the most
/// clicks in the whole range are shown (ties: the lower ad ID wins), ordered by that
/// total, largest first. A range that cuts through an hour or a day yields a partial
/// first or last bucket holding only the minutes inside the range.
#[derive(Debug, Args, Clone)]
pub struct QueryArgs {
    /// Start of the range, inclusive: RFC 3339 (2026-11-30T08:00:00Z) or a UTC date (2026-11-30).
    #[arg(long, value_parser = parse_time, required_unless_present = "period", conflicts_with = "period")]
    pub from: Option<DateTime<Utc>>,
    /// End of the range, exclusive: RFC 3339 or a UTC date.
    #[arg(long, value_parser = parse_time, required_unless_present = "period", conflicts_with = "period")]
    pub to: Option<DateTime<Utc>>,
    /// The range of one billing period instead of --from/--to: a UTC day (2026-11-30)
    /// or month (2026-11).
    #[arg(long, value_name = "DAY|MONTH", value_parser = parse_billing_period)]
    pub period: Option<Period>,
    /// With --period: the period's close, its adjustments and the current counts side
    /// by side, per ad (guide, "Billing periods and disputes").
    #[arg(long, requires = "period")]
    pub with_adjustments: bool,
    /// Only this ad; repeat for several. Default: every ad.
    #[arg(long = "ad", value_name = "ID")]
    pub ads: Vec<u64>,
    /// Bucket width (UTC).
    #[arg(long, value_enum, default_value_t = By::Minute)]
    pub by: By,
    /// Only the N ads with the most clicks in the whole range (ties: the lower ad ID),
    /// listed by that total, largest first.
    #[arg(long, value_name = "N")]
    pub top: Option<u64>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Only rows aggregated from this Kafka topic. Default: every topic in the table.
    /// (Not `--topic`: that global flag names the topic `run` consumes.)
    #[arg(long, value_name = "TOPIC")]
    pub only_topic: Option<String>,
    /// Print the SQL with the values written in (for clickhouse-client on servers
    /// without query parameters), with the range split into sealed and unsealed parts
    /// as it is now, instead of running it.
    #[arg(long)]
    pub print_sql: bool,
}

fn epoch_seconds(t: DateTime<Utc>, flag: &str) -> Result<u32> {
    u32::try_from(t.timestamp())
        .map_err(|_| anyhow!("--{flag} {t} is outside what ClickHouse DateTime holds (1970..2106)"))
}

/// A day (`2026-11-30`) or a month (`2026-11`), for `--period`.
pub fn parse_billing_period(s: &str) -> Result<Period, String> {
    let kind = if s.len() == "2026-11".len() { PeriodKind::Month } else { PeriodKind::Day };
    parse_period(kind, s)
}

/// What `args` asks of the billing read.
pub fn request(args: &QueryArgs) -> Result<BillingRequest> {
    let (from, to) = match (args.period, args.from, args.to) {
        (Some(p), _, _) => (p.start, p.end()),
        (None, Some(from), Some(to)) => (epoch_seconds(from, "from")?, epoch_seconds(to, "to")?),
        _ => anyhow::bail!("--from and --to, or --period, say which range to read"),
    };
    Ok(BillingRequest {
        from,
        to,
        by: args.by.grain(),
        ads: args.ads.clone(),
        topic: args.only_topic.clone(),
        top: args.top,
    })
}

/// The billing SQL for `args` as it reads with nothing sealed (every bucket from the
/// minute rows), with the values written in.
pub fn sql(args: &QueryArgs) -> Result<String> {
    let request = request(args)?;
    billing_sql(&request, &unsealed(&request)).map_err(anyhow::Error::msg)
}

/// Runs the billing query; rows ordered as [`QueryArgs`] describes.
pub async fn query(sink: &Sink, args: &QueryArgs) -> Result<Vec<BillingRow>> {
    let request = request(args)?;
    check(&request).map_err(anyhow::Error::msg)?;
    let rows = sink.billing_rows(&request).await.context("billing query failed")?;
    Ok(if args.top.is_some() { by_total_descending(rows) } else { rows })
}

/// Orders rows by their ad's total (largest first), then ad, then bucket: the top
/// file returns the set of top ads, the ranking is cheaper to do here than in SQL
/// (which would need a join or a second pass on 18.16).
fn by_total_descending(mut rows: Vec<BillingRow>) -> Vec<BillingRow> {
    let mut totals: BTreeMap<u64, u64> = BTreeMap::new();
    for r in &rows {
        *totals.entry(r.ad_id).or_default() += r.clicks;
    }
    rows.sort_by_key(|r| (std::cmp::Reverse(totals[&r.ad_id]), r.ad_id, r.bucket));
    rows
}

/// The rows in `format`, ending with a newline.
pub fn render(rows: &[BillingRow], format: Format) -> String {
    let mut out = String::new();
    match format {
        Format::Csv => {
            out.push_str("ad_id,bucket,clicks\n");
            for r in rows {
                let _ = writeln!(out, "{},{},{}", r.ad_id, r.bucket_rfc3339(), r.clicks);
            }
        }
        Format::Json => {
            let items: Vec<serde_json::Value> = rows
                .iter()
                .map(|r| serde_json::json!({ "ad_id": r.ad_id, "bucket": r.bucket_rfc3339(), "clicks": r.clicks }))
                .collect();
            out.push_str(&serde_json::Value::Array(items).to_string());
            out.push('\n');
        }
        Format::Table => {
            let total: u64 = rows.iter().map(|r| r.clicks).sum();
            let cells: Vec<(String, String, String)> =
                rows.iter().map(|r| (r.ad_id.to_string(), r.bucket_rfc3339(), r.clicks.to_string())).collect();
            let ad_w = cells.iter().map(|c| c.0.len()).chain(["ad_id".len(), "total".len()]).max().unwrap_or(0);
            let bucket_w = "2026-11-30T08:00:00Z".len();
            let clicks_w =
                cells.iter().map(|c| c.2.len()).chain(["clicks".len(), total.to_string().len()]).max().unwrap_or(0);
            let _ = writeln!(out, "{:>ad_w$}  {:<bucket_w$}  {:>clicks_w$}", "ad_id", "bucket", "clicks");
            for (ad, bucket, clicks) in &cells {
                let _ = writeln!(out, "{ad:>ad_w$}  {bucket:<bucket_w$}  {clicks:>clicks_w$}");
            }
            let _ = writeln!(out, "{:<ad_w$}  {:<bucket_w$}  {total:>clicks_w$}", "total", "");
        }
    }
    out
}

/// `clickagg query`: print the counts, or the SQL with `--print-sql`.
pub async fn run(settings: &Settings, args: &QueryArgs) -> Result<ExitCode> {
    // Checked first so that a bad flag is reported as such, not as a failed query.
    let request = request(args)?;
    check(&request).map_err(anyhow::Error::msg)?;
    let sink = Sink::new(&settings.clickhouse).with_seal_slack(settings.seal.slack);
    if let (Some(period), true) = (args.period, args.with_adjustments) {
        let topic = args.only_topic.as_deref().unwrap_or(&settings.kafka.topic);
        let view = crate::seal::adjust::PeriodView::read(&sink, topic, period, &args.ads)
            .await
            .with_context(|| format!("reading the close and adjustments in database {}", sink.database()))?;
        match args.format {
            Format::Json => println!("{}", serde_json::to_string(&view).expect("a view serializes")),
            _ => print!("{}", view.table()),
        }
        return Ok(ExitCode::SUCCESS);
    }
    if args.print_sql {
        let text = sink
            .billing_sql(&request)
            .await
            .with_context(|| format!("reading the seals of the range in database {}", sink.database()))?;
        println!("{text}");
        return Ok(ExitCode::SUCCESS);
    }
    let rows =
        query(&sink, args).await.with_context(|| format!("querying billing counts in database {}", sink.database()))?;
    print!("{}", render(&rows, args.format));
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(from: &str, to: &str) -> QueryArgs {
        QueryArgs {
            from: Some(parse_time(from).unwrap()),
            to: Some(parse_time(to).unwrap()),
            period: None,
            with_adjustments: false,
            ads: Vec::new(),
            by: By::Minute,
            top: None,
            format: Format::Table,
            only_topic: None,
            print_sql: false,
        }
    }

    fn row(ad_id: u64, bucket: &str, clicks: u64) -> BillingRow {
        BillingRow { ad_id, bucket: parse_time(bucket).unwrap().timestamp() as u32, clicks }
    }

    #[test]
    fn with_nothing_sealed_every_bucket_is_read_from_the_minute_rows() {
        let sql = sql(&QueryArgs { by: By::Day, ..args("2026-11-30", "2026-12-01") }).unwrap();
        assert!(sql.contains("PREWHERE minute >= toDateTime(1795996800, 'UTC')"), "{sql}");
        // The sealed parts, which would read nothing, are left out.
        assert!(!sql.contains("ad_clicks_sealed") && !sql.contains("NOT IN"), "{sql}");
    }

    #[test]
    fn both_sql_files_substitute_completely_for_every_option() {
        for by in [By::Minute, By::Hour, By::Day] {
            for top in [None, Some(10)] {
                let mut a = args("2026-11-30", "2026-12-01");
                a.by = by;
                a.top = top;
                a.ads = vec![17, 42];
                a.only_topic = Some("clicks".into());
                let sql = sql(&a).unwrap();
                assert!(!sql.contains('{') && !sql.contains("--"), "{sql}");
                assert!(sql.contains("FINAL"));
                assert!(sql.contains(&format!("'{}'", by.as_sql())));
                assert!(sql.contains("toDateTime(1796083200, 'UTC')"), "--to is 2026-12-01T00:00:00Z");
                assert_eq!(sql.contains("LIMIT 10"), top.is_some());
                assert!(sql.contains("(0 OR ad_id IN (SELECT arrayJoin(CAST([17, 42] AS Array(UInt64)))))"), "{sql}");
            }
        }
    }

    #[test]
    fn no_ad_flag_means_every_ad_through_a_literal_the_index_analysis_can_fold() {
        let sql = sql(&args("2026-11-30", "2026-12-01")).unwrap();
        assert!(sql.contains("(1 OR ad_id IN (SELECT arrayJoin(CAST([] AS Array(UInt64)))))"), "{sql}");
    }

    #[test]
    fn an_empty_or_inverted_range_and_top_zero_are_refused() {
        assert!(sql(&args("2026-11-30", "2026-11-30")).is_err());
        assert!(sql(&args("2026-12-01", "2026-11-30")).is_err());
        assert!(sql(&args("1969-12-31", "2026-11-30")).is_err());
        let mut a = args("2026-11-30", "2026-12-01");
        a.top = Some(0);
        assert!(sql(&a).is_err());
    }

    #[test]
    fn top_rows_are_ranked_by_ad_total_then_ad_then_bucket() {
        let rows = vec![
            row(1, "2026-11-30T08:00:00Z", 5),
            row(1, "2026-11-30T09:00:00Z", 5),
            row(2, "2026-11-30T08:00:00Z", 20),
            row(3, "2026-11-30T09:00:00Z", 4),
            row(3, "2026-11-30T08:00:00Z", 6),
        ];
        let ranked: Vec<(u64, u64)> = by_total_descending(rows).iter().map(|r| (r.ad_id, r.clicks)).collect();
        assert_eq!(ranked, vec![(2, 20), (1, 5), (1, 5), (3, 6), (3, 4)]);
    }

    #[test]
    fn csv_has_a_header_and_rfc3339_buckets() {
        let rows = vec![row(17, "2026-11-30T08:00:00Z", 3), row(42, "2026-11-30T09:00:00Z", 12)];
        assert_eq!(
            render(&rows, Format::Csv),
            "ad_id,bucket,clicks\n17,2026-11-30T08:00:00Z,3\n42,2026-11-30T09:00:00Z,12\n"
        );
    }

    #[test]
    fn json_is_one_array_of_objects() {
        let rows = vec![row(17, "2026-11-30T08:00:00Z", 3)];
        let out = render(&rows, Format::Json);
        assert_eq!(out, "[{\"ad_id\":17,\"bucket\":\"2026-11-30T08:00:00Z\",\"clicks\":3}]\n");
        assert_eq!(render(&[], Format::Json), "[]\n");
    }

    #[test]
    fn table_aligns_columns_and_ends_with_the_total() {
        let rows = vec![row(7, "2026-11-30T08:00:00Z", 3), row(123456, "2026-11-30T09:00:00Z", 1200)];
        let expected = [
            " ad_id  bucket                clicks",
            "     7  2026-11-30T08:00:00Z       3",
            "123456  2026-11-30T09:00:00Z    1200",
            "total                           1203",
        ];
        assert_eq!(render(&rows, Format::Table), expected.join("\n") + "\n");
    }

    #[test]
    fn an_empty_table_still_shows_a_zero_total() {
        let expected = ["ad_id  bucket                clicks", "total                             0"];
        assert_eq!(render(&[], Format::Table), expected.join("\n") + "\n");
    }
}
