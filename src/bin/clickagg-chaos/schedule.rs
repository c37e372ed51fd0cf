//! What the chaos run does when: a pure, seeded plan of faults over the time the
//! generator spends producing, so a failing run can be repeated with its seed.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One injected fault.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// SIGKILL a running member, restarted after a moment. `mid_flush`: right after it
    /// logs that a flush starts (its insert is in flight, nothing committed yet).
    Kill {
        mid_flush: bool,
    },
    /// A fourth member joins the group.
    Join,
    /// The fourth member leaves gracefully (SIGTERM: drain, commit, leave).
    Leave,
    /// SIGKILL a member and restart it only after its session expired, so the group
    /// rebalances without it first.
    Crash,
    /// Redis stopped and started again with its append-only file: the cache survives.
    RedisRestart,
    /// Redis SIGKILLed and started again from its append-only file (fsynced every
    /// second: the last second of claims may be gone).
    RedisKill,
    /// Redis stopped, its data files deleted, started again: the dedup cache is lost,
    /// as with a Redis without persistence or a replacement.
    RedisLost,
    /// A member SIGSTOPped past its session timeout (the group moves its partitions
    /// on), then SIGCONTed: it comes back as a zombie with its old state.
    Zombie,
    /// ClickHouse killed, and started again after the outage; `kills` members are
    /// SIGKILLed meanwhile, evenly spread, while their flushes are being retried.
    ClickHouseOutage {
        kills: u32,
    },
    BrokerRestart,
    /// `clickagg replay` of the records sent between two fractions of the production
    /// span (`to: None`: up to the log end when it starts).
    Replay {
        from: f64,
        to: Option<f64>,
    },
}

impl Fault {
    /// An outage of a service. These wait for running replays: a replay is a batch job
    /// an operator reruns, and this run judges replays beside a running group, not
    /// replays through an outage.
    pub fn is_outage(&self) -> bool {
        matches!(
            self,
            Fault::RedisRestart
                | Fault::RedisKill
                | Fault::RedisLost
                | Fault::ClickHouseOutage { .. }
                | Fault::BrokerRestart
        )
    }

    /// A fault that stops partitions for a while. The run keeps these apart (see
    /// `Chaos`), so that the longest stall measures one of them, not two in a row.
    pub fn is_disruption(&self) -> bool {
        self.is_outage() || matches!(self, Fault::Crash | Fault::Zombie)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// From the start of production; the earliest it happens (a disruption waits for
    /// the one before it to be over).
    pub at: Duration,
    pub fault: Fault,
}

/// How much chaos, and over how long.
#[derive(Debug, Clone)]
pub struct Shape {
    /// How long the generator produces: faults fall within it.
    pub production: Duration,
    pub kills: u32,
    pub replays: u32,
    pub seed: u64,
    /// Also the Redis restart that keeps its data, the easy case the kill and the loss
    /// of Redis go beyond (the full run; the CI run saves the time).
    pub redis_restart: bool,
}

/// The faults in time order. Fixed points of the production span, so every run
/// injects each kind (the loss of Redis's data while clicks still arrive, so that
/// their retries meet the emptied cache), with the kills at seeded random moments: one
/// (two from ten kills on) inside the ClickHouse outage, half of the rest right after a
/// flush starts.
pub fn plan(shape: &Shape) -> Vec<Event> {
    let mut rng = StdRng::seed_from_u64(shape.seed);
    let p = shape.production.as_secs_f64();
    let at = |fraction: f64| Duration::from_secs_f64(p * fraction);
    let in_outage = match shape.kills {
        0 => 0,
        1..=9 => 1,
        _ => 2,
    };
    let mut events = vec![
        Event { at: at(0.08), fault: Fault::Join },
        Event { at: at(0.14), fault: Fault::Crash },
        Event { at: at(0.30), fault: Fault::RedisKill },
        Event { at: at(0.38), fault: Fault::ClickHouseOutage { kills: in_outage } },
        Event { at: at(0.48), fault: Fault::RedisLost },
        Event { at: at(0.55), fault: Fault::Leave },
        Event { at: at(0.62), fault: Fault::Zombie },
        Event { at: at(0.72), fault: Fault::BrokerRestart },
    ];
    if shape.redis_restart {
        events.push(Event { at: at(0.22), fault: Fault::RedisRestart });
    }
    // Replays beside the running group, each range overlapping the one before; the
    // last one reads up to the live edge the members are consuming.
    let slots = [0.25, 0.50, 0.75];
    let mut previous_to: Option<f64> = None;
    for k in 0..shape.replays as usize {
        let start = slots.get(k).copied().unwrap_or_else(|| 0.75 + 0.05 * (k - 2) as f64);
        let from = previous_to.map_or(0.0, |to| (to - 0.12).max(0.0));
        let last = k + 1 == shape.replays as usize;
        let to = (!last).then_some(start - 0.05);
        previous_to = Some(to.unwrap_or(start));
        events.push(Event { at: at(start), fault: Fault::Replay { from, to } });
    }
    for i in 0..shape.kills.saturating_sub(in_outage) {
        let fraction = rng.random_range(0.05..0.95);
        events.push(Event { at: at(fraction), fault: Fault::Kill { mid_flush: i % 2 == 0 } });
    }
    events.sort_by_key(|e| e.at);
    events
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(kills: u32, replays: u32) -> Shape {
        Shape { production: Duration::from_secs(500), kills, replays, seed: 7, redis_restart: kills >= 10 }
    }

    /// How many members an event SIGKILLs.
    fn kills(e: &Event) -> u32 {
        match e.fault {
            Fault::Kill { .. } => 1,
            Fault::ClickHouseOutage { kills } => kills,
            _ => 0,
        }
    }

    fn count(events: &[Event], f: impl Fn(&Fault) -> bool) -> usize {
        events.iter().filter(|e| f(&e.fault)).count()
    }

    #[test]
    fn the_full_plan_has_every_fault_the_issue_asks_for() {
        let events = plan(&shape(20, 3));
        assert_eq!(events.iter().map(kills).sum::<u32>(), 20);
        assert_eq!(count(&events, |f| *f == Fault::ClickHouseOutage { kills: 2 }), 1);
        assert!(count(&events, |f| matches!(f, Fault::Kill { mid_flush: true })) >= 9);
        for f in [
            Fault::Join,
            Fault::Leave,
            Fault::Crash,
            Fault::RedisRestart,
            Fault::RedisKill,
            Fault::RedisLost,
            Fault::Zombie,
            Fault::BrokerRestart,
        ] {
            assert_eq!(count(&events, |g| *g == f), 1, "{f:?}");
        }
        assert_eq!(count(&events, |f| matches!(f, Fault::Replay { .. })), 3);
        assert!(events.windows(2).all(|w| w[0].at <= w[1].at), "in time order");
    }

    #[test]
    fn the_reduced_plan_still_kills_one_member_during_the_clickhouse_outage() {
        let events = plan(&shape(5, 1));
        assert_eq!(events.iter().map(kills).sum::<u32>(), 5);
        assert_eq!(count(&events, |f| *f == Fault::ClickHouseOutage { kills: 1 }), 1);
    }

    #[test]
    fn the_reduced_plan_keeps_the_hard_faults_and_leaves_out_only_the_gentle_redis_restart() {
        let events = plan(&shape(5, 1));
        for f in [Fault::RedisKill, Fault::RedisLost, Fault::Zombie, Fault::Crash, Fault::BrokerRestart] {
            assert_eq!(count(&events, |g| *g == f), 1, "{f:?}");
        }
        assert_eq!(count(&events, |f| *f == Fault::RedisRestart), 0);
        assert!(count(&events, |f| matches!(f, Fault::Kill { mid_flush: true })) >= 2);
        let lost = events.iter().find(|e| e.fault == Fault::RedisLost).unwrap();
        assert!(lost.at < Duration::from_secs(500) / 2, "Redis is lost while half the clicks are still to come");
    }

    #[test]
    fn each_replay_overlaps_the_one_before_and_reads_only_what_was_sent() {
        let events = plan(&shape(20, 3));
        let replays: Vec<(f64, f64, Option<f64>)> = events
            .iter()
            .filter_map(|e| match e.fault {
                Fault::Replay { from, to } => Some((e.at.as_secs_f64() / 500.0, from, to)),
                _ => None,
            })
            .collect();
        assert_eq!(replays[0].1, 0.0);
        for w in replays.windows(2) {
            let (_, _, to) = w[0];
            let (_, from, _) = w[1];
            assert!(from < to.unwrap(), "{w:?}");
        }
        for &(started, from, to) in &replays {
            assert!(from < started && to.is_none_or(|to| to < started), "{started} {from} {to:?}");
        }
        assert_eq!(replays.last().unwrap().2, None, "the last replay reads up to the live edge");
    }

    #[test]
    fn the_same_seed_gives_the_same_plan() {
        assert_eq!(plan(&shape(20, 3)), plan(&shape(20, 3)));
        assert_ne!(plan(&shape(20, 3)), plan(&Shape { seed: 8, ..shape(20, 3) }));
    }
}
