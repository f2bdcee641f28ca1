#!/usr/bin/env bash
# Start the local PostgreSQL if it is not answering (the outbox relay's tests need one), and wait.
set -euo pipefail

answers() { pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; }

answers && exit 0
echo "starting PostgreSQL" >&2
if command -v pg_ctlcluster >/dev/null; then
  # Debian's clusters: start each one that is down (normally just one).
  pg_lsclusters --no-header | while read -r version cluster _; do
    pg_ctlcluster "$version" "$cluster" start || true
  done
elif command -v service >/dev/null; then
  service postgresql start
fi
for _ in $(seq 1 60); do
  answers && exit 0
  sleep 1
done
echo "PostgreSQL did not answer on 127.0.0.1:5432 within 60 s (set HOOKLINE_TEST_POSTGRES_URL to use another)" >&2
exit 1
