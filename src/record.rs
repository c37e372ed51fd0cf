//! A consumed record, decoded: the [`Record`] every reader hands the stages (a valid
//! click keeps only its dedup fingerprint; a rejected one keeps its raw bytes for the
//! dead-letter topic), and the [`Decoder`] that makes one (JSON, or Avro and Protobuf
//! under the schemas their IDs name).
//!
//! No I/O of its own: `source` reads the Kafka messages and decodes them with a
//! `Decoder`, and the schemas come through [`Schemas`], the interface the schema
//! registry (`schema_registry`) implements. So the source and the registry stand side
//! by side, and neither imports the other.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::click::{decode_wire_with, decode_with, Click, Known, Limits, Rejection, WireFormat};
use crate::dedup::{Fingerprint, Fingerprinter};
use crate::retry::{Retryable, Stopped};

/// One consumed record, decoded. Only rejected records keep their raw bytes (for the
/// dead-letter topic); valid ones keep just what the pipeline needs.
#[derive(Debug)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub timestamp_ms: Option<i64>,
    /// A valid click keeps its ID only as its dedup fingerprint.
    pub outcome: Result<Click<Fingerprint>, Box<Rejected>>,
}

/// A rejected record with everything the dead letter must carry.
#[derive(Debug, Clone)]
pub struct Rejected {
    pub rejection: Rejection,
    pub payload: Option<Vec<u8>>,
    pub key: Option<Vec<u8>>,
    pub headers: Vec<(String, Vec<u8>)>,
}

/// Why a schema could not be had.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// No answer, a timeout, 5xx: waited out.
    #[error("schema registry unavailable: {0}")]
    Unavailable(String),
    /// Refused credentials and other answers no retry changes.
    #[error("schema registry: {0}")]
    Fatal(String),
}

impl Retryable for RegistryError {
    fn is_fatal(&self) -> bool {
        matches!(self, RegistryError::Fatal(_))
    }
}

/// Where the schemas of Avro and Protobuf records come from (`schema_registry`).
pub trait Schemas: Send + Sync {
    /// The wire format of the topic's records.
    fn format(&self) -> WireFormat;

    /// What was found for schema `id`, if it was asked for.
    fn known(&self, id: u32) -> Option<Known>;

    /// Makes sure every ID in `ids` is known, waiting out an outage (`answering` is told
    /// whether the source answers); stops on a fatal answer or at `shutdown`.
    fn resolve<'a>(
        &'a self,
        ids: Vec<u32>,
        max_backoff: Duration,
        shutdown: &'a CancellationToken,
        answering: &'a (dyn Fn(bool) + Send + Sync),
    ) -> BoxFuture<'a, Result<(), Stopped<RegistryError>>>;
}

/// What decoding a record needs: the validation limits, the deployment's fingerprint
/// key and, for Avro and Protobuf, the schemas the records name.
#[derive(Clone)]
pub struct Decoder {
    pub limits: Limits,
    pub fingerprints: Fingerprinter,
    /// The topic's schemas (`None`: JSON).
    pub schemas: Option<Arc<dyn Schemas>>,
}

impl Decoder {
    /// Makes sure the schema of every record among `payloads` is known, so that
    /// [`Decoder::decode`] can decide each of them: an Avro or Protobuf topic asks the
    /// registry for the IDs it has not seen, waiting out an outage (`answering` is told
    /// whether the registry answers: a member turns not ready meanwhile) — a record is
    /// never a dead letter because the registry is away.
    pub async fn resolve(
        &self,
        ids: Vec<u32>,
        max_backoff: Duration,
        shutdown: &CancellationToken,
        answering: impl Fn(bool) + Send + Sync,
    ) -> Result<(), Stopped<RegistryError>> {
        let Some(schemas) = &self.schemas else { return Ok(()) };
        schemas.resolve(ids, max_backoff, shutdown, &answering).await
    }

    /// The schema IDs the records among `payloads` name (none for JSON), for
    /// [`Decoder::resolve`]: taken out first, so that no record is held across the wait.
    pub fn schema_ids<'a>(&self, payloads: impl IntoIterator<Item = Option<&'a [u8]>>) -> Vec<u32> {
        match &self.schemas {
            None => Vec::new(),
            Some(_) => payloads.into_iter().filter_map(crate::click::wire::schema_id).collect(),
        }
    }

    /// Decides one record (its schema resolved first, see [`Decoder::resolve`]).
    pub fn decode<Id>(
        &self,
        payload: Option<&[u8]>,
        timestamp_ms: Option<i64>,
        id_of: impl FnOnce(&str) -> Id,
    ) -> Result<Click<Id>, Rejection> {
        match &self.schemas {
            None => decode_with(payload, timestamp_ms, &self.limits, id_of),
            Some(schemas) => {
                decode_wire_with(schemas.format(), payload, timestamp_ms, &self.limits, |id| schemas.known(id), id_of)
            }
        }
    }
}
