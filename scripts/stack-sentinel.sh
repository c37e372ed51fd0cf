# shellcheck shell=bash
# scripts/stack-sentinel.sh — the opt-in Redis Sentinel deployment of the local stack,
# sourced by scripts/stack after scripts/stack-cluster.sh (not a command of its own; it
# uses the helpers of both). Started only when named, and not by "cluster":
#
#   redis-sentinel      five redis-server processes on 127.0.0.1:
#     redis-sentinel:1  data node, the first master        (REDIS_SENTINEL_DATA_PORT)
#     redis-sentinel:2  data node, the first replica       (REDIS_SENTINEL_DATA_PORT + 1)
#     redis-sentinel:3..5  sentinels watching master "clickagg", quorum 2
#                                                          (REDIS_SENTINEL_PORT + 0..2)
#
# Either data node may be the master: after a failover it is the other one. Ask a
# sentinel which (SENTINEL get-master-addr-by-name clickagg), or `scripts/stack status
# redis-sentinel`. A test fails it over with `scripts/stack kill redis-sentinel:N` (N the
# master) and brings the node back with `scripts/stack up redis-sentinel:N`: it returns
# as a replica of the new master (started with --replicaof the master the sentinels
# name). A master stopped with `down` or `restart` fails over the same way once it has
# been gone for down-after-milliseconds (a restart takes about 2 s); it then starts as
# a master the sentinels no longer want, and `up` waits (some 20 s) until they have made
# it a replica. `up` returns when the deployment is ready to fail over: the replica's
# link is up, every running sentinel sees the master in good health and the replica,
# and reaches the other sentinels. Port settings take a base port or a comma-separated
# list, like the cluster services.
#
# Every node keeps its config file in its data directory (nodeN/redis.conf, or
# nodeN/sentinel.conf for a sentinel), written on the node's first start and reused on
# every later one: Sentinel rewrites them (the sentinels' state, a data node's
# replicaof after a failover). `wipe redis-sentinel` starts afresh.

REDIS_SENTINEL_DATA_PORT=${REDIS_SENTINEL_DATA_PORT:-6480}
REDIS_SENTINEL_PORT=${REDIS_SENTINEL_PORT:-26379}
REDIS_SENTINEL_DOWN_AFTER=${REDIS_SENTINEL_DOWN_AFTER:-2000}
REDIS_SENTINEL_FAILOVER_TIMEOUT=${REDIS_SENTINEL_FAILOVER_TIMEOUT:-10000}
REDIS_SENTINEL_MASTER=clickagg
REDIS_SENTINEL_QUORUM=2

# Services started only when named, and not by "cluster" (scripts/stack's services()).
EXTRA_SERVICES+=(redis-sentinel)
# Absolute: redis-server changes into its `dir` before it writes its PID file, and
# Sentinel keeps the path of its config file.
rs_dir=$(realpath -m "$STACK_DIR/redis-sentinel")
redis_sentinel_nodes() { echo 1 2 3 4 5; }
redis_sentinel_pidfile() { echo "$rs_dir/node$1/redis.pid"; }
# redis-server names itself "redis-server 127.0.0.1:PORT" ("... [sentinel]") in its
# command line.
redis_sentinel_match() { echo "127.0.0.1:$(rs_port "$1")"; }
redis_sentinel_datadir() { echo "$rs_dir"; }
redis_sentinel_check() {
  local n
  for n in $(redis_sentinel_nodes); do rs_port "$n" >/dev/null; done
  [[ $REDIS_SENTINEL_DOWN_AFTER =~ ^[0-9]+$ ]] || die "REDIS_SENTINEL_DOWN_AFTER=$REDIS_SENTINEL_DOWN_AFTER is not a number of milliseconds"
  [[ $REDIS_SENTINEL_FAILOVER_TIMEOUT =~ ^[0-9]+$ ]] || die "REDIS_SENTINEL_FAILOVER_TIMEOUT=$REDIS_SENTINEL_FAILOVER_TIMEOUT is not a number of milliseconds"
}
redis_sentinel_env() {
  local n sentinels="" data=""
  for n in 1 2; do data+="${data:+,}redis://127.0.0.1:$(rs_port "$n")/"; done
  for n in 3 4 5; do sentinels+="${sentinels:+,}redis://127.0.0.1:$(rs_port "$n")/"; done
  echo "# Redis Sentinel: three sentinels watching master \"$REDIS_SENTINEL_MASTER\" (quorum $REDIS_SENTINEL_QUORUM),"
  echo "# which is one of the two data nodes (redis-sentinel:1 and :2, in this order) and moves on a failover"
  echo "export CLICKAGG_STACK_REDIS_SENTINELS=$sentinels"
  echo "export CLICKAGG_STACK_REDIS_SENTINEL_MASTER=$REDIS_SENTINEL_MASTER"
  echo "export CLICKAGG_STACK_REDIS_SENTINEL_DATA_NODES=$data"
}

# Nodes 1 and 2 hold the data, nodes 3 to 5 are the sentinels.
rs_is_data() { [ "$1" -le 2 ]; }
rs_port() {
  if rs_is_data "$1"; then port_of REDIS_SENTINEL_DATA_PORT "$1"
  else port_of REDIS_SENTINEL_PORT $(($1 - 2)); fi
}
rs_cli() { local n=$1; shift; timeout 10 redis-cli -h 127.0.0.1 -p "$(rs_port "$n")" "$@" 2>/dev/null | tr -d '\r'; }
rs_pong() { [ "$(rs_cli "$1" ping)" = PONG ]; }
rs_running() { own_pid "$(redis_sentinel_pidfile "$1")" "$(redis_sentinel_match "$1")" >/dev/null; }
# rs_info N FIELD: a field of data node N's INFO replication (role, master_link_status...).
rs_info() { rs_cli "$1" info replication | sed -n "s/^$2://p"; }
# rs_fields: a flat RESP map as redis-cli prints it (a key line, a value line, ...) as
# "key=value" lines; a new "name" key starts the next record (SENTINEL replicas).
rs_fields() { awk 'NR % 2 { key = $0; next } { print key "=" $0 }'; }
rs_field() { rs_fields | sed -n "s/^$1=//p" | head -n 1; }

# rs_sentinel_master S: the master's address (127.0.0.1:PORT) that sentinel S names.
rs_sentinel_master() {
  local answer
  answer=$(rs_cli "$1" sentinel get-master-addr-by-name "$REDIS_SENTINEL_MASTER") || return 1
  [ "$(wc -l <<<"$answer")" = 2 ] || return 1
  echo "$(head -n 1 <<<"$answer"):$(tail -n 1 <<<"$answer")"
}

# rs_master_addr: the master as the first running sentinel that answers names it.
rs_master_addr() {
  local s
  for s in 3 4 5; do
    rs_running "$s" && rs_sentinel_master "$s" && return 0
  done
  return 1
}

# rs_sentinel_master_ok S ADDR: sentinel S names ADDR the master, in good health: no
# s_down, o_down or failover under way, and a PING answered in the last half of
# down-after-milliseconds (a master restarted in a hurry could otherwise still be
# failed over for the time it was gone).
rs_sentinel_master_ok() {
  local fields
  fields=$(rs_cli "$1" sentinel master "$REDIS_SENTINEL_MASTER") || return 1
  [ "$(rs_field ip <<<"$fields"):$(rs_field port <<<"$fields")" = "$2" ] || return 1
  [ "$(rs_field flags <<<"$fields")" = master ] || return 1
  [ "$(rs_field last-ok-ping-reply <<<"$fields")" -lt $((REDIS_SENTINEL_DOWN_AFTER / 2)) ] 2>/dev/null
}

# rs_sentinel_sees_replica S PORT: sentinel S lists 127.0.0.1:PORT as a replica in good
# health: no s_down or disconnected flag, its link to the master up.
rs_sentinel_sees_replica() {
  rs_cli "$1" sentinel replicas "$REDIS_SENTINEL_MASTER" | rs_fields | awk -F= -v port="$2" '
    $1 == "name" { ok = 0; mine = 0 }
    $1 == "port" && $2 == port { mine = 1 }
    $1 == "flags" && $2 == "slave" { ok++ }
    $1 == "master-link-status" && $2 == "ok" { ok++ }
    mine && ok == 2 { found = 1 }
    END { exit !found }'
}

# rs_data_ready N: data node N answers; as a replica its link to the master is up, as
# the master the other node (if running) is its replica with the link up; every running
# sentinel names the same master in good health, and sees a replica N in good health (a
# test may kill the master right away and see the replica promoted, with all the data).
rs_data_ready() {
  local n=$1 role master s other=$((3 - $1))
  rs_pong "$n" || return 1
  role=$(rs_info "$n" role)
  case $role in
    master)
      master="127.0.0.1:$(rs_port "$n")"
      if rs_running "$other"; then
        [ "$(rs_info "$other" role)" = slave ] && [ "$(rs_info "$other" master_port)" = "$(rs_port "$n")" ] \
          && [ "$(rs_info "$other" master_link_status)" = up ] || return 1
      fi ;;
    slave)
      [ "$(rs_info "$n" master_link_status)" = up ] || return 1
      master="$(rs_info "$n" master_host):$(rs_info "$n" master_port)" ;;
    *) return 1 ;;
  esac
  for s in 3 4 5; do
    rs_running "$s" || continue
    rs_sentinel_master_ok "$s" "$master" || return 1
    [ "$role" = master ] || rs_sentinel_sees_replica "$s" "$(rs_port "$n")" || return 1
  done
}

# rs_sentinel_ready S: sentinel S answers, names a running data node as the master that
# says it is one (in good health, see rs_sentinel_master_ok), sees the other running
# data nodes as healthy replicas, and reaches every running sentinel (CKQUORUM's usable
# count, itself included): then a failover can be authorised as soon as the master goes.
rs_sentinel_ready() {
  local s=$1 master n running=0 usable
  rs_pong "$s" || return 1
  master=$(rs_sentinel_master "$s") && rs_sentinel_master_ok "$s" "$master" || return 1
  for n in 1 2; do
    rs_running "$n" || continue
    if [ "$master" = "127.0.0.1:$(rs_port "$n")" ]; then
      [ "$(rs_info "$n" role)" = master ] || return 1
    else
      rs_sentinel_sees_replica "$s" "$(rs_port "$n")" || return 1
    fi
  done
  for n in 3 4 5; do rs_running "$n" && running=$((running + 1)); done
  usable=$(rs_cli "$s" sentinel ckquorum "$REDIS_SENTINEL_MASTER" | grep -oE '[0-9]+ usable' | cut -d' ' -f1)
  [ -n "$usable" ] && [ "$usable" -ge "$running" ]
}

# rs_role N: what node N is: "master", "replica of 127.0.0.1:PORT, link up", or for a
# sentinel the master it names and what it knows.
rs_role() {
  local n=$1 fields
  if rs_is_data "$n"; then
    case $(rs_info "$n" role) in
      master) echo "master, $(rs_info "$n" connected_slaves) replica(s) connected" ;;
      slave) echo "replica of $(rs_info "$n" master_host):$(rs_info "$n" master_port), link $(rs_info "$n" master_link_status)" ;;
      *) return 1 ;;
    esac
  else
    fields=$(rs_cli "$n" sentinel master "$REDIS_SENTINEL_MASTER")
    [ -n "$fields" ] || return 1
    echo "sentinel: $REDIS_SENTINEL_MASTER at $(rs_field ip <<<"$fields"):$(rs_field port <<<"$fields")" \
      "($(rs_field flags <<<"$fields"), $(rs_field num-slaves <<<"$fields") replica(s)," \
      "$(rs_field num-other-sentinels <<<"$fields") other sentinel(s))"
  fi
}

# rs_config_port FILE: the port a config file was written for.
rs_config_port() { sed -n 's/^port //p' "$1" | head -n 1; }

rs_start_data() {
  local n=$1 d="$rs_dir/node$1" port conf master args=()
  port=$(rs_port "$n"); conf="$d/redis.conf"
  port_open "$port" && die "redis-sentinel:$n: port $port is taken by a process this script did not start; set REDIS_SENTINEL_DATA_PORT"
  mkdir -p "$d"
  if [ ! -f "$conf" ]; then
    # appendonly + noeviction as in the single-node stack: a dedup key must not vanish.
    cat >"$conf" <<EOF
# Written by scripts/stack on the first start of redis-sentinel:$n and reused on every
# later one; Sentinel rewrites it (CONFIG REWRITE) when it makes this node a replica or
# a master. scripts/stack wipe redis-sentinel starts afresh.
bind 127.0.0.1
port $port
dir $d
daemonize yes
pidfile $d/redis.pid
logfile $d/redis.log
appendonly yes
appendfsync everysec
maxmemory-policy noeviction
save ""
repl-diskless-sync-delay 0
EOF
    [ "$n" = 1 ] || echo "replicaof 127.0.0.1 $(rs_port 1)" >>"$conf"
  elif [ "$(rs_config_port "$conf")" != "$port" ]; then
    die "redis-sentinel:$n: $conf is for port $(rs_config_port "$conf"), not $port; scripts/stack wipe redis-sentinel starts afresh with the new ports"
  fi
  # The sentinels' word beats the config file: a master killed and failed over comes
  # back as the new master's replica at once, not as a second master until a sentinel
  # notices (up to 20 s), and a node the sentinels promoted stays the master.
  local role=""
  if master=$(rs_master_addr); then
    if [ "$master" = "127.0.0.1:$port" ]; then args=(--replicaof no one); role=" as the master, as the sentinels say"
    else args=(--replicaof "${master%:*}" "${master##*:}"); role=" as a replica of $master, the sentinels' master"; fi
  fi
  log "redis-sentinel:$n: starting data node on 127.0.0.1:$port$role"
  redis-server "$conf" "${args[@]}" || die "redis-sentinel:$n: redis-server failed to start, see $d/redis.log"
}

rs_start_sentinel() {
  local n=$1 d="$rs_dir/node$1" port conf master m monitored
  port=$(rs_port "$n"); conf="$d/sentinel.conf"
  port_open "$port" && die "redis-sentinel:$n: port $port is taken by a process this script did not start; set REDIS_SENTINEL_PORT"
  mkdir -p "$d"
  if [ ! -f "$conf" ]; then
    # The master: as the other sentinels know it, else the running data node that is
    # one, else node 1.
    if ! master=$(rs_master_addr); then
      master="127.0.0.1:$(rs_port 1)"
      for m in 1 2; do
        if rs_running "$m" && [ "$(rs_info "$m" role)" = master ]; then master="127.0.0.1:$(rs_port "$m")"; break; fi
      done
    fi
    cat >"$conf" <<EOF
# Written by scripts/stack on the first start of redis-sentinel:$n and reused on every
# later one; this sentinel rewrites it (its id, the epochs, the replicas and sentinels
# it knows, the master after a failover). scripts/stack wipe redis-sentinel starts afresh.
bind 127.0.0.1
port $port
dir $d
daemonize yes
pidfile $d/redis.pid
logfile $d/sentinel.log
sentinel monitor $REDIS_SENTINEL_MASTER ${master%:*} ${master##*:} $REDIS_SENTINEL_QUORUM
sentinel down-after-milliseconds $REDIS_SENTINEL_MASTER $REDIS_SENTINEL_DOWN_AFTER
sentinel failover-timeout $REDIS_SENTINEL_MASTER $REDIS_SENTINEL_FAILOVER_TIMEOUT
sentinel parallel-syncs $REDIS_SENTINEL_MASTER 1
EOF
  else
    [ "$(rs_config_port "$conf")" = "$port" ] \
      || die "redis-sentinel:$n: $conf is for port $(rs_config_port "$conf"), not $port; scripts/stack wipe redis-sentinel starts afresh with the new ports"
    monitored=$(awk -v name="$REDIS_SENTINEL_MASTER" '$1 == "sentinel" && $2 == "monitor" && $3 == name { print $5 }' "$conf")
    [ "$monitored" = "$(rs_port 1)" ] || [ "$monitored" = "$(rs_port 2)" ] \
      || die "redis-sentinel:$n: $conf monitors port ${monitored:-none}, no data node of REDIS_SENTINEL_DATA_PORT; scripts/stack wipe redis-sentinel starts afresh"
  fi
  log "redis-sentinel:$n: starting sentinel on 127.0.0.1:$port"
  redis-server "$conf" --sentinel || die "redis-sentinel:$n: redis-server --sentinel failed to start, see $d/sentinel.log"
}

redis_sentinel_up() {
  command -v redis-server >/dev/null || apt_install redis-server
  local version; version=$(redis-server --version | sed -E 's/.*v=([0-9]+)\..*/\1/')
  [ "$version" -ge 7 ] || die "redis: redis-server $version found, clickagg needs >= 7.0 (SET ... NX GET)"
  local n pid nodes logfile ready; nodes=$(node_list redis-sentinel 5 "${1:-}")
  for n in $nodes; do
    if pid=$(own_pid "$(redis_sentinel_pidfile "$n")" "$(redis_sentinel_match "$n")"); then
      log "redis-sentinel:$n: already running (pid $pid, 127.0.0.1:$(rs_port "$n"))"
    elif rs_is_data "$n"; then rs_start_data "$n"
    else rs_start_sentinel "$n"; fi
  done
  for n in $nodes; do
    logfile="$rs_dir/node$n/redis.log"; rs_is_data "$n" || logfile="$rs_dir/node$n/sentinel.log"
    # A data node answers LOADING, not PONG, while it reads its AOF.
    wait_until 60 "redis-sentinel:$n" rs_pong "$n" || die "redis-sentinel:$n: no answer within 60 s (log: $logfile)"
    if rs_is_data "$n"; then
      # The role the sentinels gave it on the command line goes into its config file:
      # started again while no sentinel runs, it is still what they made it.
      rs_cli "$n" config rewrite >/dev/null || true
    else
      # Settings changed since the config file was written apply all the same.
      rs_cli "$n" sentinel set "$REDIS_SENTINEL_MASTER" down-after-milliseconds "$REDIS_SENTINEL_DOWN_AFTER" \
        failover-timeout "$REDIS_SENTINEL_FAILOVER_TIMEOUT" >/dev/null || true
    fi
  done
  for n in $nodes; do
    logfile="$rs_dir/node$n/redis.log"; rs_is_data "$n" || logfile="$rs_dir/node$n/sentinel.log"
    if rs_is_data "$n"; then ready=rs_data_ready; else ready=rs_sentinel_ready; fi
    if ! wait_until 60 "redis-sentinel:$n ready" "$ready" "$n"; then
      redis_sentinel_status >&2 || true
      die "redis-sentinel:$n: not ready within 60 s (log: $logfile)"
    fi
    log "redis-sentinel:$n: ready (pid $(read_pid "$(redis_sentinel_pidfile "$n")"), $(rs_role "$n" || echo 'role unknown'))"
  done
}

# The sentinels stop first: a master stopped while they watch would be failed over.
redis_sentinel_down() {
  local n specs group
  for group in "3 4 5" "1 2"; do
    specs=()
    for n in $group; do
      [ -z "${1:-}" ] || [ "$1" = "$n" ] || continue
      specs+=("redis-sentinel:$n|$(redis_sentinel_pidfile "$n")|$(redis_sentinel_match "$n")")
    done
    [ ${#specs[@]} -eq 0 ] || stop_pids TERM "${specs[@]}"
  done
}

redis_sentinel_status() {
  local n pid rc=0
  for n in $(node_list redis-sentinel 5 "${1:-}"); do
    if pid=$(own_pid "$(redis_sentinel_pidfile "$n")" "$(redis_sentinel_match "$n")") && rs_pong "$n"; then
      printf '%-21s up    pid %s  127.0.0.1:%s  %s\n' "redis-sentinel:$n" "$pid" "$(rs_port "$n")" \
        "$(rs_role "$n" || echo 'role unknown')"
    else
      printf '%-21s down  127.0.0.1:%s  %s\n' "redis-sentinel:$n" "$(rs_port "$n")" \
        "$(rs_is_data "$n" && echo 'data node' || echo sentinel)"; rc=1
    fi
  done
  return $rc
}
