#!/usr/bin/env bash
# Start the local RabbitMQ if it is not answering, and wait until it does.
#
# RabbitMQ 3.x gives every quorum queue a file handle and blocks new connections when they run out;
# with the common default of 1024 open files that happens near 900 endpoints. As root, the broker is
# started as its own user with the hard limit (`su` in the packaged wrapper would reset it via PAM).
set -euo pipefail

answers() { timeout 10 rabbitmq-diagnostics -q check_port_connectivity >/dev/null 2>&1; }

answers && exit 0
echo "starting RabbitMQ" >&2
if timeout 10 rabbitmqctl -q ping >/dev/null 2>&1; then
  # The node is up with its application stopped (a run killed inside a broker-restart test).
  rabbitmqctl -q start_app
elif [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null && [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ]; then
  (
    ulimit -n "$(ulimit -Hn)"
    cd /var/lib/rabbitmq
    HOME=/var/lib/rabbitmq setsid setpriv --reuid rabbitmq --regid rabbitmq --init-groups \
      /usr/lib/rabbitmq/bin/rabbitmq-server -detached
  )
else
  rabbitmq-server -detached
fi
for _ in $(seq 1 120); do
  if answers; then
    # Streams and at-least-once dead-lettering need these flags (on by default for new nodes; a node
    # upgraded from before 3.10 may have them off). Idempotent.
    rabbitmqctl -q enable_feature_flag quorum_queue >/dev/null
    rabbitmqctl -q enable_feature_flag stream_queue >/dev/null
    exit 0
  fi
  sleep 1
done
echo "RabbitMQ did not start within 120 s" >&2
exit 1
