//! The billing read: the one way counts are read back, for `clickagg query`, `verify`,
//! `reconcile` and the tests.
//!
//! The SQL lives in `sql/billing.sql` and `sql/billing_top.sql` so that an analyst can
//! run the very same text with `clickhouse-client --param_…`. Those files use
//! server-side `{name:Type}` placeholders, which ClickHouse 18.16 does not know, so
//! the values are written in client-side, as typed literals built only from numbers
//! and escaped strings ([`substitute`]). Both files read through `FINAL`: a row
//! replaced by a later version is never summed twice. A read takes the whole days and
//! hours of its range that are sealed and current from the sealed tables and the rest
//! from the minute rows (`sealing::split`), so it equals the minute rows alone.

use clickhouse::Row;
use serde::Deserialize;

use super::{quote_ident, quote_literal, Sink, SinkError};
use crate::sealing::split::{split, Split};
use crate::sealing::Grain;

pub const BILLING_SQL: &str = include_str!("../../sql/billing.sql");
pub const BILLING_TOP_SQL: &str = include_str!("../../sql/billing_top.sql");

/// What to read: clicks per ad and bucket of `by` in `[from, to)` (Unix seconds, UTC),
/// of the `ads` given (every ad when empty), of one topic or all, optionally only the
/// `top` ads by their total over the range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BillingRequest {
    pub from: u32,
    pub to: u32,
    pub by: Grain,
    pub ads: Vec<u64>,
    pub topic: Option<String>,
    pub top: Option<u64>,
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
        crate::click::rfc3339(self.bucket)
    }
}

/// A value for one `{name:Type}` placeholder of the SQL files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Param {
    DateTimeUtc(u32),
    String(String),
    UInt8(u8),
    UInt64(u64),
    ArrayUInt64(Vec<u64>),
    /// (topic, time) pairs: sealed days, sealed hours, the hours they cover.
    ArrayTopicTime(Vec<(String, u32)>),
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
            Param::ArrayTopicTime(_) => "Array(Tuple(String, DateTime('UTC')))",
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
            Param::ArrayTopicTime(v) => {
                let items: Vec<String> =
                    v.iter().map(|(topic, t)| format!("({}, toDateTime({t}, 'UTC'))", quote_literal(topic))).collect();
                format!("CAST([{}] AS Array(Tuple(String, DateTime('UTC'))))", items.join(", "))
            }
            Param::Identifier(name) => quote_ident(name),
        }
    }
}

/// Writes `params` into the `{name:Type}` placeholders of `sql` and drops the `--`
/// comment lines (they show placeholders too, in the examples). Every placeholder must
/// have a parameter of its declared type, and every parameter must be used.
pub fn substitute(sql: &str, params: &[(&str, Param)]) -> Result<String, String> {
    let body: String = sql.lines().filter(|l| !l.trim_start().starts_with("--")).map(|l| format!("{l}\n")).collect();
    let mut out = String::with_capacity(body.len());
    let mut used = vec![false; params.len()];
    let mut rest = body.as_str();
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let close = rest[open..].find('}').ok_or_else(|| "unclosed '{' in SQL".to_string())? + open;
        let inner = &rest[open + 1..close];
        let (name, ty) =
            inner.split_once(':').ok_or_else(|| format!("'{{{inner}}}' is not a {{name:Type}} placeholder"))?;
        let i = params
            .iter()
            .position(|(n, _)| *n == name.trim())
            .ok_or_else(|| format!("no value for placeholder {{{inner}}}"))?;
        let param = &params[i].1;
        if ty.trim() != param.sql_type() {
            return Err(format!("placeholder {{{inner}}} does not have the expected type {}", param.sql_type()));
        }
        used[i] = true;
        out.push_str(&param.literal());
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    if let Some(i) = used.iter().position(|u| !u) {
        return Err(format!("parameter {} is not used by the SQL", params[i].0));
    }
    Ok(out.trim().to_string())
}

/// The name of a bucket width in the SQL files' `{by:String}` parameter.
fn by_name(by: Grain) -> &'static str {
    match by {
        Grain::Minute => "minute",
        Grain::Hour => "hour",
        Grain::Day => "day",
    }
}

/// Refuses what no read can answer.
pub fn check(r: &BillingRequest) -> Result<(), String> {
    if r.from >= r.to {
        return Err("--from must be before --to (the range is [from, to))".into());
    }
    if r.topic.as_deref() == Some("") {
        return Err("--only-topic must not be empty (leave it out for every topic)".into());
    }
    if r.top == Some(0) {
        return Err("--top must be at least 1".into());
    }
    Ok(())
}

/// The billing SQL for `r`, with its range split as `split` says and the values
/// written in.
pub fn billing_sql(r: &BillingRequest, split: &Split) -> Result<String, String> {
    check(r)?;
    let mut params = vec![
        ("sealed_days", Param::ArrayTopicTime(split.days.clone())),
        ("sealed_hours", Param::ArrayTopicTime(split.hours.clone())),
        ("covered", Param::ArrayTopicTime(split.covered.clone())),
        ("from", Param::DateTimeUtc(split.minutes.0)),
        ("to", Param::DateTimeUtc(split.minutes.1)),
        ("by", Param::String(by_name(r.by).to_string())),
        ("all_ads", Param::UInt8(u8::from(r.ads.is_empty()))),
        ("ads", Param::ArrayUInt64(r.ads.clone())),
        ("topic", Param::String(r.topic.clone().unwrap_or_default())),
    ];
    let file = match r.top {
        None => BILLING_SQL,
        Some(n) => {
            // One read ranks the ads and gives their buckets.
            params.push(("top", Param::UInt64(n)));
            BILLING_TOP_SQL
        }
    };
    // The parts a read of this split does not need: each costs ClickHouse a pipeline
    // even when it reads nothing (one ad over a day: 24-28 ms with all three parts,
    // 14-16 ms with the minute rows alone, scripts/bench-query's table on 26.9).
    let unneeded = [
        ("sealed_days", split.days.is_empty()),
        ("sealed_hours", split.hours.is_empty()),
        ("covered", split.covered.is_empty()),
    ];
    let file = without_parts(file, &unneeded.iter().filter(|(_, drop)| *drop).map(|(n, _)| *n).collect::<Vec<_>>());
    params.retain(|(name, _)| file.contains(&format!("{{{name}:")));
    substitute(&file, &params)
}

/// `sql` without the parts marked `-- if NAME` … `-- end if` whose NAME is in `drop`:
/// the SQL files mark the sealed parts of a read, which an analyst's copy runs whole.
pub fn without_parts(sql: &str, drop: &[&str]) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut skipping = false;
    for line in sql.lines() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("-- if ") {
            skipping = drop.iter().any(|name| rest.split_whitespace().next() == Some(name));
            continue;
        }
        if t == "-- end if" {
            skipping = false;
            continue;
        }
        if !skipping {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// At most this many named ads are read from the minute rows alone.
pub const FEW_ADS: usize = 64;

/// A read of a few named ads: the minute table is sorted by ad first, so their rows are
/// found by the primary key over any range, and reading the seal records first would
/// only add a round trip (one ad over a day: 16-20 ms from the minute rows, 22-24 ms
/// through the seals in scripts/bench-query). Sealed tables are sorted by time first:
/// they pay off when every ad is read.
pub fn reads_few_ads(r: &BillingRequest) -> bool {
    !r.ads.is_empty() && r.ads.len() <= FEW_ADS
}

/// The split of a read with nothing sealed: every bucket from the minute rows.
pub fn unsealed(r: &BillingRequest) -> Split {
    Split { minutes: (r.from, r.to), ..Split::default() }
}

impl Sink {
    /// How a read of `r` splits into sealed days, sealed hours and minute rows, from the
    /// seal records and markers of its range (one request; none for minute buckets, a
    /// range under an hour, or a few named ads).
    pub async fn billing_split(&self, r: &BillingRequest) -> Result<Split, SinkError> {
        check(r).map_err(SinkError::Fatal)?;
        if r.by == Grain::Minute || r.to - r.from < 3_600 || reads_few_ads(r) {
            return Ok(unsealed(r));
        }
        let state = self.seal_state(r.topic.as_deref(), r.from, r.to).await?;
        let current = state.current(self.seal_slack);
        Ok(split(r.from, r.to, r.by, &state.topics, &current))
    }

    /// The billing SQL for `r` as it would run now (`query --print-sql`).
    pub async fn billing_sql(&self, r: &BillingRequest) -> Result<String, SinkError> {
        let split = self.billing_split(r).await?;
        billing_sql(r, &split).map_err(SinkError::Fatal)
    }

    /// The billing counts `r` asks for, as the SQL files order them.
    pub async fn billing_rows(&self, r: &BillingRequest) -> Result<Vec<BillingRow>, SinkError> {
        // The client treats `?` as a bind marker and `??` as a literal `?`; a topic name
        // cannot hold one, but an escaped literal must reach the server unchanged anyway.
        let sql = self.billing_sql(r).await?.replace('?', "??");
        self.timed(self.client.query(&sql).fetch_all::<BillingRow>()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_few_named_ads_are_read_from_the_minute_rows_and_more_or_all_through_the_seals() {
        let r = |ads: Vec<u64>| BillingRequest { from: 0, to: 86_400, by: Grain::Hour, ads, topic: None, top: None };
        assert!(reads_few_ads(&r(vec![42])));
        assert!(reads_few_ads(&r((0..FEW_ADS as u64).collect())));
        assert!(!reads_few_ads(&r((0..=FEW_ADS as u64).collect())));
        assert!(!reads_few_ads(&r(vec![])), "every ad");
    }

    #[test]
    fn a_read_leaves_out_the_sealed_parts_its_split_does_not_need() {
        let r = BillingRequest { from: 0, to: 86_400, by: Grain::Hour, ads: vec![7], topic: None, top: None };
        for top in [None, Some(3)] {
            let r = BillingRequest { top, ..r.clone() };
            let minutes_only = billing_sql(&r, &unsealed(&r)).unwrap();
            assert!(!minutes_only.contains("ad_clicks_sealed"), "{minutes_only}");
            assert!(!minutes_only.contains("NOT IN"), "{minutes_only}");
            assert!(minutes_only.contains("FROM ad_clicks_minute FINAL"), "{minutes_only}");
            let t = |h: u32| ("t".to_string(), h * 3_600);
            let split = Split { hours: vec![t(0)], covered: vec![t(0)], minutes: (0, 86_400), ..Split::default() };
            let with_hours = billing_sql(&r, &split).unwrap();
            assert!(with_hours.contains("ad_clicks_sealed_hour") && !with_hours.contains("ad_clicks_sealed_day"));
            assert!(with_hours.contains("NOT IN"), "{with_hours}");
        }
        // An analyst's copy of the files runs every part: the markers are comments.
        assert!(BILLING_SQL.contains("-- if sealed_days") && BILLING_TOP_SQL.contains("-- if covered"));
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
    fn topic_time_pairs_are_typed_literals_and_an_empty_list_keeps_its_type() {
        assert_eq!(
            Param::ArrayTopicTime(vec![("it's".into(), 3_600)]).literal(),
            "CAST([('it\\'s', toDateTime(3600, 'UTC'))] AS Array(Tuple(String, DateTime('UTC'))))"
        );
        assert_eq!(Param::ArrayTopicTime(vec![]).literal(), "CAST([] AS Array(Tuple(String, DateTime('UTC'))))");
    }

    #[test]
    fn the_split_is_written_into_both_files() {
        let r = BillingRequest { from: 0, to: 86_400, by: Grain::Day, ads: vec![], topic: None, top: None };
        let s = Split {
            days: vec![("t".into(), 0)],
            hours: vec![],
            minutes: (0, 0),
            covered: (0..24).map(|h| ("t".to_string(), h * 3_600)).collect(),
        };
        for top in [None, Some(3)] {
            let sql = billing_sql(&BillingRequest { top, ..r.clone() }, &s).unwrap();
            assert!(sql.contains("arrayJoin(CAST([('t', toDateTime(0, 'UTC'))] AS"), "{sql}");
            assert!(sql.contains("minute >= toDateTime(0, 'UTC')\n") || sql.contains("minute >= toDateTime(0, 'UTC')"));
            assert!(sql.contains("toDateTime(82800, 'UTC')"), "the last covered hour");
        }
        assert!(billing_sql(&BillingRequest { from: 5, to: 5, ..r.clone() }, &s).is_err());
        assert!(billing_sql(&BillingRequest { top: Some(0), ..r }, &s).is_err());
    }
}
