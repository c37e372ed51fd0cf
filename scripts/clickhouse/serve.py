"""Serves a current ClickHouse engine (chdb-core's, in-process) over HTTP and TCP: the
default ClickHouse of scripts/stack, and the mirror of scripts/current-clickhouse.

chdb's connection API (`chdb.connect`) runs the engine without a server: `SYSTEM START
LISTEN` there fails with "start_servers_callback is not set". Its one-shot `query`
entry point runs the engine as `clickhouse-local`, which since 26.x implements
`SYSTEM START LISTEN` for TCP and HTTP, with the listen host and ports of a
`config.xml` in the working directory. The listeners live as long as that
`clickhouse-local` does, so the same call then runs one long query (a sleep) while
the listeners serve other connections, each query in its own thread like a server.

    python serve.py DIR HTTP_PORT TCP_PORT [--zookeeper HOST:PORT] [--timezone TZ] [--lifetime SECONDS]

DIR receives config.xml and the data (`--path`). The process answers /ping once it
listens and ends at SIGTERM (or after --lifetime seconds). The HTTP default format is
TabSeparated, as on clickhouse-server.
"""

import argparse
import os
import sys

p = argparse.ArgumentParser()
p.add_argument("dir")
p.add_argument("http_port", type=int)
p.add_argument("tcp_port", type=int)
p.add_argument("--zookeeper", help="HOST:PORT of a ZooKeeper for Replicated tables")
p.add_argument("--cluster", default="clickagg_cluster", help="name of a one-node cluster of this server")
p.add_argument("--lifetime", type=int, default=3600)
p.add_argument("--timezone", default="UTC", help="the server's time zone (clickhouse-local takes TZ, not <timezone>)")
args = p.parse_args()
os.environ["TZ"] = args.timezone

os.makedirs(os.path.join(args.dir, "data"), exist_ok=True)
zookeeper = ""
if args.zookeeper:
    host, port = args.zookeeper.rsplit(":", 1)
    zookeeper = f"<zookeeper><node><host>{host}</host><port>{port}</port></node></zookeeper>"
# Like the 18.16 server of scripts/stack: loopback only, its two users, UTC (set through TZ above: the
# <timezone> element is a server setting that clickhouse-local ignores). The cluster is
# this server alone (one shard, one replica), with the macros the cluster DDL names.
config = f"""<clickhouse>
  <users_config>users.xml</users_config>
  <listen_host>127.0.0.1</listen_host>
  <http_port>{args.http_port}</http_port>
  <tcp_port>{args.tcp_port}</tcp_port>
  <remote_servers>
    <{args.cluster}><shard><replica><host>127.0.0.1</host><port>{args.tcp_port}</port></replica></shard></{args.cluster}>
  </remote_servers>
  <macros><shard>1</shard><replica>node1</replica></macros>
  {zookeeper}
</clickhouse>
"""
with open(os.path.join(args.dir, "config.xml"), "w") as f:
    f.write(config)
# The users of the 18.16 server of scripts/stack: "default" without a password and
# "clickagg" with one (the tests use both).
users = """<clickhouse>
  <profiles><default/></profiles>
  <users>
    <default><password></password><networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
      <profile>default</profile><quota>default</quota><access_management>1</access_management></default>
    <clickagg><password>clickagg-local-password</password><networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
      <profile>default</profile><quota>default</quota></clickagg>
  </users>
  <quotas><default/></quotas>
</clickhouse>
"""
with open(os.path.join(args.dir, "users.xml"), "w") as f:
    f.write(users)
# clickhouse-local reads ./config.xml.
os.chdir(args.dir)

from chdb import _chdb  # noqa: E402  (after the chdir: the engine starts at import)

sql = (
    "SYSTEM START LISTEN QUERIES ALL; "
    f"SELECT max(sleepEachRow(1)) FROM numbers({args.lifetime}) "
    "SETTINGS function_sleep_max_microseconds_per_block = 0, max_block_size = 1"
)
# The `query` entry point reports errors on stderr and returns an empty result.
_chdb.query(sql, "TSV", path=os.path.join(os.getcwd(), "data"))
print("chdb server: lifetime over", file=sys.stderr)
