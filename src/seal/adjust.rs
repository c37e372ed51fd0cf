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

use std::collections::{BTreeMap, BTreeSet};

use crate::sealing::period::{adjusted_by_ad, adjustments, Period};
use crate::sealing::Grain;
use crate::sink::billing::BillingRequest;
use crate::sink::periods::Close;
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
