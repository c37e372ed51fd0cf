"""sql/billing.sql and sql/billing_top.sql as an analyst runs them on a current
ClickHouse: the file as it is, the values sent as server-side query parameters
(`param_<name>`, what `clickhouse-client --param_...` does). Their answer must be
byte for byte the answer to the SQL `clickagg query --print-sql` prints for the same
arguments (the values written in client-side, the form clickagg itself sends).

    python params_check.py CLICKAGG_BIN SERVER_URL DATABASE REPO -- QUERY_ARGS... [-- QUERY_ARGS...]...

Prints one line per variant; exits 1 if any differs or fails.
"""

import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone


def post(url, database, sql, params):
    q = {"database": database, "default_format": "RowBinary"}
    q.update({f"param_{k}": v for k, v in params.items()})
    req = urllib.request.Request(f"{url}/?{urllib.parse.urlencode(q)}", data=sql.encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(e.read().decode("utf-8", "replace")[:600]) from None


def literal_time(s):
    """The server-side value of a `toDateTime(N, 'UTC')` literal."""
    return datetime.fromtimestamp(int(s), tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


PAIRS = re.compile(r"CAST\(\[(.*?)\] AS Array\(Tuple\(String, DateTime\('UTC'\)\)\)\)")
PAIR = re.compile(r"\('((?:[^'\\]|\\.)*)', toDateTime\((\d+), 'UTC'\)\)")


def pairs_param(inner):
    """The server-side value of a (topic, time) array literal: [('topic','YYYY-MM-DD hh:mm:ss'),...]."""
    return "[" + ",".join(f"('{t}','{literal_time(s)}')" for t, s in PAIR.findall(inner)) + "]"


# What each (topic, time) array is, by the clause it follows. clickagg leaves out the
# parts of the files a read does not need (`-- if ...`), so an array may be missing:
# the file as an analyst runs it then gets an empty one, and must answer the same.
ROLES = (("sealed_days", "(topic, day) IN"), ("sealed_hours", "(topic, hour) IN"), ("covered", "NOT IN"))


def arrays_of(printed):
    arrays = {}
    for m in PAIRS.finditer(printed):
        before = printed[max(0, m.start() - 200):m.start()]
        role = max(ROLES, key=lambda r: before.rfind(r[1]))
        if before.rfind(role[1]) < 0 or role[0] in arrays:
            raise RuntimeError(f"a (topic, time) array after no clause the check knows: {before[-80:]!r}")
        arrays[role[0]] = m.group(1)
    return [arrays.get(name, "") for name, _ in ROLES]


def params_of(printed, args):
    # The three (topic, time) arrays, in the files' order: sealed days, sealed hours, covered.
    arrays = arrays_of(printed)
    # The minute rows' range: the time literals outside those arrays.
    times = re.findall(r"toDateTime\((\d+), 'UTC'\)", PAIRS.sub("", printed))
    by = args[args.index("--by") + 1] if "--by" in args else "minute"
    ads = [args[i + 1] for i, a in enumerate(args) if a == "--ad"]
    topic = args[args.index("--only-topic") + 1] if "--only-topic" in args else ""
    params = {
        "sealed_days": pairs_param(arrays[0]), "sealed_hours": pairs_param(arrays[1]), "covered": pairs_param(arrays[2]),
        "from": literal_time(times[0]), "to": literal_time(times[1]),
        "by": by, "all_ads": "0" if ads else "1", "ads": "[" + ",".join(ads) + "]", "topic": topic,
    }
    if "--top" in args:
        params["top"] = args[args.index("--top") + 1]
    return params


def main():
    binary, url, database, repo = sys.argv[1:5]
    variants, current = [], None
    for a in sys.argv[5:]:
        if a == "--":
            current = []
            variants.append(current)
        else:
            current.append(a)
    failed = 0
    for args in variants:
        printed = subprocess.run([binary, "query", "--print-sql", *args], check=True, capture_output=True,
                                 text=True).stdout
        try:
            params = params_of(printed, args)
        except RuntimeError as e:
            print(f"  FAILED  {' '.join(args)}: {e}")
            failed += 1
            continue
        path = f"{repo}/sql/billing_top.sql" if "top" in params else f"{repo}/sql/billing.sql"
        try:
            substituted = post(url, database, printed, {})
            parameterised = post(url, database, open(path).read(), params)
        except RuntimeError as e:
            print(f"  FAILED  {' '.join(args)}: {e}")
            failed += 1
            continue
        same = substituted == parameterised
        failed += not same
        print(f"  {'same  ' if same else 'DIFFERS'}  {path.rsplit('/', 1)[1]} {' '.join(args)} "
              f"({len(substituted)} bytes)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
