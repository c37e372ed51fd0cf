//! What to do about a ClickHouse error: every code clickagg's requests can meet, in one
//! table, with its class and, for a fatal one, what an operator must change.

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The server is down, overloaded or timed out: keep the rows and retry.
    #[error("ClickHouse unavailable: {0}")]
    Transient(String),
    /// Retrying cannot help (missing table, wrong password, schema mismatch).
    #[error("ClickHouse refused the request: {0}")]
    Fatal(String),
}

impl crate::retry::Retryable for SinkError {
    fn is_fatal(&self) -> bool {
        SinkError::is_fatal(self)
    }
}

impl SinkError {
    pub fn is_fatal(&self) -> bool {
        matches!(self, SinkError::Fatal(_))
    }
}

/// What to do about a ClickHouse error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// The server is down, overloaded, or behind on merges or replication: the same
    /// request succeeds later. The flush keeps its rows and retries with backoff;
    /// consumption pauses at `pipeline.max_unflushed_buckets`; nothing is committed.
    Transient,
    /// The same request fails the same way until an operator changes something: the
    /// member stops with the server's message and this advice.
    Fatal(&'static str),
}

const SCHEMA: &str = "the tables do not match this clickagg: run `clickagg migrate` on clickhouse.database";
const MISSING: &str = "run `clickagg migrate`, or check clickhouse.database";
const CREDENTIALS: &str = "check clickhouse.user and clickhouse.password, or the credentials in clickhouse.url";
const GRANTS: &str =
    "grant clickhouse.user SELECT, INSERT and CREATE on clickhouse.database in a profile that is not readonly";
const LIMITS: &str = "a limit in clickhouse.user's settings profile refuses this request every time: raise it";
const SERVER: &str = "the server cannot run this request: see its log";
/// Every ClickHouse error code clickagg's requests (row and pin INSERTs, billing and
/// registry SELECTs, the migrations) can meet, and what to do about it. Transient means
/// an outage of the server, not of clickagg's request; codes that depend on the request
/// (a setting's limit, the data, the schema) are fatal.
///
/// A code that is not listed is retried like an outage, and counted
/// (`clickagg_clickhouse_unknown_errors_total`, the code in the log; alert
/// ClickaggClickHouseUnknownError): only a code known to be permanent stops a member. A
/// new server's code for an outage must not become a crash loop (on Kubernetes, every
/// restart of every member meets it again); a permanent one that is retried holds the
/// rows and commits nothing, which the alert and the member's log make visible.
pub const CODES: &[(u32, &str, Class)] = &[
    (6, "CANNOT_PARSE_TEXT", Class::Fatal(SCHEMA)),
    (8, "THERE_IS_NO_COLUMN", Class::Fatal(SCHEMA)),
    (10, "NOT_FOUND_COLUMN_IN_BLOCK", Class::Fatal(SCHEMA)),
    (16, "NO_SUCH_COLUMN_IN_TABLE", Class::Fatal(SCHEMA)),
    (20, "NUMBER_OF_COLUMNS_DOESNT_MATCH", Class::Fatal(SCHEMA)),
    (27, "CANNOT_PARSE_INPUT_ASSERTION_FAILED", Class::Fatal(SCHEMA)),
    (33, "CANNOT_READ_ALL_DATA", Class::Fatal(SCHEMA)),
    (43, "ILLEGAL_TYPE_OF_ARGUMENT", Class::Fatal(SCHEMA)),
    (44, "ILLEGAL_COLUMN", Class::Fatal(SCHEMA)),
    (46, "UNKNOWN_FUNCTION", Class::Fatal(SERVER)),
    (47, "UNKNOWN_IDENTIFIER", Class::Fatal(SCHEMA)),
    (48, "NOT_IMPLEMENTED", Class::Fatal(SERVER)),
    (49, "LOGICAL_ERROR", Class::Fatal(SERVER)),
    (53, "TYPE_MISMATCH", Class::Fatal(SCHEMA)),
    (60, "UNKNOWN_TABLE", Class::Fatal(MISSING)),
    (62, "SYNTAX_ERROR", Class::Fatal(SERVER)),
    (73, "UNKNOWN_FORMAT", Class::Fatal(SERVER)),
    (81, "UNKNOWN_DATABASE", Class::Fatal(MISSING)),
    (115, "UNKNOWN_SETTING", Class::Fatal(SERVER)),
    (117, "INCORRECT_DATA", Class::Fatal(SCHEMA)),
    (158, "TOO_MANY_ROWS", Class::Fatal(LIMITS)),
    (159, "TIMEOUT_EXCEEDED", Class::Transient),
    (160, "TOO_SLOW", Class::Transient),
    (164, "READONLY", Class::Fatal(GRANTS)),
    (192, "UNKNOWN_USER", Class::Fatal(CREDENTIALS)),
    (193, "WRONG_PASSWORD", Class::Fatal(CREDENTIALS)),
    (194, "REQUIRED_PASSWORD", Class::Fatal(CREDENTIALS)),
    (195, "IP_ADDRESS_NOT_ALLOWED", Class::Fatal(CREDENTIALS)),
    (201, "QUOTA_EXPIRED", Class::Transient),
    (202, "TOO_MANY_SIMULTANEOUS_QUERIES", Class::Transient),
    (203, "NO_FREE_CONNECTION", Class::Transient),
    (209, "SOCKET_TIMEOUT", Class::Transient),
    (210, "NETWORK_ERROR", Class::Transient),
    (225, "NO_ZOOKEEPER", Class::Transient),
    (236, "ABORTED", Class::Transient),
    (241, "MEMORY_LIMIT_EXCEEDED", Class::Transient),
    (242, "TABLE_IS_READ_ONLY", Class::Transient),
    (243, "NOT_ENOUGH_SPACE", Class::Transient),
    // Also "too many partitions for single INSERT block", which is fatal: see classify.
    (252, "TOO_MANY_PARTS", Class::Transient),
    (279, "ALL_CONNECTION_TRIES_FAILED", Class::Transient),
    (285, "TOO_FEW_LIVE_REPLICAS", Class::Transient),
    (286, "UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE", Class::Transient),
    // A read (select_sequential_consistency) from a replica that has not fetched a part
    // written with a quorum yet: it catches up, or the next read goes to another one.
    (289, "REPLICA_IS_NOT_IN_QUORUM", Class::Transient),
    (290, "LIMIT_EXCEEDED", Class::Fatal(LIMITS)),
    (291, "DATABASE_ACCESS_DENIED", Class::Fatal(GRANTS)),
    (307, "TOO_MANY_BYTES", Class::Fatal(LIMITS)),
    (319, "UNKNOWN_STATUS_OF_INSERT", Class::Transient),
    (364, "RECEIVED_ERROR_TOO_MANY_REQUESTS", Class::Transient),
    (373, "SESSION_IS_LOCKED", Class::Transient),
    (384, "PART_IS_TEMPORARILY_LOCKED", Class::Transient),
    (394, "QUERY_WAS_CANCELLED", Class::Transient),
    (396, "TOO_MANY_ROWS_OR_BYTES", Class::Fatal(LIMITS)),
    (439, "CANNOT_SCHEDULE_TASK", Class::Transient),
    (473, "DEADLOCK_AVOIDED", Class::Transient),
    (497, "ACCESS_DENIED", Class::Fatal(GRANTS)),
    (516, "AUTHENTICATION_FAILED", Class::Fatal(CREDENTIALS)),
    (999, "KEEPER_EXCEPTION", Class::Transient),
    (1000, "POCO_EXCEPTION", Class::Transient),
];

/// The class of `code` by [`CODES`]; `None` for a code the table does not list.
pub fn class_of(code: u32) -> Option<Class> {
    CODES.iter().find(|(c, _, _)| *c == code).map(|&(_, _, class)| class)
}

/// What a proxy or load balancer in front of ClickHouse says while the server is away;
/// any other answer without a ClickHouse error code means clickhouse.url is wrong.
const TRANSIENT_HTTP: &[&str] = &["Too Many Requests", "Bad Gateway", "Service Unavailable", "Gateway Timeout"];

/// The `Code: N` of a ClickHouse exception message, if any.
fn error_code(message: &str) -> Option<u32> {
    let rest = &message[message.find("Code: ")? + 6..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Retry or stop, by [`CODES`].
pub fn classify(e: clickhouse::error::Error) -> SinkError {
    use clickhouse::error::Error as E;
    let fatal = |msg: String, fix: &str| SinkError::Fatal(format!("{msg} ({fix})"));
    match e {
        E::BadResponse(msg) => match error_code(&msg) {
            None if TRANSIENT_HTTP.iter().any(|t| msg.contains(t)) => SinkError::Transient(msg),
            None => fatal(msg, "not an answer from ClickHouse: check clickhouse.url"),
            // TOO_MANY_PARTS has two meanings: merges behind (they catch up), or one
            // INSERT over more partitions than the server's setting allows, which fails
            // every time. clickagg keeps to 100, the setting's default.
            Some(252) if msg.contains("Too many partitions for single INSERT block") => fatal(
                msg,
                "clickagg writes up to 100 months per INSERT: set max_partitions_per_insert_block to 100 \
                 or more in clickhouse.user's settings profile",
            ),
            // A cluster node that died mid-request: the node clickagg talks to reports
            // the lost connection with the code of the read that failed (32
            // ATTEMPT_TO_READ_AFTER_EOF, 33 CANNOT_READ_ALL_DATA, …) and names the node
            // it was receiving from. An outage of that node, not a fault of the request;
            // the insert is idempotent, so repeating it is safe.
            Some(_) if msg.contains("while receiving packet from") => SinkError::Transient(msg),
            Some(code) => match class_of(code) {
                Some(Class::Transient) => SinkError::Transient(msg),
                Some(Class::Fatal(fix)) => fatal(msg, fix),
                None => {
                    // Unlabelled, so that it is exported (at 0) before the first one: the
                    // code is in the message the member logs.
                    metrics::counter!(crate::telemetry::CLICKHOUSE_UNKNOWN_ERRORS).increment(1);
                    SinkError::Transient(format!(
                        "{msg} (error code {code} is not in clickagg's table of codes: retried)"
                    ))
                }
            },
        },
        E::Network(_) | E::TimedOut => SinkError::Transient(e.to_string()),
        // The client cannot build the request or read the answer: the same next time.
        other => fatal(other.to_string(), SERVER),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes_decide_retry_or_stop() {
        let fatal = clickhouse::error::Error::BadResponse(
            "Code: 60, e.displayText() = DB::Exception: Table x doesn't exist".into(),
        );
        assert!(classify(fatal).is_fatal());
        let busy =
            clickhouse::error::Error::BadResponse("Code: 202. DB::Exception: Too many simultaneous queries".into());
        assert!(!classify(busy).is_fatal());
        assert!(!classify(clickhouse::error::Error::TimedOut).is_fatal());
    }

    fn bad(msg: &str) -> SinkError {
        classify(clickhouse::error::Error::BadResponse(msg.into()))
    }

    #[test]
    fn no_error_that_a_retry_cannot_fix_is_retried() {
        // The same request fails the same way however often it is sent.
        for fatal in [
            "Code: 252, e.displayText() = DB::Exception: Too many partitions for single INSERT block (more than 100). \
             The limit is controlled by 'max_partitions_per_insert_block' setting",
            "Code: 252. DB::Exception: Too many partitions for single INSERT block (more than 100). (TOO_MANY_PARTS)",
            "404 Not Found",
            "<html><body>Welcome to nginx!</body></html>",
        ] {
            assert!(bad(fatal).is_fatal(), "{fatal}");
        }
        // Overload, merges behind, a restart: the same request succeeds later.
        for transient in [
            "Code: 252, e.displayText() = DB::Exception: Too many parts (300). Merges are processing \
             significantly slower than inserts.",
            "Code: 202. DB::Exception: Too many simultaneous queries. Maximum: 100. (TOO_MANY_SIMULTANEOUS_QUERIES)",
            "Code: 241. DB::Exception: Memory limit (total) exceeded (MEMORY_LIMIT_EXCEEDED)",
            "503 Service Unavailable",
            "<html><head><title>502 Bad Gateway</title></head></html>",
            // A replica killed while a Distributed insert wrote to it (scripts/test-cluster).
            "Code: 32, e.displayText() = DB::Exception: Attempt to read after eof: while receiving packet from \
             127.0.0.1:19002: Insertion status:\nWrote 1 blocks and 90 rows on shard 0 replica 0, 127.0.0.1:19000 \
             (average 0 ms per block)\n, e.what() = DB::Exception",
            "Code: 32. DB::Exception: Attempt to read after eof: while receiving packet from node-3:9000. \
             (ATTEMPT_TO_READ_AFTER_EOF)",
            // A code the table does not know: retried, never a crash loop.
            "Code: 1234567. DB::Exception: an error this version of clickagg has never heard of",
            "Code: 4242, e.displayText() = DB::Exception: new",
        ] {
            assert!(!bad(transient).is_fatal(), "{transient}");
        }
        assert!(!classify(clickhouse::error::Error::TimedOut).is_fatal());
        assert!(!classify(clickhouse::error::Error::Network("connection reset".into())).is_fatal());
    }

    #[test]
    fn every_code_in_the_table_is_classified_as_listed_in_both_message_formats() {
        for &(code, name, class) in CODES {
            let old = format!("Code: {code}, e.displayText() = DB::Exception: something, e.what() = DB::Exception");
            let new = format!("Code: {code}. DB::Exception: something. ({name}) (version 25.8.1.1 (official build))");
            for msg in [old, new] {
                assert_eq!(bad(&msg).is_fatal(), matches!(class, Class::Fatal(_)), "{name}: {msg}");
            }
        }
    }

    #[test]
    fn the_table_lists_each_code_once_in_order() {
        assert!(CODES.windows(2).all(|w| w[0].0 < w[1].0), "codes sorted and unique");
        assert!(CODES.iter().all(|(_, name, _)| name.chars().all(|c| c.is_ascii_uppercase() || c == '_')));
    }

    #[test]
    fn fatal_errors_say_what_to_change() {
        let says = |msg: &str, advice: &str| {
            let e = bad(msg).to_string();
            assert!(e.contains(advice), "{e}");
        };
        says("Code: 193. DB::Exception: Wrong password for user clickagg", "clickhouse.password");
        says("Code: 60. DB::Exception: Table it.ad_clicks_minute doesn't exist", "clickagg migrate");
        says("Code: 164. DB::Exception: Cannot execute query in readonly mode", "grant clickhouse.user");
        says("Code: 252. DB::Exception: Too many partitions for single INSERT block (more than 10)", "max_partitions");
        let unknown = bad("Code: 4242. DB::Exception: new").to_string();
        assert!(unknown.contains("4242 is not in clickagg's table of codes: retried"), "{unknown}");
        says("404 Not Found", "check clickhouse.url");
    }
}
