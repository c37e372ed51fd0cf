//! `clickagg status`: the whole consumer group from outside any member.
//!
//! From Kafka: the group's members and which partitions each owns (the assignment in
//! the group's description), the committed offsets and the log ends. From ClickHouse:
//! the last durable flush of each partition (the highest offset its rows cover, and
//! when they were written). Nothing here needs a member to answer, so it also shows a
//! member that was killed: the group lists it, with its partitions, until its session
//! times out, and those partitions stop moving.
//!
//! **Stalled.** A partition has records *waiting* when the log holds records after
//! what is known durable: past both its committed offset and the last offset its rows
//! cover. It is *stalled* when its first waiting record has waited longer than
//! `--stall-after` and no flush of the partition became durable in that time either.
//! A partition whose last records count nothing (duplicates, rejected records) leaves
//! no row for them, so when it then goes quiet it reads as waiting on them, and as
//! stalled once they are older than `--stall-after`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;

mod kafka;

use crate::config::Settings;
use crate::sink::{LastFlush, Sink};
use kafka::timestamps_at;
pub use kafka::{kafka_view, GroupMember, KafkaView, Offsets};

/// Exit code when at least one partition is stalled: a check that found a problem.
pub const EXIT_STALLED: u8 = super::EXIT_CHECK_FAILED;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// The members, then one line per partition, for people.
    Table,
    /// One JSON object: `group`, `members`, `partitions`, `stalled`.
    Json,
}

/// The consumer group (`kafka.group`) on `kafka.topic`: each partition's owner, its
/// committed offset and lag, the age of its last durable flush and whether it stalled.
///
/// Exit status: 0 when no partition is stalled, 4 when one is (records waiting
/// longer than `--stall-after` and nothing of the partition made durable in that
/// time), 1 when Kafka or ClickHouse cannot be read, 2 for a bad setting.
#[derive(Debug, Args, Clone)]
pub struct StatusArgs {
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// A partition whose records wait longer than this, with no durable flush in that
    /// time either, is stalled (exit 4). E.g. 10m, 90s.
    #[arg(long, default_value = "10m")]
    pub stall_after: humantime::Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Nothing waiting: every record is durable (or counts nothing and is committed).
    CaughtUp,
    /// Records waiting, for less than `--stall-after` or with a recent flush.
    Moving,
    Stalled,
}

impl State {
    fn as_str(self) -> &'static str {
        match self {
            State::CaughtUp => "caught up",
            State::Moving => "moving",
            State::Stalled => "STALLED",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct PartitionStatus {
    pub partition: i32,
    /// The owner's client ID; `null` when no member owns it.
    pub owner: Option<String>,
    pub owner_member_id: Option<String>,
    pub committed_offset: Option<i64>,
    pub log_start: i64,
    pub log_end: i64,
    /// Log end minus committed offset (as `kafka-consumer-groups` shows it); at least
    /// the open batch for a partition that is read, since commits are batch boundaries.
    pub lag: Option<i64>,
    /// The highest offset the partition's rows in ClickHouse cover.
    pub flushed_through: Option<i64>,
    pub last_flush_age_seconds: Option<u64>,
    /// Records after what is known durable.
    pub waiting_records: i64,
    /// How long the first of them has waited (its Kafka timestamp to now).
    pub waiting_seconds: Option<f64>,
    pub state: State,
}

#[derive(Debug, Clone, Serialize)]
pub struct GroupStatus {
    pub group: String,
    pub topic: String,
    /// The group's state in Kafka: Stable, PreparingRebalance, Empty, …
    pub group_state: String,
    pub stall_after_seconds: u64,
    pub members: Vec<GroupMember>,
    pub partitions: Vec<PartitionStatus>,
    pub stalled: Vec<i32>,
}

pub async fn run(s: &Settings, args: &StatusArgs) -> Result<ExitCode> {
    let stall_after: Duration = args.stall_after.into();
    let (k, group, topic) = (s.kafka.clone(), s.kafka.group.clone(), s.kafka.topic.clone());
    let kafka = tokio::task::spawn_blocking(move || kafka_view(&k, &group, &topic))
        .await
        .context("the Kafka look-up task")?
        .with_context(|| format!("reading group {} and topic {} from Kafka", s.kafka.group, s.kafka.topic))?;
    let (flushes, clickhouse_now) = Sink::new(&s.clickhouse)
        .last_flushes(&s.kafka.topic)
        .await
        .context("reading the last flushes from ClickHouse")?;
    let waiting: BTreeMap<i32, i64> = kafka
        .partitions
        .iter()
        .filter_map(|(&p, o)| {
            let from = durable_until(o, flushes.get(&p));
            (from < o.log_end).then_some((p, from))
        })
        .collect();
    let k = s.kafka.clone();
    let topic = s.kafka.topic.clone();
    let first_waiting = tokio::task::spawn_blocking(move || timestamps_at(&k, &topic, &waiting))
        .await
        .context("the Kafka look-up task")?
        .context("reading the first waiting record of each partition")?;
    let now = Clocks { unix_ms: chrono::Utc::now().timestamp_millis(), clickhouse: clickhouse_now };
    let status = assess(s, kafka, &flushes, &first_waiting, now, stall_after);
    match args.format {
        Format::Table => print!("{}", render_table(&status)),
        Format::Json => println!("{}", serde_json::to_string_pretty(&status).expect("plain data serializes")),
    }
    Ok(if status.stalled.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(EXIT_STALLED) })
}

/// The first offset not known to be durable: past the committed offset and past the
/// last offset the rows cover.
fn durable_until(o: &Offsets, flush: Option<&LastFlush>) -> i64 {
    let committed = o.committed.unwrap_or(o.log_start);
    let flushed = flush.map_or(i64::MIN, |f| f.through_offset + 1);
    committed.max(flushed).clamp(o.log_start, o.log_end.max(o.log_start))
}

/// The clocks the ages are measured on: record timestamps against this host's, flush
/// times against ClickHouse's own (they were written by it).
#[derive(Debug, Clone, Copy)]
pub struct Clocks {
    pub unix_ms: i64,
    pub clickhouse: u32,
}

/// Puts the group view together and decides which partitions are stalled.
pub fn assess(
    s: &Settings,
    kafka: KafkaView,
    flushes: &BTreeMap<i32, LastFlush>,
    first_waiting_ms: &BTreeMap<i32, i64>,
    now: Clocks,
    stall_after: Duration,
) -> GroupStatus {
    let limit = stall_after.as_secs_f64();
    let owners: BTreeMap<i32, &GroupMember> =
        kafka.members.iter().flat_map(|m| m.partitions.iter().map(move |&p| (p, m))).collect();
    let partitions: Vec<PartitionStatus> = kafka
        .partitions
        .iter()
        .map(|(&p, o)| {
            let flush = flushes.get(&p);
            let from = durable_until(o, flush);
            let waiting_seconds = first_waiting_ms.get(&p).map(|&ts| ((now.unix_ms - ts) as f64 / 1000.0).max(0.0));
            let last_flush_age_seconds = flush.map(|f| u64::from(now.clickhouse.saturating_sub(f.written_at)));
            let waited_long = waiting_seconds.is_some_and(|w| w > limit);
            let no_recent_flush = last_flush_age_seconds.is_none_or(|a| a as f64 > limit);
            let state = match () {
                _ if from >= o.log_end => State::CaughtUp,
                _ if waited_long && no_recent_flush => State::Stalled,
                _ => State::Moving,
            };
            PartitionStatus {
                partition: p,
                owner: owners.get(&p).map(|m| m.client_id.clone()),
                owner_member_id: owners.get(&p).map(|m| m.member_id.clone()),
                committed_offset: o.committed,
                log_start: o.log_start,
                log_end: o.log_end,
                lag: o.committed.map(|c| (o.log_end - c).max(0)),
                flushed_through: flush.map(|f| f.through_offset),
                last_flush_age_seconds,
                waiting_records: o.log_end - from,
                waiting_seconds: if from < o.log_end { waiting_seconds } else { None },
                state,
            }
        })
        .collect();
    let stalled = partitions.iter().filter(|p| p.state == State::Stalled).map(|p| p.partition).collect();
    GroupStatus {
        group: s.kafka.group.clone(),
        topic: s.kafka.topic.clone(),
        group_state: kafka.state,
        stall_after_seconds: stall_after.as_secs(),
        members: kafka.members,
        partitions,
        stalled,
    }
}

fn age(seconds: Option<f64>) -> String {
    match seconds {
        None => "–".into(),
        Some(s) if s < 60.0 => format!("{s:.0}s"),
        Some(s) if s < 3600.0 => format!("{}m{:02}s", (s / 60.0) as u64, (s % 60.0) as u64),
        Some(s) => format!("{}h{:02}m", (s / 3600.0) as u64, ((s % 3600.0) / 60.0) as u64),
    }
}

fn or_dash<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "–".into(), |v| v.to_string())
}

/// The members, then one line per partition.
pub fn render_table(s: &GroupStatus) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "group {} ({}, {} member{}) on topic {}; stalled = records waiting over {} with no flush",
        s.group,
        s.group_state,
        s.members.len(),
        if s.members.len() == 1 { "" } else { "s" },
        s.topic,
        age(Some(s.stall_after_seconds as f64)),
    );
    if !s.members.is_empty() {
        let w = s.members.iter().map(|m| m.client_id.len()).max().unwrap_or(0).max(6);
        let _ = writeln!(out, "\n{:<w$}  {:<16}  partitions", "member", "host");
        for m in &s.members {
            let parts: Vec<String> = m.partitions.iter().map(i32::to_string).collect();
            let _ = writeln!(
                out,
                "{:<w$}  {:<16}  {}",
                m.client_id,
                m.host,
                or_dash((!parts.is_empty()).then(|| parts.join(",")))
            );
        }
    }
    let w = s.partitions.iter().filter_map(|p| p.owner.as_ref().map(String::len)).max().unwrap_or(0).max(5);
    let _ = writeln!(
        out,
        "\n{:>9}  {:<w$}  {:>12}  {:>12}  {:>9}  {:>15}  {:>10}  {:>8}  {:>8}  state",
        "partition", "owner", "committed", "log end", "lag", "flushed through", "last flush", "waiting", "for"
    );
    for p in &s.partitions {
        let _ = writeln!(
            out,
            "{:>9}  {:<w$}  {:>12}  {:>12}  {:>9}  {:>15}  {:>10}  {:>8}  {:>8}  {}",
            p.partition,
            or_dash(p.owner.as_deref()),
            or_dash(p.committed_offset),
            p.log_end,
            or_dash(p.lag),
            or_dash(p.flushed_through),
            p.last_flush_age_seconds.map_or_else(|| "never".into(), |a| format!("{} ago", age(Some(a as f64)))),
            p.waiting_records,
            age(p.waiting_seconds),
            p.state.as_str(),
        );
    }
    let _ = match s.stalled.as_slice() {
        [] => writeln!(out, "\nno partition stalled"),
        stalled => {
            let list: Vec<String> = stalled.iter().map(i32::to_string).collect();
            writeln!(
                out,
                "\n{} partition{} stalled: {}",
                stalled.len(),
                if stalled.len() == 1 { "" } else { "s" },
                list.join(", ")
            )
        }
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW_MS: i64 = 1_000_000_000;
    const CH_NOW: u32 = 1_000_000;

    fn member(id: &str, partitions: &[i32]) -> GroupMember {
        GroupMember {
            client_id: format!("clickagg-h-{id}"),
            member_id: format!("m-{id}"),
            host: "/127.0.0.1".into(),
            partitions: partitions.to_vec(),
        }
    }

    /// One partition: committed, log end, flushed through and flush age (s), age of the
    /// first waiting record (s).
    type Case = (Option<i64>, i64, Option<(i64, u32)>, Option<i64>);

    fn status(cases: &[Case]) -> GroupStatus {
        let mut s = Settings::default();
        s.kafka.group = "g".into();
        let partitions = (0..cases.len() as i32)
            .zip(cases)
            .map(|(p, &(committed, log_end, _, _))| (p, Offsets { committed, log_start: 0, log_end }))
            .collect();
        let flushes = (0..cases.len() as i32)
            .zip(cases)
            .filter_map(|(p, c)| c.2.map(|(o, age)| (p, LastFlush { through_offset: o, written_at: CH_NOW - age })))
            .collect();
        let waiting =
            (0..cases.len() as i32).zip(cases).filter_map(|(p, c)| c.3.map(|s| (p, NOW_MS - s * 1000))).collect();
        let kafka = KafkaView {
            state: "Stable".into(),
            members: vec![member("a", &[0, 1, 2]), member("b", &[3, 4, 5])],
            partitions,
        };
        let now = Clocks { unix_ms: NOW_MS, clickhouse: CH_NOW };
        assess(&s, kafka, &flushes, &waiting, now, Duration::from_secs(600))
    }

    #[test]
    fn only_a_partition_whose_records_wait_with_no_flush_beyond_the_limit_is_stalled() {
        let s = status(&[
            // 0: busy and healthy: records arrive, flushed a second ago.
            (Some(3000), 3500, Some((3490, 1)), Some(0)),
            // 1: idle, everything read is flushed; its open batch keeps the lag above 0.
            (Some(3000), 3456, Some((3455, 7200)), None),
            // 2: its member died an hour ago while records kept coming.
            (Some(3000), 9000, Some((3100, 3600)), Some(3590)),
            // 3: catching up on a day-old backlog: old records wait, but it flushes.
            (Some(0), 90_000, Some((5000, 2)), Some(86_400)),
            // 4: never read by anyone, records waiting for 20 minutes.
            (None, 50, None, Some(1200)),
            // 5: a first record in a long while, not read yet: it has waited 2 s.
            (Some(3000), 3457, Some((3455, 7200)), Some(2)),
        ]);
        let states: Vec<State> = s.partitions.iter().map(|p| p.state).collect();
        use State::*;
        assert_eq!(states, [Moving, CaughtUp, Stalled, Moving, Stalled, Moving]);
        assert_eq!(s.stalled, [2, 4]);
        let p2 = &s.partitions[2];
        assert_eq!((p2.owner.as_deref(), p2.lag, p2.waiting_records), (Some("clickagg-h-a"), Some(6000), 5899));
        assert_eq!((p2.last_flush_age_seconds, p2.waiting_seconds), (Some(3600), Some(3590.0)));
        assert_eq!(s.partitions[1].lag, Some(456), "lag counts the open batch, waiting does not");
        assert_eq!(s.partitions[1].waiting_records, 0);
        let table = render_table(&s);
        assert!(table.contains("2 partitions stalled: 2, 4"), "{table}");
        assert!(table.lines().any(|l| l.contains("clickagg-h-a") && l.ends_with("STALLED")), "{table}");
    }

    #[test]
    fn a_partition_no_member_owns_shows_no_owner() {
        let mut s = status(&[(Some(0), 0, None, None); 7]);
        assert_eq!(s.partitions[6].owner, None);
        assert_eq!(s.partitions[0].state, State::CaughtUp);
        s.members.clear();
        assert!(render_table(&s).contains("no partition stalled"));
    }
}
