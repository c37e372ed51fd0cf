//! Dedup: one Redis key per click ID whose value is the *owner token* — the
//! `topic/partition/offset` of the record that first claimed it (DESIGN.md §1).
//!
//! ```text
//! SET <prefix><click_id> <topic>/<partition>/<offset> NX GET EX <ttl>
//!   nil                 → first sighting: count it
//!   == my own position  → my record, read again after a crash or rebalance: count it
//!   anything else       → a true duplicate: drop it
//! ```
//!
//! A plain `SETNX` would lose clicks: a consumer killed between the claim and the flush
//! finds its own key on the re-read and drops the click forever. The owner token makes
//! the decision a function of the log, so every re-read decides the same way.
//!
//! One pipeline per poll batch, never one round trip per click. After `ttl` the key
//! expires and a repeat of the click counts as new: the TTL is the dedup window.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ErrorKind, RedisError};

/// One click to claim: its ID and the position of the record carrying it.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    pub click_id: &'a str,
    pub partition: i32,
    pub offset: i64,
}

/// What Redis said about one claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nobody had claimed the click: count it.
    First,
    /// This very record had claimed it before (a re-read): count it again, since the
    /// state that counted it the first time was not durable.
    Redelivered,
    /// Another record owns the click: drop it.
    Duplicate,
}

impl Verdict {
    pub fn counts(self) -> bool {
        !matches!(self, Verdict::Duplicate)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DedupError {
    /// Redis is unreachable, slow, loading or failing over: retry with backoff.
    #[error("Redis unavailable: {0}")]
    Transient(RedisError),
    /// Retrying cannot help (bad credentials, missing ACL permission, a Redis that does
    /// not know `SET … NX GET`): stop with this message.
    #[error("Redis refused the dedup command: {0}")]
    Fatal(String),
}

impl DedupError {
    fn classify(e: RedisError) -> DedupError {
        use redis::ServerErrorKind as S;
        // An untrusted server certificate stays untrusted however often we retry.
        if e.to_string().contains("certificate verify failed") {
            return DedupError::Fatal(format!(
                "{e} (set redis.tls_ca_file to the CA that signed the Redis server certificate)"
            ));
        }
        match e.kind() {
            ErrorKind::AuthenticationFailed | ErrorKind::InvalidClientConfig => DedupError::Fatal(e.to_string()),
            ErrorKind::Server(S::NoPerm) => DedupError::Fatal(format!("{e} (the ACL user needs +set and +ping)")),
            ErrorKind::Server(S::ResponseError) if e.to_string().contains("syntax error") => {
                DedupError::Fatal(format!("{e} (SET … NX GET needs Redis >= 7.0)"))
            }
            // WRONGPASS and friends come back as extension errors on some servers.
            ErrorKind::Extension if e.to_string().contains("WRONGPASS") || e.to_string().contains("NOAUTH") => {
                DedupError::Fatal(e.to_string())
            }
            _ => DedupError::Transient(e),
        }
    }

    pub fn is_fatal(&self) -> bool {
        matches!(self, DedupError::Fatal(_))
    }
}

/// The verdict for one claim, from what the key held before `SET … NX GET` (`None`:
/// no key, so this claim now owns it).
pub fn decide(previous: Option<&[u8]>, mine: &str) -> Verdict {
    match previous {
        None => Verdict::First,
        Some(owner) if owner == mine.as_bytes() => Verdict::Redelivered,
        Some(_) => Verdict::Duplicate,
    }
}

/// The owner token stored as the key's value.
pub fn owner_token(topic: &str, partition: i32, offset: i64) -> String {
    format!("{topic}/{partition}/{offset}")
}

/// A Redis connection that claims click IDs. It reconnects lazily after any error, so
/// the caller's retry loop is the only recovery path.
pub struct Dedup {
    client: redis::Client,
    conn: Option<MultiplexedConnection>,
    config: AsyncConnectionConfig,
    key_prefix: String,
    ttl_secs: u64,
}

impl Dedup {
    pub fn new(client: redis::Client, key_prefix: String, ttl: Duration, timeout: Duration) -> Dedup {
        let config =
            AsyncConnectionConfig::new().set_connection_timeout(Some(timeout)).set_response_timeout(Some(timeout));
        Dedup { client, conn: None, config, key_prefix, ttl_secs: ttl.as_secs().max(1) }
    }

    async fn connection(&mut self) -> Result<&mut MultiplexedConnection, DedupError> {
        if self.conn.is_none() {
            let conn = self
                .client
                .get_multiplexed_async_connection_with_config(&self.config)
                .await
                .map_err(DedupError::classify)?;
            self.conn = Some(conn);
        }
        Ok(self.conn.as_mut().expect("just connected"))
    }

    /// Claims every click in one pipelined round trip. Verdicts come back in input
    /// order; a click appearing twice in `claims` is decided in order, too.
    pub async fn claim(&mut self, topic: &str, claims: &[Claim<'_>]) -> Result<Vec<Verdict>, DedupError> {
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        let mut tokens = Vec::with_capacity(claims.len());
        let mut key = String::with_capacity(self.key_prefix.len() + 64);
        for c in claims {
            key.clear();
            key.push_str(&self.key_prefix);
            key.push_str(c.click_id);
            let token = owner_token(topic, c.partition, c.offset);
            pipe.cmd("SET").arg(&key).arg(&token).arg("NX").arg("GET").arg("EX").arg(self.ttl_secs);
            tokens.push(token);
        }
        let conn = self.connection().await?;
        let replies: Result<Vec<Option<Vec<u8>>>, RedisError> = pipe.query_async(conn).await;
        let replies = match replies {
            Ok(r) => r,
            Err(e) => {
                // The multiplexed connection may be half-broken; start afresh next time.
                self.conn = None;
                return Err(DedupError::classify(e));
            }
        };
        Ok(replies.iter().zip(&tokens).map(|(previous, mine)| decide(previous.as_deref(), mine)).collect())
    }

    /// Round trip for readiness checks.
    pub async fn ping(&mut self) -> Result<(), DedupError> {
        let conn = self.connection().await?;
        let r: Result<String, RedisError> = redis::cmd("PING").query_async(conn).await;
        r.map(drop).map_err(|e| {
            self.conn = None;
            DedupError::classify(e)
        })
    }
}
