//! What the adapters tell the member's readiness, as an interface defined down here so
//! that no adapter imports `health`: the claim task (`cache::claimer`) reports whether
//! Redis takes its claims through [`ClaimsReport`], which `health::Health` implements.
//! (The schema registry's outages reach it through a callback the member hands the
//! decoder.)

/// Why Redis refuses claims; decides the readiness reason and the metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RedisTrouble {
    Unreachable = 1,
    OutOfMemory = 2,
    ReadOnly = 3,
    /// Claims wait while other partitions' dedup state is rebuilt from the log (after
    /// the cache was lost).
    Rebuilding = 4,
}

impl RedisTrouble {
    pub const ALL: [RedisTrouble; 4] =
        [RedisTrouble::Unreachable, RedisTrouble::OutOfMemory, RedisTrouble::ReadOnly, RedisTrouble::Rebuilding];

    /// The `kind` label of `clickagg_redis_errors_total`.
    pub fn label(self) -> &'static str {
        match self {
            RedisTrouble::Unreachable => "unreachable",
            RedisTrouble::OutOfMemory => "out_of_memory",
            RedisTrouble::ReadOnly => "read_only",
            RedisTrouble::Rebuilding => "rebuilding",
        }
    }

    pub fn reason(self) -> &'static str {
        match self {
            RedisTrouble::Unreachable => "redis unreachable",
            RedisTrouble::OutOfMemory => "redis out of memory: claims refused (raise maxmemory)",
            RedisTrouble::ReadOnly => "redis read-only: claims refused (point redis.url at the master)",
            RedisTrouble::Rebuilding => "dedup cache being rebuilt from the log after it was lost",
        }
    }
}

/// Where the claim task reports the outcome of each claim request.
pub trait ClaimsReport: Send + Sync {
    /// `None`: Redis took the claims; otherwise why it did not.
    fn claims(&self, trouble: Option<RedisTrouble>);
}
