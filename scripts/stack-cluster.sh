# shellcheck shell=bash
# scripts/stack-cluster.sh — the cluster services of the local stack, sourced by
# scripts/stack (not a command of its own; it uses the helpers defined there):
#
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
