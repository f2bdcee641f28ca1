"""The registry kept in a local file (shared/state/registrystore.py): what a restart reads back, the bounded
caches, and a damaged file."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from support.waiting import eventually

from hookline.shared.contracts.models import (
    EndpointDeleted,
    EndpointDrained,
    EndpointUpserted,
    Placement,
    PlacementSet,
    SigningSecret,
    StoredEndpoint,
)
from hookline.shared.state import batchedfile
from hookline.shared.state import endpointrows as registry_module
from hookline.shared.state.notifications import OPERATOR_TENANT, notifier_of
from hookline.shared.state.registry import EndpointRegistry
from hookline.shared.state.registrystore import RegistryStore

NOW = datetime(2026, 12, 2, tzinfo=UTC)
IDENTITY = "vhost/hookline.endpoints/1"


def endpoint(n: int, tenant: str = "acme", **fields: object) -> StoredEndpoint:
    return StoredEndpoint(
        id=f"ep_{n:026d}",
        tenant=tenant,
        url=f"https://example.com/{n}",
        event_types=["order.*"],
        created_at=NOW,
        updated_at=NOW,
        secrets=[SigningSecret(value="whsec_" + "A" * 44, created_at=NOW)],
        laned=True,
        **fields,  # type: ignore[arg-type]
    )


def upsert(e: StoredEndpoint) -> EndpointUpserted:
    return EndpointUpserted(change_id=f"chg_{e.id}", at=NOW, endpoint=e)


def on_disk(path: Path, **store: object) -> tuple[EndpointRegistry, int | None]:
    registry = EndpointRegistry(RegistryStore(path, identity=IDENTITY, **store))  # type: ignore[arg-type]
    return registry, registry.open()


def test_a_restart_reads_back_what_was_applied_up_to_its_offset(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    registry, offset = on_disk(path)
    assert offset is None, "a new file is built from the first record"
    for n in range(5):
        registry.apply(upsert(endpoint(n)))
        registry.store.applied(n)
    registry.apply(EndpointDeleted(change_id="d", at=NOW, endpoint_id=endpoint(1).id))
    registry.apply(upsert(endpoint(3).model_copy(update={"url": "https://example.com/three"})))
    placed = Placement(endpoint_id=endpoint(4).id, generation=1, isolated=True, reason="slow", at=NOW)
    registry.apply_placement(PlacementSet(change_id="p", at=NOW, placement=placed, base_generation=0))
    registry.store.applied(7)
    deleted = registry.deletions.last_known(endpoint(1).id)
    registry.close()

    again, offset = on_disk(path)
    assert offset == 7
    assert len(again) == 4
    assert [e.id for e in again.rows.of_tenant("acme")] == [endpoint(n).id for n in (0, 2, 3, 4)]
    three = again.get(endpoint(3).id)
    assert three is not None
    assert three.url == "https://example.com/three"
    assert three.version == 2
    assert deleted is not None
    assert again.deletions.last_known(endpoint(1).id) == deleted
    assert [e.id for e in again.deletions.deleted_since(NOW - timedelta(seconds=1))] == [endpoint(1).id]
    assert again.placements.placement(endpoint(4).id) == placed
    assert [e.id for e in again.placements.with_queues()] == [endpoint(4).id], "which endpoints have queues"
    assert again.placements.isolated(again.get(endpoint(4).id))  # type: ignore[arg-type]


def test_uncommitted_changes_are_read_but_not_kept_without_their_offset(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    registry, _ = on_disk(path)
    registry.apply(upsert(endpoint(1)))
    registry.store.applied(0)
    registry.store.commit()
    registry.apply(upsert(endpoint(2)))  # its record's offset not applied yet
    assert registry.get(endpoint(2).id) is not None
    # A crash here: the file is as of offset 0, and record 1 is read again from the log.
    with sqlite3.connect(path) as other:
        assert other.execute("SELECT count(*) FROM endpoints").fetchone() == (1,)
        assert other.execute("SELECT value FROM state WHERE key = 'offset'").fetchone() == ("0",)


def test_a_file_of_another_vhost_is_built_again(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    registry, _ = on_disk(path)
    registry.apply(upsert(endpoint(1)))
    registry.store.applied(0)
    registry.close()
    other = EndpointRegistry(RegistryStore(path, identity="another/hookline.endpoints/1"))
    assert other.open() is None
    assert len(other) == 0
    assert other.get(endpoint(1).id) is None


@pytest.mark.parametrize(
    ("skipped_by", "reads", "rebuilt"),
    [
        (None, "v2", False),  # nothing was skipped: kept whatever reads it next
        ("v2", "v2", False),  # skipped by this very version: reading again would skip it again
        ("v1", "v2", True),  # skipped by the version before: this one may read it
    ],
)
def test_a_file_built_past_records_it_could_not_read_is_built_again_by_another_version(
    tmp_path: Path, skipped_by: str | None, reads: str, rebuilt: bool
) -> None:
    path = tmp_path / "r.sqlite"
    registry, _ = on_disk(path, reads=skipped_by or "v1")
    registry.apply(upsert(endpoint(1)))
    if skipped_by is not None:
        registry.store.skipped()
    registry.store.applied(1)
    registry.close()

    again, offset = on_disk(path, reads=reads)
    assert (offset is None) is rebuilt
    assert (again.get(endpoint(1).id) is None) is rebuilt


def test_pages_in_id_order_by_tenant_and_every_notifier_named(tmp_path: Path) -> None:
    registry, _ = on_disk(tmp_path / "r.sqlite")
    for n in range(10):
        registry.apply(upsert(endpoint(n, tenant="acme" if n % 2 else "globex")))
    notified = endpoint(20, notify_url="https://ops.acme.example/hooks")
    registry.apply(upsert(notified))
    page = registry.rows.page(tenant="acme", after=endpoint(3).id, limit=2)
    assert [e.id for e in page] == [endpoint(5).id, endpoint(7).id]
    assert [e.id for e in registry.rows.page(tenant=None, after=None, limit=3)] == [
        endpoint(n).id for n in range(3)
    ]
    assert registry.rows.count_of_tenant("acme") == 6
    assert registry.rows.tenants() == ["acme", "globex"]
    named = notifier_of(notified)
    assert named is not None
    assert registry.rows.notifier_named(named)
    assert not registry.rows.notifier_named("ep_nobody")
    registry.apply(upsert(notified.model_copy(update={"notify_url": None})))
    assert not registry.rows.notifier_named(named), "named no more once the URL is dropped"
    assert registry.rows.of_tenant(OPERATOR_TENANT) == []


def test_the_caches_stay_bounded_and_the_fan_out_still_sees_every_endpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry_module, "CACHED_ENDPOINTS", 5)
    monkeypatch.setattr(registry_module, "CACHED_TENANT_ENDPOINTS", 6)
    registry, _ = on_disk(tmp_path / "r.sqlite")
    for n in range(40):
        registry.apply(upsert(endpoint(n, tenant=f"t{n % 10}")))
    for t in range(10):
        assert len(registry.subscriptions.matching(f"t{t}", "order.created")) == 4
    assert len(registry.rows._by_id) <= 5
    assert registry.rows._by_tenant_size <= 6 + 4, "at most one tenant over the bound (the one just read)"
    assert set(registry.subscriptions._matches) <= set(registry.rows._by_tenant), (
        "matches forgotten with their tenant"
    )
    # A change to a tenant read from disk again is seen at once.
    registry.apply(upsert(endpoint(0, tenant="t0").model_copy(update={"event_types": ["invoice.*"]})))
    assert len(registry.subscriptions.matching("t0", "order.created")) == 3


def test_a_deleted_endpoint_waits_for_its_fence_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    registry, _ = on_disk(path)
    registry.apply(upsert(endpoint(1)))
    registry.apply(EndpointDeleted(change_id="d", at=NOW, endpoint_id=endpoint(1).id))
    registry.store.applied(1)
    registry.close()
    again, _ = on_disk(path)
    assert [e.id for e in again.subscriptions.matching("acme", "order.created")] == [endpoint(1).id]
    assert again.subscriptions.patterns_needed("acme") == {"order.*"}
    again.apply_drained(EndpointDrained(change_id="x", at=NOW, endpoint_id=endpoint(1).id))
    assert again.subscriptions.matching("acme", "order.created") == ()


def test_a_file_damaged_at_start_is_set_aside_and_one_damaged_in_use_stops_the_process(
    tmp_path: Path,
) -> None:
    path = tmp_path / "r.sqlite"
    registry, _ = on_disk(path)
    registry.apply(upsert(endpoint(1)))
    registry.store.applied(0)
    registry.close()
    path.write_bytes(b"not a database" * 500)
    again, offset = on_disk(path)
    assert offset is None, "rebuilt from the first record"
    assert len(again) == 0
    assert list(tmp_path.glob("r.sqlite.corrupt-*")), "the damaged file kept aside"

    stopped: list[Path | None] = []
    damaged, _ = on_disk(tmp_path / "d.sqlite", on_damaged=stopped.append)
    for n in range(300):
        damaged.apply(upsert(endpoint(n)))
    damaged.store.applied(0)
    damaged.store.commit()
    # Into the file itself, past its first page (the schema), read afresh: a disk that went bad.
    state_file = damaged.store.batch.file
    # Closed once its own checkpoints have ended: the last connection copies the log into the file.
    damaged.store.close()
    with (tmp_path / "d.sqlite").open("r+b") as file:
        file.seek(4096)
        file.write(b"\xff" * 40_000)
    state_file._connect()
    damaged.rows._by_id.clear()
    with pytest.raises(sqlite3.DatabaseError):
        damaged.rows.all()  # every page read
    assert stopped == [tmp_path / "d.sqlite"]


def in_the_file_alone(path: Path) -> int:
    """Endpoints the main file holds without its write-ahead log: what checkpoints have copied there."""
    connection = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
    try:
        return int(connection.execute("SELECT count(*) FROM endpoints").fetchone()[0])
    except sqlite3.DatabaseError:
        # Its tables still in the log alone (OperationalError), or a page torn by a checkpoint copying
        # while this reads without locks ("malformed"): either way, not copied yet.
        return 0
    finally:
        connection.close()


async def test_the_log_is_copied_into_the_file_off_the_event_loop(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    registry, _ = on_disk(path)
    # SQLite's own checkpoint would run in the commit that passes 1,000 pages, on the loop.
    assert registry.store.batch.file.connection.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    for n in range(10):
        registry.apply(upsert(endpoint(n)))
    registry.store.applied(10)
    registry.store.commit()

    async def copied() -> bool:
        return in_the_file_alone(path) == 10

    await eventually(copied, timeout_s=10, explain=lambda: f"{in_the_file_alone(path)} of 10 in the file")
    registry.close()


def test_a_writer_that_outruns_its_checkpoints_keeps_the_log_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batchedfile, "WAL_LIMIT_BYTES", 256 * 1024)
    monkeypatch.setattr(batchedfile, "_checkpoint", lambda path: None)  # never done in time
    path = tmp_path / "r.sqlite"
    wal = path.with_name(path.name + "-wal")
    registry, _ = on_disk(path)
    largest = 0
    for n in range(2_000):
        registry.apply(upsert(endpoint(n, description="x" * 400)))
        registry.store.applied(n)  # no event loop: committed at once
        largest = max(largest, wal.stat().st_size)
    assert largest < 2 * 256 * 1024, f"the log grew to {largest} bytes"
    assert in_the_file_alone(path) > 1_500, "the commits past the limit copied the log into the file"
    registry.close()
    again, offset = on_disk(path)
    assert (offset, len(again)) == (1_999, 2_000)
    again.close()
