//! One sealer at a time: a lease in Redis (`SET key token NX PX ttl`), renewed by its
//! holder while it seals and given back when it stops. Exactness never depends on it
//! (two sealers at once compute the same seals, `seal`); it keeps the members of a
//! group from doing the same reads.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterConfig;
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, RedisError};

/// Why the lease could not be taken, renewed or given back (always transient to the
/// sealer: it does not seal this time). Only the error's kind: its text may quote the
/// URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the sealer's lease in Redis: {0}")]
pub struct LeaseError(String);

impl From<RedisError> for LeaseError {
    fn from(e: RedisError) -> LeaseError {
        LeaseError(format!("{:?}", e.kind()))
    }
}

use crate::cache::RedisTarget;

/// Takes the lease when it is free, renews it when `token` holds it; 1 when held.
const HOLD: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
return 0
";

/// Deletes the lease if `token` still holds it (never another holder's).
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

/// This process's claim on the lease of one topic's sealer.
pub struct Lease {
    target: RedisTarget,
    conn: Option<Conn>,
    key: String,
    token: String,
    ttl: Duration,
    timeout: Duration,
}

impl Lease {
    /// The lease `key` (one per topic), held for `ttl` after each renewal.
    pub fn new(target: RedisTarget, key: String, ttl: Duration, timeout: Duration) -> Lease {
        let token = format!("{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>());
        Lease { target, conn: None, key, token, ttl, timeout }
    }

    /// The key of `topic`'s lease under the cache's key prefix.
    pub fn key_of(key_prefix: &str, topic: &str) -> String {
        format!("{key_prefix}sealer:{topic}")
    }

    /// Takes or renews the lease: whether this process holds it now.
    pub async fn hold(&mut self) -> Result<bool, LeaseError> {
        let held: i64 = self.eval(HOLD).await?;
        Ok(held == 1)
    }

    /// Gives the lease back if this process holds it.
    pub async fn release(&mut self) -> Result<(), LeaseError> {
        let _: i64 = self.eval(RELEASE).await?;
        Ok(())
    }

    async fn eval(&mut self, script: &str) -> Result<i64, LeaseError> {
        let (key, token, ttl_ms) = (self.key.clone(), self.token.clone(), self.ttl.as_millis().to_string());
        let timeout = self.timeout;
        let call = async {
            let conn = self.connection().await?;
            let mut eval = redis::cmd("EVAL");
            eval.arg(script).arg(1).arg(&key).arg(&token).arg(&ttl_ms);
            let held: i64 = match conn {
                Conn::Single(c) => eval.query_async(c).await?,
                Conn::Cluster(c) => eval.query_async(c).await?,
            };
            Ok::<i64, LeaseError>(held)
        };
        let result = match tokio::time::timeout(timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(LeaseError(format!("no answer within {timeout:?}"))),
        };
        if result.is_err() {
            // Connect again next time.
            self.conn = None;
        }
        result
    }

    async fn connection(&mut self) -> Result<&mut Conn, RedisError> {
        if self.conn.is_none() {
            let conn = match &self.target {
                RedisTarget::Single(_) | RedisTarget::Sentinel(_) => {
                    let config = AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(self.timeout))
                        .set_response_timeout(Some(self.timeout));
                    Conn::Single(self.target.connect_single(&config).await.expect("one Redis")?)
                }
                RedisTarget::Cluster(client) => {
                    let config =
                        ClusterConfig::new().set_connection_timeout(self.timeout).set_response_timeout(self.timeout);
                    Conn::Cluster(client.get_async_connection_with_config(config).await?)
                }
            };
            self.conn = Some(conn);
        }
        Ok(self.conn.as_mut().expect("just set"))
    }
}
