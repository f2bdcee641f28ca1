"""``hookline``: start a service, or administer a running system through its HTTP APIs.

    hookline ingest | dispatcher | health-monitor
    hookline endpoints add|list|show|update|delete|secret|pause|resume ...
    hookline events publish ...
    hookline dead-letters list|redrive ...
    hookline replay ENDPOINT_ID --since ...
    hookline portal link --tenant T [--endpoint-id ID] [--read-only]   (a customer portal link)
    hookline status [--degrading] [--json]
    hookline receive [--status 500]      (a receiver for trying it out)
    hookline broker-setup [--upstream NAME[:TENANT]] ...   (least-privilege broker users)
    hookline export > backup.jsonl | hookline import backup.jsonl [--force]   (the change log)

Admin commands: :mod:`hookline.cli.admin`. Each service also starts with ``python -m hookline.<service>``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hookline.cli import admin
from hookline.shared import __version__
from hookline.shared.contracts.models import DeadLetterReason
from hookline.shared.contracts.telemetry import Outcome


def _start_ingest(_: argparse.Namespace) -> int:
    from hookline.ingest.service import main

    main()
    return 0


def _start_dispatcher(_: argparse.Namespace) -> int:
    from hookline.dispatcher.service import main

    main()
    return 0


def _start_monitor(_: argparse.Namespace) -> int:
    from hookline.health_monitor.service import main

    main()
    return 0


def _start_outbox_relay(args: argparse.Namespace) -> int:
    from hookline.outbox_relay.service import main

    main(dsn=args.dsn, migrate_only=args.migrate)
    return 0


def _broker_setup(args: argparse.Namespace) -> int:
    import os
    from urllib.parse import unquote, urlsplit

    from pydantic import ValidationError

    from hookline.cli import brokersetup

    amqp_url = os.environ.get("HOOKLINE_AMQP_URL", "amqp://guest:guest@localhost:5672/")
    vhost = args.vhost or unquote(urlsplit(amqp_url.split(",")[0]).path[1:]) or "/"
    broker: brokersetup.Admin = (
        brokersetup.HttpAdmin(args.management_url)
        if args.management_url
        else brokersetup.CtlAdmin(args.rabbitmqctl)
    )
    try:
        upstreams = [brokersetup.Upstream.parse(text) for text in args.upstream]
    except ValueError as exc:  # a ValidationError too
        why = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
        print(f"hookline: --upstream takes NAME or NAME:TENANT: {why}", file=sys.stderr)
        return 2
    try:
        users = brokersetup.setup(
            broker, vhost=vhost, amqp_url=amqp_url, upstreams=upstreams, rotate=args.rotate
        )
    # 2, like a bad argument: what was given is wrong, and a retry (a Kubernetes Job's) cannot help.
    except brokersetup.PasswordError as exc:
        print(f"hookline: {exc}", file=sys.stderr)
        return 2
    except brokersetup.SetupError as exc:
        print(f"hookline: {exc}", file=sys.stderr)
        return 1
    admin.print_json({"vhost": vhost, "users": [user.model_dump(mode="json") for user in users]})
    return 0


def _export(_: argparse.Namespace) -> int:
    import asyncio
    from datetime import UTC, datetime

    from hookline.cli import backup
    from hookline.shared.runtime import logging as hookline_logging
    from hookline.shared.runtime.settings import CommonSettings, load

    settings = load(CommonSettings)
    hookline_logging.configure(service="backup", level="warning", output=sys.stderr.buffer)

    async def write_out() -> tuple[str, dict[str, int], int | None]:
        # Written only once the whole state is read (into the export's own file): a failed export
        # leaves an empty file, never half of one.
        async with backup.exported(settings) as export:
            out = sys.stdout.buffer
            for line in export.lines(now=datetime.now(UTC)):
                out.write(line + b"\n")
            out.flush()
            return export.vhost, export.counts(), export.rest.offset

    try:
        vhost, written, offset = asyncio.run(write_out())
    except backup.BackupError as exc:
        print(f"hookline: {exc}", file=sys.stderr)
        return 1
    counts = ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in written.items())
    print(f"hookline: exported {counts} (offset {offset} of vhost {vhost!r})", file=sys.stderr)
    return 0


def _import(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from hookline.cli import backup
    from hookline.shared.runtime import logging as hookline_logging
    from hookline.shared.runtime.settings import CommonSettings, load

    settings = load(CommonSettings)
    hookline_logging.configure(service="backup", level="warning", output=sys.stderr.buffer)
    try:
        if args.file == "-":
            header, snapshot = backup.parse(sys.stdin.buffer)
        else:
            with Path(args.file).open("rb") as file:
                header, snapshot = backup.parse(file)
        steps = asyncio.run(backup.restore(settings, snapshot, force=args.force))
    except (OSError, backup.BackupError) as exc:
        print(f"hookline: {exc}", file=sys.stderr)
        return 1
    admin.print_json(
        {
            "offset": header.offset,
            "exported_at": header.exported_at.isoformat(),
            "written": steps.to_write.counts(),
            "already_there": steps.already,
            "overwritten": steps.conflicts,
        }
    )
    return 0


def _receive(args: argparse.Namespace) -> int:
    from hookline.cli.devreceiver import run

    run(host=args.host, port=args.port, status=args.status, secret=args.secret)
    return 0


def _synthetic(args: argparse.Namespace) -> int:
    from hookline.cli.synthetic import run

    run(host=args.host, port=args.port)
    return 0


def _add_endpoint_options(parser: argparse.ArgumentParser, *, creating: bool) -> None:
    parser.add_argument(
        "--url", help="where the webhooks are POSTed" + (" (not with --polling)" if creating else "")
    )
    parser.add_argument(
        "--event-type",
        dest="event_types",
        action="append",
        required=creating,
        metavar="PATTERN",
        help="event type pattern (repeatable): order.created, order.*, #",
    )
    parser.add_argument("--description")
    parser.add_argument("--timeout-s", type=float, help="per-attempt timeout, 1-30 s (default 15)")
    parser.add_argument("--rate-limit-per-s", type=float)
    parser.add_argument("--max-in-flight", type=int)
    parser.add_argument(
        "--body-format", choices=["event", "slack"], help='slack: POST {"text": ...} (incoming webhooks)'
    )
    parser.add_argument(
        "--notify-url", help="where hookline tells you this endpoint is failing, recovered or disabled"
    )
    parser.add_argument("--notify-format", choices=["event", "slack"])
    parser.add_argument(
        "--gzip-over-bytes",
        type=int,
        metavar="BYTES",
        help="gzip bodies larger than this (content-encoding: gzip; signed before compression)",
    )
    parser.add_argument(
        "--filter",
        help='a CEL expression its events must match: data.amount >= 1000 && data.currency == "EUR"',
    )
    parser.add_argument(
        "--transform", help='a jq program whose output is the body sent: {text: "Order \\(.data.order_id)"}'
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hookline", description="Webhook delivery over RabbitMQ.")
    parser.add_argument("--version", action="version", version=f"hookline {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _service_commands(commands)
    _endpoint_commands(commands)
    _operations_commands(commands)
    _event_commands(commands)
    return parser


def _service_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Start a service, set up the broker, or run a receiver for trying hookline out."""
    commands.add_parser("ingest", help="run the HTTP API").set_defaults(run=_start_ingest)
    commands.add_parser("dispatcher", help="run a dispatcher replica").set_defaults(run=_start_dispatcher)
    commands.add_parser("health-monitor", help="run the health monitor").set_defaults(run=_start_monitor)
    relay = commands.add_parser(
        "outbox-relay",
        help="publish an upstream's outbox table to events (PostgreSQL)",
        description="Publishes the committed rows of the hookline_outbox table to events with publisher "
        "confirms, marking each sent once confirmed; run as many as you like.",
    )
    relay.add_argument(
        "--dsn", help="postgresql://user:password@host/db (or HOOKLINE_OUTBOX_DSN, which keeps it out of ps)"
    )
    relay.add_argument("--migrate", action="store_true", help="create or update the outbox table, then exit")
    relay.set_defaults(run=_start_outbox_relay)

    setup = commands.add_parser(
        "broker-setup",
        help="create one RabbitMQ user per service and upstream, each with least privilege",
        description="Users hookline-ingest, hookline-dispatcher, hookline-monitor and each --upstream, "
        "permitted only what they use (shared/broker/permissions.py); prints new passwords and URLs once. "
        "Passwords may be given as HOOKLINE_BROKER_PASSWORD_<USER> (16 characters at least).",
    )
    setup.add_argument("--vhost", help="default: the vhost of HOOKLINE_AMQP_URL")
    setup.add_argument(
        "--upstream", action="append", default=[], metavar="NAME[:TENANT]",
        help="a user that may only publish to events (with TENANT: only routing keys TENANT.*)",
    )  # fmt: skip
    setup.add_argument("--rotate", action="store_true", help="new passwords for existing users too")
    setup.add_argument("--management-url", help="use the management API, e.g. http://admin:pw@host:15672")
    setup.add_argument("--rabbitmqctl", default="rabbitmqctl", help="the rabbitmqctl command line to run")
    setup.set_defaults(run=_broker_setup)

    commands.add_parser(
        "export",
        help="write the change log (endpoints, sealed secrets, event types, tokens, quotas) to stdout",
        description="One JSON object per line: a header (format, version, the stream offset of the state), "
        "then each endpoint, event type, token and quota as of that offset, secrets sealed as stored. "
        "Talks to the broker at HOOKLINE_AMQP_URL.",
    ).set_defaults(run=_export)
    restore = commands.add_parser(
        "import",
        help="restore a backup written by hookline export into the broker's change log",
        description="Declares the topology and each endpoint's queue and bindings, then writes the records. "
        "Refuses a change log that holds anything else unless --force; run again after a failure, it goes "
        "on where it stopped. Needs the HOOKLINE_SECRET_KEY the backup's secrets were sealed with.",
    )
    restore.add_argument("file", help="the backup (- for stdin)")
    restore.add_argument(
        "--force",
        action="store_true",
        help="write the backup over what the change log holds (deletes nothing)",
    )
    restore.set_defaults(run=_import)

    receive = commands.add_parser("receive", help="a local webhook receiver for trying hookline out")
    receive.add_argument("--host", default="127.0.0.1")
    receive.add_argument("--port", type=int, default=9000)
    receive.add_argument("--status", type=int, default=204, help="the status to answer with (try 500)")
    receive.add_argument("--secret", help="the endpoint's whsec_ secret, to verify signatures")
    receive.set_defaults(run=_receive)

    synthetic = commands.add_parser(
        "synthetic", help="endpoints that behave as their path says: /ok /status/503 /slow/2000 /flaky/25 …"
    )
    synthetic.add_argument("--host", default="127.0.0.1")
    synthetic.add_argument("--port", type=int, default=9100)
    synthetic.set_defaults(run=_synthetic)


def _endpoint_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hookline endpoints …``."""
    endpoints = commands.add_parser("endpoints", help="manage endpoints").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    add = endpoints.add_parser("add", help="register an endpoint (prints its secret)")
    add.add_argument("--tenant", required=True)
    _add_endpoint_options(add, creating=True)
    add.add_argument("--ordered", action="store_true", help="deliver each subject's events in order")
    add.add_argument(
        "--polling",
        action="store_true",
        help="no url: its events are fetched (endpoints poll; prints a poll_token)",
    )
    add.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip the verification handshake (development)",
    )
    endpoints.add_parser("list", help="list endpoints").add_argument("--tenant")
    for action, text in (
        ("show", "show one endpoint"),
        ("secret", "show its signing secret"),
        ("delete", "delete it (queued events become dead letters)"),
        ("pause", "stop delivering (events keep queueing)"),
        ("resume", "deliver again (also after a 410 disabled it)"),
        ("verify", "run the verification handshake again"),
        ("rotate-secret", "a new signing secret; the old one keeps signing for the overlap"),
        ("attempts", "its attempts, newest first (the delivery log)"),
        ("rotate-poll-token", "a polling endpoint's new poll_token (the old one stops working)"),
    ):
        endpoints.add_parser(action, help=text).add_argument("id")
    endpoints.choices["delete"].add_argument(
        "--force", action="store_true", help="delete even with events pending (they become dead letters)"
    )
    endpoints.choices["rotate-secret"].add_argument("--overlap-s", type=int, help="default 24 h")
    attempts = endpoints.choices["attempts"]
    attempts.add_argument("--outcome", choices=[outcome.value for outcome in Outcome])
    attempts.add_argument("--since", help="RFC 3339 time")
    attempts.add_argument("--limit", type=int)
    attempts.add_argument("--after", help="next_after of the previous page")
    poll = endpoints.add_parser("poll", help="fetch a polling endpoint's next events (with its poll_token)")
    poll.add_argument("id")
    poll.add_argument("--poll-token", required=True, help="the hlpt_ token its creation printed")
    poll.add_argument("--iterator", help="next_iterator of the last poll (none: from the start)")
    poll.add_argument("--limit", type=int)
    test = endpoints.add_parser(
        "test", help="send it a test event now and show the attempt (status, timings, the answer's start)"
    )
    test.add_argument("id")
    test.add_argument("--type", required=True, help="the event type")
    test.add_argument("--data", help="the event's data as JSON (default: the catalog's first example)")
    test.add_argument("--subject")
    update = endpoints.add_parser(
        "update",
        help="change url, patterns, description, timeout, limits or ordering (a limit or ordering "
        "added or removed moves the endpoint to a new queue, without losing or repeating an event)",
    )
    update.add_argument("id")
    _add_endpoint_options(update, creating=False)
    update.add_argument("--no-rate-limit", action="store_true", help="remove the rate limit")
    update.add_argument("--no-max-in-flight", action="store_true", help="remove the concurrency cap")
    update.add_argument("--no-gzip", action="store_true", help="send bodies uncompressed")
    update.add_argument("--no-filter", action="store_true", help="every event its patterns match")
    update.add_argument("--no-transform", action="store_true", help="send events as they are")
    ordering = update.add_mutually_exclusive_group()
    ordering.add_argument("--ordered", dest="ordered", action="store_true", default=None)
    ordering.add_argument("--unordered", dest="ordered", action="store_false")
    update.add_argument(
        "--if-version", type=int, help="change only if the endpoint is still at this version (else 409)"
    )
    for sub in endpoints.choices.values():
        sub.set_defaults(run=_admin(admin.endpoints))


def _operations_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Dead letters, replay and the status of the system."""
    dead = commands.add_parser("dead-letters", help="list and redrive dead letters").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    for action, text in (
        ("list", "list dead letters"),
        ("redrive", "send dead letters to their endpoint again"),
    ):
        sub = dead.add_parser(action, help=text)
        sub.add_argument("--endpoint-id")
        sub.add_argument("--tenant")
        sub.add_argument("--reason", choices=[reason.value for reason in DeadLetterReason])
        sub.set_defaults(run=_admin(admin.dead_letters))
    dead.choices["list"].add_argument("--limit", type=int, default=100)
    dead.choices["list"].add_argument("--event-id")
    dead.choices["redrive"].add_argument("--event-id")
    dead.choices["redrive"].add_argument(
        "--id", dest="ids", action="append", help="a dead letter id (repeatable)"
    )
    dead.choices["redrive"].add_argument("--all", action="store_true", help="every dead letter")

    replay = commands.add_parser("replay", help="resend an endpoint's events from the event log")
    replay.add_argument("endpoint_id")
    replay.add_argument("--since", required=True, help="RFC 3339 time, e.g. 2026-11-29T10:00:00Z")
    replay.add_argument("--until", help="RFC 3339 time (default: now)")
    replay.set_defaults(run=_admin(admin.replay))

    portal = commands.add_parser("portal", help="the customer portal").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    link = portal.add_parser("link", help="a link that opens a tenant's portal once (show it in an iframe)")
    link.add_argument("--tenant", required=True)
    link.add_argument(
        "--endpoint-id", dest="endpoint_ids", action="append", help="only this endpoint (repeatable)"
    )
    link.add_argument("--read-only", action="store_true", help="it can look, and change nothing")
    link.add_argument("--expires-in-s", type=int, default=3600, help="the link and its session end then")
    link.set_defaults(run=_admin(admin.portal_link))

    status = commands.add_parser("status", help="the system's health, from the health monitor")
    status.add_argument("--degrading", action="store_true", help="only slow endpoints and open breakers")
    status.add_argument("--json", action="store_true", help="the API's answers, as JSON")
    status.set_defaults(run=_admin(admin.status))


def _event_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``hookline events …``."""
    events = commands.add_parser("events", help="publish events and follow them").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    publish = events.add_parser("publish", help="publish one event through the ingest API")
    publish.add_argument("--tenant", required=True)
    publish.add_argument("--type", required=True)
    publish.add_argument("--data", default="{}", help="the event's data, a JSON object")
    publish.add_argument("--id", help="event id (assigned when absent)")
    publish.add_argument(
        "--idempotency-key", help="sent again with the same key, the event is accepted once (no --id needed)"
    )
    publish.add_argument("--subject")
    publish.set_defaults(run=_admin(admin.events))
    show = events.add_parser(
        "show", help="an event and its story at every endpoint: attempts, state, why it waits"
    )
    show.add_argument("id")
    show.set_defaults(run=_admin(admin.events))
    listing = events.add_parser("list", help="recent events, newest first")
    for option in ("--tenant", "--type", "--subject", "--after"):
        listing.add_argument(option)
    listing.add_argument("--since", help="RFC 3339 time")
    listing.add_argument("--until", help="RFC 3339 time")
    listing.add_argument(
        "--state",
        choices=[
            "delivered",
            "pending",
            "retrying",
            "dead",
            "paused",
            "breaker_open",
            "unverified",
            "disabled",
        ],
    )
    listing.add_argument("--limit", type=int)
    listing.set_defaults(run=_admin(admin.events))
    resend = events.add_parser("resend", help="one attempt now, same webhook-id, beside the retry budget")
    resend.add_argument("id")
    resend.add_argument("--endpoint-id", required=True)
    resend.set_defaults(run=_admin(admin.events))


def _admin(command: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            admin.print_json(command(args))
        except admin.CliError as exc:
            print(f"hookline: {exc}", file=sys.stderr)
            return 1
        return 0

    return run


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    raise SystemExit(args.run(args))
