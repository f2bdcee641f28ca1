#!/usr/bin/env bash
# A three-node RabbitMQ cluster on this machine, without Docker: nodes hookline-a, -b and -c @localhost,
# AMQP on 127.0.0.1:5681, 5682 and 5683, each with its own node name, ports and data directory, one
# Erlang cookie (the rabbitmq user's, shared with the machine's own broker), joined to hookline-a.
# The machine's broker on 5672 is left alone. Idempotent: nodes already running are kept.
#
#   scripts/start-rabbitmq-cluster.sh          start (and join) the three nodes; print HOOKLINE_AMQP_URL
#   scripts/start-rabbitmq-cluster.sh stop     stop them (data kept)
#   scripts/start-rabbitmq-cluster.sh reset    stop them and delete their data
#   scripts/start-rabbitmq-cluster.sh ctl NODE ARGS...   rabbitmqctl against node a, b or c
#
# Environment: HOOKLINE_CLUSTER_NAME (default hookline: the nodes' names before -a, -b, -c),
# HOOKLINE_CLUSTER_DIR (default /var/lib/rabbitmq/hookline-cluster), HOOKLINE_CLUSTER_PORT
# (default 5681: the first node's AMQP port; the others follow), HOOKLINE_CLUSTER_NODES (default 3; 1
# gives a single node started the same way, with a directory and port of its own, for measurements),
# HOOKLINE_CLUSTER_FILE_HANDLES (default: the open-file limit): the file handles each node accounts for.
# RabbitMQ 3.x reserves three per quorum queue in that account though an idle queue holds none open (500
# queues: 1,502 reserved, 37 files open), and hangs new connections once the account is full; 4.x keeps
# no such account. Setting it above the open-file limit lets one node hold 10,000 idle endpoint queues
# on a machine whose hard limit is 20,000. HOOKLINE_CLUSTER_MANAGEMENT=1 enables the management plugin,
# its HTTP API on 127.0.0.1 at each node's AMQP port + 10000.
set -euo pipefail

BASE="${HOOKLINE_CLUSTER_DIR:-/var/lib/rabbitmq/hookline-cluster}"
FIRST_PORT="${HOOKLINE_CLUSTER_PORT:-5681}"
ALL_NODES=(a b c)
NODES=("${ALL_NODES[@]:0:${HOOKLINE_CLUSTER_NODES:-3}}")
SBIN=/usr/lib/rabbitmq/bin

NAME="${HOOKLINE_CLUSTER_NAME:-hookline}"
node_name() { echo "$NAME-$1@localhost"; }
node_port() { echo $((FIRST_PORT + $2)); }

# Run a RabbitMQ command as the broker's own user (its HOME holds the shared cookie), for one node.
as_broker() {
  local env_file="$1"; shift
  if [ "$(id -u)" = 0 ]; then
    (cd "$BASE" && RABBITMQ_CONF_ENV_FILE="$env_file" HOME=/var/lib/rabbitmq \
      setpriv --reuid rabbitmq --regid rabbitmq --init-groups "$@")
  else
    RABBITMQ_CONF_ENV_FILE="$env_file" "$@"
  fi
}

ctl() { # ctl NODE ARGS...: rabbitmqctl against one node
  local node="$1"; shift
  as_broker "$BASE/$node/rabbitmq-env.conf" "$SBIN/rabbitmqctl" -q -n "$(node_name "$node")" "$@"
}

answers() { ctl "$1" status >/dev/null 2>&1; }

prepare() {
  local node="$1" index="$2" dir="$BASE/$1" port
  port="$(node_port "$node" "$index")"
  mkdir -p "$dir/mnesia" "$dir/log"
  cat > "$dir/rabbitmq-env.conf" <<EOF
NODENAME=$(node_name "$node")
NODE_PORT=$port
DIST_PORT=$((port + 20000))
MNESIA_BASE=$dir/mnesia
LOG_BASE=$dir/log
CONFIG_FILE=$dir/rabbitmq.conf
ADVANCED_CONFIG_FILE=$dir/advanced.config
ENABLED_PLUGINS_FILE=$dir/enabled_plugins
PID_FILE=$dir/pid
ERL_EPMD_ADDRESS=127.0.0.1
export ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}"
EOF
  cat > "$dir/rabbitmq.conf" <<EOF
listeners.tcp.local = 127.0.0.1:$port
cluster_name = hookline-local
EOF
  if [ -n "${HOOKLINE_CLUSTER_FILE_HANDLES:-}" ]; then
    echo "[{rabbit, [{file_handles_high_watermark, $HOOKLINE_CLUSTER_FILE_HANDLES}]}]." > "$dir/advanced.config"
  else
    echo "[]." > "$dir/advanced.config"
  fi
  if [ "${HOOKLINE_CLUSTER_MANAGEMENT:-0}" = 1 ]; then
    echo "[rabbitmq_management]." > "$dir/enabled_plugins"
    printf 'management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = %s\n' $((port + 10000)) >> "$dir/rabbitmq.conf"
  else
    echo "[]." > "$dir/enabled_plugins"
  fi
  if [ "$(id -u)" = 0 ]; then chown -R rabbitmq:rabbitmq "$BASE"; fi
}

launch_node() {
  local node="$1"
  answers "$node" && return 0
  echo "starting $(node_name "$node") on 127.0.0.1:$(node_port "$node" "$2")" >&2
  (
    # Each quorum queue takes file handles (RabbitMQ 3.x: its log segments); past the limit a node stops
    # accepting connections without an error. Root may raise the hard limit first.
    if [ "$(id -u)" = 0 ]; then ulimit -Hn "${HOOKLINE_CLUSTER_NOFILE:-262144}" 2>/dev/null || true; fi
    ulimit -n "$(ulimit -Hn)"
    as_broker "$BASE/$node/rabbitmq-env.conf" setsid "$SBIN/rabbitmq-server" -detached
  )
}

await_node() {
  # A node that was not the last of the cluster to stop waits for its peers before it boots: all three
  # are launched first, then awaited.
  local node="$1"
  for _ in $(seq 1 180); do
    answers "$node" && ctl "$node" await_startup >/dev/null 2>&1 && return 0
    sleep 1
  done
  echo "$(node_name "$node") did not start within 180 s (log: $BASE/$node/log)" >&2
  exit 1
}

joined() { ctl "$1" cluster_status --formatter json 2>/dev/null | grep -q "$(node_name a)"; }

case "${1:-start}" in
  start)
    for index in "${!NODES[@]}"; do
      prepare "${NODES[$index]}" "$index"
      launch_node "${NODES[$index]}" "$index"
    done
    for node in "${NODES[@]}"; do
      await_node "$node"
    done
    for node in "${NODES[@]:1}"; do
      if ! joined "$node"; then
        echo "joining $(node_name "$node") to $(node_name a)" >&2
        {
          ctl "$node" stop_app
          ctl "$node" reset
          ctl "$node" join_cluster "$(node_name a)"
          ctl "$node" start_app
        } > "$BASE/$node/log/join.log" 2>&1 || { cat "$BASE/$node/log/join.log" >&2; exit 1; }
      fi
    done
    ctl a enable_feature_flag all >/dev/null
    # RabbitMQ 3.10 can come back from a restart without its at-least-once dead-letter supervisor, and
    # then refuses to declare such quorum queues (INTERNAL_ERROR): start it where it is missing.
    for node in "${NODES[@]}"; do
      if [ "$(ctl "$node" eval 'is_pid(whereis(rabbit_fifo_dlx_sup)).')" != true ]; then
        echo "restarting the dead-letter supervisor on $(node_name "$node") (RabbitMQ 3.10)" >&2
        ctl "$node" eval 'supervisor:restart_child(rabbit_sup, rabbit_fifo_dlx_sup).' >/dev/null
      fi
    done
    urls=()
    for index in "${!NODES[@]}"; do
      urls+=("amqp://guest:guest@127.0.0.1:$(node_port "${NODES[$index]}" "$index")/")
    done
    (IFS=,; echo "HOOKLINE_AMQP_URL=${urls[*]}")
    ;;
  stop | reset)
    for node in "${NODES[@]}"; do
      if [ -f "$BASE/$node/rabbitmq-env.conf" ] && answers "$node"; then ctl "$node" stop; fi
    done
    if [ "$1" = reset ]; then rm -rf "$BASE"; fi
    ;;
  ctl)
    shift
    node="$1"; shift
    ctl "$node" "$@"
    ;;
  *)
    echo "usage: $0 [start|stop|reset|ctl NODE ARGS...]" >&2
    exit 2
    ;;
esac
