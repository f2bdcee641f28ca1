"""``python -m hookline.outbox_relay [--dsn ...] [--migrate]`` starts the relay, as ``hookline
outbox-relay`` does."""

import sys

from hookline.cli.main import main

main(["outbox-relay", *sys.argv[1:]])
