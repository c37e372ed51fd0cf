//! `clickagg query`: billing counts from ClickHouse, per ad and minute, hour or day.
//!
//! The SQL lives in `sql/billing.sql` and `sql/billing_top.sql` so that an analyst can
//! run the very same text with `clickhouse-client --param_…`. Those files use
//! server-side `{name:Type}` placeholders, which ClickHouse 18.16 does not know, so
//! this module writes the values in client-side, as literals built only from numbers
//! and escaped strings ([`substitute`]). Both files read through `FINAL`: a batch row
//! replaced by a later version is never summed twice.
//!
//! The query reads the coarsest table that answers it exactly ([`grain_for`]): the daily
//! roll-up for days over whole days, the hourly one for hours (or days) over whole
//! hours, the minute table otherwise.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context, Result};
use chrono::{DateTime, NaiveDate, Utc};
use clap::{Args, ValueEnum};
use clickhouse::Row;
use serde::Deserialize;

use crate::aggregate::Grain;
use crate::config::Settings;
use crate::sink::{quote_ident, quote_literal, table_of, Sink};

pub const BILLING_SQL: &str = include_str!("../sql/billing.sql");
pub const BILLING_TOP_SQL: &str = include_str!("../sql/billing_top.sql");

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
    #[arg(long, value_parser = parse_time)]
    pub from: DateTime<Utc>,
    /// End of the range, exclusive: RFC 3339 or a UTC date.
    #[arg(long, value_parser = parse_time)]
    pub to: DateTime<Utc>,
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
    /// without query parameters) instead of running it.
    #[arg(long)]
    pub print_sql: bool,
}

/// One bucket of one ad.
#[derive(Debug, Clone, PartialEq, Eq, Row, Deserialize)]
pub struct BillingRow {
    pub ad_id: u64,
    /// Start of the bucket, Unix seconds (UTC).
    pub bucket: u32,
    pub clicks: u64,
}

impl BillingRow {
    pub fn bucket_rfc3339(&self) -> String {
        DateTime::from_timestamp(i64::from(self.bucket), 0)
            .expect("u32 seconds are always a valid timestamp")
            .format("%Y-%m-%dT%H:%M:%SZ")
            .to_string()
    }
}

/// RFC 3339, or a plain date meaning its UTC midnight (billing days are UTC days).
pub fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    if let Ok(d) = NaiveDate::parse_from_str(s, "%Y-%m-%d") {
        return Ok(d.and_hms_opt(0, 0, 0).expect("midnight exists").and_utc());
    }
    Err(format!("{s:?} is neither RFC 3339 (2026-11-30T08:00:00Z) nor a date (2026-11-30)"))
}

/// A value for one `{name:Type}` placeholder of the SQL files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Param {
    DateTimeUtc(u32),
    String(String),
    UInt8(u8),
    UInt64(u64),
    ArrayUInt64(Vec<u64>),
    Identifier(&'static str),
}

impl Param {
    /// The type the placeholder must declare: a file and this code that disagree
    /// fail loudly instead of comparing, say, a date with a string.
    fn sql_type(&self) -> &'static str {
        match self {
            Param::DateTimeUtc(_) => "DateTime('UTC')",
            Param::String(_) => "String",
            Param::UInt8(_) => "UInt8",
            Param::UInt64(_) => "UInt64",
            Param::ArrayUInt64(_) => "Array(UInt64)",
            Param::Identifier(_) => "Identifier",
        }
    }

    /// The value as a ClickHouse 18.16-compatible literal. Typed explicitly where the
    /// bare literal would have another type (an empty `[]` has no element type).
    /// Plain numbers for the integers: they also have to work after `LIMIT`, and a
    /// literal 0 or 1 is what 18.16 folds when it picks granules by the primary key.
    fn literal(&self) -> String {
        match self {
            Param::DateTimeUtc(secs) => format!("toDateTime({secs}, 'UTC')"),
            Param::String(s) => quote_literal(s),
            Param::UInt8(n) => n.to_string(),
            Param::UInt64(n) => n.to_string(),
            Param::ArrayUInt64(v) => {
                let items: Vec<String> = v.iter().map(u64::to_string).collect();
                format!("CAST([{}] AS Array(UInt64))", items.join(", "))
            }
            Param::Identifier(name) => quote_ident(name),
        }
    }
}

/// Writes `params` into the `{name:Type}` placeholders of `sql` and drops the `--`
/// comment lines (they show placeholders too, in the examples). Every placeholder must
/// have a parameter of its declared type, and every parameter must be used.
pub fn substitute(sql: &str, params: &[(&str, Param)]) -> Result<String> {
    let body: String = sql.lines().filter(|l| !l.trim_start().starts_with("--")).map(|l| format!("{l}\n")).collect();
    let mut out = String::with_capacity(body.len());
    let mut used = vec![false; params.len()];
    let mut rest = body.as_str();
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let close = rest[open..].find('}').ok_or_else(|| anyhow!("unclosed '{{' in SQL"))? + open;
        let inner = &rest[open + 1..close];
        let (name, ty) =
            inner.split_once(':').ok_or_else(|| anyhow!("'{{{inner}}}' is not a {{name:Type}} placeholder"))?;
        let i = params
            .iter()
            .position(|(n, _)| *n == name.trim())
            .ok_or_else(|| anyhow!("no value for placeholder {{{inner}}}"))?;
        let param = &params[i].1;
        if ty.trim() != param.sql_type() {
            bail!("placeholder {{{inner}}} does not have the expected type {}", param.sql_type());
        }
        used[i] = true;
        out.push_str(&param.literal());
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    if let Some(i) = used.iter().position(|u| !u) {
        bail!("parameter {} is not used by the SQL", params[i].0);
    }
    Ok(out.trim().to_string())
}

fn epoch_seconds(t: DateTime<Utc>, flag: &str) -> Result<u32> {
    u32::try_from(t.timestamp())
        .map_err(|_| anyhow!("--{flag} {t} is outside what ClickHouse DateTime holds (1970..2106)"))
}

/// The coarsest grain whose table answers `[from, to)` by `by` exactly: every bucket of
/// the answer must be a whole number of its buckets, and so must the range.
pub fn grain_for(by: By, from: u32, to: u32) -> Grain {
    let fits = |g: Grain| from.is_multiple_of(g.seconds()) && to.is_multiple_of(g.seconds());
    match by {
        By::Day if fits(Grain::Day) => Grain::Day,
        By::Day | By::Hour if fits(Grain::Hour) => Grain::Hour,
        _ => Grain::Minute,
    }
}

/// The billing SQL for `args`, with the values written in.
pub fn sql(args: &QueryArgs) -> Result<String> {
    let from = epoch_seconds(args.from, "from")?;
    let to = epoch_seconds(args.to, "to")?;
    if from >= to {
        bail!("--from must be before --to (the range is [from, to))");
    }
    if args.only_topic.as_deref() == Some("") {
        bail!("--only-topic must not be empty (leave it out for every topic)");
    }
    let (table, time) = table_of(grain_for(args.by, from, to));
    let mut params = vec![
        ("table", Param::Identifier(table)),
        ("time", Param::Identifier(time)),
        ("from", Param::DateTimeUtc(from)),
        ("to", Param::DateTimeUtc(to)),
        ("by", Param::String(args.by.as_sql().to_string())),
        ("all_ads", Param::UInt8(u8::from(args.ads.is_empty()))),
        ("ads", Param::ArrayUInt64(args.ads.clone())),
        ("topic", Param::String(args.only_topic.clone().unwrap_or_default())),
    ];
    let file = match args.top {
        None => BILLING_SQL,
        Some(0) => bail!("--top must be at least 1"),
        Some(n) => {
            // One read of `table` through FINAL ranks the ads and gives their buckets.
            params.push(("top", Param::UInt64(n)));
            BILLING_TOP_SQL
        }
    };
    substitute(file, &params)
}

/// Runs the billing query; rows ordered as [`QueryArgs`] describes.
pub async fn query(sink: &Sink, args: &QueryArgs) -> Result<Vec<BillingRow>> {
    // The client treats `?` as a bind marker and `??` as a literal `?`; a topic name
    // cannot hold one, but an escaped literal must reach the server unchanged anyway.
    let sql = sql(args)?.replace('?', "??");
    let fetch = sink.client().query(&sql).fetch_all::<BillingRow>();
    let rows = tokio::time::timeout(sink.timeout(), fetch)
        .await
        .map_err(|_| anyhow!("ClickHouse did not answer within {:?}", sink.timeout()))?
        .context("billing query failed")?;
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
    // Built first so that a bad flag is reported as such, not as a failed query.
    let text = sql(args)?;
    if args.print_sql {
        println!("{text}");
        return Ok(ExitCode::SUCCESS);
    }
    let sink = Sink::new(&settings.clickhouse);
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
            from: parse_time(from).unwrap(),
            to: parse_time(to).unwrap(),
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
    fn the_coarsest_table_that_answers_exactly_is_read() {
        let day = 86_400;
        assert_eq!(grain_for(By::Day, day, 3 * day), Grain::Day);
        assert_eq!(grain_for(By::Day, day + 3_600, 3 * day), Grain::Hour, "a partial first day");
        assert_eq!(grain_for(By::Hour, day, 3 * day), Grain::Hour);
        assert_eq!(grain_for(By::Hour, day + 60, 3 * day), Grain::Minute);
        assert_eq!(grain_for(By::Minute, day, 3 * day), Grain::Minute);
        let sql = sql(&QueryArgs { by: By::Day, ..args("2026-11-30", "2026-12-01") }).unwrap();
        assert!(sql.contains("FROM `ad_clicks_day` FINAL") && sql.contains("toStartOfDay(`day`)"), "{sql}");
    }

    #[test]
    fn plain_dates_mean_utc_midnight_and_offsets_are_converted_to_utc() {
        assert_eq!(parse_time("2026-11-30").unwrap().to_rfc3339(), "2026-11-30T00:00:00+00:00");
        assert_eq!(parse_time("2026-11-30T09:30:00+01:00").unwrap().to_rfc3339(), "2026-11-30T08:30:00+00:00");
        assert!(parse_time("30/11/2026").is_err());
    }

    #[test]
    fn values_are_written_in_as_typed_literals() {
        let sql = "SELECT {a:UInt64} WHERE t >= {t:DateTime('UTC')} AND has({ads:Array(UInt64)}, x) AND s = {s:String}";
        let out = substitute(
            sql,
            &[
                ("a", Param::UInt64(7)),
                ("t", Param::DateTimeUtc(1_795_996_800)),
                ("ads", Param::ArrayUInt64(vec![1, 2])),
                ("s", Param::String("it's".into())),
            ],
        )
        .unwrap();
        assert_eq!(
            out,
            "SELECT 7 WHERE t >= toDateTime(1795996800, 'UTC') AND has(CAST([1, 2] AS Array(UInt64)), x) AND s = 'it\\'s'"
        );
    }

    #[test]
    fn an_empty_ad_list_still_has_an_element_type() {
        assert_eq!(Param::ArrayUInt64(vec![]).literal(), "CAST([] AS Array(UInt64))");
    }

    #[test]
    fn a_placeholder_without_a_value_or_with_another_type_is_an_error() {
        assert!(substitute("SELECT {x:UInt64}", &[]).is_err());
        assert!(substitute("SELECT {x:String}", &[("x", Param::UInt64(1))]).is_err());
        assert!(substitute("SELECT {x", &[("x", Param::UInt64(1))]).is_err());
    }

    #[test]
    fn a_value_the_sql_does_not_use_is_an_error() {
        assert!(substitute("SELECT 1", &[("x", Param::UInt64(1))]).is_err());
    }

    #[test]
    fn comment_lines_are_dropped_with_the_placeholders_in_their_examples() {
        let out =
            substitute("-- run with --param_x={x:UInt64}\nSELECT {x:UInt64}\n", &[("x", Param::UInt64(3))]).unwrap();
        assert_eq!(out, "SELECT 3");
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
