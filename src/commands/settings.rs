//! `clickagg settings`: the settings that decide which clicks count, as the topic
//! records them (`show`), and the one way to change them on purpose (`change`).
//!
//! Why a procedure: the window, the fingerprint key, the shard count and the validation
//! limits are part of the definition of what counts (guide, "What counts"). A member
//! that decided under other values than the ones that decided before it would count
//! retries of earlier clicks again, so members refuse to start with values other than
//! the recorded ones. `change` deletes the rows past the group's committed offsets
//! (decided under the old values, and nothing committed lies there) and records the
//! values it runs with as a new version that decides every partition from the group's
//! committed offset on; the next member moves
//! the dedup cache to a new namespace and warms it up from the log under the new values
//! before it counts, and `replay` decides every range under the version recorded for it.

use std::collections::BTreeMap;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Subcommand;

use crate::config::Settings;
use crate::position;
use crate::sink::Sink;
use crate::source;

#[derive(Debug, Clone, Subcommand)]
pub enum SettingsCommand {
    /// The settings versions recorded for the topic, with where each took over.
    Show,
    /// Record this invocation's dedup and validation settings as the topic's, from the
    /// consumer group's committed offsets on. Every member of the group must be stopped.
    Change,
}

pub async fn run(s: &Settings, command: &SettingsCommand) -> Result<ExitCode> {
    let sink = Sink::new(&s.clickhouse);
    match command {
        SettingsCommand::Show => {
            let history = sink.rules_history(&s.kafka.topic).await?;
            if history.versions.is_empty() {
                println!("nothing recorded for topic {} yet: the first member records its settings", s.kafka.topic);
            }
            for v in &history.versions {
                println!("version {}: {}", v.version, serde_json::to_string(&v.rules)?);
                if v.version > 1 {
                    println!("  from offsets {}", serde_json::to_string(&v.effective)?);
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        SettingsCommand::Change => change(s, &sink).await,
    }
}

async fn change(s: &Settings, sink: &Sink) -> Result<ExitCode> {
    let ours = s.rules();
    let topic = s.kafka.topic.clone();
    let history = sink.rules_history(&topic).await?;
    let Some(latest) = history.latest() else {
        bail!("nothing is recorded for topic {topic} yet: start a member, which records its settings as the topic's");
    };
    let differences = ours.differences(&latest.rules);
    if differences.is_empty() {
        println!("topic {topic} already decides with these settings (version {}); nothing to change", latest.version);
        return Ok(ExitCode::SUCCESS);
    }
    let (k, group, t) = (s.kafka.clone(), s.kafka.group.clone(), topic.clone());
    let (view, topic_id) = tokio::task::spawn_blocking(move || -> Result<_> {
        let view = super::status::kafka_view(&k, &group, &t)?;
        let id = source::topic_id(&source::lookup_consumer(&k)?, &t, std::time::Duration::from_secs(10))?;
        Ok((view, id))
    })
    .await
    .context("asking Kafka for the group")??;
    if !view.members.is_empty() {
        let names: Vec<&str> = view.members.iter().map(|m| m.client_id.as_str()).collect();
        bail!(
            "group {} has {} running members ({}): stop every member first, so that no partition is decided \
             under the old settings once the new ones took over",
            s.kafka.group,
            names.len(),
            names.join(", ")
        );
    }
    // From where each partition's next member will count: the batch boundary at or below
    // its committed offset (or where a member would start without one).
    let n = s.batch_offsets();
    let effective: BTreeMap<i32, i64> =
        view.partitions.iter().map(|(&p, o)| (p, position::boundary(n, o.log_start, o.log_end, o.committed))).collect();
    let version = latest.version + 1;
    let id = topic_id.or_else(|| latest.topic_id.clone()).unwrap_or_default();
    // Rows past the committed offsets were decided under the old settings, and the new
    // ones replace a row only where they count something: gone first, so that a failure
    // here leaves the old version in force and the change can simply be run again.
    sink.delete_rows_from(&topic, &effective).await.context("deleting the rows past the committed offsets")?;
    sink.record_rules(&topic, version, &ours, &effective, &id).await?;
    println!("topic {topic}: settings version {version} recorded; it decides each partition from offset:");
    for (p, o) in &effective {
        println!("  partition {p}: {o}");
    }
    for (name, mine, recorded) in differences {
        println!("  {name}: {recorded} -> {mine}");
    }
    println!(
        "Start the members with these settings: the first moves the dedup cache to a new namespace and rebuilds \
         it from the log before counting. Members with the old settings refuse to start."
    );
    Ok(ExitCode::SUCCESS)
}
