//! The dedup cache as the simulated members see it: `claim.lua` (its `claim`,
//! `restart`, `open`, `renew` and `sweep`), in key groups as on a Redis Cluster, with
//! the client-side steps of `SharedCache` (`open`, `renew`, `recover`, `frontiers`,
//! `cached_pins`, `trim_cached_pins`, holds) that decide what the functions are asked.
//! Each chain decision is the product's own mirror of the function, `decide_shared`.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::dedup::{decide_shared, Chain, ClaimMode, Frontier, Pin, Secs, Sighting, Verdict};
use crate::position::CacheFrontier;

/// Key groups (hash tags); a click's entry lives in one.
pub const GROUPS: usize = 2;

pub fn group_of(id: u32) -> usize {
    id as usize % GROUPS
}

/// A namespace name: the settings version it was made under (its tag) and a serial.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ns {
    pub tag: usize,
    pub serial: u64,
}

/// One namespace's keys in one key group.
#[derive(Debug, Clone, Default)]
pub struct Space {
    pub entries: HashMap<u32, Vec<Chain>>,
    /// Per partition: one past the highest offset claimed, its record time, and where
    /// re-reads are exact from (`claim.lua`'s `frontier` hash).
    pub frontier: BTreeMap<i32, (i64, Secs, i64)>,
    /// Cross-partition decisions not yet durable (`x:<partition>`), by offset.
    pub x: BTreeMap<i32, BTreeSet<i64>>,
    /// Group 0: record times lagging readers hold.
    pub holds: BTreeMap<i32, Secs>,
}

#[derive(Debug, Clone, Default)]
pub struct Group {
    /// The key `ns`: the namespace this group is in (`None`: lost, or never opened).
    pub ns: Option<Ns>,
    /// Group 0: `ns:previous`, the namespace a renewal replaced.
    pub previous: Option<Ns>,
    pub spaces: HashMap<Ns, Space>,
}

impl Group {
    fn space(&mut self, ns: Ns) -> &mut Space {
        self.spaces.entry(ns).or_default()
    }
}

/// A claim as the client packs it.
#[derive(Debug, Clone, Copy)]
pub struct ClaimIn {
    pub id: u32,
    pub sighting: Sighting,
    pub mode: ClaimMode,
}

/// What one group's `claim` answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The verdicts, and the partitions nothing of which was applied (`prev`).
    Ok(Vec<Verdict>, BTreeSet<i32>),
    Lost(Lost),
}

/// `shared::Lost`: which group answered, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lost {
    pub group: usize,
    pub frontier: bool,
    /// For a namespace loss: the namespace the group holds instead.
    pub holds: Option<Ns>,
}

/// What a member does after a loss (`shared::Recovery`), or that it must stop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovered {
    Ns(Ns),
    /// A renewal by a member with other settings: fatal for this one.
    Fatal,
}

#[derive(Debug, Clone, Default)]
pub struct Redis {
    pub groups: Vec<Group>,
    serial: u64,
    /// Per group: the state before the last claim call and who made it, while nothing
    /// else wrote the group since (what a failover that lost that call's writes leaves).
    pub undo: Vec<Option<(u64, Group)>>,
    /// The model's note: per namespace, every sighting (partition, offset) claimed in it.
    pub claimed: HashMap<Ns, BTreeSet<(i32, i64)>>,
}

impl Redis {
    pub fn new() -> Redis {
        Redis { groups: vec![Group::default(); GROUPS], serial: 0, undo: vec![None; GROUPS], claimed: HashMap::new() }
    }

    fn touched(&mut self, g: usize) {
        self.undo[g] = None;
    }

    /// Everything gone (a Redis restarted without persistence, FLUSHALL).
    pub fn wipe(&mut self) {
        self.groups = vec![Group::default(); GROUPS];
        self.undo = vec![None; GROUPS];
    }

    /// One key group lost everything (a node of a Redis Cluster).
    pub fn wipe_group(&mut self, g: usize) {
        self.groups[g] = Group::default();
        self.touched(g);
    }

    /// A partial loss: every key group loses the frontier hash of the namespace it holds,
    /// and keeps everything else, the key `ns` included (a key-by-key deletion that ran on
    /// while the members rebuilt, its `SCAN` meeting the new namespace's keys; a failover
    /// to a replica that lacks the `restart` calls).
    pub fn lose_frontiers(&mut self) {
        for g in 0..GROUPS {
            if let Some(ns) = self.groups[g].ns {
                self.groups[g].space(ns).frontier.clear();
            }
            self.touched(g);
        }
    }

    /// A failover to a replica that lacks the last claim call's writes: the group is as
    /// before that call. Returns who made the call.
    pub fn lose_last_call(&mut self, g: usize) -> Option<u64> {
        let (caller, before) = self.undo[g].take()?;
        self.groups[g] = before;
        Some(caller)
    }

    fn fresh(&mut self, tag: usize) -> Ns {
        self.serial += 1;
        Ns { tag, serial: self.serial }
    }

    /// `SharedCache::open` for a member running settings version `tag`.
    pub fn open(&mut self, tag: usize) -> Recovered {
        match self.groups[0].ns {
            Some(v) if v.tag == tag => {
                let mut lost_group = false;
                for g in 1..GROUPS {
                    match self.groups[g].ns {
                        None => lost_group = true,
                        Some(x) if x != v => self.set_ns(g, v),
                        Some(_) => {}
                    }
                }
                if lost_group {
                    return self.renew(Some(v), tag);
                }
                Recovered::Ns(v)
            }
            Some(v) => self.renew(Some(v), tag),
            None => {
                let candidate = self.fresh(tag);
                for g in 0..GROUPS {
                    self.set_ns(g, candidate);
                }
                Recovered::Ns(candidate)
            }
        }
    }

    /// `SharedCache::holds_namespace`: every group still holds `ns`.
    pub fn holds_ns(&self, ns: Ns) -> bool {
        self.groups.iter().all(|g| g.ns == Some(ns))
    }

    fn set_ns(&mut self, g: usize, ns: Ns) {
        self.groups[g].ns = Some(ns);
        self.touched(g);
    }

    /// `SharedCache::renew`: moves every group from `lost` to a new namespace unless
    /// group 0 was moved already (then to that one).
    pub fn renew(&mut self, lost: Option<Ns>, tag: usize) -> Recovered {
        let candidate = self.fresh(tag);
        for g in 1..GROUPS {
            self.set_ns(g, candidate);
        }
        let winner = match self.groups[0].ns {
            Some(ns) if Some(ns) != lost => ns,
            _ => {
                self.set_ns(0, candidate);
                if lost.is_some() {
                    self.groups[0].previous = lost;
                }
                candidate
            }
        };
        if winner != candidate {
            for g in 1..GROUPS {
                self.set_ns(g, winner);
            }
        }
        if winner.tag != tag {
            return Recovered::Fatal;
        }
        Recovered::Ns(winner)
    }

    /// `SharedCache::recover` for a member using `ours` (a `Recovery::Retry` is followed
    /// by a start over too, as the member does).
    pub fn recover(&mut self, ours: Ns, lost: &Lost) -> Recovered {
        if lost.frontier {
            return self.renew(Some(ours), ours.tag);
        }
        match self.groups[0].ns {
            None => self.renew(Some(ours), ours.tag),
            Some(v) if v != ours => {
                if v.tag != ours.tag {
                    return self.renew(Some(v), ours.tag);
                }
                for g in 1..GROUPS {
                    self.set_ns(g, v);
                }
                Recovered::Ns(v)
            }
            Some(_) if lost.group != 0 && lost.holds.is_some() => {
                self.set_ns(lost.group, ours);
                Recovered::Ns(ours)
            }
            Some(_) => self.renew(Some(ours), ours.tag),
        }
    }

    /// `claim.lua`'s `claim` in group `g`, made by process `caller`. `expect`: per
    /// partition, the highest offset the caller saw acknowledged (-1: nothing yet, but its
    /// frontier must exist; `claim.lua` takes one past it); `marks`: the batch's highest offset per partition and its
    /// record time; `total`: the topic's partition count.
    #[allow(clippy::too_many_arguments)]
    pub fn claim(
        &mut self,
        caller: u64,
        g: usize,
        ns: Ns,
        window: Secs,
        claims: &[ClaimIn],
        marks: &BTreeMap<i32, (i64, Secs)>,
        expect: &BTreeMap<i32, i64>,
        prev: &BTreeMap<i32, i64>,
        total: i32,
    ) -> Reply {
        let before = self.groups[g].clone();
        let group = &mut self.groups[g];
        if group.ns != Some(ns) {
            return Reply::Lost(Lost { group: g, frontier: false, holds: group.ns });
        }
        let space = group.space(ns);
        for (&p, &seen) in expect {
            if space.frontier.get(&p).is_none_or(|&(next, _, _)| next - 1 < seen) {
                return Reply::Lost(Lost { group: g, frontier: true, holds: None });
            }
        }
        // The partitions not ready: no frontier in this group, or one short of where its
        // last warm-up counts from. (The hash changes only at the end of the call.)
        let unready: Vec<i32> =
            (0..total).filter(|q| space.frontier.get(q).is_none_or(|&(next, _, exact)| next < exact)).collect();
        let mut frontier: BTreeMap<i32, (i64, i64)> = BTreeMap::new();
        let mut touched: BTreeMap<i32, Secs> = BTreeMap::new();
        // Per partition, the offset of its first claim that waited; -1 for a partition the
        // caller's previous call did not take to its mark here (nothing of it is applied).
        let mut waiting: BTreeMap<i32, i64> = BTreeMap::new();
        for (&p, &mark) in prev {
            if space.frontier.get(&p).map_or(-1, |&(next, _, _)| next - 1) < mark {
                waiting.insert(p, -1);
            }
        }
        let mut out = Vec::with_capacity(claims.len());
        for c in claims {
            let s = c.sighting;
            let p = s.partition;
            let (f, exact) = *frontier
                .entry(p)
                .or_insert_with(|| space.frontier.get(&p).map_or((-1, 0), |&(next, _, exact)| (next - 1, exact)));
            if waiting.contains_key(&p) {
                out.push(Verdict::Wait);
                continue;
            }
            let reread = s.offset <= f;
            let cached = space.x.get(&p).is_some_and(|x| x.contains(&s.offset));
            let ready = !unready.iter().any(|&q| q != p);
            let entry = space.entries.entry(c.id).or_default();
            let v = decide_shared(
                entry,
                s,
                Some(Frontier { claimed: f, exact_from: exact }),
                c.mode,
                cached,
                ready,
                window,
            );
            if entry.is_empty() {
                space.entries.remove(&c.id);
            }
            if c.mode.confirm {
                // Not a sighting: no frontier moves.
                out.push(v);
                continue;
            }
            if v == Verdict::Wait {
                waiting.insert(p, s.offset);
                out.push(v);
                continue;
            }
            self.claimed.entry(ns).or_default().insert((p, s.offset));
            if v == Verdict::CrossDuplicate && !reread && c.mode.pin.is_none() {
                space.x.entry(p).or_default().insert(s.offset);
            }
            if s.offset > f {
                frontier.insert(p, (s.offset, exact));
                touched.insert(p, s.now);
            }
            out.push(v);
        }
        for (&p, &(mark, mark_clock)) in marks {
            let (f, exact) = *frontier
                .entry(p)
                .or_insert_with(|| space.frontier.get(&p).map_or((-1, 0), |&(next, _, exact)| (next - 1, exact)));
            // A partition that waited here reaches its mark only up to just before the
            // claim that waited.
            let (o, clock) = match waiting.get(&p) {
                Some(&w) if mark >= w => {
                    let kept = space.frontier.get(&p).map_or(Secs::ZERO, |&(_, clock, _)| clock);
                    (w - 1, touched.get(&p).copied().unwrap_or(kept))
                }
                _ => (mark, mark_clock),
            };
            if o > f {
                frontier.insert(p, (o, exact));
                touched.insert(p, clock);
            }
        }
        for (p, clock) in touched {
            let (claimed, exact) = frontier[&p];
            space.frontier.insert(p, (claimed + 1, clock, exact));
        }
        self.undo[g] = Some((caller, before));
        let refused = waiting.iter().filter(|&(_, &w)| w == -1).map(|(&p, _)| p).collect();
        Reply::Ok(out, refused)
    }

    /// `claim.lua`'s `restart` in every group (`SharedCache::restart`); `Err` when a
    /// group is not in `ns`.
    /// `Ok(false)`: some group's frontier already reached the lookback; it kept what it
    /// claimed, and is exact (and ready) only from the boundary on unless it reached it.
    pub fn restart(&mut self, ns: Ns, partition: i32, lookback: i64, boundary: i64) -> Result<bool, Lost> {
        // One call per group, all sent: the groups still in `ns` restart the partition
        // even when another answers lost.
        let mut lost = None;
        let mut all = true;
        for g in 0..GROUPS {
            let group = &mut self.groups[g];
            if group.ns != Some(ns) {
                lost.get_or_insert(Lost { group: g, frontier: false, holds: group.ns });
                continue;
            }
            let space = group.space(ns);
            match space.frontier.get(&partition).copied() {
                Some((next, clock, exact)) if next >= lookback => {
                    all = false;
                    // Short of the boundary: not ready until the warm-up reaches it.
                    if next < boundary && exact < boundary {
                        space.frontier.insert(partition, (next, clock, boundary));
                        self.touched(g);
                    }
                }
                _ => {
                    space.frontier.insert(partition, (lookback, Secs::new(0), boundary));
                    self.touched(g);
                }
            }
        }
        lost.map_or(Ok(all), Err)
    }

    /// `SharedCache::frontiers`: what each group's frontier hash in `ns` says of `p`
    /// (read without a namespace check, as `HMGET` does).
    pub fn frontiers(&self, ns: Ns, p: i32) -> Vec<Option<CacheFrontier>> {
        self.groups
            .iter()
            .map(|g| {
                g.spaces.get(&ns).and_then(|s| s.frontier.get(&p)).map(|&(next, clock, exact_from)| CacheFrontier {
                    claimed: next - 1,
                    clock,
                    exact_from,
                })
            })
            .collect()
    }

    /// `SharedCache::cached_pins` of `p` at or after `from`.
    pub fn cached_pins(&self, ns: Ns, p: i32, from: i64) -> BTreeMap<i64, Pin> {
        let mut out = BTreeMap::new();
        for g in &self.groups {
            if let Some(x) = g.spaces.get(&ns).and_then(|s| s.x.get(&p)) {
                out.extend(x.range(from..).map(|&o| (o, Pin::CrossDuplicate)));
            }
        }
        out
    }

    /// `SharedCache::trim_cached_pins`.
    pub fn trim_cached_pins(&mut self, ns: Ns, committed: &BTreeMap<i32, i64>) {
        for g in 0..GROUPS {
            if let Some(space) = self.groups[g].spaces.get_mut(&ns) {
                for (&p, &c) in committed {
                    if let Some(x) = space.x.get_mut(&p) {
                        x.retain(|&o| o >= c);
                    }
                }
                self.touched(g);
            }
        }
    }

    /// `SharedCache::set_holds` (group 0's `holds` in `ns`).
    pub fn set_holds(&mut self, ns: Ns, holds: &BTreeMap<i32, Option<Secs>>) {
        let space = self.groups[0].space(ns);
        for (&p, &h) in holds {
            match h {
                Some(t) => space.holds.insert(p, t),
                None => space.holds.remove(&p),
            };
        }
        self.touched(0);
    }

    pub fn lowest_hold(&self, ns: Ns) -> Option<Secs> {
        self.groups[0].spaces.get(&ns).and_then(|s| s.holds.values().min().copied())
    }

    /// One full walk of the sweeper of a member using `ns`: chains last seen before
    /// `cutoff` go (entries left with none too; `Chain::kept_by_sweep`, with the record
    /// time at the partition's frontier in the group), and so does the namespace a
    /// renewal replaced.
    pub fn sweep(&mut self, ns: Ns, cutoff: Secs) -> usize {
        let mut swept = 0;
        let previous = self.groups[0].previous.take();
        for g in 0..GROUPS {
            let group = &mut self.groups[g];
            if let Some(prev) = previous {
                group.spaces.remove(&prev);
            }
            if let Some(space) = group.spaces.get_mut(&ns) {
                let clocks: BTreeMap<i32, Secs> = space.frontier.iter().map(|(&p, &(_, t, _))| (p, t)).collect();
                for chains in space.entries.values_mut() {
                    let before = chains.len();
                    chains.retain(|c| c.kept_by_sweep(cutoff, clocks.get(&c.partition).copied()));
                    swept += before - chains.len();
                }
                space.entries.retain(|_, chains| !chains.is_empty());
            }
            self.touched(g);
        }
        swept
    }
}
