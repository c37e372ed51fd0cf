//! Sealed hours' pure parts: when an hour is due and how a seal is versioned
//! ([`plan`]), how a billing read splits into sealed days, sealed hours and minute
//! rows ([`split`]), and billing periods: their bounds, closes and adjustments
//! ([`period`]). No I/O: `sink` writes and reads what they decide, and `seal`, a
//! layer above both, runs the rounds (the argument for exactness is in `seal`'s docs).

pub mod period;
pub mod plan;
pub mod split;

/// How coarse a billing bucket is: what `query --by` asks for and what the sealer
/// compacts minutes into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Grain {
    Minute,
    Hour,
    Day,
}
