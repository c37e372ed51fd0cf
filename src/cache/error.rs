//! What a call to the cache can fail with, classified once where the Redis error is read:
//! transient (retry with backoff), fatal (stop with the message), or lost (the cache no
//! longer holds what this member relied on: `SharedCache::recover`).

use redis::{ErrorKind, RedisError};

use crate::readiness::RedisTrouble;

#[derive(Debug, thiserror::Error)]
pub enum DedupError {
    /// Redis is unreachable, slow, loading, out of memory, read-only, failing over, or
    /// its replicas did not acknowledge the claims in time: retry with backoff. `trouble`
    /// says which, classified once where the Redis error is read.
    #[error("Redis unavailable: {message}")]
    Transient { trouble: RedisTrouble, message: String },
    /// Retrying cannot help (bad credentials, missing ACL permission, a Redis without
    /// functions, a setting that can lose dedup state): stop with this message.
    #[error("Redis refused the dedup cache: {0}")]
    Fatal(String),
    /// The cache no longer holds what this member relied on: its data is gone (a Redis
    /// restarted without persistence, a failover to an empty replica, FLUSHALL, keys
    /// deleted), another member moved it to a new namespace, or it lost writes this
    /// member saw acknowledged. Nothing was decided; [`SharedCache::recover`](super::SharedCache::recover) says what
    /// to do.
    #[error("the dedup cache lost what this member relied on ({0})")]
    Lost(Lost),
}

/// What a claim found lost, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lost {
    /// The key group that answered.
    pub group: u32,
    /// `namespace`: the group holds another namespace (`detail`, empty for none);
    /// `frontier`: the group's frontier of partition `detail` is behind what this member
    /// saw acknowledged (lost writes).
    pub why: String,
    pub detail: String,
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.why.as_str() {
            "namespace" if self.detail.is_empty() => write!(f, "key group {} holds no dedup state at all", self.group),
            "namespace" => write!(f, "key group {} holds another namespace, {}", self.group, self.detail),
            "frontier" => {
                write!(f, "key group {} lost claims of partition {} it had acknowledged", self.group, self.detail)
            }
            other => write!(f, "key group {}: {other} {}", self.group, self.detail),
        }
    }
}

/// What a member does after [`DedupError::Lost`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovery {
    /// A racing member left one key group on a namespace it then gave up; the group is
    /// set right and the claims can be made again.
    Retry,
    /// The cache starts over in this namespace: every partition's state must be rebuilt
    /// from the log before its reader decides anything again.
    Renewed(String),
}

impl crate::retry::Retryable for DedupError {
    fn is_fatal(&self) -> bool {
        DedupError::is_fatal(self)
    }
}

impl DedupError {
    pub(super) fn classify(e: RedisError) -> DedupError {
        use redis::ServerErrorKind as S;
        let text = e.to_string();
        // An untrusted server certificate stays untrusted however often we retry.
        if text.contains("certificate verify failed") {
            return DedupError::Fatal(format!(
                "{text} (set redis.tls_ca_file to the CA that signed the Redis server certificate)"
            ));
        }
        match e.kind() {
            ErrorKind::AuthenticationFailed | ErrorKind::InvalidClientConfig => DedupError::Fatal(text),
            ErrorKind::Server(S::NoPerm) => DedupError::Fatal(format!(
                "{text} (the ACL user needs +fcall, +function, +hget, +hmget, +ping, and +wait and +cluster on a Redis Cluster)"
            )),
            // Keys of two slots in one call: the layout is wrong, not the server.
            ErrorKind::Server(S::CrossSlot) => DedupError::Fatal(format!("{text} (a bug: report it)")),
            ErrorKind::Extension if text.contains("WRONGPASS") || text.contains("NOAUTH") => DedupError::Fatal(text),
            // A bug in the function, or a server without functions (Redis < 7.0).
            _ if text.contains("user_function") || text.contains("unknown command 'FCALL'") => {
                DedupError::Fatal(format!("{text} (clickagg needs Redis >= 7.0 with functions)"))
            }
            // A cluster client pointed at a Redis that is not one.
            _ if text.contains("cluster support disabled") => DedupError::Fatal(format!(
                "{text} (redis.url names a Redis without cluster mode: unset redis.cluster)"
            )),
            _ => DedupError::Transient { trouble: trouble_of(&e), message: text },
        }
    }

    pub fn is_fatal(&self) -> bool {
        matches!(self, DedupError::Fatal(_))
    }

    /// A transient failure that is not Redis refusing writes.
    pub(super) fn unreachable(message: impl Into<String>) -> DedupError {
        DedupError::Transient { trouble: RedisTrouble::Unreachable, message: message.into() }
    }

    /// Why Redis refuses claims, when it does so for a while.
    pub fn trouble(&self) -> Option<RedisTrouble> {
        match self {
            DedupError::Transient { trouble, .. } => Some(*trouble),
            _ => None,
        }
    }

    pub fn is_lost(&self) -> bool {
        matches!(self, DedupError::Lost(_))
    }
}

/// Reads a Redis error: OOM (maxmemory reached with noeviction) and READONLY (the
/// node became a replica, e.g. after a failover) are the two ways a reachable Redis
/// refuses writes; anything else counts as unreachable.
///
/// Claims go in a pipeline, and a pipeline's error carries the server errors of its
/// commands: `code()` reports only the kinds the client knows (READONLY), not OOM,
/// so the codes are read from the server errors themselves.
pub(super) fn trouble_of(error: &RedisError) -> RedisTrouble {
    let server = error.clone().into_server_errors();
    let codes = server.iter().flat_map(|errors| errors.iter().map(|(_, e)| e.code()));
    trouble_of_codes(codes.chain(error.code()))
}

fn trouble_of_codes<'a>(codes: impl IntoIterator<Item = &'a str>) -> RedisTrouble {
    let codes: Vec<&str> = codes.into_iter().collect();
    if codes.contains(&"OOM") {
        RedisTrouble::OutOfMemory
    } else if codes.contains(&"READONLY") {
        RedisTrouble::ReadOnly
    } else {
        RedisTrouble::Unreachable
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_read_from_any_server_error_of_a_pipeline() {
        let server = |reply: &[u8]| redis::parse_redis_value(reply).unwrap().extract_error().unwrap_err();
        assert_eq!(trouble_of(&server(b"-OOM command not allowed\r\n")), RedisTrouble::OutOfMemory);
        assert_eq!(trouble_of(&server(b"-READONLY You can't write\r\n")), RedisTrouble::ReadOnly);
        assert_eq!(trouble_of(&server(b"-ERR something else\r\n")), RedisTrouble::Unreachable);
        let io = redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(trouble_of(&io), RedisTrouble::Unreachable);
        // What a pipeline's error yields: one code per failed command, unknown kinds too.
        assert_eq!(trouble_of_codes(["ERR", "OOM"]), RedisTrouble::OutOfMemory);
        assert_eq!(trouble_of_codes(["READONLY"]), RedisTrouble::ReadOnly);
    }
}
