"""A recording HTTP proxy between clickagg and ClickHouse.

    python proxy.py serve --listen PORT --primary URL [--mirror URL] [--strip-on-cluster] --record DIR
    python proxy.py report DIR...

`serve` forwards every request clickagg sends (method, path and query string with
`query=` and every setting, the headers that matter, the raw body: SQL, or the
RowBinary rows of an INSERT) to the primary server and answers with the primary's
answer. With --mirror it sends the very same request to a second server right after,
one request at a time (so both servers receive the same statements and inserts in the
same order and hold the same data), and compares the answers:

  - a statement the primary runs and the mirror refuses (or the other way round) is a
    difference, and so is an error with another code;
  - a SELECT answered in RowBinary is decoded on both sides with the column types the
    mirror reports for it (RowBinaryWithNamesAndTypes) and compared value by value: a
    result type the two servers disagree on shows as an undecodable answer. Values
    read from the servers' clocks (`now()`, `written_at`, `registered_at`, `done_at`,
    `age_secs`) may differ by a few seconds; rows of a query without ORDER BY may come
    in another order; of a bare `SELECT count() FROM t` (no FINAL: its value depends on
    the server's merges) only whether it is 0 is compared; `SELECT version()` is each
    server's own;
  - any other answer (DDL, INSERT) must be byte for byte the same.

With --strip-on-cluster (the mirror-less cluster run) a statement `... ON CLUSTER x
...` is first parsed by the primary (`formatQuery` of the exact statement), then run
there without its ON CLUSTER clause: a server without a distributed DDL queue (chdb
has none) still creates the replicated and Distributed tables the statement names.
chdb never activates a replicated table's replica (it stays read-only, and an insert
into one waits minutes before it is refused with code 242), so in that run an INSERT is
not forwarded: the proxy checks that the server accepts its settings (a `SELECT 1`
with the same query string), records it as not exercised, and answers with code 242.

Every exchange is appended to DIR/requests.jsonl; request bodies and differing answers
are kept beside it. A request with the header `X-Clickagg-Check-Origin: harness` is the
check's own (marked so in the record); the header is not forwarded. `report` prints
the counts and every difference, and exits 1 if there is one.
"""

import argparse
import http.client
import json
import os
import re
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rowbinary  # noqa: E402

# Columns whose values come from a server's clock: equal within CLOCK_SLACK seconds.
CLOCK_COLUMNS = {"now", "written_at", "registered_at", "done_at", "age_secs"}
CLOCK_SLACK = 5
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-connection", "content-length", "host", "accept-encoding", "expect"}
ORIGIN_HEADER = "x-clickagg-check-origin"
READ_ONLY_REPLICA = 242  # TABLE_IS_READ_ONLY
# `SELECT version()`: each server's own, which `migrate` asks (sink::schema::for_server).
VERSION = re.compile(r"^\s*SELECT\s+version\(\)\s*$", re.IGNORECASE)
# `SELECT count() FROM t` without FINAL counts the rows of the parts the server has not
# merged yet, which two servers do at their own times. clickagg asks it only to know
# whether minute rows exist (sink::backfill), so only that is compared.
RAW_COUNT = re.compile(r"^\s*SELECT\s+count\(\)\s+FROM\s+[`\w.]+\s*$", re.IGNORECASE)
ON_CLUSTER = re.compile(r"\s+ON\s+CLUSTER\s+(`(?:[^`\\]|\\.)*`|[A-Za-z_][A-Za-z0-9_]*)", re.IGNORECASE)


def escaped(value: str) -> str:
    """A query parameter's value as the server reads it (TabSeparated escaping)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def kind_of(sql: str) -> str:
    words = re.sub(r"^(\s|--[^\n]*\n)*", "", sql).split(None, 1)
    first = words[0].upper() if words else ""
    if first in ("SELECT", "WITH"):
        return "select"
    if first == "INSERT":
        return "insert"
    if first in ("CREATE", "ALTER", "DROP", "TRUNCATE", "RENAME", "ATTACH", "DETACH"):
        return "ddl"
    return "other"


def error_code(status: int, headers: dict, body: bytes):
    if status == 200:
        return None
    code = headers.get("x-clickhouse-exception-code")
    if code:
        return int(code)
    m = re.search(rb"Code: (\d+)", body)
    return int(m.group(1)) if m else -1


class Upstream:
    def __init__(self, url: str):
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname, u.port or 8123
        self.url = url

    def send(self, method: str, path: str, headers: dict, body: bytes):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
        try:
            conn.request(method, path, body=body if body or method == "POST" else None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
        except OSError as e:
            return 599, {}, f"proxy: {self.url} unreachable: {e}".encode()
        finally:
            conn.close()


def with_params(path: str, changes: dict, drop=()) -> str:
    u = urllib.parse.urlsplit(path)
    params = [(k, v) for k, v in urllib.parse.parse_qsl(u.query, keep_blank_values=True)
              if k not in changes and k not in drop]
    params += list(changes.items())
    return urllib.parse.urlunsplit(("", "", u.path or "/", urllib.parse.urlencode(params), ""))


class Recorder:
    def __init__(self, directory: str):
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self.log = open(os.path.join(directory, "requests.jsonl"), "a", buffering=1)
        self.seq = 0

    def keep(self, seq: int, what: str, data: bytes) -> str:
        name = f"{seq:05d}-{what}.bin"
        with open(os.path.join(self.dir, name), "wb") as f:
            f.write(data)
        return name

    def write(self, entry: dict):
        self.log.write(json.dumps(entry) + "\n")


def decode_select(body: bytes, types):
    return rowbinary.rows(body, types)


def close_enough(name: str, a, b) -> bool:
    if a == b:
        return True
    if name in CLOCK_COLUMNS and isinstance(a, int) and isinstance(b, int):
        return abs(a - b) <= CLOCK_SLACK
    return False


def rows_match(names, ra, rb) -> bool:
    return len(ra) == len(rb) and all(
        len(x) == len(y) and all(close_enough(n, u, v) for n, u, v in zip(names, x, y)) for x, y in zip(ra, rb))


def printable(v):
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, (list, tuple)):
        return [printable(x) for x in v]
    return v


def compare(entry, sql, kind, params, fwd_headers, path, primary, mirror, mirror_up: Upstream):
    """The verdict on the two answers to one request: (verdict, detail)."""
    (ps, ph, pb), (ms, mh, mb) = primary, mirror
    pcode, mcode = error_code(ps, ph, pb), error_code(ms, mh, mb)
    if pcode is not None or mcode is not None:
        if pcode is None:
            return "rejected", f"the mirror refused what the primary ran: {mb[:600].decode('utf-8', 'replace')}"
        if mcode is None:
            return "differs", f"the primary refused (code {pcode}) what the mirror ran: {pb[:300].decode('utf-8', 'replace')}"
        if pcode != mcode:
            return "differs", f"both refused, with codes {pcode} (primary) and {mcode} (mirror)"
        return "both-refused", f"code {pcode}"
    fmt = params.get("default_format", "")
    if kind == "select" and fmt == "RowBinary" and not re.search(r"\bFORMAT\s+\w+\s*;?\s*$", sql, re.IGNORECASE):
        ts, th, tb = mirror_up.send(
            "POST", with_params(path, {"default_format": "RowBinaryWithNamesAndTypes"}), fwd_headers, sql.encode())
        if ts != 200:
            return "differs", f"the mirror could not describe the result: {tb[:300].decode('utf-8', 'replace')}"
        names, types, _ = rowbinary.header(tb)
        entry["columns"] = [f"{n} {t}" for n, t in zip(names, types)]
        try:
            rm = decode_select(mb, types)
        except rowbinary.DecodeError as e:
            return "differs", f"the mirror's own answer does not decode as {types}: {e}"
        try:
            rp = decode_select(pb, types)
        except rowbinary.DecodeError as e:
            return "differs", f"the primary's answer does not decode with the mirror's types {types}: {e}"
        entry["rows"] = len(rp)
        if rows_match(names, rp, rm):
            return "same", ""
        if VERSION.match(sql):
            return "same", "the servers' versions, which differ by design (migrate asks, for the minute table's layout)"
        if RAW_COUNT.match(sql) and len(rp) == len(rm) == 1 and (rp[0][0] > 0) == (rm[0][0] > 0):
            return "same", f"raw row counts {rp[0][0]} and {rm[0][0]}: only whether rows exist is compared"
        key = lambda r: repr(r)  # noqa: E731
        unordered = not re.search(r"\bORDER\s+BY\b", sql, re.IGNORECASE)
        if unordered and rows_match(names, sorted(rp, key=key), sorted(rm, key=key)):
            return "same", "same rows in another order (the query has no ORDER BY)"
        first = next((i for i, (x, y) in enumerate(zip(rp, rm)) if not rows_match(names, [x], [y])), min(len(rp), len(rm)))
        return "differs", json.dumps({
            "primary_rows": len(rp), "mirror_rows": len(rm), "first_difference_at_row": first,
            "primary": printable(rp[first]) if first < len(rp) else None,
            "mirror": printable(rm[first]) if first < len(rm) else None,
        })
    if pb == mb:
        return "same", ""
    if kind == "select":
        # Text formats: the same lines, maybe in another order.
        if sorted(pb.splitlines()) == sorted(mb.splitlines()) and not re.search(r"\bORDER\s+BY\b", sql, re.IGNORECASE):
            return "same", "same lines in another order (the query has no ORDER BY)"
    return "differs", f"answers differ: primary {pb[:200]!r}, mirror {mb[:200]!r}"


def make_handler(primary: Upstream, mirror, strip_on_cluster: bool, rec: Recorder, lock: threading.Lock):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: everything is in the record
            pass

        def read_body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                out = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return bytes(out)
                    out += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def answer(self, status, headers, body):
            self.send_response(status)
            for k, v in headers.items():
                if k.startswith("x-clickhouse") or k == "content-type":
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def handle_any(self):
            body = self.read_body()
            origin = self.headers.get(ORIGIN_HEADER, "clickagg")
            fwd = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != ORIGIN_HEADER}
            u = urllib.parse.urlsplit(self.path)
            params = dict(urllib.parse.parse_qsl(u.query, keep_blank_values=True))
            if "query" in params:
                sql, data = params["query"], body
            else:
                sql, data = body.decode("utf-8", "replace"), b""
            kind = kind_of(sql) if (sql.strip() or self.command == "POST") else "http"
            with lock:
                rec.seq += 1
                seq = rec.seq
                entry = {
                    "seq": seq, "t": round(time.time(), 3), "origin": origin, "method": self.command,
                    "path": u.path, "kind": kind, "sql": sql,
                    "settings": {k: v for k, v in params.items() if k != "query"},
                    "headers": {k: ("[redacted]" if k.lower() in ("x-clickhouse-key", "authorization") else v)
                                for k, v in fwd.items() if k.lower().startswith("x-clickhouse") or k.lower() in ("content-type", "user-agent")},
                }
                if data:
                    entry["body"] = rec.keep(seq, "request", data)
                    entry["body_bytes"] = len(data)
                path, send_body = self.path, body
                if strip_on_cluster and ON_CLUSTER.search(sql):
                    entry["on_cluster"] = True
                    es, eh, eb = primary.send(
                        "POST", with_params(self.path, {"param_statement": escaped(sql), "default_format": "TSVRaw"},
                                            drop=("query",)), fwd,
                        b"SELECT formatQuery({statement:String})")
                    entry["parsed"] = {"status": es, "text": eb.decode("utf-8", "replace")[:4000]}
                    local = ON_CLUSTER.sub("", sql, count=1)
                    entry["ran_as"] = local
                    if "query" in params:
                        path = with_params(self.path, {"query": local})
                    else:
                        send_body = local.encode()
                    if es != 200:
                        entry["verdict"], entry["detail"] = "rejected", "formatQuery: " + eb[:600].decode("utf-8", "replace")
                if strip_on_cluster and kind == "insert":
                    # chdb never activates a replicated table's replica, and an insert
                    # into one waits minutes before it is refused (code 242). Check that
                    # the server knows and accepts the insert's settings, and answer
                    # with that refusal at once.
                    ss, sh, sb = primary.send(
                        "POST", with_params(self.path, {}, drop=("query",)), fwd, b"SELECT 1 FORMAT Null")
                    entry["settings_accepted"] = ss == 200
                    note = ("Code: 242. DB::Exception: not exercised by scripts/current-clickhouse: the replicated "
                            "tables of chdb are read-only (TABLE_IS_READ_ONLY)").encode()
                    p = (500, {"x-clickhouse-exception-code": str(READ_ONLY_REPLICA)}, note) if ss == 200 else (ss, sh, sb)
                else:
                    p = primary.send(self.command, path, fwd, send_body)
                entry["primary"] = {"status": p[0], "bytes": len(p[2])}
                if p[0] != 200:
                    entry["primary"]["error"] = p[2][:2000].decode("utf-8", "replace")
                if mirror is not None:
                    m = mirror.send(self.command, self.path, fwd, body)
                    entry["mirror"] = {"status": m[0], "bytes": len(m[2])}
                    if m[0] != 200:
                        entry["mirror"]["error"] = m[2][:2000].decode("utf-8", "replace")
                    try:
                        verdict, detail = compare(entry, sql, kind, params, fwd, self.path, p, m, mirror)
                    except Exception as e:  # a bug here must show, not pass
                        verdict, detail = "differs", f"comparison failed: {type(e).__name__}: {e}"
                    entry["verdict"], entry["detail"] = verdict, detail
                    if verdict != "same":
                        entry["primary"]["answer"] = rec.keep(seq, "primary", p[2])
                        entry["mirror"]["answer"] = rec.keep(seq, "mirror", m[2])
                elif "verdict" not in entry:
                    entry["verdict"] = "ran" if p[0] == 200 else "rejected"
                    if p[0] != 200:
                        entry["detail"] = p[2][:600].decode("utf-8", "replace")
                    if strip_on_cluster and error_code(*p) == READ_ONLY_REPLICA:
                        # chdb (clickhouse-local) creates replicated tables but never
                        # activates their replicas: they stay read-only. Not the statement's doing.
                        entry["verdict"] = "not-exercised"
                rec.write(entry)
            self.answer(*p)

        do_GET = do_POST = handle_any

    return Handler


def serve(a):
    rec = Recorder(a.record)
    handler = make_handler(Upstream(a.primary), Upstream(a.mirror) if a.mirror else None, a.strip_on_cluster,
                           rec, threading.Lock())
    server = ThreadingHTTPServer(("127.0.0.1", a.listen), handler)
    server.daemon_threads = True
    print(f"proxy: 127.0.0.1:{a.listen} -> {a.primary}" + (f", mirrored to {a.mirror}" if a.mirror else ""),
          file=sys.stderr, flush=True)
    server.serve_forever()


# Product defects this check found that wait for a fix in src/. Each matches one
# statement shape and the current engine's error code exactly; it is listed in every
# report but does not fail the check. Anything else still does. Remove an entry once
# the product no longer sends that statement. None is open: the one it found (the
# roll-up backfill's INSERT ... SELECT over more than 100 months, code 252, issue 20)
# went with the roll-ups, which sealed hours replaced; the sealer writes each hour
# and day in INSERTs of rows, one month each.
KNOWN_DEFECTS = []


def known_defect(e):
    for k in KNOWN_DEFECTS:
        code = error_code(e["mirror"]["status"], {}, e["mirror"].get("error", "").encode()) if "mirror" in e else None
        if e.get("verdict") == k["verdict"] and code == k["code"] and k["sql"].match(" ".join(e["sql"].split())):
            return k
    return None


def report(a):
    entries = []
    for d in a.dirs:
        with open(os.path.join(d, "requests.jsonl")) as f:
            entries += [dict(json.loads(line), run=os.path.basename(d.rstrip("/"))) for line in f if line.strip()]
    count = lambda pred: sum(1 for e in entries if pred(e))  # noqa: E731
    found = [e for e in entries if e.get("verdict") in ("differs", "rejected")]
    known = [(e, known_defect(e)) for e in found if known_defect(e)]
    bad = [e for e in found if not known_defect(e)]
    mirrored = [e for e in entries if "mirror" in e]
    print(f"requests recorded: {len(entries)} "
          f"({count(lambda e: e['origin'] == 'clickagg')} from clickagg, {count(lambda e: e['origin'] != 'clickagg')} from the check)")
    print(f"  compared with the primary's answers: {len(mirrored)}")
    for kind in ("ddl", "insert", "select", "other"):
        es = [e for e in mirrored if e["kind"] == kind]
        if es:
            rows = sum(e.get("rows", 0) for e in es)
            print(f"    {kind:7s} {len(es):5d}   same {sum(1 for e in es if e['verdict'] == 'same'):5d}"
                  + (f"   ({rows} rows compared)" if kind == "select" else "")
                  + (f"   ({sum(e.get('body_bytes', 0) for e in es)} bytes of RowBinary)" if kind == "insert" else ""))
    both = count(lambda e: e.get("verdict") == "both-refused")
    if both:
        print(f"    refused by both alike: {both}")
    cluster = [e for e in entries if e.get("on_cluster")]
    if cluster:
        ok = sum(1 for e in cluster if e.get("verdict") == "ran")
        print(f"  ON CLUSTER statements parsed (formatQuery) and run without the clause: {ok} of {len(cluster)}")
    skipped = [e for e in entries if e.get("verdict") == "not-exercised"]
    if skipped:
        print(f"  not exercised (writes into replicated tables, read-only in chdb): {len(skipped)}")
        for e in skipped:
            accepted = "settings accepted: " + ", ".join(f"{k}={v}" for k, v in e["settings"].items())
            print("    " + " ".join(e["sql"].split())[:160] + f" ({accepted})")
    others = [e for e in entries if "mirror" not in e and not e.get("on_cluster") and e.get("verdict") != "not-exercised"]
    if others:
        print(f"  other statements run on the current engine alone: {len(others)}, "
              f"{sum(1 for e in others if e.get('verdict') == 'ran')} accepted")
    if known:
        print(f"known product defects (reported, awaiting a fix in src/): {len(known)} requests")
        for k in KNOWN_DEFECTS:
            hits = [e for e, kk in known if kk is k]
            if hits:
                print(f"  {k['name']}: {len(hits)} (#{', #'.join(str(e['seq']) for e in hits)})")
                print(f"    {k['why']}")
                print(f"    e.g. {hits[0]['mirror'].get('error', '')[:200]!r}")
    print(f"differences: {len(bad)}")
    for e in bad:
        print(f"\n--- {e['run']} #{e['seq']} ({e['origin']}, {e['kind']}): {e['verdict']}")
        print("    " + " ".join(e["sql"].split())[:600])
        if e.get("settings"):
            print(f"    settings: {e['settings']}")
        print(f"    {e.get('detail', '')}")
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--listen", type=int, required=True)
    s.add_argument("--primary", required=True)
    s.add_argument("--mirror")
    s.add_argument("--strip-on-cluster", action="store_true")
    s.add_argument("--record", required=True)
    r = sub.add_parser("report")
    r.add_argument("dirs", nargs="+")
    a = ap.parse_args()
    if a.cmd == "serve":
        serve(a)
    else:
        sys.exit(report(a))


if __name__ == "__main__":
    main()
