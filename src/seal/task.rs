//! The sealer in a member: every `seal.interval`, the member that holds the lease
//! (`lease`) runs a round; every member reports how far sealing is behind
//! (`clickagg_seal_lag_seconds`), so the alert sees it whichever member seals.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::lease::Lease;
use super::round::Sealer;
use crate::cache::RedisTarget;
use crate::config::Settings;
use crate::retry::{sleep_or_shutdown, FatalSignal, Retry, Retryable, Stopped};
use crate::sink::{Sink, SinkError};
use crate::telemetry::{self as t, RateLimiter};

/// Runs until `stop`; a fatal error (the sealed tables missing, no grants) is raised on
/// `fatal`, which stops the member with its message, as a failing flush would.
pub async fn seal_forever(s: Settings, fatal: FatalSignal, stop: CancellationToken) {
    let sink = Sink::new(&s.clickhouse);
    let sealer = Sealer::for_group(&s, sink.clone());
    let mut lease = match RedisTarget::from_settings(&s.redis) {
        // A round may run longer than an interval (a first seal of a long history): it
        // renews the lease as it goes.
        Ok(target) => {
            let ttl = (s.seal.interval * 3).max(Duration::from_secs(30));
            Some(Lease::new(target, Lease::key_of(&s.redis.key_prefix, &s.kafka.topic), ttl, s.redis.timeout))
        }
        Err(e) => {
            warn!(error = %e, "the sealer cannot reach Redis for its lease; this member does not seal");
            None
        }
    };
    if !s.seal.enabled {
        info!("seal.enabled is off: this member reports the seal lag but does not seal");
        lease = None;
    }
    let logs = RateLimiter::new(Duration::from_secs(60));
    let mut retry = Retry::new(s.pipeline.max_backoff.max(Duration::from_secs(5)), &stop);
    let mut wait = Duration::ZERO;
    loop {
        if sleep_or_shutdown(wait, &stop).await.is_err() {
            break;
        }
        match tick(&sealer, lease.as_mut(), s.seal.interval).await {
            Ok(()) => {
                retry.reset();
                wait = s.seal.interval;
            }
            Err(e) => {
                let on_transient = |e: &TickError| {
                    metrics::counter!(t::SEAL_ERRORS).increment(1);
                    if logs.allow("seal", std::time::Instant::now()).is_some() {
                        warn!(error = %e, "sealing failed; trying again");
                    }
                };
                match retry.after(e, on_transient).await {
                    Ok(()) => wait = Duration::ZERO,
                    Err(Stopped::Fatal(e)) => {
                        fatal.raise(format!("sealing hours: {e}"));
                        break;
                    }
                    Err(Stopped::ShutDown) => break,
                }
            }
        }
    }
    if let Some(lease) = &mut lease {
        if let Err(e) = lease.release().await {
            debug!(error = %e, "could not give the sealer's lease back; it expires");
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum TickError {
    #[error(transparent)]
    Seal(#[from] super::SealError),
    #[error(transparent)]
    Sink(#[from] SinkError),
}

impl Retryable for TickError {
    fn is_fatal(&self) -> bool {
        match self {
            TickError::Seal(e) => e.is_fatal(),
            TickError::Sink(e) => e.is_fatal(),
        }
    }
}

/// One interval's work: a round if this member holds the lease, then the lag.
async fn tick(sealer: &Sealer, lease: Option<&mut Lease>, interval: Duration) -> Result<(), TickError> {
    let holding = match lease {
        Some(lease) => match lease.hold().await {
            Ok(true) => Some(lease),
            Ok(false) => None,
            Err(e) => {
                // Not sealing this time costs nothing but time; another member may.
                debug!(error = %e, "the sealer's lease is out of reach; not sealing this time");
                None
            }
        },
        None => None,
    };
    if let Some(lease) = holding {
        let round = sealer.round(None);
        tokio::pin!(round);
        let mut renew = tokio::time::interval(interval.max(Duration::from_secs(10)));
        renew.tick().await;
        let report = loop {
            tokio::select! {
                report = &mut round => break report?,
                _ = renew.tick() => {
                    if !matches!(lease.hold().await, Ok(true)) {
                        debug!("the sealer's lease lapsed mid-round; finishing the round (another sealer only repeats work)");
                    }
                }
            }
        };
        let idle = super::Report { due_until: report.due_until, frontier: report.frontier, ..Default::default() };
        if report != idle {
            info!(summary = %report.summary(), "sealing round");
        }
    }
    let sink = sealer.sink();
    let (progress, now) = (sink.seal_progress(sealer.topic()).await?, sink.server_now().await?);
    let lag = progress.frontier.map_or(0, |f| now.saturating_sub(f));
    metrics::gauge!(t::SEAL_LAG).set(f64::from(lag));
    Ok(())
}
