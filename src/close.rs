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
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};

use crate::click::rfc3339;
use crate::config::Settings;
use crate::seal::adjust::Closed;
use crate::sealing::period::{close_id, parse_period, Period, PeriodKind};
use crate::sink::periods::Close;
use crate::sink::Sink;

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
