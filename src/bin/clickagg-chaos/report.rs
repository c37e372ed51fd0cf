//! The verdict: counts against the generator's truth (the `verify` diff), the sealed
//! hours and days against the minute rows, dead letters against the generator's invalid records, the
//! longest stall, the kills that were to land mid-flush, peak memory; the table, which
//! names every check and whether it passed, and the exit status.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use std::time::Duration;

use anyhow::{Context, Result};
use clickagg::click::RejectReason;
use clickagg::config::KafkaSettings;
use clickagg::dead_letter::{ORIGIN, REASON, SOURCE_OFFSET, SOURCE_PARTITION};
use clickagg::sink::Sink;
use clickagg::verify::Diff;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

use crate::inject::Kills;
use crate::progress::Stall;
use crate::young::CaseOutcome;

/// Clicks missing: the per-bucket deficits.
pub fn lost(d: &Diff) -> u64 {
    d.mismatches.iter().map(|m| m.expected.saturating_sub(m.actual)).sum()
}

/// Clicks counted twice: the per-bucket surpluses.
pub fn doubled(d: &Diff) -> u64 {
    d.mismatches.iter().map(|m| m.actual.saturating_sub(m.expected)).sum()
}

/// The dead letters read back: the distinct source positions the members ("run")
/// dead-lettered, per reason, and how many letters there were in all.
#[derive(Debug, Default, Clone)]
pub struct DeadLetters {
    pub positions: BTreeMap<String, BTreeSet<(i32, i64)>>,
    /// Letters produced by a member, re-reads (a crash, a rebalance) included.
    pub from_members: u64,
    pub from_replays: u64,
    /// Letters without the headers that name their source.
    pub unreadable: u64,
}

impl DeadLetters {
    /// Takes one letter by its headers.
    pub fn add(&mut self, header: impl Fn(&str) -> Option<String>) {
        let position = header(SOURCE_PARTITION)
            .and_then(|p| p.parse().ok())
            .zip(header(SOURCE_OFFSET).and_then(|o| o.parse().ok()));
        let (Some(reason), Some(position), Some(origin)) = (header(REASON), position, header(ORIGIN)) else {
            self.unreadable += 1;
            return;
        };
        if origin == "replay" {
            // A replay's letters repeat positions a member dead-lettered (or should
            // have): they must not make up for a letter a member failed to send.
            self.from_replays += 1;
            return;
        }
        self.from_members += 1;
        self.positions.entry(reason).or_default().insert(position);
    }

    pub fn received(&self, reason: RejectReason) -> u64 {
        self.positions.get(reason.as_str()).map_or(0, |s| s.len() as u64)
    }

    /// Reads the whole dead-letter topic, up to its end when the call starts.
    /// Blocking: broker round trips.
    pub fn read(k: &KafkaSettings, topic: &str) -> Result<DeadLetters> {
        let timeout = Duration::from_secs(15);
        let consumer: BaseConsumer = clickagg::source::assigned_consumer_config(k, "clickagg-chaos-dead-letters")
            .set("enable.partition.eof", "false")
            .create()?;
        let parts = match clickagg::source::partitions(&consumer, topic, timeout) {
            Ok(parts) => parts,
            // No member ever produced a letter: every expected one is missing.
            Err(e) if e.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::UnknownTopicOrPartition) => {
                return Ok(DeadLetters::default());
            }
            Err(e) => return Err(e).with_context(|| format!("topic {topic}")),
        };
        let mut tpl = TopicPartitionList::new();
        let mut ends = BTreeMap::new();
        for p in parts {
            let (low, high) = consumer.fetch_watermarks(topic, p, timeout)?;
            if high > low {
                tpl.add_partition_offset(topic, p, Offset::Offset(low))?;
                ends.insert(p, high);
            }
        }
        consumer.assign(&tpl)?;
        let mut out = DeadLetters::default();
        let mut quiet = std::time::Instant::now();
        while !ends.is_empty() {
            match consumer.poll(Duration::from_millis(500)) {
                Some(Ok(m)) => {
                    quiet = std::time::Instant::now();
                    let headers = m.headers();
                    out.add(|name| {
                        headers?
                            .iter()
                            .find(|h| h.key == name)
                            .and_then(|h| h.value)
                            .map(|v| String::from_utf8_lossy(v).into_owned())
                    });
                    if ends.get(&m.partition()).is_some_and(|&end| m.offset() + 1 >= end) {
                        ends.remove(&m.partition());
                    }
                }
                Some(Err(e)) => anyhow::bail!("reading {topic}: {e}"),
                None if quiet.elapsed() > Duration::from_secs(60) => {
                    anyhow::bail!("reading {topic}: nothing for 60 s with partitions {ends:?} unfinished")
                }
                None => {}
            }
        }
        Ok(out)
    }
}

/// Seals every hour of the run (a round through the current time, as `clickagg seal
/// --through` runs it), then compares every sealed hour and day with the minute rows:
/// what disagrees (empty: they agree), and how many hours and days were compared.
pub async fn seal_disagreements(sink: &Sink, topic: &str, slack: Duration) -> Result<(Vec<String>, String)> {
    use clickagg::seal::{check, Due, Sealer};
    let now = u32::try_from(chrono::Utc::now().timestamp()).context("now is within 1970..2106")?;
    let sealer = Sealer::new(sink.clone(), topic, Due::Through(now + 3_600), slack);
    let report = sealer.round(None).await.context("the final sealing round")?;
    let found = check::agreement(sink, topic).await.context("comparing the sealed hours")?;
    let mut problems = found.problems;
    if found.hours == 0 {
        problems.push("nothing was sealed".to_string());
    }
    Ok((problems, format!("{} hours and {} days compared; last round: {}", found.hours, found.days, report.summary())))
}

/// A finding from the run outside the numbers: a member that exited on its own, a
/// replay or a graceful leave that failed.
pub type Incident = String;

/// Everything the table shows.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub records_sent: u64,
    pub clicks_sent: u64,
    pub duplicates_sent: u64,
    /// Of the duplicates, those re-stamped into another minute than their original's.
    pub drifted_sent: u64,
    pub diff: Diff,
    /// Whether the counts became exact within `settle_timeout` after the last fault.
    pub settled: bool,
    pub settle_timeout: Duration,
    /// Where the sealed hours and days disagree with the minute rows (empty: they agree).
    pub seals: Vec<String>,
    pub invalid_sent: BTreeMap<RejectReason, u64>,
    pub dead_letters: DeadLetters,
    pub stall: Stall,
    /// Samples that saw a committed offset move back.
    pub commits_back: u64,
    /// Longest injected outage plus the slack the issue allows.
    pub stall_limit: Duration,
    pub kills: Kills,
    pub peak_rss_kib: u64,
    pub peak_rss_of: String,
    pub faults: Vec<String>,
    /// The cases at a topic's log start, each on a young topic of its own (`young`).
    pub log_start: Vec<CaseOutcome>,
    pub incidents: Vec<Incident>,
    pub wall: Duration,
}

impl Outcome {
    pub fn lost(&self) -> u64 {
        lost(&self.diff)
    }

    pub fn doubled(&self) -> u64 {
        doubled(&self.diff)
    }

    pub fn dead_letters_expected(&self) -> u64 {
        self.invalid_sent.values().sum()
    }

    /// Per reason: (expected, received).
    fn dead_letters_by_reason(&self) -> Vec<(RejectReason, u64, u64)> {
        RejectReason::ALL
            .iter()
            .map(|&r| (r, self.invalid_sent.get(&r).copied().unwrap_or(0), self.dead_letters.received(r)))
            .collect()
    }

    /// Every check, in the order of the table: its name and what failed (empty: passed).
    pub fn checks(&self) -> Vec<(&'static str, Vec<String>)> {
        let mut counts = Vec::new();
        if self.lost() > 0 {
            counts.push(format!("{} clicks lost", self.lost()));
        }
        if self.doubled() > 0 {
            counts.push(format!("{} clicks counted twice", self.doubled()));
        }
        let mut settled = Vec::new();
        if !self.settled {
            settled.push(format!(
                "the counts were not exact within {} s of the last fault",
                self.settle_timeout.as_secs()
            ));
        }
        let mut letters = Vec::new();
        for (reason, expected, received) in self.dead_letters_by_reason() {
            if received < expected {
                letters.push(format!("{} {reason} dead letters missing", expected - received));
            }
            if received > expected {
                letters.push(format!("{} {reason} dead letters for records that are not invalid", received - expected));
            }
        }
        if self.dead_letters.unreadable > 0 {
            letters.push(format!("{} dead letters without their source headers", self.dead_letters.unreadable));
        }
        let mut progress = Vec::new();
        if self.stall.length_s > self.stall_limit.as_secs_f64() {
            progress.push(format!(
                "partition {} made no progress for {:.0} s (limit {} s)",
                self.stall.partition,
                self.stall.length_s,
                self.stall_limit.as_secs()
            ));
        }
        let mut mid_flush = Vec::new();
        if self.kills.planned_mid_flush() > 0 && self.kills.mid_flush == 0 {
            mid_flush.push(format!(
                "none of the {} kills planned mid-flush landed while a flush was in flight",
                self.kills.planned_mid_flush()
            ));
        }
        let mut checks =
            vec![("counts exact (vs the generator's truth)", counts), ("counts settled within the timeout", settled)];
        checks.extend(self.log_start.iter().map(|o| (o.case.check(), o.failures())));
        checks.extend([
            ("sealed hours and days agree with the minute rows", self.seals.clone()),
            ("dead letters (one per invalid record)", letters),
            ("progress (no stall past the limit)", progress),
            ("mid-flush kills landed mid-flush", mid_flush),
            ("members, replays and leaves ran clean", self.incidents.clone()),
        ]);
        checks
    }

    /// Why the run fails, each prefixed with its check; empty when it passes.
    pub fn failures(&self) -> Vec<String> {
        self.checks()
            .into_iter()
            .flat_map(|(check, failed)| failed.into_iter().map(move |f| format!("{check}: {f}")))
            .collect()
    }

    /// A Markdown table, so a result can go into docs/BENCHMARKS.md as it is.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "| {:<36} | {:<60} |", "chaos run", "result");
        let _ = writeln!(s, "|{}|{}|", "-".repeat(38), "-".repeat(62));
        // A newline would end the table: an incident quotes several lines of a log.
        let mut row = |what: &str, value: String| {
            let value = value.replace('\n', " ⏎ ");
            let _ = writeln!(s, "| {what:<36} | {value:<60} |");
        };
        row(
            "records sent",
            format!(
                "{} ({} clicks, {} duplicates of which {} re-stamped, {} invalid)",
                self.records_sent,
                self.clicks_sent,
                self.duplicates_sent,
                self.drifted_sent,
                self.dead_letters_expected()
            ),
        );
        row("clicks sent (distinct, valid)", self.clicks_sent.to_string());
        row("clicks counted (ClickHouse, FINAL)", self.diff.clicks_actual.to_string());
        row("clicks lost (per-bucket deficits)", self.lost().to_string());
        row("clicks double (per-bucket surpluses)", self.doubled().to_string());
        row("dead letters expected", format!("{} (invalid records sent)", self.dead_letters_expected()));
        row(
            "dead letters received",
            format!(
                "{} distinct source positions ({} letters from members, {} from replays)",
                self.dead_letters.positions.values().map(BTreeSet::len).sum::<usize>(),
                self.dead_letters.from_members,
                self.dead_letters.from_replays
            ),
        );
        let by_reason: Vec<String> = self
            .dead_letters_by_reason()
            .iter()
            .map(|(r, e, g)| if e == g { format!("{r} {g}") } else { format!("{r} {g}/{e}") })
            .collect();
        for chunk in by_reason.chunks(3) {
            row("  per reason", chunk.join(", "));
        }
        row(
            "longest partition without progress",
            format!(
                "{:.0} s (partition {}, from {:.0} s, at offset {}; limit {} s); {} commits moved back",
                self.stall.length_s,
                self.stall.partition,
                self.stall.from_s,
                self.stall.committed,
                self.stall_limit.as_secs(),
                self.commits_back
            ),
        );
        row("peak RSS of a member (VmHWM)", format!("{} MiB ({})", self.peak_rss_kib / 1024, self.peak_rss_of));
        for f in &self.faults {
            row("injected", f.clone());
        }
        for o in &self.log_start {
            row(
                match o.case {
                    crate::young::Case::CacheLost => "log start: cache lost at offset 0",
                    crate::young::Case::FarFuture => "log start: first record in 2100",
                },
                o.summary(),
            );
        }
        row("wall time", format!("{:.0} s", self.wall.as_secs_f64()));
        for (check, failed) in self.checks() {
            row(
                &format!("check: {check}"),
                if failed.is_empty() { "PASS".into() } else { format!("FAIL: {}", failed.join("; ")) },
            );
        }
        let failures = self.failures();
        row("verdict", if failures.is_empty() { "PASS".to_string() } else { format!("FAIL: {}", failures.join("; ")) });
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clickagg::aggregate::BucketKey;
    use clickagg::click::Minute;
    use clickagg::verify::diff;

    fn letter(reason: &str, p: i32, o: i64, origin: &str) -> impl Fn(&str) -> Option<String> {
        let headers = BTreeMap::from([
            (REASON.to_string(), reason.to_string()),
            (SOURCE_PARTITION.to_string(), p.to_string()),
            (SOURCE_OFFSET.to_string(), o.to_string()),
            (ORIGIN.to_string(), origin.to_string()),
        ]);
        move |name| headers.get(name).cloned()
    }

    fn outcome(expected: u64, actual: u64) -> Outcome {
        let k = BucketKey { ad_id: 1, minute: Minute::from_epoch_seconds(60) };
        Outcome {
            records_sent: expected,
            clicks_sent: expected,
            duplicates_sent: 0,
            drifted_sent: 0,
            diff: diff(&BTreeMap::from([(k, expected)]), &BTreeMap::from([(k, actual)])),
            settled: expected == actual,
            settle_timeout: Duration::from_secs(180),
            seals: Vec::new(),
            invalid_sent: BTreeMap::from([(RejectReason::Oversized, 2)]),
            dead_letters: DeadLetters::default(),
            stall: Stall::default(),
            commits_back: 0,
            stall_limit: Duration::from_secs(60),
            kills: Kills { mid_flush: 1, ..Kills::default() },
            peak_rss_kib: 0,
            peak_rss_of: String::new(),
            faults: Vec::new(),
            log_start: Vec::new(),
            incidents: Vec::new(),
            wall: Duration::ZERO,
        }
    }

    #[test]
    fn copies_of_a_dead_letter_count_once_and_a_replays_letter_never_stands_in_for_a_members() {
        let mut d = DeadLetters::default();
        d.add(letter("oversized", 0, 10, "run"));
        d.add(letter("oversized", 0, 10, "run")); // re-read after a crash
        d.add(letter("oversized", 1, 20, "replay"));
        assert_eq!(d.received(RejectReason::Oversized), 1);
        assert_eq!((d.from_members, d.from_replays), (2, 1));
        let mut o = outcome(5, 5);
        o.dead_letters = d;
        assert_eq!(
            o.failures(),
            vec!["dead letters (one per invalid record): 1 oversized dead letters missing".to_string()]
        );
    }

    #[test]
    fn a_run_fails_on_loss_double_counts_and_a_long_stall() {
        let mut o = outcome(5, 5);
        o.dead_letters.add(letter("oversized", 0, 1, "run"));
        o.dead_letters.add(letter("oversized", 0, 2, "run"));
        assert!(o.failures().is_empty(), "{:?}", o.failures());
        assert!(o.table().contains("PASS"));
        assert_eq!(outcome(5, 3).lost(), 2);
        assert_eq!(outcome(5, 8).doubled(), 3);
        o.stall = Stall { partition: 2, from_s: 10.0, length_s: 61.0, committed: 0, log_end: 9 };
        assert_eq!(
            o.failures(),
            vec!["progress (no stall past the limit): partition 2 made no progress for 61 s (limit 60 s)".to_string()]
        );
    }

    #[test]
    fn a_run_fails_when_the_counts_never_settled_the_roll_ups_disagree_or_no_kill_landed_mid_flush() {
        let passing = || {
            let mut o = outcome(5, 5);
            o.dead_letters.add(letter("oversized", 0, 1, "run"));
            o.dead_letters.add(letter("oversized", 0, 2, "run"));
            o
        };
        assert!(passing().failures().is_empty());
        let mut o = passing();
        o.settled = false;
        assert_eq!(
            o.failures(),
            vec!["counts settled within the timeout: the counts were not exact within 180 s of the last fault"]
        );
        let mut o = passing();
        o.seals = vec!["2 (ad, hour) of ad_clicks_sealed_hour differ from the minute rows: …".into()];
        assert!(
            o.failures()[0].starts_with("sealed hours and days agree with the minute rows: 2 (ad, hour)"),
            "{:?}",
            o.failures()
        );
        let mut o = passing();
        o.kills = Kills { flush_completed_first: 2, flushing_never_came: 1, ..Kills::default() };
        assert_eq!(
            o.failures(),
            vec!["mid-flush kills landed mid-flush: none of the 3 kills planned mid-flush landed while a flush was in flight"]
        );
        assert!(o.table().contains("| check: mid-flush kills landed mid-flush"), "{}", o.table());
        o.kills = Kills::default();
        assert!(o.failures().is_empty(), "no kill planned mid-flush, none to land");
    }

    #[test]
    fn a_log_start_case_that_is_not_exact_fails_the_run_with_a_row_of_its_own() {
        use crate::young::{Case, CaseOutcome};
        let mut o = outcome(5, 5);
        o.dead_letters.add(letter("oversized", 0, 1, "run"));
        o.dead_letters.add(letter("oversized", 0, 2, "run"));
        let k = BucketKey { ad_id: 2, minute: Minute::from_epoch_seconds(120) };
        let case = |c: Case, actual: u64| CaseOutcome {
            case: c,
            records_sent: 10,
            clicks_sent: 10,
            diff: diff(&BTreeMap::from([(k, 10)]), &BTreeMap::from([(k, actual)])),
            settled_after: (actual == 10).then_some(Duration::from_secs(2)),
            settle_timeout: Duration::from_secs(90),
            notes: vec!["log ends 3..5".into()],
            problems: Vec::new(),
            took: Duration::from_secs(30),
        };
        o.log_start = vec![case(Case::CacheLost, 10), case(Case::FarFuture, 12)];
        let table = o.table();
        assert!(table.contains("| check: log start: cache lost at offset 0, counts exact | PASS"), "{table}");
        assert!(
            table.contains("| check: log start: first record in 2100, counts exact | FAIL: 2 clicks counted twice"),
            "{table}"
        );
        assert_eq!(
            o.failures(),
            vec![
                "log start: first record in 2100, counts exact: 2 clicks counted twice".to_string(),
                "log start: first record in 2100, counts exact: the counts were not exact within 90 s of the last record"
                    .to_string(),
            ]
        );
        assert_eq!((o.lost(), o.doubled()), (0, 0), "the main run's counts are apart");
    }
}
