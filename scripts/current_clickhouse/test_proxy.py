"""The comparison of scripts/current_clickhouse/proxy.py on made-up answers: it must
call a real difference a difference (a check that finds everything the same proves
nothing), and let through only the differences the proxy documents as legitimate.

    python3 -m unittest scripts/current_clickhouse/test_proxy.py
"""

import os
import re
import struct
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import proxy  # noqa: E402
import rowbinary  # noqa: E402


def leb(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def string(s):
    b = s.encode() if isinstance(s, str) else s
    return leb(len(b)) + b


def header(columns):
    return leb(len(columns)) + b"".join(string(n) for n, _ in columns) + b"".join(string(t) for _, t in columns)


def row(*cells):
    out = b""
    for t, v in cells:
        out += string(v) if t == "String" else struct.pack({"UInt8": "<B", "UInt32": "<I", "UInt64": "<Q",
                                                           "Int64": "<q"}[t], v)
    return out


class FakeMirror:
    """Answers the proxy's describe request (RowBinaryWithNamesAndTypes) with `columns`."""

    def __init__(self, columns):
        self.columns = columns

    def send(self, method, path, headers, body):
        return 200, {}, header(self.columns)


def ok(body):
    return 200, {}, body


def verdict(sql, columns, primary, mirror):
    entry = {}
    return proxy.compare(entry, sql, "select", {"default_format": "RowBinary"}, {}, "/?default_format=RowBinary",
                         primary, mirror, FakeMirror(columns))[0]


BILLING = [("ad_id", "UInt64"), ("minute", "UInt32"), ("clicks", "UInt64")]


def billing(*rows):
    return b"".join(row(("UInt64", a), ("UInt32", m), ("UInt64", c)) for a, m, c in rows)


class Compare(unittest.TestCase):
    def test_equal_rows_are_the_same(self):
        body = billing((1, 60, 3), (2, 60, 4))
        self.assertEqual(verdict("SELECT … ORDER BY ad_id", BILLING, ok(body), ok(body)), "same")

    def test_a_different_count_or_a_missing_row_is_a_difference(self):
        sql = "SELECT ad_id, minute, sum(clicks) AS clicks FROM t FINAL GROUP BY ad_id, minute"
        self.assertEqual(verdict(sql, BILLING, ok(billing((1, 60, 3))), ok(billing((1, 60, 4)))), "differs")
        self.assertEqual(verdict(sql, BILLING, ok(billing((1, 60, 3))), ok(billing((1, 60, 3), (2, 60, 1)))),
                         "differs")

    def test_another_order_passes_only_without_order_by(self):
        a, b = billing((1, 60, 3), (2, 60, 4)), billing((2, 60, 4), (1, 60, 3))
        self.assertEqual(verdict("SELECT ad_id, minute, clicks FROM t GROUP BY ad_id, minute", BILLING, ok(a), ok(b)),
                         "same")
        self.assertEqual(verdict("SELECT ad_id, minute, clicks FROM t ORDER BY ad_id", BILLING, ok(a), ok(b)),
                         "differs")

    def test_clock_columns_may_differ_by_seconds_other_columns_not(self):
        cols = [("batch_offsets", "UInt64"), ("age_secs", "Int64")]
        a = row(("UInt64", 500), ("Int64", 10))
        self.assertEqual(verdict("SELECT … ORDER BY x", cols, ok(a), ok(row(("UInt64", 500), ("Int64", 12)))), "same")
        self.assertEqual(verdict("SELECT … ORDER BY x", cols, ok(a), ok(row(("UInt64", 500), ("Int64", 60)))),
                         "differs")
        self.assertEqual(verdict("SELECT … ORDER BY x", cols, ok(a), ok(row(("UInt64", 501), ("Int64", 10)))),
                         "differs")

    def test_a_result_type_that_changed_is_a_difference(self):
        # 18.16 answers a UInt32 where the current engine says UInt64: the primary's
        # bytes do not decode with the mirror's types.
        cols = [("n", "UInt64")]
        self.assertEqual(verdict("SELECT n ORDER BY n", cols, ok(struct.pack("<I", 7)), ok(struct.pack("<Q", 7))),
                         "differs")

    def test_a_bare_count_compares_only_zero_or_not(self):
        cols = [("count()", "UInt64")]
        sql = "SELECT count() FROM ad_clicks_minute"
        self.assertEqual(verdict(sql, cols, ok(struct.pack("<Q", 2)), ok(struct.pack("<Q", 1))), "same")
        self.assertEqual(verdict(sql, cols, ok(struct.pack("<Q", 2)), ok(struct.pack("<Q", 0))), "differs")
        self.assertEqual(verdict(sql + " FINAL", cols, ok(struct.pack("<Q", 2)), ok(struct.pack("<Q", 1))), "differs")

    def test_refusals(self):
        refused = (500, {"x-clickhouse-exception-code": "62"}, b"Code: 62. DB::Exception: Syntax error")
        self.assertEqual(verdict("SELECT 1", [("1", "UInt8")], ok(b"\x01"), refused), "rejected")
        self.assertEqual(verdict("SELECT 1", [("1", "UInt8")], refused, ok(b"\x01")), "differs")
        other = (500, {}, b"Code: 47, e.displayText() = DB::Exception: Unknown identifier")
        self.assertEqual(verdict("SELECT 1", [("1", "UInt8")], other, refused), "differs")
        self.assertEqual(verdict("SELECT 1", [("1", "UInt8")], refused, refused), "both-refused")

    def test_other_answers_must_be_byte_for_byte_equal(self):
        entry = {}
        same = proxy.compare(entry, "INSERT INTO t FORMAT RowBinary", "insert", {}, {}, "/", ok(b""), ok(b""), None)
        self.assertEqual(same[0], "same")
        differs = proxy.compare(entry, "CREATE TABLE t", "ddl", {}, {}, "/", ok(b""), ok(b"x"), None)
        self.assertEqual(differs[0], "differs")


class KnownDefects(unittest.TestCase):
    BACKFILL = ("INSERT INTO ad_clicks_hour (ad_id, hour, topic, partition, batch_start, clicks, version) "
                "SELECT ad_id, toStartOfHour(minute) AS hour, topic, partition, batch_start, sum(clicks), max(version) "
                "FROM ad_clicks_minute FINAL GROUP BY ad_id, hour, topic, partition, batch_start")
    # A listed defect, as the first one was listed until its fix: that statement, that code.
    LISTED = {
        "name": "roll-up backfill over more than 100 months",
        "verdict": "rejected",
        "code": 252,
        "sql": re.compile(r"^INSERT INTO ad_clicks_(hour|day) \(ad_id, (hour|day), topic, partition, batch_start, clicks, "
                          r"version\) SELECT .* FROM ad_clicks_minute FINAL GROUP BY ", re.S),
        "why": "made up for the test",
    }

    def setUp(self):
        self.open = list(proxy.KNOWN_DEFECTS)
        proxy.KNOWN_DEFECTS[:] = [self.LISTED]

    def tearDown(self):
        proxy.KNOWN_DEFECTS[:] = self.open

    def entry(self, sql, code):
        return {"sql": sql, "verdict": "rejected", "mirror": {"status": 500, "error": f"Code: {code}. DB::Exception: x"}}

    def test_only_the_listed_statement_with_its_code_is_known(self):
        self.assertIsNotNone(proxy.known_defect(self.entry(self.BACKFILL, 252)))
        self.assertIsNone(proxy.known_defect(self.entry(self.BACKFILL, 241)), "another error of the same statement")
        self.assertIsNone(proxy.known_defect(self.entry("INSERT INTO `ad_clicks_hour`(`ad_id`) FORMAT RowBinary", 252)),
                          "a flush refused for too many partitions")
        differs = dict(self.entry(self.BACKFILL, 252), verdict="differs")
        self.assertIsNone(proxy.known_defect(differs), "answered differently rather than refused")

    def test_none_is_open_so_the_fixed_one_fails_the_check_again(self):
        self.assertEqual(self.open, [])
        proxy.KNOWN_DEFECTS[:] = []
        self.assertIsNone(proxy.known_defect(self.entry(self.BACKFILL, 252)))


class Decode(unittest.TestCase):
    def test_types_clickagg_reads(self):
        body = row(("UInt8", 1), ("String", "café")) + struct.pack("<I", 1_796_083_200) + leb(2) + struct.pack("<QQ", 17, 42)
        got = rowbinary.rows(body, ["UInt8", "String", "DateTime('UTC')", "Array(UInt64)"])
        self.assertEqual(got, [(1, "café".encode(), 1_796_083_200, [17, 42])])

    def test_a_truncated_body_does_not_decode(self):
        with self.assertRaises(rowbinary.DecodeError):
            rowbinary.rows(b"\x01\x00", ["UInt32"])

    def test_an_unknown_type_is_an_error_not_a_guess(self):
        with self.assertRaises(rowbinary.DecodeError):
            rowbinary.rows(b"\x00" * 16, ["Decimal(18, 2)"])

    def test_on_cluster_is_removed_with_its_quoted_name(self):
        sql = "CREATE TABLE IF NOT EXISTS `d`.t_local ON CLUSTER `c-1` (a UInt8) ENGINE = MergeTree ORDER BY a"
        self.assertEqual(proxy.ON_CLUSTER.sub("", sql, count=1),
                         "CREATE TABLE IF NOT EXISTS `d`.t_local (a UInt8) ENGINE = MergeTree ORDER BY a")

    def test_query_parameter_values_are_escaped(self):
        self.assertEqual(proxy.escaped("a\nb\\c\td"), "a\\nb\\\\c\\td")


if __name__ == "__main__":
    unittest.main()
