# shellcheck shell=bash
# scripts/stack-cluster.sh — the cluster services of the local stack, sourced by
# scripts/stack (not a command of its own; it uses the helpers defined there):
#
#   zookeeper           one standalone Apache ZooKeeper (jars from Maven Central)
#
# Node N of a service is SERVICE:N (e.g. kafka-cluster:2); every node has its own PID
# file, data and logs below $CLICKAGG_STACK_DIR/SERVICE/nodeN. A port setting is either
# one port, the base (node N listens on BASE + N - 1), or a comma-separated list of one
# port per node (as a test that picks free ports one at a time makes it).

# `up cluster` starts them in this order, `down` stops them the other way round
# (ClickHouse before its ZooKeeper). Each section below adds its service.
CLUSTER_SERVICES=()

# --- helpers for services with several nodes ----------------------------------------

# port_of SETTING N: node N's port from the setting named SETTING (a base or a list).
port_of() {
  local setting=$1 n=$2 value=${!1} ports
  if [[ $value == *,* ]]; then
    IFS=, read -ra ports <<<"$value"
    value=${ports[$((n - 1))]:-}
    [[ $value =~ ^[0-9]+$ ]] || die "$setting=${!1} has no port for node $n"
    echo "$value"
  else
    [[ $value =~ ^[0-9]+$ ]] || die "$setting=$value is neither a port nor a comma-separated list of ports"
    echo $((value + n - 1))
  fi
}

# node_list SERVICE COUNT [N]: the node numbers an operation covers, all without N.
node_list() {
  local service=$1 count=$2 node=${3:-}
  if [ -z "$node" ]; then seq 1 "$count"; return; fi
  if ! [[ $node =~ ^[0-9]+$ ]] || [ "$node" -lt 1 ] || [ "$node" -gt "$count" ]; then
    die "$service has nodes 1..$count, not '$node'"
  fi
  echo "$node"
}

# --- ZooKeeper (standalone) -----------------------------------------------------------

ZOOKEEPER_VERSION=${ZOOKEEPER_VERSION:-3.8.4}
ZOOKEEPER_PORT=${ZOOKEEPER_PORT:-12181}
ZOOKEEPER_HEAP=${ZOOKEEPER_HEAP:-256m}
CLUSTER_SERVICES+=(zookeeper)
zk_dir="$STACK_DIR/zookeeper"
zk_libs="$CACHE_DIR/zookeeper-$ZOOKEEPER_VERSION/libs"
zookeeper_nodes() { echo 1; }
zookeeper_pidfile() { echo "$zk_dir/zookeeper.pid"; }
zookeeper_match() { echo "$zk_dir/zoo.cfg"; }
zookeeper_datadir() { echo "$zk_dir"; }
zookeeper_check() { port_of ZOOKEEPER_PORT 1 >/dev/null; }
zookeeper_env() {
  echo "# ZooKeeper: standalone, the coordination service of the replicated ClickHouse tables"
  echo "export CLICKAGG_STACK_ZOOKEEPER=127.0.0.1:$ZOOKEEPER_PORT"
}

zookeeper_install() {
  command -v java >/dev/null || die "java not found; ZooKeeper needs Java"
  local marker; marker="$zk_libs/.complete-$(sha256sum "$repo/scripts/zookeeper/pom.xml" | cut -c1-12)"
  [ -f "$marker" ] && return 0
  [ "${CLICKAGG_STACK_NO_INSTALL:-0}" = 1 ] && die "ZooKeeper jars missing in $zk_libs and CLICKAGG_STACK_NO_INSTALL=1"
  command -v mvn >/dev/null || die "mvn not found; it fetches the ZooKeeper jars from Maven Central"
  log "zookeeper: fetching org.apache.zookeeper:zookeeper:$ZOOKEEPER_VERSION and its dependencies with Maven into $zk_libs"
  mkdir -p "$zk_libs"
  mvn -q -B -f "$repo/scripts/zookeeper/pom.xml" -Dzookeeper.version="$ZOOKEEPER_VERSION" \
    dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$zk_libs" \
    >"$STACK_DIR/maven-zookeeper.log" 2>&1 \
    || die "Maven could not fetch the ZooKeeper jars, see $STACK_DIR/maven-zookeeper.log"
  touch "$marker"
}

# zk_command WORD: a ZooKeeper four-letter command ("srvr", "ruok") and its answer.
zk_command() { (exec 3<>"/dev/tcp/127.0.0.1/$ZOOKEEPER_PORT" && printf '%s' "$1" >&3 && cat <&3) 2>/dev/null; }
zk_serving() { zk_command srvr | grep -q '^Mode: standalone'; }

zookeeper_config() {
  mkdir -p "$zk_dir/data" "$zk_dir/logs"
  cat >"$zk_dir/zoo.cfg" <<EOF
# Written by scripts/stack: one standalone ZooKeeper for the replicated ClickHouse tables.
tickTime=2000
dataDir=$zk_dir/data
clientPort=$ZOOKEEPER_PORT
clientPortAddress=127.0.0.1
maxClientCnxns=0
# No admin web server (it would take port 8080) and only the health commands.
admin.enableServer=false
4lw.commands.whitelist=srvr,ruok,mntr,stat,conf
autopurge.snapRetainCount=3
autopurge.purgeInterval=1
EOF
  cat >"$zk_dir/logback.xml" <<EOF
<configuration>
  <appender name="file" class="ch.qos.logback.core.FileAppender">
    <file>$zk_dir/logs/zookeeper.log</file>
    <encoder><pattern>[%d] %-5level %msg \(%logger{36}\)%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="file"/></root>
</configuration>
EOF
}

zookeeper_up() {
  local pidfile; pidfile=$(zookeeper_pidfile)
  zookeeper_install
  local pid
  if pid=$(own_pid "$pidfile" "$(zookeeper_match)") && zk_serving; then
    log "zookeeper: already running (pid $pid, 127.0.0.1:$ZOOKEEPER_PORT)"
    return 0
  fi
  if [ -z "$pid" ]; then
    port_open "$ZOOKEEPER_PORT" && die "zookeeper: port $ZOOKEEPER_PORT is taken by a process this script did not start; set ZOOKEEPER_PORT"
    zookeeper_config
    log "zookeeper: starting $ZOOKEEPER_VERSION on 127.0.0.1:$ZOOKEEPER_PORT"
    nohup setsid java -Xms"$ZOOKEEPER_HEAP" -Xmx"$ZOOKEEPER_HEAP" -XX:+UseG1GC -Djava.awt.headless=true \
      -Dlogback.configurationFile="$zk_dir/logback.xml" -Dzookeeper.jmx.log4j.disable=true \
      -cp "$zk_libs/*" org.apache.zookeeper.server.quorum.QuorumPeerMain "$zk_dir/zoo.cfg" \
      >"$zk_dir/logs/stdout.log" 2>&1 </dev/null &
    echo $! >"$pidfile"
  fi
  if ! wait_ready 60 "$(read_pid "$pidfile")" zk_serving; then
    tail -n 30 "$zk_dir/logs/stdout.log" "$zk_dir/logs/zookeeper.log" 2>/dev/null >&2 || true
    die "zookeeper: exited or not serving within 60 s (logs in $zk_dir/logs)"
  fi
  log "zookeeper: ready (pid $(read_pid "$pidfile"))"
}

zookeeper_down() { stop_pids TERM "zookeeper|$(zookeeper_pidfile)|$(zookeeper_match)"; }

zookeeper_status() {
  local pid
  if pid=$(own_pid "$(zookeeper_pidfile)" "$(zookeeper_match)") && zk_serving; then
    echo "zookeeper             up    pid $pid  127.0.0.1:$ZOOKEEPER_PORT"
  else echo "zookeeper             down  127.0.0.1:$ZOOKEEPER_PORT"; return 1; fi
}
