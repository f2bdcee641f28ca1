#!/usr/bin/env bash
# `make run`: ingest, two dispatchers and the health monitor against the RabbitMQ at HOOKLINE_AMQP_URL.
# JSON logs from all four go to this terminal; Ctrl-C (or SIGTERM) stops them all cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin

export HOOKLINE_AMQP_URL="${HOOKLINE_AMQP_URL:-amqp://guest:guest@localhost:5672/}"
# A local run talks to receivers on this machine, over http: allow it here, never by default.
export HOOKLINE_ALLOW_HTTP="${HOOKLINE_ALLOW_HTTP:-true}"
export HOOKLINE_ALLOW_PRIVATE_TARGETS="${HOOKLINE_ALLOW_PRIVATE_TARGETS:-true}"
if [ -z "${HOOKLINE_API_TOKEN:-}" ]; then
  mkdir -p .hookline
  [ -s .hookline/dev-token ] || "$BIN/python" -c 'import secrets; print(secrets.token_urlsafe(24))' > .hookline/dev-token
  HOOKLINE_API_TOKEN="$(cat .hookline/dev-token)"
  export HOOKLINE_API_TOKEN
fi

cat >&2 <<INFO
hookline: ingest http://127.0.0.1:${HOOKLINE_INGEST_PORT:-8000}  monitor http://127.0.0.1:${HOOKLINE_MONITOR_PORT:-8001}
hookline: dashboard http://127.0.0.1:${HOOKLINE_MONITOR_PORT:-8001}/ui/ (log in with the token below)
hookline: dispatcher metrics :8002 and :8003; broker ${HOOKLINE_AMQP_URL%%@*}@…
hookline: export HOOKLINE_API_TOKEN=$HOOKLINE_API_TOKEN   # for curl and the hookline command
INFO

pids=()
stop() {
  trap - INT TERM
  kill -TERM "${pids[@]}" 2>/dev/null || true
  wait "${pids[@]}" 2>/dev/null || true
}
trap stop INT TERM

"$BIN/hookline" ingest & pids+=($!)
HOOKLINE_DISPATCHER_METRICS_PORT=8002 "$BIN/hookline" dispatcher & pids+=($!)
HOOKLINE_DISPATCHER_METRICS_PORT=8003 "$BIN/hookline" dispatcher & pids+=($!)
HOOKLINE_INGEST_URL="${HOOKLINE_INGEST_URL:-http://127.0.0.1:${HOOKLINE_INGEST_PORT:-8000}}" \
  "$BIN/hookline" health-monitor & pids+=($!)

# Any service exiting on its own (a bad setting, the broker unreachable) stops the rest.
wait -n "${pids[@]}" || true
stop
