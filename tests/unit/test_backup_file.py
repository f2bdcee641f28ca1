"""Backups of the change log: the file read back as written, a damaged file refused by line, and what an
import writes given what the log already holds (table-tested)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
from support.factories import CREATED, stored_endpoint

from hookline.cli.backup import BackupError, Export, Snapshot, key_problem, parse, plan, restored
from hookline.shared.contracts.models import (
    EndpointStatus,
    EndpointUpserted,
    EventTypeInfo,
    SigningSecret,
    StoredToken,
    TenantQuota,
)
from hookline.shared.outbound.sealing import Sealer
from hookline.shared.state.registry import EndpointRegistry
from hookline.shared.state.registrystore import RegistryStore

A, B = "ep_" + "A" * 26, "ep_" + "B" * 26
SEALED = "enc:v2:" + "x" * 60
TOKEN = StoredToken(
    id="tok_" + "1" * 26, tenant="acme", prefix="hlt_abcdefgh", digest="0" * 64, created_at=CREATED
)
TYPE = EventTypeInfo(
    name="order.created", schemas={"1": {"type": "object"}}, validation="enforce", created_at=CREATED,
    updated_at=CREATED, version=3,
)  # fmt: skip
QUOTA = TenantQuota(max_endpoints=5, events_per_s=10.0)


def backup() -> Snapshot:
    rotated = stored_endpoint(
        A, secrets=[SigningSecret(value=SEALED, created_at=CREATED),
                    SigningSecret(value=SEALED[:-1] + "y", created_at=CREATED, expires_at=CREATED)],
        version=7, queue_generation=2, retired_queues=["hookline.endpoint.x.g1"],
    )  # fmt: skip
    paused = stored_endpoint(B, status=EndpointStatus.PAUSED, version=2)
    return Snapshot(
        endpoints=[rotated, paused], event_types=[TYPE], tokens=[TOKEN], quotas={"acme": QUOTA}, offset=41
    )


def test_a_backup_reads_back_as_it_was_written_secrets_sealed_as_stored() -> None:
    lines = list(backup().lines(vhost="prod", now=datetime(2026, 12, 2, tzinfo=UTC)))
    header, read = parse(lines)
    assert (header.format, header.version, header.offset, header.vhost) == ("hookline-backup", 1, 41, "prod")
    assert header.counts == {"endpoints": 2, "event_types": 1, "tokens": 1, "quotas": 1}
    assert read == backup()
    assert SEALED.encode() in lines[1]


def test_an_export_streams_its_endpoints_from_its_file_in_id_order(tmp_path: Path) -> None:
    """What ``hookline export`` writes: the endpoints read back from the export's registry file one at a
    time, the same file as a backup held in memory would give."""
    state = backup()
    on_disk = EndpointRegistry(RegistryStore(tmp_path / "export.sqlite", identity="test"))
    assert on_disk.open() is None  # a new file
    for endpoint in reversed(state.endpoints):  # applied in another order: written in id order
        on_disk.apply(
            EndpointUpserted(change_id="c", at=CREATED, endpoint=endpoint.model_copy(update={"version": 0}))
        )
    export = Export("prod", on_disk, replace(state, endpoints=[]))
    now = datetime(2026, 12, 2, tzinfo=UTC)
    streamed = list(export.lines(now=now))
    header, read = parse(streamed)
    assert header.counts == {"endpoints": 2, "event_types": 1, "tokens": 1, "quotas": 1}
    assert [e.id for e in read.endpoints] == sorted(e.id for e in state.endpoints)
    assert [e.model_copy(update={"version": 0}) for e in read.endpoints] == [
        e.model_copy(update={"version": 0}) for e in sorted(state.endpoints, key=lambda e: e.id)
    ]
    on_disk.close()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda lines: [], "empty file"),
        (lambda lines: lines[:-1], "truncated"),
        (lambda lines: [lines[0].replace(b'"version":1', b'"version":2'), *lines[1:]], "format version 2"),
        (lambda lines: [*lines[:2], b'{"kind": "endpoint", "endpoint": {}}', *lines[3:]], "line 3"),
        (lambda lines: [b'{"format": "something-else"}', *lines[1:]], "line 1"),
    ],
)
def test_a_damaged_backup_is_refused_naming_what_is_wrong(
    damage: Callable[[list[bytes]], list[bytes]], message: str
) -> None:
    lines = list(backup().lines(vhost="prod", now=CREATED))
    with pytest.raises(BackupError, match=message):
        parse(damage(lines))


def _as_written(state: Snapshot) -> Snapshot:
    """The log after an import of ``state``: its own versions."""
    return Snapshot(
        endpoints=[restored(e).model_copy(update={"version": 1}) for e in state.endpoints],
        event_types=[t.model_copy(update={"version": 1}) for t in state.event_types],
        tokens=state.tokens,
        quotas=state.quotas,
    )


@pytest.mark.parametrize(
    ("current", "writes", "already", "conflicts"),
    [
        # An empty log: everything is written.
        (Snapshot(), {"endpoints": 2, "event_types": 1, "tokens": 1, "quotas": 1}, 0, []),
        # A retry after everything was written: nothing to do.
        (_as_written(backup()), {"endpoints": 0, "event_types": 0, "tokens": 0, "quotas": 0}, 5, []),
        # A retry after a failure half-way (the types, tokens, quotas and one endpoint written).
        (
            Snapshot(
                endpoints=_as_written(backup()).endpoints[:1],
                event_types=_as_written(backup()).event_types,
                tokens=[TOKEN],
                quotas={"acme": QUOTA},
            ),
            {"endpoints": 1, "event_types": 0, "tokens": 0, "quotas": 0},
            4,
            [],
        ),
        # A log in use: another endpoint, and one of the backup's changed since.
        (
            Snapshot(
                endpoints=[stored_endpoint(A, description="edited"), stored_endpoint("ep_" + "C" * 26)],
                quotas={"other": QUOTA},
            ),
            {"endpoints": 2, "event_types": 1, "tokens": 1, "quotas": 1},
            0,
            [
                f"endpoint {A} differs from the backup's",
                f"endpoint {'ep_' + 'C' * 26} is not in the backup",
                "quota of other is not in the backup",
            ],
        ),
    ],
)
def test_an_import_writes_what_the_log_lacks_and_names_what_stands_in_its_way(
    current: Snapshot, writes: dict[str, int], already: int, conflicts: list[str]
) -> None:
    steps = plan(backup(), current)
    assert steps.to_write.counts() == writes
    assert steps.already == already
    assert steps.conflicts == conflicts


def test_a_restored_endpoint_keeps_its_secrets_status_and_queue_but_not_the_old_brokers_queues() -> None:
    rotated, paused = (restored(e) for e in backup().endpoints)
    assert rotated.secrets == backup().endpoints[0].secrets
    assert (rotated.queue_generation, rotated.retired_queues, rotated.routed) == (2, [], True)
    assert paused.status is EndpointStatus.PAUSED


def test_a_restored_ordered_endpoint_takes_its_events_straight_and_the_others_through_their_lane() -> None:
    ordered, other = (restored(stored_endpoint(A, ordered=True)), restored(stored_endpoint(B, laned=False)))
    assert (ordered.laned, ordered.straight) == (False, True)
    assert (other.laned, other.straight) == (True, False)


def test_an_import_checks_the_key_opens_every_secret_before_it_writes() -> None:
    key, other = "k" * 32, "o" * 32
    sealed = SigningSecret(value=Sealer(key).seal("whsec_" + "B" * 44), created_at=CREATED)
    state = Snapshot(endpoints=[stored_endpoint(A), stored_endpoint(B, secrets=[sealed])])
    assert key_problem(state, Sealer(key)) is None
    assert key_problem(Snapshot(endpoints=[stored_endpoint(A)]), Sealer(None)) is None  # stored unsealed
    for wrong, why in ((Sealer(None), "is not set"), (Sealer(other), "is not the key")):
        problem = key_problem(state, wrong)
        assert problem is not None
        assert problem.startswith(f"endpoint {B}: ")
        assert why in problem
