//! `clickagg close`: freeze a billing period's totals (guide, "Billing periods and
//! disputes"; `sql/009_billing_periods.sql`).
//!
//! A close reads the period's total per ad through the billing read, names them by a
//! hash (`period::close_id`), writes them, then a record naming that hash, the group's
//! committed offsets and the time taken before the read. The record is the close: once
//! one exists, closing again reports it and writes nothing, and the closed totals are
//! that record's rows forever. Later changes to the period's rows become adjustments,
//! written by the sealer's rounds (`seal::adjust`).
//!
//! `kill -9` anywhere: before the record, nothing is closed and closing again redoes
//! it (the same totals give the same rows); after it, the close is complete.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;

use crate::click::rfc3339;
use crate::config::Settings;
use crate::sealing::period::{close_id, parse_period, Period, PeriodKind};
use crate::sink::periods::{AdjustmentRow, Close};
use crate::sink::{Sink, SinkError};

/// Exit code of a close refused because the period is not sealed (guide, "Exit codes").
pub const EXIT_NOT_SEALED: u8 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CloseFormat {
    Table,
    Json,
}

/// Freezes the billing totals of a day or month of the topic (`--topic`).
#[derive(Debug, Args, Clone)]
pub struct CloseArgs {
    /// `day` or `month` (UTC).
    #[arg(long, value_enum)]
    pub period: PeriodKind,
    /// The day (2026-11-30), or the month (2026-11 or any day in it).
    pub date: String,
    /// Close even though the sealer has not sealed the whole period (a partition has
    /// not passed its end, or `validation.max_lateness` has not passed since): what
    /// arrives later becomes adjustments.
    #[arg(long)]
    pub force: bool,
    #[arg(long, value_enum, default_value_t = CloseFormat::Table)]
    pub format: CloseFormat,
}

/// What `close` reports: the close that stands for the period.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Closed {
    pub topic: String,
    pub period: &'static str,
    /// `2026-11-30` or `2026-11`.
    pub date: String,
    pub start: String,
    pub end: String,
    /// The content hash of the totals, hex.
    pub close_id: String,
    pub ads: u64,
    pub clicks: u64,
    /// Per partition, the group's committed offset when it was closed (null: none).
    pub positions: serde_json::Value,
    pub forced: bool,
    pub closed_at: String,
    /// Whether this run closed it (false: it was closed already, nothing written).
    pub closed_now: bool,
}

impl Closed {
    pub fn new(topic: &str, period: Period, c: &Close, closed_now: bool) -> Closed {
        Closed {
            topic: topic.to_string(),
            period: period.kind.word(),
            date: period.label(),
            start: rfc3339(period.start),
            end: rfc3339(period.end()),
            close_id: format!("{:016x}", c.close_id),
            ads: c.ads,
            clicks: c.clicks,
            positions: serde_json::from_str(&c.positions).unwrap_or(serde_json::Value::Null),
            forced: c.forced == 1,
            closed_at: rfc3339(c.closed_at),
            closed_now,
        }
    }

    pub fn table(&self) -> String {
        let mut out = String::new();
        let how = if self.closed_now { "closed" } else { "already closed (nothing written)" };
        let _ = writeln!(out, "{} {} of topic {}: {how}", self.period, self.date, self.topic);
        let _ = writeln!(out, "  period     {} .. {}", self.start, self.end);
        let _ = writeln!(out, "  totals     {} clicks of {} ads", self.clicks, self.ads);
        let _ = writeln!(out, "  close id   {}", self.close_id);
        let _ = writeln!(out, "  positions  {}", self.positions);
        let _ = writeln!(out, "  closed at  {}{}", self.closed_at, if self.forced { " (forced)" } else { "" });
        out
    }
}

/// Why a period may not be closed now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub why: String,
    /// Whether `--force` overrides it (a period not sealed whole; never one still running).
    pub forceable: bool,
}

/// Why a period may not be closed yet, or `None` when the sealer has sealed all of it.
pub fn not_sealed(period: Period, frontier: Option<u32>, now: u32) -> Option<Refusal> {
    let sealing = |why: String| Some(Refusal { why, forceable: true });
    if period.end() > now {
        let why = format!("it has not ended yet (it ends at {})", rfc3339(period.end()));
        return Some(Refusal { why, forceable: false });
    }
    match frontier {
        Some(f) if f >= period.end() => None,
        Some(f) => sealing(format!(
            "it is not sealed: hours are sealed through {}, the period ends at {}. An hour is sealed once every \
             partition's committed position has passed its end plus validation.max_lateness; a partition has not \
             passed it yet, or lateness could still add to it",
            rfc3339(f),
            rfc3339(period.end())
        )),
        None => sealing("it is not sealed: the sealer has sealed nothing of this topic yet".into()),
    }
}

pub async fn run(s: &Settings, args: &CloseArgs) -> Result<ExitCode> {
    let period = parse_period(args.period, &args.date).map_err(anyhow::Error::msg)?;
    let topic = s.kafka.topic.as_str();
    let sink = Sink::new(&s.clickhouse).with_seal_slack(s.seal.slack);
    let print = |c: &Closed| match args.format {
        CloseFormat::Table => print!("{}", c.table()),
        CloseFormat::Json => println!("{}", serde_json::to_string(c).expect("a close serializes")),
    };
    if let Some(existing) = sink.close_of(topic, period).await.context("reading the closes")? {
        print(&Closed::new(topic, period, &existing, false));
        return Ok(ExitCode::SUCCESS);
    }
    let computed_at = sink.server_now().await?;
    let progress = sink.seal_progress(topic).await?;
    if let Some(Refusal { why, forceable }) = not_sealed(period, progress.frontier, computed_at) {
        if !(forceable && args.force) {
            let hint = if forceable { "; --force closes it anyway" } else { "" };
            eprintln!("not closing {} {} of topic {topic}: {why}{hint}", period.kind.word(), period.label());
            return Ok(ExitCode::from(EXIT_NOT_SEALED));
        }
        tracing::warn!(period = %period.label(), reason = %why, "closing with --force: later changes become adjustments");
    }
    let positions = committed_positions(s).await?;
    let totals = crate::seal::adjust::current_totals(&sink, topic, period).await.context("reading the totals")?;
    let id = close_id(topic, period, &totals);
    stop_point!("close:before-totals");
    sink.insert_closed(topic, period, id, &totals).await.context("writing the closed totals")?;
    stop_point!("close:after-totals");
    let record = Close {
        period: period.kind.word().to_string(),
        start: period.start,
        close_id: id,
        ads: totals.len() as u64,
        clicks: totals.values().sum(),
        positions,
        forced: u8::from(args.force),
        computed_at,
        closed_at: 0,
    };
    sink.insert_close_record(topic, &record).await.context("writing the close record")?;
    stop_point!("close:after-record");
    // Another close may have been recorded first: the first one stands, and is reported.
    let stands = sink.close_of(topic, period).await?.context("the close record just written is not readable")?;
    print(&Closed::new(topic, period, &stands, stands.close_id == id));
    Ok(ExitCode::SUCCESS)
}

/// The group's committed offset per partition (JSON; null: nothing committed).
async fn committed_positions(s: &Settings) -> Result<String> {
    let (k, group, topic) = (s.kafka.clone(), s.kafka.group.clone(), s.kafka.topic.clone());
    let offsets = tokio::task::spawn_blocking(move || crate::seal::due::group_offsets(&k, &group, &topic))
        .await?
        .context("reading the group's committed offsets")?;
    let committed: BTreeMap<String, Option<i64>> =
        offsets.into_iter().map(|(p, (committed, _, _))| (p.to_string(), committed)).collect();
    Ok(serde_json::to_string(&committed).expect("offsets serialize"))
}

/// One ad of a period side by side: its closed total, the adjustments since, and its
/// current total (`query --period … --with-adjustments`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AdView {
    pub ad_id: u64,
    /// `None`: the period is not closed.
    pub closed: Option<u64>,
    /// The sum of the adjustments.
    pub adjusted: i64,
    pub adjustments: Vec<AdjustmentRow>,
    pub current: u64,
}

/// A period: its close (if closed), and per ad closed, adjustments and current.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeriodView {
    pub topic: String,
    pub period: &'static str,
    pub date: String,
    pub close: Option<Closed>,
    pub ads: Vec<AdView>,
}

impl PeriodView {
    /// Reads the view of `period` for `ads` (every ad when empty).
    pub async fn read(sink: &Sink, topic: &str, period: Period, ads: &[u64]) -> Result<PeriodView, SinkError> {
        let close = sink.close_of(topic, period).await?;
        let closed = match &close {
            Some(c) => Some(sink.closed_totals(topic, c).await?),
            None => None,
        };
        let mut adjustments: BTreeMap<u64, Vec<AdjustmentRow>> = BTreeMap::new();
        for a in sink.adjustments_of(topic, period).await? {
            adjustments.entry(a.ad_id).or_default().push(a);
        }
        let current = crate::seal::adjust::current_totals(sink, topic, period).await?;
        let mut all: std::collections::BTreeSet<u64> = current.keys().copied().collect();
        all.extend(closed.iter().flat_map(|c| c.keys().copied()));
        all.extend(adjustments.keys().copied());
        if !ads.is_empty() {
            all.retain(|ad| ads.contains(ad));
        }
        let ads = all
            .into_iter()
            .map(|ad_id| {
                let adjustments = adjustments.remove(&ad_id).unwrap_or_default();
                AdView {
                    ad_id,
                    closed: closed.as_ref().map(|c| c.get(&ad_id).copied().unwrap_or(0)),
                    adjusted: adjustments.iter().map(|a| a.delta).sum(),
                    adjustments,
                    current: current.get(&ad_id).copied().unwrap_or(0),
                }
            })
            .collect();
        Ok(PeriodView {
            topic: topic.to_string(),
            period: period.kind.word(),
            date: period.label(),
            close: close.map(|c| Closed::new(topic, period, &c, false)),
            ads,
        })
    }

    pub fn table(&self) -> String {
        let mut out = String::new();
        match &self.close {
            Some(c) => {
                let forced = if c.forced { " (forced)" } else { "" };
                let _ = writeln!(
                    out,
                    "{} {} of topic {}: closed at {}{forced}, close id {}",
                    self.period, self.date, self.topic, c.closed_at, c.close_id
                );
            }
            None => {
                let _ = writeln!(out, "{} {} of topic {}: not closed", self.period, self.date, self.topic);
            }
        }
        let _ = writeln!(
            out,
            "{:>20}  {:>10}  {:>11}  {:>18}  {:>10}",
            "ad_id", "closed", "adjustments", "closed+adjustments", "current"
        );
        let (mut closed, mut adjusted, mut current) = (0u64, 0i64, 0u64);
        let cell = |v: Option<i64>| v.map_or("-".to_string(), |v| v.to_string());
        for a in &self.ads {
            closed += a.closed.unwrap_or(0);
            adjusted += a.adjusted;
            current += a.current;
            let billed = a.closed.map(|c| c as i64 + a.adjusted);
            let _ = writeln!(
                out,
                "{:>20}  {:>10}  {:>11}  {:>18}  {:>10}",
                a.ad_id,
                cell(a.closed.map(|c| c as i64)),
                format!("{:+}", a.adjusted),
                cell(billed),
                a.current
            );
        }
        let is_closed = self.close.is_some();
        let _ = writeln!(
            out,
            "{:<20}  {:>10}  {:>11}  {:>18}  {:>10}",
            "total",
            cell(is_closed.then_some(closed as i64)),
            format!("{adjusted:+}"),
            cell(is_closed.then_some(closed as i64 + adjusted)),
            current
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_period_closes_once_the_sealer_passed_its_end_and_never_before_it_ended() {
        let day = parse_period(PeriodKind::Day, "2026-11-30").unwrap();
        let end = day.end();
        assert_eq!(not_sealed(day, Some(end), end + 1), None);
        assert_eq!(not_sealed(day, Some(end + 7_200), end + 99_999), None);
        let why = not_sealed(day, Some(end - 3_600), end + 1).unwrap().why;
        assert!(why.contains("sealed through 2026-11-30T23:00:00Z") && why.contains("max_lateness"), "{why}");
        assert!(not_sealed(day, None, end + 1).unwrap().why.contains("sealed nothing"));
        assert!(not_sealed(day, Some(end), end - 1).unwrap().why.contains("has not ended"));
    }
}
