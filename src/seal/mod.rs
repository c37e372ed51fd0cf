//! Sealed hours: the minute rows of an hour that has settled, compacted into one row per
//! (topic, ad, hour) in `ad_clicks_sealed_hour`, and the same per day in
//! `ad_clicks_sealed_day` from the 24 sealed hours, so that a billing read of a day
//! or a month reads thousands of rows instead of millions (`sql/008_sealed_hours.sql`).
//!
//! # What a seal is
//!
//! A seal of hour `H` of a topic is computed in one read of the minute rows of `H`
//! through `FINAL` (one snapshot): per ad the sum of its clicks, and the hour's
//! *version* `V`, the sum over those rows of a weight that grows with the row's
//! version (`plan::ROW_WEIGHT_SQL`). Minute rows are only ever added or replaced by a
//! row of higher version, so `V` grows with every change of the hour's rows and stays
//! put otherwise: of two computations, the one from later rows has the higher version
//! (`plan`'s property test). The seal writes every ad's row with version `V` in one
//! INSERT (one part), plus a row of 0 clicks at `V` for every ad an earlier seal had
//! and this one lacks; then a record (`clickagg_seals`: topic, hour, `V`, `computed_at`
//! = server time taken before the read, the partitions' positions it saw).
//! `ReplacingMergeTree(version)` keeps, per ad, the row of the latest computation, so a
//! slow sealer that writes an older computation last loses, and a seal is never
//! counted twice: the hour's rows are one seal's, read through `FINAL`. A day is
//! sealed the same way from its 24 sealed hours: per ad the sum of its hour rows, each
//! ad's row versioned by the sum of its hour rows' versions (which grows with any of
//! them), the record versioned by the sum of the 24 recorded hour versions.
//!
//! # When an hour is sealed
//!
//! Once it is *due*: every partition's committed offset has a recorded clock at least
//! the hour's end plus `validation.max_lateness` (a partition with nothing left but its
//! open batch counts as being at the current time), so no more clicks are expected for
//! it (`plan::due_until`). The frontier (`clickagg_seal_progress`) is the first hour not
//! sealed yet; each round seals the due hours after it, one read per UTC day. Due is a
//! forecast, not a guarantee: a producer whose clock lags can still deliver a click of a
//! sealed hour, a replay can write rows no member wrote. Exactness rests on the markers.
//!
//! # Re-seals: the markers
//!
//! Every write of minute rows (`Sink::insert`, a member's or a replay's flush) writes,
//! after the rows and before the offset commit that passes them, one marker per (hour,
//! partition) it touched (`clickagg_touched`, stamped `written_at` by the server). A
//! round takes the server time `T` first, reads the markers written since the previous
//! complete round's `T` minus `seal.slack`, and re-seals every hour they name below the
//! frontier, each by a read of its minute rows made after the marker read. At the end
//! it records `T` as where the next round starts (`scanned_from`).
//!
//! Why no write is missed. Take a write `w` of minute rows of a sealed hour `H` and its
//! marker `m`, written after `w` was durable. Rounds start at `T₁ < T₂ < …` (each only
//! once the previous one completed, or started again from the same `scanned_from`
//! after a failure or a `kill -9`).
//! - If `m` was readable when round `k` read the markers, and its `written_at` is at or
//!   after `T_{k-1} − slack`, round `k` re-seals `H` with a read that starts after `m`
//!   was readable, so after `w` was: the seal holds `w`.
//! - If `m` was not readable yet when round `k` read the markers (after `T_k`), it
//!   became readable after `T_k`; its `written_at` (the server's clock when its INSERT
//!   ran) is then at least `T_k − slack`, as long as an INSERT takes less than the slack
//!   to become readable and the servers' clocks differ by less (what `seal.slack`
//!   promises). Round `k + 1` reads from `T_k − slack`, and finds it.
//! - A `kill -9` between `w` and `m`: the flush never completed, so its offsets were
//!   not committed; the next owner re-reads the batch, writes its rows again (equal or
//!   higher versions) and then its marker, which the argument above covers. A `kill -9`
//!   of the sealer anywhere: its round did not record its `T`, so the next round reads
//!   the same markers again and recomputes; rows and records it wrote before dying are
//!   a complete computation (rows before record), or rows a later computation
//!   outranks or repeats.
//!
//! Two sealers at once (a lease that expired mid-round, `clickagg seal` beside a member)
//! each keep the argument for the rounds they complete; any `scanned_from` or frontier
//! a completed step recorded is true, so readers take the largest. They only waste work.
//!
//! # Reads
//!
//! `query` and every billing read (`sink::billing`) take a range's whole days from the
//! sealed days, its whole hours from the sealed hours, and the rest from the minute
//! rows; a sealed hour with a marker newer than its latest computation (minus the
//! slack) is read from the minute rows until it is sealed again (`split`). So a read
//! equals the minute table whether or not the sealer has caught up.
//!
//! # Who seals
//!
//! One member of the group at a time, holding a lease in Redis (`lease`: `SET NX PX`
//! with an owner token, renewed while it seals), every `seal.interval` (`task`); and
//! `clickagg seal` for operators (after a backfill with no member running, or to seal
//! through a time of their choosing). Nothing above depends on the lease: it only
//! keeps members from doing the same work twice.

pub mod adjust;
pub mod check;
pub mod due;
pub mod lease;
pub mod round;
pub mod task;

// The pure parts, a layer below `sink` (which writes and reads what they decide).
pub use crate::sealing::{plan, split};
pub use round::{Due, Report, SealError, Sealer};
