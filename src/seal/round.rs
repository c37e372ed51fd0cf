//! One sealing round (see `mod.rs` for why it is exact): take the server time, read
//! the progress and the markers, advance the frontier over the due hours a day at a
//! time, re-seal the marked hours behind it, seal the days that completed or changed,
//! record the progress.

use std::collections::BTreeSet;
use std::time::Duration;

use tracing::{debug, info};

use super::due::{self, PositionsError};
use super::plan::{
    chunks_by_day, complete_days, day_version, decide, due_until, floor_day, next_stretch, skip_empty_days, to_reseal,
    Decision, DAY, HOUR,
};
use crate::config::{KafkaSettings, Settings};
use crate::position::BatchOffsets;
use crate::retry::Retryable;
use crate::sealing::Grain;
use crate::sink::seal::{grain_word, Progress, RecordOut, SealedRow};
use crate::sink::{Sink, SinkError};
use crate::telemetry as t;

/// What makes an hour due.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // one per sealer
pub enum Due {
    /// The group's committed positions and the recorded clocks, past the hour's end by
    /// `lateness` seconds (`plan::due_until`).
    Group { kafka: KafkaSettings, group: String, batch_offsets: BatchOffsets, lateness: u32 },
    /// Every hour that ends at or before this time (Unix s): an operator's word
    /// (`clickagg seal --through`).
    Through(u32),
}

#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error(transparent)]
    Sink(#[from] SinkError),
    #[error("reading the group's offsets from Kafka: {message}")]
    Kafka { fatal: bool, message: String },
}

impl From<PositionsError> for SealError {
    fn from(e: PositionsError) -> SealError {
        match e {
            PositionsError::Sink(e) => SealError::Sink(e),
            PositionsError::Kafka { fatal, message } => SealError::Kafka { fatal, message },
        }
    }
}

impl Retryable for SealError {
    fn is_fatal(&self) -> bool {
        match self {
            SealError::Sink(e) => e.is_fatal(),
            SealError::Kafka { fatal, .. } => *fatal,
        }
    }
}

/// What a round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Hours and days sealed for the first time.
    pub hours_sealed: u64,
    pub days_sealed: u64,
    /// Sealed ones whose rows changed, sealed again with a higher version.
    pub hours_resealed: u64,
    pub days_resealed: u64,
    /// Sealed ones computed again and found unchanged.
    pub hours_unchanged: u64,
    /// Adjustments written to closed billing periods.
    pub adjustments: u64,
    /// The first hour not sealed after the round (`None`: no minute rows yet).
    pub frontier: Option<u32>,
    /// The first hour not due (`None`: none is).
    pub due_until: Option<u32>,
}

impl Report {
    pub fn summary(&self) -> String {
        let at =
            |t: Option<u32>| t.map_or("-".to_string(), |t| crate::click::Minute::from_epoch_seconds(t).to_rfc3339());
        let adjusted = match self.adjustments {
            0 => String::new(),
            n => format!("; {n} adjustments of closed billing periods written"),
        };
        format!(
            "sealed {} hours and {} days; re-sealed {} hours and {} days ({} hours unchanged); \
             sealed through {} (due through {}){adjusted}",
            self.hours_sealed,
            self.days_sealed,
            self.hours_resealed,
            self.days_resealed,
            self.hours_unchanged,
            at(self.frontier),
            at(self.due_until)
        )
    }
}

/// Seals one topic.
pub struct Sealer {
    sink: Sink,
    topic: String,
    due: Due,
    slack: u32,
}

impl Sealer {
    pub fn new(sink: Sink, topic: &str, due: Due, slack: Duration) -> Sealer {
        Sealer { sink, topic: topic.to_string(), due, slack: slack.as_secs().max(1) as u32 }
    }

    /// The sealer of `kafka.topic`, with hours due by the group `kafka.group`.
    pub fn for_group(s: &Settings, sink: Sink) -> Sealer {
        let due = Due::Group {
            kafka: s.kafka.clone(),
            group: s.kafka.group.clone(),
            batch_offsets: s.batch_offsets(),
            lateness: s.validation.max_lateness.as_secs().min(u64::from(u32::MAX)) as u32,
        };
        Sealer::new(sink, &s.kafka.topic, due, s.seal.slack)
    }

    pub fn sink(&self) -> &Sink {
        &self.sink
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// One round. `recompute_from`: also compute every sealed hour from then on again
    /// (an operator's repair, `clickagg seal --recompute-from`).
    pub async fn round(&self, recompute_from: Option<u32>) -> Result<Report, SealError> {
        let started = self.sink.server_now().await?;
        let progress = self.sink.seal_progress(&self.topic).await?;
        let (due_until, positions) = self.due_until(started).await?;
        // Before any minute row is read: every marker readable now is handled by a read
        // that comes after this one.
        let touched = self.sink.touched_since(&self.topic, progress.scanned_from.saturating_sub(self.slack)).await?;
        let mut report = Report { due_until, ..Report::default() };
        let first = match progress.frontier {
            Some(f) => Some(f),
            None => self.sink.first_minute(&self.topic, 0).await?.map(floor_day),
        };
        let Some(first) = first else {
            debug!(topic = %self.topic, "no minute rows yet: nothing to seal");
            return Ok(report);
        };

        // The frontier, over the due hours, one UTC day (one read) at a time.
        let mut frontier = first;
        while let Some((from, to)) = due_until.and_then(|due| next_stretch(frontier, due)) {
            let hours: Vec<u32> = (from..to).step_by(HOUR as usize).collect();
            frontier = if self.seal_hours(&hours, &positions, true, &mut report).await? {
                to
            } else {
                let due = due_until.expect("a stretch is due");
                let until = self.sink.first_minute(&self.topic, from).await?.map_or(due, |next| next.min(due));
                match skip_empty_days(from, until) {
                    Some(next_day) => {
                        info!(topic = %self.topic, from, next_day, "no minute rows: the frontier skips whole days");
                        next_day
                    }
                    None => {
                        self.seal_hours(&hours, &positions, false, &mut report).await?;
                        to
                    }
                }
            };
            if frontier.is_multiple_of(DAY) && to == frontier {
                self.seal_day(frontier - DAY, &mut report).await?;
            }
            let keep = Progress { frontier: Some(frontier), scanned_from: progress.scanned_from };
            self.sink.record_seal_progress(&self.topic, keep).await?;
        }

        // Hours behind where the frontier was that rows were written to since the last
        // round (or that an operator asked for).
        let reseal = to_reseal(&touched, first, recompute_from);
        for chunk in chunks_by_day(reseal.iter().copied()) {
            self.seal_hours(&chunk, &positions, false, &mut report).await?;
        }
        for day in complete_days(reseal, frontier) {
            self.seal_day(day, &mut report).await?;
        }
        // Closed periods whose rows changed, or that were closed, since the last round.
        let since = progress.scanned_from.saturating_sub(self.slack);
        report.adjustments = super::adjust::detect(&self.sink, &self.topic, &touched, since, self.slack).await?;
        self.sink
            .record_seal_progress(&self.topic, Progress { frontier: Some(frontier), scanned_from: started })
            .await?;
        report.frontier = Some(frontier);
        Ok(report)
    }

    /// The first hour not due, and the positions that say so (JSON, for the records).
    async fn due_until(&self, now: u32) -> Result<(Option<u32>, String), SealError> {
        match &self.due {
            Due::Through(t) => Ok((Some(t - t % HOUR), format!("{{\"through\":{t}}}"))),
            Due::Group { kafka, group, batch_offsets, lateness } => {
                let positions = due::positions(&self.sink, kafka, group, &self.topic).await?;
                let due = due_until(&positions, *batch_offsets, *lateness, now);
                let json = serde_json::to_string(&positions).expect("positions serialize");
                Ok((due, json))
            }
        }
    }

    /// Seals `hours` (within one UTC day, ascending) from one read of their minute rows.
    /// With `may_skip`, a read that finds no row at all writes nothing and returns
    /// `false`, for the caller to decide whether the hours are sealed empty.
    async fn seal_hours(
        &self,
        hours: &[u32],
        positions: &str,
        may_skip: bool,
        report: &mut Report,
    ) -> Result<bool, SealError> {
        let (topic, sink) = (self.topic.as_str(), &self.sink);
        let (first, end) = (hours[0], hours[hours.len() - 1] + HOUR);
        let computed_at = sink.server_now().await?;
        let in_table = sink.sealed_versions(Grain::Hour, topic, first, end).await?;
        let recorded = sink.recorded_versions(Grain::Hour, topic, first, end).await?;
        let mut cursor = sink.hour_sums(topic, hours).await?;
        let mut next = sink.next_hour_sum(&mut cursor).await?;
        if next.is_none() && may_skip {
            return Ok(false);
        }
        let mut records = Vec::new();
        for &hour in hours {
            // The rows come ordered by hour, then ad.
            let (mut ads, mut version) = (Vec::new(), 0u64);
            while let Some(r) = next.filter(|r| r.hour == hour) {
                ads.push((r.ad_id, r.clicks));
                // Saturating: only a forged row (a version near 2^64) gets there.
                version = version.saturating_add(r.weight);
                next = sink.next_hour_sum(&mut cursor).await?;
            }
            let (in_table, recorded) = (in_table.get(&hour).copied(), recorded.get(&hour).copied());
            match decide(version, in_table, recorded) {
                Decision::Outranked => continue,
                Decision::Record => report.hours_unchanged += 1,
                Decision::Write => {
                    let mut rows: Vec<SealedRow> = ads.iter().map(|&(ad, clicks)| (ad, clicks, version)).collect();
                    if in_table.is_some() {
                        rows.extend(self.vanished(Grain::Hour, hour, &ads, version).await?);
                    }
                    stop_point!("seal:before-hour-rows");
                    sink.insert_sealed(Grain::Hour, topic, hour, &rows).await?;
                    stop_point!("seal:after-hour-rows");
                    count(Grain::Hour, recorded.is_some(), report);
                }
            }
            records.push(RecordOut {
                topic: topic.to_string(),
                grain: grain_word(Grain::Hour),
                bucket: hour,
                version,
                computed_at,
                positions: positions.to_string(),
            });
        }
        // Every row read belongs to one of `hours`, in order, so the loop took them all.
        // One left over is not an hour's sum: an answer the server broke off, whose tail
        // decoded as rows. The hours after it would be recorded with the clicks read
        // before it (none, say): nothing is recorded, and the round is tried again.
        if let Some(r) = next {
            return Err(SealError::Sink(SinkError::Transient(format!(
                "the read of the minute rows of {} hours from {first} answered a row of hour {} after its \
                 last: an answer cut short; not sealed",
                hours.len(),
                r.hour
            ))));
        }
        sink.insert_seal_records(&records).await?;
        stop_point!("seal:after-hour-records");
        Ok(true)
    }

    /// Seals `day` from its 24 sealed hours, once all are recorded.
    async fn seal_day(&self, day: u32, report: &mut Report) -> Result<(), SealError> {
        let (topic, sink) = (self.topic.as_str(), &self.sink);
        // The hours' versions before their rows are read: the rows read are at least as
        // new (a record follows its rows), and if newer, a marker says so to readers.
        let hours = sink.recorded_versions(Grain::Hour, topic, day, day + DAY).await?;
        if hours.len() < 24 {
            return Ok(());
        }
        let version = day_version(&hours.values().copied().collect::<Vec<u64>>());
        let recorded = sink.recorded_versions(Grain::Day, topic, day, day + DAY).await?.get(&day).copied();
        if recorded.is_some_and(|r| r >= version) {
            return Ok(());
        }
        let computed_at = sink.server_now().await?;
        let sums = sink.day_sums(topic, day).await?;
        let mut rows: Vec<SealedRow> = sums.iter().map(|d| (d.ad_id, d.clicks, d.version)).collect();
        if recorded.is_some() {
            let ads: Vec<(u64, u64)> = sums.iter().map(|d| (d.ad_id, d.clicks)).collect();
            rows.extend(self.vanished(Grain::Day, day, &ads, version).await?);
        }
        sink.insert_sealed(Grain::Day, topic, day, &rows).await?;
        stop_point!("seal:after-day-rows");
        let record = RecordOut {
            topic: topic.to_string(),
            grain: grain_word(Grain::Day),
            bucket: day,
            version,
            computed_at,
            positions: String::new(),
        };
        sink.insert_seal_records(&[record]).await?;
        stop_point!("seal:after-day-record");
        count(Grain::Day, recorded.is_some(), report);
        Ok(())
    }

    /// Rows of 0 clicks at `version` for the ads the sealed bucket holds that `ads`
    /// lacks: a re-seal replaces every row of the one before it.
    async fn vanished(
        &self,
        grain: Grain,
        bucket: u32,
        ads: &[(u64, u64)],
        version: u64,
    ) -> Result<Vec<SealedRow>, SealError> {
        let now: BTreeSet<u64> = ads.iter().map(|a| a.0).collect();
        let before = self.sink.sealed_ads(grain, &self.topic, bucket).await?;
        Ok(before.difference(&now).map(|&ad| (ad, 0, version)).collect())
    }
}

fn count(grain: Grain, again: bool, report: &mut Report) {
    let (counter, field) = match (grain, again) {
        (Grain::Day, false) => (t::SEALS, &mut report.days_sealed),
        (Grain::Day, true) => (t::RESEALS, &mut report.days_resealed),
        (_, false) => (t::SEALS, &mut report.hours_sealed),
        (_, true) => (t::RESEALS, &mut report.hours_resealed),
    };
    *field += 1;
    metrics::counter!(counter, "grain" => grain_word(grain)).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::fake_server::{self, Answer, FakeServer, Request};

    /// 2026-11-30T00:00:00Z.
    const DAY0: u32 = 1_795_996_800;

    /// An `HourAd` row as RowBinary.
    fn hour_ad(hour: u32, ad_id: u64, clicks: u64, weight: u64) -> Vec<u8> {
        [hour.to_le_bytes().as_slice(), &ad_id.to_le_bytes(), &clicks.to_le_bytes(), &weight.to_le_bytes()].concat()
    }

    /// A server whose seal read of three hours (clicks in each) fails after its first
    /// block, as 18.16 sends it; with `holds_answers`, it keeps a whole answer back until
    /// the query ends when asked to (`wait_end_of_query=1`), as every server does.
    async fn server(holds_answers: bool) -> FakeServer {
        fake_server::serve(move |r: &Request| {
            let sql = r.sql.as_str();
            if sql.starts_with("SELECT toUInt32(now())") {
                Answer::Rows((DAY0 + 10 * 3_600).to_le_bytes().to_vec())
            } else if sql.contains("FROM clickagg_seal_progress") {
                // Sealed up to the start of the day; the last round at its start.
                Answer::Rows([1u64.to_le_bytes().as_slice(), &DAY0.to_le_bytes(), &DAY0.to_le_bytes()].concat())
            } else if sql.contains("AS weight") {
                let text = fake_server::timeout_18_16(28);
                if holds_answers && r.params.get("wait_end_of_query").map(String::as_str) == Some("1") {
                    return Answer::Error { status: 500, text };
                }
                // The first block: the first hour's ads. The other hours' rows never come.
                let rows = [hour_ad(DAY0, 1, 40, 1), hour_ad(DAY0, 2, 2, 1)].concat();
                Answer::BrokenOff { rows, text }
            } else {
                Answer::Rows(Vec::new())
            }
        })
        .await
    }

    async fn round_against(server: &FakeServer) -> Result<Report, SealError> {
        let settings = crate::config::ClickHouseSettings {
            url: crate::secrets::SecretUrl::new(server.url.clone()),
            ..Default::default()
        };
        let sealer = Sealer::new(Sink::new(&settings), "clicks", Due::Through(DAY0 + 3 * HOUR), Duration::from_secs(5));
        sealer.round(None).await
    }

    // Regression (issue 35): the 18.16 exception after the first block of a seal's read
    // decoded as a row of some other hour, the loop over the hours stopped at it, and the
    // hours after the first were recorded sealed with no clicks: billing read them as 0.
    #[tokio::test]
    async fn a_seal_read_broken_off_by_an_exception_seals_no_hour() {
        let server = server(true).await;
        let round = round_against(&server).await;
        let records = server.requests_with("clickagg_seals").iter().filter(|r| r.sql.starts_with("INSERT")).count();
        assert!(round.is_err() && records == 0, "{round:?}; {records} inserts of seal records");
        assert!(round.unwrap_err().to_string().contains("Code: 159"));
    }

    // The same answer from a server that does not hold it back (a proxy that drops the
    // parameter, say): the row the loop over the hours did not take fails the round.
    #[tokio::test]
    async fn a_row_the_loop_over_the_hours_did_not_take_fails_the_round() {
        let server = server(false).await;
        let round = round_against(&server).await;
        let records = server.requests_with("clickagg_seals").iter().filter(|r| r.sql.starts_with("INSERT")).count();
        assert!(round.is_err() && records == 0, "{round:?}; {records} inserts of seal records");
        let e = round.unwrap_err();
        assert!(!e.is_fatal(), "retried: {e}");
    }
}
