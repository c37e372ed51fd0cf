//! Adjustments of closed billing periods (`sql/009_billing_periods.sql`): a step of
//! every sealing round. A closed period's totals never change; when its minute rows
//! do (a late click, a replay after a fix, a backfill), the round writes per ad the
//! signed difference between the current total and the closed total plus the
//! adjustments so far (`period::adjustments`).
//!
//! Which periods a round looks at: those holding an hour a marker names since the last
//! round (the markers the round reads anyway, `mod.rs`), and those closed since the
//! last round — which covers writes between a close's read of the totals and its record
//! becoming readable. So no change is missed, by the sealer's own argument.
//!
//! Exactly once under `kill -9` and two sealers: a round records its progress only
//! after this step, so a killed round runs it again, and a run finds what an earlier
//! one wrote (its adjustments are read before the current totals) and writes only what
//! is still missing. Two runs that read the same adjustments write under the same key
//! (period, ad, seq); `ReplacingMergeTree(detected_at)` keeps the one whose read came
//! later, which holds everything the other saw.
//!
//! A period as people read it, its close and per ad the closed total, the adjustments
//! since and the current total ([`PeriodView`]), is here too: `close` reports a close
//! ([`Closed`]) and `query --period … --with-adjustments` prints the view.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde::Serialize;

use crate::click::rfc3339;

use crate::sealing::period::{adjusted_by_ad, adjustments, Period};
use crate::sealing::Grain;
use crate::sink::billing::BillingRequest;
use crate::sink::periods::{AdjustmentRow, Close};
use crate::sink::{Sink, SinkError};
use crate::telemetry as t;

/// The current total per ad of `period`, through the billing read `query` uses.
pub async fn current_totals(sink: &Sink, topic: &str, period: Period) -> Result<BTreeMap<u64, u64>, SinkError> {
    let r = BillingRequest {
        from: period.start,
        to: period.end(),
        by: Grain::Day,
        ads: Vec::new(),
        topic: Some(topic.to_string()),
        top: None,
    };
    let mut totals: BTreeMap<u64, u64> = BTreeMap::new();
    for row in sink.billing_rows(&r).await? {
        *totals.entry(row.ad_id).or_default() += row.clicks;
    }
    totals.retain(|_, c| *c > 0);
    Ok(totals)
}

/// Detects the adjustments of the closed periods of `topic` that hold an hour of
/// `touched`, or that were closed at or after `since`; returns how many it wrote.
pub async fn detect(
    sink: &Sink,
    topic: &str,
    touched: &BTreeSet<u32>,
    since: u32,
    slack: u32,
) -> Result<u64, SinkError> {
    // Billing reads take an hour from its minute rows while a marker is within the
    // sealer's slack of its seal, as `query` does.
    let sink = &sink.clone().with_seal_slack(std::time::Duration::from_secs(u64::from(slack)));
    let mut written = 0;
    for close in sink.closes(topic).await? {
        let Some(period) = close.period() else { continue };
        if close.closed_at >= since || touched.iter().any(|&h| period.holds_hour(h)) {
            written += detect_period(sink, topic, &close, period, slack).await?;
        }
    }
    Ok(written)
}

/// One period's detection: returns how many adjustments it wrote.
async fn detect_period(sink: &Sink, topic: &str, close: &Close, period: Period, slack: u32) -> Result<u64, SinkError> {
    // The time first: every read below is at least this new.
    let detected_at = sink.server_now().await?;
    let closed = sink.closed_totals(topic, close).await?;
    let stored = sink.adjustments_of(topic, period).await?;
    let adjusted = adjusted_by_ad(stored.iter().map(|a| (a.ad_id, a.seq, a.delta, a.detected_at)));
    let current = current_totals(sink, topic, period).await?;
    let found = adjustments(&closed, &adjusted, &current);
    if found.is_empty() {
        return Ok(0);
    }
    // Since the ad's last look (its last adjustment, or the close's read).
    let since: BTreeMap<u64, u32> = found
        .iter()
        .map(|a| {
            let last = adjusted.get(&a.ad_id).map_or(close.computed_at, |d| d.last_detected_at);
            (a.ad_id, last.saturating_sub(slack))
        })
        .collect();
    let mut moved = sink.batches_written_since(topic, period, &since).await?;
    let rows: Vec<_> = found
        .into_iter()
        .map(|a| {
            let batches = moved.remove(&a.ad_id).unwrap_or_default();
            (a, serde_json::to_string(&batches).expect("strings serialize"))
        })
        .collect();
    stop_point!("adjust:before-rows");
    sink.insert_adjustments(topic, period, &rows, detected_at).await?;
    stop_point!("adjust:after-rows");
    tracing::warn!(
        topic,
        period = %period.label(),
        kind = period.kind.word(),
        ads = rows.len(),
        delta = rows.iter().map(|(a, _)| a.delta).sum::<i64>(),
        "a closed billing period changed: adjustments written"
    );
    metrics::counter!(t::ADJUSTMENTS).increment(rows.len() as u64);
    Ok(rows.len() as u64)
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
        let current = current_totals(sink, topic, period).await?;
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
