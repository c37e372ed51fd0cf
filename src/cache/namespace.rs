//! The namespace a member decides in: joined at start, renewed when a key group lost its
//! data (the cache starts over, every partition is rebuilt from the log), adopted when
//! another member renewed it, and the replaced one forgotten after a sweep cycle.

use redis::Value;

use super::error::{DedupError, Lost, Recovery};
use super::shared::SharedCache;

impl SharedCache {
    /// A new namespace name: the settings tag and 64 random bits.
    pub(super) fn new_namespace_name(&self) -> String {
        format!("{}.{:016x}", self.settings_tag, rand::random::<u64>())
    }

    pub(super) fn is_ours(&self, ns: &str) -> bool {
        ns.split_once('.').is_some_and(|(tag, _)| tag == self.settings_tag)
    }

    /// Joins the cache's namespace, creating it if the cache has none; a namespace built
    /// under other decision settings is replaced (the settings registry already said
    /// ours are the topic's), and one a key group lost is renewed. Returns the name.
    pub async fn open(&mut self) -> Result<String, DedupError> {
        let v0: Option<String> = self.query(redis::cmd("GET").arg(self.ns_key(0)).clone(), 0).await?;
        let ns = match v0 {
            Some(v) if self.is_ours(&v) => {
                let mut lost_group = false;
                for g in 1..self.groups {
                    let vg: Option<String> = self.query(redis::cmd("GET").arg(self.ns_key(g)).clone(), g).await?;
                    match vg {
                        None => lost_group = true,
                        Some(x) if x != v => self.set_ns(g, &v).await?,
                        Some(_) => {}
                    }
                }
                if lost_group {
                    return self.renew(&v).await;
                }
                v
            }
            Some(v) => return self.renew(&v).await,
            None => {
                let candidate = self.new_namespace_name();
                for g in 1..self.groups {
                    self.set_ns(g, &candidate).await?;
                }
                let open =
                    redis::cmd("FCALL").arg(&self.functions.open).arg(1).arg(self.ns_key(0)).arg(&candidate).clone();
                let winner: String = self.query(open, 0).await?;
                if winner != candidate {
                    for g in 1..self.groups {
                        self.set_ns(g, &winner).await?;
                    }
                }
                if !self.is_ours(&winner) {
                    return self.renew(&winner).await;
                }
                winner
            }
        };
        *self.namespace.lock().expect("not poisoned") = Some(ns.clone());
        Ok(ns)
    }

    /// Moves the cache from the namespace `lost` to a new one (unless another member
    /// already did: then to that one); returns its name.
    pub(super) async fn renew(&mut self, lost: &str) -> Result<String, DedupError> {
        let candidate = self.new_namespace_name();
        for g in 1..self.groups {
            self.set_ns(g, &candidate).await?;
        }
        let renew = redis::cmd("FCALL")
            .arg(&self.functions.renew)
            .arg(2)
            .arg(self.ns_key(0))
            .arg(self.previous_ns_key())
            .arg(lost)
            .arg(&candidate)
            .clone();
        let winner: String = self.query(renew, 0).await?;
        if winner != candidate {
            for g in 1..self.groups {
                self.set_ns(g, &winner).await?;
            }
        }
        if !self.is_ours(&winner) {
            return Err(DedupError::Fatal(format!(
                "the dedup cache of {} was renewed by a member with other decision settings (namespace {winner}, \
                 ours are {}); run every member with the settings the topic records",
                self.topic, self.settings_tag
            )));
        }
        tracing::warn!(lost, namespace = %winner, "the dedup cache starts over in a new namespace");
        *self.namespace.lock().expect("not poisoned") = Some(winner.clone());
        self.acked.1.clear();
        Ok(winner)
    }

    /// What to do after a claim answered [`DedupError::Lost`]: set right a key group a
    /// racing renewal left behind, or move to (or adopt) a new namespace.
    pub async fn recover(&mut self, lost: &Lost) -> Result<Recovery, DedupError> {
        let ours = self.namespace();
        if lost.why == "frontier" {
            return self.renew(&ours).await.map(Recovery::Renewed);
        }
        let v0: Option<String> = self.query(redis::cmd("GET").arg(self.ns_key(0)).clone(), 0).await?;
        match v0 {
            None => self.renew(&ours).await.map(Recovery::Renewed),
            Some(v) if v != ours => {
                if !self.is_ours(&v) {
                    return self.renew(&v).await.map(Recovery::Renewed);
                }
                for g in 1..self.groups {
                    self.set_ns(g, &v).await?;
                }
                tracing::warn!(lost = %ours, namespace = %v, "another member moved the dedup cache to a new namespace");
                *self.namespace.lock().expect("not poisoned") = Some(v.clone());
                self.acked.1.clear();
                Ok(Recovery::Renewed(v))
            }
            // Group 0 holds ours: the group that answered lost its data, or holds what a
            // racing renewal wrote before it lost the race.
            Some(_) if lost.group != 0 && !lost.detail.is_empty() => {
                self.set_ns(lost.group, &ours).await?;
                Ok(Recovery::Retry)
            }
            Some(_) => self.renew(&ours).await.map(Recovery::Renewed),
        }
    }

    /// Whether every key group still holds the namespace this member decides in. A
    /// flush is written only then (`flusher`): once the cache was lost, another member
    /// may already have decided the flush's offsets again in a new namespace, and rows or
    /// pins from the old decisions written after its own would outrank or contradict them.
    pub async fn holds_namespace(&mut self) -> Result<bool, DedupError> {
        let ours = self.namespace();
        if ours.is_empty() {
            return Ok(false);
        }
        let cmds = (0..self.groups).map(|g| redis::cmd("GET").arg(self.ns_key(g)).clone()).collect();
        let held = self.each(cmds).await?;
        Ok(held.into_iter().all(|v| matches!(redis::from_redis_value::<Option<String>>(v), Ok(Some(ns)) if ns == ours)))
    }

    pub(super) async fn set_ns(&mut self, group: u32, ns: &str) -> Result<(), DedupError> {
        let _: Value = self.query(redis::cmd("SET").arg(self.ns_key(group)).arg(ns).clone(), group).await?;
        Ok(())
    }

    /// After a full sweep cycle: the replaced namespace's remaining keys go, and with
    /// them the record that it exists.
    pub(super) async fn forget_previous(&mut self) -> Result<(), DedupError> {
        let previous: Option<String> = self.query(redis::cmd("GET").arg(self.previous_ns_key()).clone(), 0).await?;
        let Some(prev) = previous else { return Ok(()) };
        // The shard hashes went with the walk; what is left are the frontiers, the x sets
        // of the partitions those name, and the holds. No key scan: a KEYS over a shared
        // Redis would block it.
        let mut cmds = Vec::new();
        for g in 0..self.groups {
            let data = self.data_prefix(g, &prev);
            let frontier = format!("{data}frontier");
            let partitions: Vec<String> = self.query(redis::cmd("HKEYS").arg(&frontier).clone(), g).await?;
            cmds.extend(partitions.iter().map(|p| redis::cmd("UNLINK").arg(format!("{data}x:{p}")).clone()));
            cmds.push(redis::cmd("UNLINK").arg(frontier).clone());
        }
        cmds.push(redis::cmd("UNLINK").arg(format!("{}holds", self.data_prefix(0, &prev))).clone());
        cmds.push(redis::cmd("DEL").arg(self.previous_ns_key()).clone());
        self.each(cmds).await.map(drop)
    }
}
