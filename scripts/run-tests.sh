#!/usr/bin/env bash
# `make test`'s two pytest runs. The test modules run TEST_WORKERS at a time (each module's system,
# broker vhost and receivers are its own; most of a test is waiting). The few tests that change a broker
# for everyone (an alarm, a restart: marked serial) run beside them on a RabbitMQ node of their own,
# started here from the same installation (scripts/start-rabbitmq-cluster.sh, one node) and deleted
# afterwards: a minute off the run. Where that node cannot be had (HOOKLINE_TEST_AMQP_URL names a broker,
# a Docker engine answers, RabbitMQ is not installed here, the node does not start), they run after the
# others, alone, as before.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
WORKERS="${TEST_WORKERS:-3}"
# The serial run collects only the modules that mark tests serial (collecting all takes 9 s).
mapfile -t SERIAL_MODULES < <(grep -rl --include='test_*.py' 'mark.serial' tests | sort)

parallel() { "$BIN/pytest" -q -n "$WORKERS" --dist loadfile --no-loadscope-reorder -m "not serial"; }
serial() { "$BIN/pytest" -q -m serial "${SERIAL_MODULES[@]}"; }

# The serial tests' node: its own name, port and data directory (readable by the broker's user when it
# is started as root). Its ports stay clear of the cluster test's (5681-5683, 5695) and the README's
# 10,000-endpoint node (5691).
NODE_NAME=hookline-serial
NODE_PORT=5697
if [ "$(id -u)" = 0 ]; then NODE_DIR=/var/lib/rabbitmq/hookline-serial; else NODE_DIR="${TMPDIR:-/tmp}/hookline-serial-$(id -un)"; fi
node() {
  HOOKLINE_CLUSTER_NAME=$NODE_NAME HOOKLINE_CLUSTER_NODES=1 HOOKLINE_CLUSTER_PORT=$NODE_PORT \
    HOOKLINE_CLUSTER_DIR="$NODE_DIR" scripts/start-rabbitmq-cluster.sh "$@"
}

own_node_possible() {
  [ -z "${HOOKLINE_TEST_AMQP_URL:-}" ] || return 1
  "$BIN/python" -c 'import sys; from hookline.cli.localservices import docker_available as d; sys.exit(d())' \
    || return 1
  [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || command -v rabbitmq-server >/dev/null
}

if ! own_node_possible; then
  parallel; parallel_status=$?
  serial; serial_status=$?
  exit $((parallel_status || serial_status))
fi

SERIAL_LOG="$(mktemp -t hookline-serial-tests.XXXXXX)"
serial_on_own_node() {
  # Always a fresh node: one left by a run killed inside a restart test may have its application stopped.
  node reset >/dev/null 2>&1
  if ! node start >/dev/null 2>"$SERIAL_LOG.node"; then
    echo "own node" > "$SERIAL_LOG.failed-to-start"
    return 0
  fi
  # The port block after the parallel workers' (support.services.free_port); rabbitmqctl and
  # rabbitmq-diagnostics (the tests' and the services') address the node through RABBITMQ_NODENAME.
  HOOKLINE_TEST_AMQP_URL="amqp://guest:guest@127.0.0.1:$NODE_PORT/" \
    RABBITMQ_NODENAME="$NODE_NAME-a@localhost" \
    HOOKLINE_TEST_PORT_BLOCKS_FROM=$((${HOOKLINE_TEST_PORT_BLOCKS_FROM:-0} + WORKERS)) serial
}

serial_on_own_node > "$SERIAL_LOG" 2>&1 &
serial_pid=$!
# Interrupted or done, the node and its data go (a serial run still going is interrupted first, so that
# it stops what it started).
cleanup() {
  if kill -0 "$serial_pid" 2>/dev/null; then
    pkill -INT -P "$serial_pid"
    wait "$serial_pid"
  fi
  node reset >/dev/null 2>&1
  rm -f "$SERIAL_LOG" "$SERIAL_LOG.node" "$SERIAL_LOG.failed-to-start"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

parallel; parallel_status=$?
wait "$serial_pid"; serial_status=$?
if [ -e "$SERIAL_LOG.failed-to-start" ]; then
  echo "the serial tests' own RabbitMQ node did not start ($(tail -1 "$SERIAL_LOG.node")): they run now, alone"
  serial; serial_status=$?
else
  echo "serial tests (on a RabbitMQ node of their own, beside the others):"
  cat "$SERIAL_LOG"
fi
exit $((parallel_status || serial_status))
