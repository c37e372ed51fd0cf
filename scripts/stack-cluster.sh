# shellcheck shell=bash
# scripts/stack-cluster.sh — the cluster services of the local stack, sourced by
# scripts/stack (not a command of its own; it uses the helpers defined there):
#
#   zookeeper           one standalone Apache ZooKeeper (jars from Maven Central)
#   kafka-cluster       three KRaft nodes, each broker and controller (node ids 1..3)
#   redis-cluster       six redis-server nodes with cluster-enabled: 3 masters, 3 replicas
#   clickhouse-cluster  four clickhouse-server nodes: 2 shards x 2 replicas, replicated
#                       through the zookeeper service
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
zk_command() { tcp_ask 10 "$ZOOKEEPER_PORT" "$1"; }
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

# --- Kafka cluster (three KRaft nodes, each broker and controller) --------------------

KAFKA_CLUSTER_PORT=${KAFKA_CLUSTER_PORT:-19092}
KAFKA_CLUSTER_CONTROLLER_PORT=${KAFKA_CLUSTER_CONTROLLER_PORT:-19192}
KAFKA_CLUSTER_HEAP=${KAFKA_CLUSTER_HEAP:-384m}
CLUSTER_SERVICES+=(kafka-cluster)
kc_dir="$STACK_DIR/kafka-cluster"
kafka_cluster_nodes() { echo 1 2 3; }
kafka_cluster_pidfile() { echo "$kc_dir/node$1/kafka.pid"; }
kafka_cluster_match() { echo "$kc_dir/node$1/server.properties"; }
kafka_cluster_datadir() { echo "$kc_dir"; }
kafka_cluster_check() {
  local n
  for n in $(kafka_cluster_nodes); do
    port_of KAFKA_CLUSTER_PORT "$n" >/dev/null; port_of KAFKA_CLUSTER_CONTROLLER_PORT "$n" >/dev/null
  done
}
kafka_cluster_env() {
  echo "# Kafka: three brokers (node.id 1..3), replication factor 3, min.insync.replicas 2"
  echo "export CLICKAGG__KAFKA__BROKERS=$(kc_bootstrap)"
  # The same list under a name the single-node stack's settings never shadow (the cluster tests read it).
  echo "export CLICKAGG_STACK_KAFKA_CLUSTER_BROKERS=$(kc_bootstrap)"
}
kc_port() { port_of KAFKA_CLUSTER_PORT "$1"; }
kc_controller_port() { port_of KAFKA_CLUSTER_CONTROLLER_PORT "$1"; }
kc_bootstrap() {
  local n list=""
  for n in $(kafka_cluster_nodes); do list+="${list:+,}127.0.0.1:$(kc_port "$n")"; done
  echo "$list"
}
# kc_started N OFFSET: node N logged "Kafka Server started" past OFFSET of its log.
kc_started() { logged_since "$kc_dir/node$1/logs/server.log" "$2" 'Kafka Server started'; }

kafka_cluster_config() {
  local n=$1 d="$kc_dir/node$1" voters="" v
  mkdir -p "$d/data" "$d/logs"
  for v in $(kafka_cluster_nodes); do voters+="${voters:+,}$v@127.0.0.1:$(kc_controller_port "$v")"; done
  cat >"$d/server.properties" <<EOP
# Written by scripts/stack: node $n of a three-node KRaft cluster, broker and controller.
process.roles=broker,controller
node.id=$n
controller.quorum.voters=$voters
listeners=PLAINTEXT://127.0.0.1:$(kc_port "$n"),CONTROLLER://127.0.0.1:$(kc_controller_port "$n")
advertised.listeners=PLAINTEXT://127.0.0.1:$(kc_port "$n")
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$d/data
num.partitions=4
auto.create.topics.enable=true
# Every topic (the click and dead-letter topics included) on all three brokers, and an
# acks=all write durable on two of them: one broker may die without losing a record.
default.replication.factor=3
min.insync.replicas=2
unclean.leader.election.enable=false
offsets.topic.replication.factor=3
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
group.initial.rebalance.delay.ms=0
log.retention.hours=-1
log.segment.bytes=268435456
EOP
  cat >"$d/log4j2.xml" <<EOP
<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="WARN">
  <Appenders>
    <File name="server" fileName="$d/logs/server.log">
      <PatternLayout pattern="[%d] %p %m (%c)%n"/>
    </File>
  </Appenders>
  <Loggers>
    <Root level="INFO"><AppenderRef ref="server"/></Root>
    <Logger name="kafka.request.logger" level="WARN"/>
    <Logger name="org.apache.kafka.controller" level="WARN"/>
    <Logger name="state.change.logger" level="WARN"/>
  </Loggers>
</Configuration>
EOP
}

# kafka_cluster_format N: format node N's log directory with the cluster's one id (made
# once, kept in $kc_dir/cluster.id), so a node whose data was deleted rejoins the cluster.
kafka_cluster_format() {
  local n=$1 d="$kc_dir/node$1"
  [ -f "$d/data/meta.properties" ] && return 0
  java -Dlog4j2.configurationFile="$repo/scripts/kafka/log4j2-tools.xml" -cp "$kafka_libs/*" \
    kafka.tools.StorageTool format -t "$(cat "$kc_dir/cluster.id")" -c "$d/server.properties" \
    >>"$d/logs/format.log" 2>&1 || die "kafka-cluster:$n: formatting the KRaft log failed, see $d/logs/format.log"
}

kafka_cluster_up() {
  kafka_install
  local n pid d started=() offsets=()
  for n in $(node_list kafka-cluster 3 "${1:-}"); do
    d="$kc_dir/node$n"
    if pid=$(own_pid "$(kafka_cluster_pidfile "$n")" "$(kafka_cluster_match "$n")") && port_open "$(kc_port "$n")"; then
      log "kafka-cluster:$n: already running (pid $pid, 127.0.0.1:$(kc_port "$n"))"
      continue
    fi
    [ -n "$pid" ] && die "kafka-cluster:$n: pid $pid runs but does not listen on $(kc_port "$n"); stop it with: scripts/stack down kafka-cluster:$n"
    for port in "$(kc_port "$n")" "$(kc_controller_port "$n")"; do
      port_open "$port" && die "kafka-cluster:$n: port $port is taken by a process this script did not start; set KAFKA_CLUSTER_PORT and KAFKA_CLUSTER_CONTROLLER_PORT"
    done
    kafka_cluster_config "$n"
    started+=("$n")
  done
  [ ${#started[@]} -gt 0 ] || return 0
  if [ ! -s "$kc_dir/cluster.id" ]; then
    java -cp "$kafka_libs/*" kafka.tools.StorageTool random-uuid >"$kc_dir/cluster.id" 2>"$kc_dir/random-uuid.log" \
      || die "kafka-cluster: could not generate a cluster id, see $kc_dir/random-uuid.log"
  fi
  local jobs=()
  for n in "${started[@]}"; do kafka_cluster_format "$n" & jobs+=($!); done
  for pid in "${jobs[@]}"; do wait "$pid" || exit 1; done
  # All at once: a broker reports started only once a quorum of controllers (two of
  # the three nodes) elected a leader, so one node alone never gets there.
  for n in "${started[@]}"; do
    d="$kc_dir/node$n"
    offsets[$n]=$(log_size "$d/logs/server.log")
    log "kafka-cluster:$n: starting on 127.0.0.1:$(kc_port "$n") (controller $(kc_controller_port "$n"))"
    nohup setsid java -Xms"$KAFKA_CLUSTER_HEAP" -Xmx"$KAFKA_CLUSTER_HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
      -Djava.awt.headless=true -Dlog4j2.configurationFile="$d/log4j2.xml" -Dkafka.logs.dir="$d/logs" \
      -cp "$kafka_libs/*" kafka.Kafka "$d/server.properties" >>"$d/logs/stdout.log" 2>&1 </dev/null &
    echo $! >"$(kafka_cluster_pidfile "$n")"
  done
  for n in "${started[@]}"; do
    d="$kc_dir/node$n"
    pid=$(read_pid "$(kafka_cluster_pidfile "$n")")
    if ! wait_ready 180 "$pid" kc_started "$n" "${offsets[$n]}"; then
      tail -n 30 "$d/logs/stdout.log" "$d/logs/server.log" 2>/dev/null >&2 || true
      die "kafka-cluster:$n: exited or not ready within 180 s (logs in $d/logs; a node needs one more running to form a quorum)"
    fi
    log "kafka-cluster:$n: ready (pid $pid)"
  done
}

kafka_cluster_down() {
  local n specs=()
  for n in $(node_list kafka-cluster 3 "${1:-}"); do
    specs+=("kafka-cluster:$n|$(kafka_cluster_pidfile "$n")|$(kafka_cluster_match "$n")")
  done
  # A broker's controlled shutdown waits for the controller quorum (two of the three
  # nodes) to move its partition leaders away. With the whole cluster stopping, the last
  # node has no quorum left and would wait for minutes: it gets SIGKILL instead (what it
  # wrote is in the page cache; its next start recovers the log).
  STOP_HOPELESS=kc_no_quorum stop_pids TERM "${specs[@]}"
}

kc_no_quorum() {
  local n running=0
  for n in $(kafka_cluster_nodes); do
    own_pid "$(kafka_cluster_pidfile "$n")" "$(kafka_cluster_match "$n")" >/dev/null && running=$((running + 1))
  done
  [ $running -lt 2 ]
}

kafka_cluster_status() {
  local n pid rc=0
  for n in $(node_list kafka-cluster 3 "${1:-}"); do
    if pid=$(own_pid "$(kafka_cluster_pidfile "$n")" "$(kafka_cluster_match "$n")") && port_open "$(kc_port "$n")"; then
      printf '%-21s up    pid %s  127.0.0.1:%s  node.id %s\n' "kafka-cluster:$n" "$pid" "$(kc_port "$n")" "$n"
    else
      printf '%-21s down  127.0.0.1:%s  node.id %s\n' "kafka-cluster:$n" "$(kc_port "$n")" "$n"; rc=1
    fi
  done
  return $rc
}

# --- Redis Cluster (six nodes: three masters, three replicas) -------------------------

REDIS_CLUSTER_PORT=${REDIS_CLUSTER_PORT:-7001}
REDIS_CLUSTER_BUS_PORT=${REDIS_CLUSTER_BUS_PORT:-17001}
REDIS_CLUSTER_NODE_TIMEOUT=${REDIS_CLUSTER_NODE_TIMEOUT:-5000}
CLUSTER_SERVICES+=(redis-cluster)
rc_dir="$STACK_DIR/redis-cluster"
redis_cluster_nodes() { echo 1 2 3 4 5 6; }
redis_cluster_pidfile() { echo "$rc_dir/node$1/redis.pid"; }
redis_cluster_datadir() { echo "$rc_dir"; }
redis_cluster_check() {
  local n
  for n in $(redis_cluster_nodes); do
    port_of REDIS_CLUSTER_PORT "$n" >/dev/null; port_of REDIS_CLUSTER_BUS_PORT "$n" >/dev/null
  done
}
redis_cluster_env() {
  local n list=""
  for n in $(redis_cluster_nodes); do list+="${list:+,}redis://127.0.0.1:$(rc_port "$n")/"; done
  echo "# Redis Cluster: all six nodes (3 masters, 3 replicas); a cluster client needs one or more"
  echo "export CLICKAGG_STACK_REDIS_CLUSTER_NODES=$list"
}
# redis-server names itself "redis-server 127.0.0.1:PORT [cluster]" in its command line.
redis_cluster_match() { echo "127.0.0.1:$(rc_port "$1")"; }
rc_port() { port_of REDIS_CLUSTER_PORT "$1"; }
rc_bus_port() { port_of REDIS_CLUSTER_BUS_PORT "$1"; }
rc_cli() { local n=$1; shift; redis-cli -h 127.0.0.1 -p "$(rc_port "$n")" "$@" 2>/dev/null | tr -d '\r'; }
rc_info() { rc_cli "$1" cluster info | sed -n "s/^$2://p"; }
rc_pong() { [ "$(rc_cli "$1" ping)" = PONG ]; }
rc_running() { own_pid "$(redis_cluster_pidfile "$1")" "$(redis_cluster_match "$1")" >/dev/null; }
rc_lone() { [ "$(rc_info "$1" cluster_known_nodes)" = 1 ] && [ "$(rc_info "$1" cluster_slots_assigned)" = 0 ]; }

# rc_role N: "master of slots ..." or "replica of 127.0.0.1:PORT", as node N says.
rc_role() {
  rc_cli "$1" cluster nodes | awk '
    { addr[$1] = $2; sub(/@.*/, "", addr[$1]) }
    $3 ~ /myself/ { flags = $3; master = $4; slots = ""; for (i = 9; i <= NF; i++) slots = slots (slots ? "," : "") $i }
    END {
      if (flags ~ /master/) print "master of slots " (slots ? slots : "none")
      else if (flags ~ /slave/) print "replica of " addr[master]
      else exit 1
    }'
}

# rc_node_ready N: node N is in the cluster, says cluster_state:ok, another running
# node sees it without a failure flag in the same role, and as a replica its link to the
# master is up (so a test may kill that master right away and see this one promoted).
rc_node_ready() {
  local n=$1 id me peer view
  [ "$(rc_info "$n" cluster_state)" = ok ] || return 1
  id=$(rc_cli "$n" cluster myid) && [ -n "$id" ] || return 1
  me=$(rc_cli "$n" cluster nodes | awk '$3 ~ /myself/ {sub(/myself,/, "", $3); print $3, $4}')
  for peer in $(redis_cluster_nodes); do
    [ "$peer" != "$n" ] && rc_running "$peer" || continue
    view=$(rc_cli "$peer" cluster nodes | awk -v id="$id" '$1 == id {print $3, $4}')
    [ "$view" = "$me" ] || return 1
    break
  done
  case $me in
    slave*) rc_cli "$n" info replication | grep -q '^master_link_status:up' ;;
  esac
}

redis_cluster_start() {
  local n=$1 d="$rc_dir/node$1" port; port=$(rc_port "$1")
  port_open "$port" && die "redis-cluster:$n: port $port is taken by a process this script did not start; set REDIS_CLUSTER_PORT"
  port_open "$(rc_bus_port "$n")" && die "redis-cluster:$n: cluster bus port $(rc_bus_port "$n") is taken by a process this script did not start; set REDIS_CLUSTER_BUS_PORT"
  mkdir -p "$d"
  log "redis-cluster:$n: starting on 127.0.0.1:$port"
  # appendonly + noeviction as in the single-node stack: a dedup key must not vanish.
  # A replica-validity factor of 0 lets any replica take over from a killed master,
  # however long the master had been quiet.
  redis-server --bind 127.0.0.1 --port "$port" --dir "$d" \
    --cluster-enabled yes --cluster-config-file nodes.conf --cluster-port "$(rc_bus_port "$n")" \
    --cluster-node-timeout "$REDIS_CLUSTER_NODE_TIMEOUT" --cluster-replica-validity-factor 0 \
    --appendonly yes --appendfsync everysec --maxmemory-policy noeviction --save "" \
    --daemonize yes --pidfile "$d/redis.pid" --logfile "$d/redis.log" \
    || die "redis-cluster:$n: redis-server failed to start, see $d/redis.log"
}

redis_cluster_up() {
  command -v redis-server >/dev/null || apt_install redis-server
  local version; version=$(redis-server --version | sed -E 's/.*v=([0-9]+)\..*/\1/')
  [ "$version" -ge 7 ] || die "redis: redis-server $version found, clickagg needs >= 7.0 (SET ... NX GET)"
  local n pid nodes; nodes=$(node_list redis-cluster 6 "${1:-}")
  for n in $nodes; do
    if pid=$(own_pid "$(redis_cluster_pidfile "$n")" "$(redis_cluster_match "$n")"); then
      log "redis-cluster:$n: already running (pid $pid, 127.0.0.1:$(rc_port "$n"))"
    else
      redis_cluster_start "$n"
    fi
  done
  for n in $nodes; do
    wait_until 20 "redis-cluster:$n" rc_pong "$n" \
      || die "redis-cluster:$n: no answer within 20 s (log: $rc_dir/node$n/redis.log)"
  done
  redis_cluster_form
  for n in $nodes; do
    if ! wait_until 60 "redis-cluster:$n ready" rc_node_ready "$n"; then
      rc_cli "$n" cluster info >&2 || true
      die "redis-cluster:$n: not ready within 60 s (log: $rc_dir/node$n/redis.log)"
    fi
    log "redis-cluster:$n: ready (pid $(read_pid "$(redis_cluster_pidfile "$n")"), $(rc_role "$n"))"
  done
}

# redis_cluster_form: create the cluster when none of the six nodes knows another one;
# when a cluster exists, add each node that knows no other (its data was deleted) back
# as a replica. A node that was in the cluster finds it again by itself (nodes.conf).
redis_cluster_form() {
  local n seed="" all_lone=1 lone=() addrs=()
  for n in $(redis_cluster_nodes); do
    addrs+=("127.0.0.1:$(rc_port "$n")")
    if ! rc_running "$n"; then all_lone=0; continue; fi
    if rc_lone "$n"; then lone+=("$n")
    else all_lone=0; [ "$(rc_info "$n" cluster_state)" = ok ] && seed=${seed:-$n}; fi
  done
  [ ${#lone[@]} -gt 0 ] || return 0
  if [ $all_lone = 1 ]; then
    log "redis-cluster: creating the cluster (3 masters, 3 replicas)"
    redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes >"$rc_dir/create.log" 2>&1 \
      || die "redis-cluster: redis-cli --cluster create failed, see $rc_dir/create.log"
    return 0
  fi
  [ -n "$seed" ] || die "redis-cluster: nodes ${lone[*]} are not in the cluster and no node says cluster_state:ok to add them to; scripts/stack wipe redis-cluster starts afresh"
  for n in "${lone[@]}"; do
    log "redis-cluster:$n: knows no other node, adding it as a replica"
    redis-cli --cluster add-node "127.0.0.1:$(rc_port "$n")" "127.0.0.1:$(rc_port "$seed")" --cluster-slave \
      >>"$rc_dir/add-node.log" 2>&1 || die "redis-cluster:$n: redis-cli --cluster add-node failed, see $rc_dir/add-node.log"
  done
  # The node's former self (another id, its address now unknown) would stay listed as a
  # failed member: every node forgets it.
  local ghost m
  for ghost in $(rc_cli "$seed" cluster nodes | awk '$3 ~ /noaddr/ && $3 !~ /myself/ {print $1}'); do
    log "redis-cluster: forgetting the departed node id $ghost"
    for m in $(redis_cluster_nodes); do
      rc_running "$m" && [ "$(rc_cli "$m" cluster myid)" != "$ghost" ] && rc_cli "$m" cluster forget "$ghost" >/dev/null
    done
  done
}

redis_cluster_down() {
  local n specs=()
  for n in $(node_list redis-cluster 6 "${1:-}"); do
    specs+=("redis-cluster:$n|$(redis_cluster_pidfile "$n")|$(redis_cluster_match "$n")")
  done
  stop_pids TERM "${specs[@]}"
}

redis_cluster_status() {
  local n pid rc=0
  for n in $(node_list redis-cluster 6 "${1:-}"); do
    if pid=$(own_pid "$(redis_cluster_pidfile "$n")" "$(redis_cluster_match "$n")") \
        && rc_pong "$n"; then
      printf '%-21s up    pid %s  127.0.0.1:%s  cluster_state:%s  %s\n' "redis-cluster:$n" "$pid" \
        "$(rc_port "$n")" "$(rc_info "$n" cluster_state)" "$(rc_role "$n" || echo 'role unknown')"
    else
      printf '%-21s down  127.0.0.1:%s\n' "redis-cluster:$n" "$(rc_port "$n")"; rc=1
    fi
  done
  return $rc
}

# --- ClickHouse cluster (2 shards x 2 replicas, replicated through ZooKeeper) ---------

CLICKHOUSE_CLUSTER_HTTP_PORT=${CLICKHOUSE_CLUSTER_HTTP_PORT:-18123}
CLICKHOUSE_CLUSTER_TCP_PORT=${CLICKHOUSE_CLUSTER_TCP_PORT:-19000}
CLICKHOUSE_CLUSTER_INTERSERVER_PORT=${CLICKHOUSE_CLUSTER_INTERSERVER_PORT:-19009}
CLICKHOUSE_CLUSTER_NAME=clickagg_cluster
CLUSTER_SERVICES+=(clickhouse-cluster)
cc_dir="$STACK_DIR/clickhouse-cluster"
clickhouse_cluster_nodes() { echo 1 2 3 4; }
clickhouse_cluster_pidfile() { echo "$cc_dir/node$1/clickhouse.pid"; }
clickhouse_cluster_match() { echo "$cc_dir/node$1/config.xml"; }
clickhouse_cluster_datadir() { echo "$cc_dir"; }
# The replicated tables live in ZooKeeper as much as on the nodes: wiping one without
# the other leaves replicas that exist in one place only, so both go.
clickhouse_cluster_wipe() {
  clickhouse_cluster_down
  zookeeper_down
  rm -rf "$cc_dir" "$zk_dir"
  log "clickhouse-cluster: wiped, and zookeeper with it"
}
clickhouse_cluster_check() {
  local n
  for n in $(clickhouse_cluster_nodes); do
    port_of CLICKHOUSE_CLUSTER_HTTP_PORT "$n" >/dev/null; port_of CLICKHOUSE_CLUSTER_TCP_PORT "$n" >/dev/null
    port_of CLICKHOUSE_CLUSTER_INTERSERVER_PORT "$n" >/dev/null
  done
}
clickhouse_cluster_env() {
  local n list=""
  for n in $(clickhouse_cluster_nodes); do list+="${list:+,}http://127.0.0.1:$(cc_http "$n")"; done
  echo "# ClickHouse: cluster $CLICKHOUSE_CLUSTER_NAME, 2 shards x 2 replicas (nodes 1+2, 3+4), through ZooKeeper"
  echo "export CLICKAGG__CLICKHOUSE__URL=http://127.0.0.1:$(cc_http 1)"
  echo "export CLICKAGG_STACK_CLICKHOUSE_CLUSTER=$CLICKHOUSE_CLUSTER_NAME"
  echo "export CLICKAGG_STACK_CLICKHOUSE_CLUSTER_URLS=$list"
}
cc_http() { port_of CLICKHOUSE_CLUSTER_HTTP_PORT "$1"; }
cc_tcp() { port_of CLICKHOUSE_CLUSTER_TCP_PORT "$1"; }
cc_interserver() { port_of CLICKHOUSE_CLUSTER_INTERSERVER_PORT "$1"; }
# Nodes 1 and 2 hold shard 1, nodes 3 and 4 shard 2; the replica name is the node's.
cc_shard() { echo $((($1 + 1) / 2)); }
cc_replica() { echo "node$1"; }

# http_get PORT PATH / http_post PORT PATH BODY: the body of a plain HTTP/1.0 exchange
# with 127.0.0.1:PORT, failing unless the status is 200 (bash only, no curl needed).
http_exchange() {
  local port=$1 request=$2 response
  response=$(tcp_ask 60 "$port" "$request") || return 1
  [[ ${response%%$'\r'*} == *" 200 "* ]] || { printf '%s\n' "${response#*$'\r\n\r\n'}" >&2; return 1; }
  printf '%s' "${response#*$'\r\n\r\n'}"
}
http_get() { http_exchange "$1" "GET $2 HTTP/1.0"$'\r\n\r\n'; }
http_post() {
  local body=$3
  http_exchange "$1" "POST $2 HTTP/1.0"$'\r\n'"Content-Length: $(printf '%s' "$body" | wc -c)"$'\r\n\r\n'"$body"
}

cc_ping() { [ "$(http_get "$(cc_http "$1")" /ping 2>/dev/null)" = "Ok." ]; }
# cc_query N SQL: run SQL on node N over HTTP and print the result (TabSeparated).
cc_query() { http_post "$(cc_http "$1")" / "$2"; }
cc_zookeeper_ok() { [ "$(cc_query "$1" "SELECT count() > 0 FROM system.zookeeper WHERE path = '/'" 2>/dev/null)" = 1 ]; }
# cc_replicas_synced N: every replicated table of node N replicates and has caught up.
# After a SIGKILL that takes a while: the killed process's ZooKeeper session (and with
# it the replica's is_active node) lives until the session timeout, and until then the
# restarted replica is refused ("appears to be already active"). It does not say so in
# is_readonly; absolute_delay does: it is the current time until the replica has read
# the replication log once, then 0 when nothing is left to fetch.
cc_replicas_synced() {
  [ "$(cc_query "$1" "SELECT count() FROM system.replicas
      WHERE is_readonly OR is_session_expired OR queue_size > 0 OR absolute_delay > 0" 2>/dev/null)" = 0 ]
}

# clickhouse_cluster_users: the users.xml all nodes read, written before any starts and
# replaced in one rename: a running node rereads it whenever it changes.
clickhouse_cluster_users() {
  mkdir -p "$cc_dir"
  cat >"$cc_dir/users.xml.new" <<EOF
<?xml version="1.0"?>
<!-- Written by scripts/stack: the users of the single-node stack, on every node. -->
<yandex>
  <profiles>
    <default>
      <max_memory_usage>2000000000</max_memory_usage>
      <load_balancing>random</load_balancing>
    </default>
  </profiles>
  <users>
    <default>
      <password></password>
      <networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
      <profile>default</profile>
      <quota>default</quota>
    </default>
    <clickagg>
      <password>clickagg-local-password</password>
      <networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
      <profile>default</profile>
      <quota>default</quota>
    </clickagg>
  </users>
  <quotas><default><interval><duration>3600</duration><queries>0</queries><errors>0</errors><result_rows>0</result_rows><read_rows>0</read_rows><execution_time>0</execution_time></interval></default></quotas>
</yandex>
EOF
  if cmp -s "$cc_dir/users.xml.new" "$cc_dir/users.xml"; then rm -f "$cc_dir/users.xml.new"
  else mv -f "$cc_dir/users.xml.new" "$cc_dir/users.xml"; fi
}

# cc_start N BIN: starts node N in the background and records its PID, and how far its
# error log went before, so a refusal is read from this start's lines only.
declare -A cc_err_size=() cc_started_at=()
cc_start() {
  local n=$1 bin=$2
  cc_err_size[$n]=$(log_size "$cc_dir/node$n/logs/clickhouse-server.err.log")
  cc_started_at[$n]=$SECONDS
  # shellcheck disable=SC2086
  nohup setsid $bin --config-file="$cc_dir/node$n/config.xml" >>"$cc_dir/node$n/logs/stdout.log" 2>&1 </dev/null &
  echo $! >"$(clickhouse_cluster_pidfile "$n")"
}

# cc_wait_started N: node N answers /ping within 120 s, or has exited (status 1).
cc_wait_started() {
  wait_ready 120 "$(read_pid "$(clickhouse_cluster_pidfile "$1")")" cc_ping "$1"
}

# cc_exited N: node N's process is gone. cc_errors_since_start N: its error log since
# the last cc_start.
cc_exited() { ! own_pid "$(clickhouse_cluster_pidfile "$1")" "$(clickhouse_cluster_match "$1")" >/dev/null; }
cc_errors_since_start() { tail -c +"$((${cc_err_size[$1]:-0} + 1))" "$cc_dir/node$1/logs/clickhouse-server.err.log" 2>/dev/null; }

cc_start_failed() {
  local n=$1 how="did not answer within 120 s"
  cc_exited "$n" && how="exited after $((SECONDS - ${cc_started_at[$n]:-$SECONDS})) s"
  { tail -n 30 "$cc_dir/node$n/logs/stdout.log"; cc_errors_since_start "$n" | tail -n 30; } >&2 2>/dev/null || true
  die "clickhouse-cluster:$n: $how (logs in $cc_dir/node$n/logs)"
}

clickhouse_cluster_config() {
  local n=$1 d="$cc_dir/node$1" shards="" s r
  mkdir -p "$d/data" "$d/tmp" "$d/user_files" "$d/format_schemas" "$d/logs"
  for s in 1 2; do
    shards+="
      <shard>
        <internal_replication>true</internal_replication>"
    for r in $((2 * s - 1)) $((2 * s)); do
      shards+="
        <replica><host>127.0.0.1</host><port>$(cc_tcp "$r")</port></replica>"
    done
    shards+="
      </shard>"
  done
  cat >"$d/config.xml" <<EOF
<?xml version="1.0"?>
<!-- Written by scripts/stack: node $n of $CLICKHOUSE_CLUSTER_NAME, shard $(cc_shard "$n"), replica $(cc_replica "$n"). -->
<yandex>
  <logger>
    <level>information</level>
    <log>$d/logs/clickhouse-server.log</log>
    <errorlog>$d/logs/clickhouse-server.err.log</errorlog>
    <size>100M</size>
    <count>3</count>
  </logger>
  <listen_host>127.0.0.1</listen_host>
  <http_port>$(cc_http "$n")</http_port>
  <tcp_port>$(cc_tcp "$n")</tcp_port>
  <!-- Replicas fetch parts from each other here; without a host they would announce
       the machine's hostname. -->
  <interserver_http_port>$(cc_interserver "$n")</interserver_http_port>
  <interserver_http_host>127.0.0.1</interserver_http_host>
  <max_connections>1024</max_connections>
  <keep_alive_timeout>3</keep_alive_timeout>
  <max_concurrent_queries>100</max_concurrent_queries>
  <uncompressed_cache_size>268435456</uncompressed_cache_size>
  <mark_cache_size>268435456</mark_cache_size>
  <path>$d/data/</path>
  <tmp_path>$d/tmp/</tmp_path>
  <user_files_path>$d/user_files/</user_files_path>
  <format_schema_path>$d/format_schemas/</format_schema_path>
  <users_config>$cc_dir/users.xml</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
  <timezone>UTC</timezone>
  <mlock_executable>false</mlock_executable>
  <builtin_dictionaries_reload_interval>3600</builtin_dictionaries_reload_interval>
  <max_session_timeout>3600</max_session_timeout>
  <default_session_timeout>60</default_session_timeout>
  <remote_servers>
    <$CLICKHOUSE_CLUSTER_NAME>$shards
    </$CLICKHOUSE_CLUSTER_NAME>
  </remote_servers>
  <zookeeper>
    <node><host>127.0.0.1</host><port>$ZOOKEEPER_PORT</port></node>
    <!-- Short, so a replica killed with SIGKILL and restarted is let back in soon (its
         old session must expire first); long enough to ride out a ZooKeeper restart. -->
    <session_timeout_ms>10000</session_timeout_ms>
  </zookeeper>
  <macros>
    <cluster>$CLICKHOUSE_CLUSTER_NAME</cluster>
    <shard>$(cc_shard "$n")</shard>
    <replica>$(cc_replica "$n")</replica>
  </macros>
  <!-- CREATE/DROP/ALTER ... ON CLUSTER: the queue every node reads its share from. -->
  <distributed_ddl><path>/clickhouse/task_queue/ddl</path></distributed_ddl>
</yandex>
EOF
}

clickhouse_cluster_up() {
  local node=${1:-} n pid bin started=()
  # The whole cluster needs its ZooKeeper; a single node started again is left to the
  # caller, who may have stopped ZooKeeper on purpose.
  [ -n "$node" ] || zookeeper_up
  clickhouse_cluster_users
  for n in $(node_list clickhouse-cluster 4 "$node"); do
    if pid=$(own_pid "$(clickhouse_cluster_pidfile "$n")" "$(clickhouse_cluster_match "$n")") && cc_ping "$n"; then
      log "clickhouse-cluster:$n: already running (pid $pid, http://127.0.0.1:$(cc_http "$n"))"
      continue
    fi
    if [ -z "$pid" ]; then
      for port in "$(cc_http "$n")" "$(cc_tcp "$n")" "$(cc_interserver "$n")"; do
        port_open "$port" && die "clickhouse-cluster:$n: port $port is taken by a process this script did not start; set CLICKHOUSE_CLUSTER_HTTP_PORT, CLICKHOUSE_CLUSTER_TCP_PORT and CLICKHOUSE_CLUSTER_INTERSERVER_PORT"
      done
      bin=$(clickhouse_server_bin)
      if [ -z "$bin" ]; then apt_install clickhouse-server clickhouse-client; bin=$(clickhouse_server_bin); fi
      [ -n "$bin" ] || die "clickhouse: no clickhouse-server binary after installing"
      clickhouse_cluster_config "$n"
      log "clickhouse-cluster:$n: starting on http://127.0.0.1:$(cc_http "$n") (tcp $(cc_tcp "$n"), shard $(cc_shard "$n"), replica $(cc_replica "$n"))"
      cc_start "$n" "$bin"
    fi
    started+=("$n")
  done
  for n in "${started[@]}"; do
    if ! cc_wait_started "$n"; then
      # A node killed with -9 in the middle of an insert or a merge can leave local parts
      # ZooKeeper never heard of. Old servers then refuse to start when a small table
      # looks too different ("doesn't look like the set of parts in ZooKeeper"); the
      # documented remedy is one start with flags/force_restore_data, which sets the
      # unknown parts aside and fetches what is missing from the other replica.
      if cc_exited "$n" && cc_errors_since_start "$n" | grep -q "doesn't look like the set of parts in ZooKeeper"; then
        log "clickhouse-cluster:$n: refused to start: its local parts differ from ZooKeeper's after an unclean stop; starting once more with flags/force_restore_data"
        mkdir -p "$cc_dir/node$n/data/flags"
        touch "$cc_dir/node$n/data/flags/force_restore_data"
        cc_start "$n" "$(clickhouse_server_bin)"
        cc_wait_started "$n" || cc_start_failed "$n"
      else
        cc_start_failed "$n"
      fi
    fi
    if [ -z "$node" ] && ! wait_until 30 "clickhouse-cluster:$n zookeeper" cc_zookeeper_ok "$n"; then
      die "clickhouse-cluster:$n: cannot reach ZooKeeper on 127.0.0.1:$ZOOKEEPER_PORT (logs in $cc_dir/node$n/logs)"
    fi
    # Replicas caught up, unless ZooKeeper is down (a test may have stopped it).
    if zk_serving && ! wait_until 90 "clickhouse-cluster:$n replicas" cc_replicas_synced "$n"; then
      cc_query "$n" "SELECT database, table, is_readonly, is_session_expired, queue_size FROM system.replicas" >&2 || true
      die "clickhouse-cluster:$n: replicated tables not caught up within 90 s (logs in $cc_dir/node$n/logs)"
    fi
    log "clickhouse-cluster:$n: ready (pid $(read_pid "$(clickhouse_cluster_pidfile "$n")"))"
  done
}

clickhouse_cluster_down() {
  local n specs=()
  for n in $(node_list clickhouse-cluster 4 "${1:-}"); do
    specs+=("clickhouse-cluster:$n|$(clickhouse_cluster_pidfile "$n")|$(clickhouse_cluster_match "$n")")
  done
  stop_pids TERM "${specs[@]}"
}

clickhouse_cluster_status() {
  local n pid rc=0
  for n in $(node_list clickhouse-cluster 4 "${1:-}"); do
    if pid=$(own_pid "$(clickhouse_cluster_pidfile "$n")" "$(clickhouse_cluster_match "$n")") && cc_ping "$n"; then
      printf '%-21s up    pid %s  http://127.0.0.1:%s  tcp %s  shard %s replica %s\n' "clickhouse-cluster:$n" \
        "$pid" "$(cc_http "$n")" "$(cc_tcp "$n")" "$(cc_shard "$n")" "$(cc_replica "$n")"
    else
      printf '%-21s down  http://127.0.0.1:%s\n' "clickhouse-cluster:$n" "$(cc_http "$n")"; rc=1
    fi
  done
  return $rc
}
