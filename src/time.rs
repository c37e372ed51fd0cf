//! Times as the command line takes them (`--from`, `--to`, `--through`): RFC 3339, or a
//! plain date meaning its UTC midnight (billing days are UTC days). `query`, `replay`,
//! `reconcile` and the commands read them alike.

use chrono::{DateTime, NaiveDate, Utc};

/// RFC 3339, or a plain date meaning its UTC midnight.
pub fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    if let Ok(d) = NaiveDate::parse_from_str(s, "%Y-%m-%d") {
        return Ok(d.and_hms_opt(0, 0, 0).expect("midnight exists").and_utc());
    }
    Err(format!("{s:?} is neither RFC 3339 (2026-11-30T08:00:00Z) nor a date (2026-11-30)"))
}

/// [`parse_time`] in milliseconds since the epoch.
pub fn parse_time_ms(s: &str) -> Option<i64> {
    parse_time(s).ok().map(|t| t.timestamp_millis())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_dates_mean_utc_midnight_and_offsets_are_converted_to_utc() {
        assert_eq!(parse_time("2026-11-30").unwrap().to_rfc3339(), "2026-11-30T00:00:00+00:00");
        assert_eq!(parse_time("2026-11-30T09:30:00+01:00").unwrap().to_rfc3339(), "2026-11-30T08:30:00+00:00");
        assert!(parse_time("30/11/2026").is_err());
        assert_eq!(parse_time_ms("1970-01-02"), Some(86_400_000));
    }
}
