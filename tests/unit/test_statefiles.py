"""A damaged local state file never stops a service: it is set aside (renamed beside itself, never
deleted), said once in an alert line and counted, and a fresh file takes its place, at open and in use;
a view's store then refuses to record an offset until its view has been reset, and the monitor's
checkpoint is written whole into the fresh file."""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from structlog.testing import capture_logs

from hookline.health_monitor.checkpoint import CheckpointStore
from hookline.shared.broker.views import ViewSchema, ViewStore
from hookline.shared.state.statefiles import StateFile, StateFileReplacedError, damaged

SCHEMA = ViewSchema(version=1, statements=["CREATE TABLE things (n INTEGER PRIMARY KEY, label TEXT)"])
#: Enough rows that the table spans far more pages than a freshly opened connection has read.
ROWS = 20_000


def set_aside_count(path: Path) -> float:
    value = prometheus_client.REGISTRY.get_sample_value(
        "hookline_state_files_set_aside_total", {"file": path.name}
    )
    return value or 0.0


def filled(path: Path) -> Path:
    """A real SQLite file of many pages, closed (its WAL checkpointed into it)."""
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE things (n INTEGER PRIMARY KEY, label TEXT)")
        db.executemany("INSERT INTO things VALUES (?, ?)", ((n, f"thing {n:08d} " * 8) for n in range(ROWS)))
    db.close()
    return path


def garbage_over_everything(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def garbage_over_the_header(path: Path) -> None:
    with path.open("r+b") as file:
        file.write(os.urandom(100))


def truncated_to_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def truncated_mid_page(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 3 + 123)


def garbage_in_the_middle(path: Path) -> None:
    """Pages that only a query reaching them finds damaged (the header and schema are intact)."""
    size = path.stat().st_size
    with path.open("r+b") as file:
        file.seek(size // 4)
        file.write(os.urandom(size // 2))


def make_table(db: sqlite3.Connection) -> str:
    db.execute("CREATE TABLE IF NOT EXISTS things (n INTEGER PRIMARY KEY, label TEXT)")
    return "prepared"


def count(db: sqlite3.Connection) -> int:
    return int(db.execute("SELECT count(*), sum(length(label)) FROM things").fetchone()[0])


def aside(path: Path) -> list[Path]:
    """The damaged files set aside (their logs beside them left out)."""
    return sorted(path.parent.glob(f"{path.name}.corrupt-*Z"))


@pytest.mark.parametrize(
    "damage", [garbage_over_everything, garbage_over_the_header, truncated_to_half, truncated_mid_page]
)
def test_a_file_damaged_before_open_is_set_aside_and_a_fresh_one_prepared(
    tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    path = filled(tmp_path / "view.sqlite")
    damage(path)
    damaged_bytes = path.read_bytes()
    before = set_aside_count(path)
    state = StateFile(path, prepare=make_table)
    with capture_logs() as logs:
        assert state.open() == "prepared"
    try:
        assert state.run(count) == 0, "a fresh, empty file"
    finally:
        state.close()
    [moved] = aside(path)
    assert moved.read_bytes() == damaged_bytes, "set aside as it was, not deleted"
    assert moved.name.startswith("view.sqlite.corrupt-")
    [line] = [entry for entry in logs if entry["event"] == "state_file_set_aside"]
    assert (line["log_level"], line["alert"]) == ("error", True)
    assert (line["path"], line["moved_to"]) == (str(path), str(moved))
    assert line["code"] in {"SQLITE_NOTADB", "SQLITE_CORRUPT"}
    assert line["error"] in {"file is not a database", "database disk image is malformed"}
    assert set_aside_count(path) == before + 1


def test_a_page_found_damaged_in_use_replaces_the_file_and_says_so(tmp_path: Path) -> None:
    path = filled(tmp_path / "view.sqlite")
    state = StateFile(path, prepare=make_table)
    state.open()  # reads the header and the schema only
    garbage_in_the_middle(path)
    with capture_logs() as logs, pytest.raises(StateFileReplacedError, match=r"view\.sqlite was damaged"):
        state.run(count)
    try:
        assert state.run(count) == 0, "the fresh file, prepared"
        state.run(lambda db: db.execute("INSERT INTO things VALUES (1, 'new')"))
        assert state.run(count) == 1
    finally:
        state.close()
    assert len(aside(path)) == 1
    assert [entry["code"] for entry in logs if entry["event"] == "state_file_set_aside"] == ["SQLITE_CORRUPT"]


def test_errors_that_are_not_damage_leave_the_file_alone(tmp_path: Path) -> None:
    path = filled(tmp_path / "view.sqlite")
    state = StateFile(path, prepare=make_table)
    state.open()
    try:
        with pytest.raises(sqlite3.OperationalError, match="no such table"):
            state.run(lambda db: db.execute("SELECT * FROM missing"))
        with pytest.raises(sqlite3.IntegrityError):
            state.run(lambda db: db.execute("INSERT INTO things VALUES (1, 'again')"))
        assert state.run(count) == ROWS
    finally:
        state.close()
    assert aside(path) == []


def test_a_fresh_file_never_replays_the_damaged_files_log(tmp_path: Path) -> None:
    live = filled(tmp_path / "live.sqlite")
    db = sqlite3.connect(live, isolation_level=None)
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.executemany("INSERT INTO things VALUES (?, 'x')", ((ROWS + n,) for n in range(100)))
    # What a process killed now leaves: the file, and its last commits in the log beside it.
    path = tmp_path / "view.sqlite"
    shutil.copy(live, path)
    shutil.copy(f"{live}-wal", f"{path}-wal")
    db.close()
    garbage_in_the_middle(path)
    # Someone else has it open too (an operator's sqlite3 shell): closing ours then leaves the log.
    shell = sqlite3.connect(path)
    shell.execute("SELECT count(*) FROM sqlite_master").fetchone()
    state = StateFile(path, prepare=make_table)
    state.open()
    try:
        with pytest.raises(StateFileReplacedError):
            state.run(count)
        assert state.run(count) == 0
    finally:
        state.close()
        shell.close()
    [moved] = aside(path)
    assert Path(f"{moved}-wal").exists(), "kept with its file"


def test_an_in_memory_file_is_never_set_aside() -> None:
    state = StateFile(None, prepare=make_table)
    state.open()
    try:
        assert state.run(count) == 0
    finally:
        state.close()


def error(kind: type[Exception], name: str | None) -> Exception:
    raised = kind("what SQLite said")
    if name is not None:
        raised.sqlite_errorname = name  # type: ignore[attr-defined]
    return raised


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (error(sqlite3.DatabaseError, "SQLITE_NOTADB"), True),
        (error(sqlite3.DatabaseError, "SQLITE_CORRUPT"), True),
        (error(sqlite3.DatabaseError, "SQLITE_CORRUPT_INDEX"), True),
        (error(sqlite3.OperationalError, "SQLITE_FULL"), False),  # the disk, not the file
        (error(sqlite3.OperationalError, "SQLITE_BUSY"), False),
        (error(sqlite3.OperationalError, "SQLITE_CANTOPEN"), False),
        (error(sqlite3.DatabaseError, None), False),
        (error(ValueError, "SQLITE_CORRUPT"), False),
    ],
)
def test_damage_is_what_sqlite_calls_corrupt_or_not_a_database(raised: Exception, expected: bool) -> None:
    assert damaged(raised) is expected


# --- a view's store -------------------------------------------------------------------------------


def insert(n: int) -> Callable[[sqlite3.Connection], Any]:
    return lambda db: db.execute("INSERT INTO things (n, label) VALUES (?, ?)", (n, f"thing {n} " * 20))


async def view_of_many(path: Path) -> None:
    async with ViewStore(path, schema=SCHEMA, identity="s") as store:
        await store.write(
            lambda db: db.executemany(
                "INSERT INTO things VALUES (?, ?)", ((n, f"thing {n:08d} " * 8) for n in range(ROWS))
            ),
            applied=(41, "m41"),
        )


async def test_a_view_damaged_before_open_starts_from_the_first_offset(tmp_path: Path) -> None:
    path = tmp_path / "view.sqlite"
    await view_of_many(path)
    garbage_over_everything(path)
    with capture_logs() as logs:
        async with ViewStore(path, schema=SCHEMA, identity="s") as store:
            assert (store.last_applied, store.next_offset, await store.read(count)) == (None, "first", 0)
            await store.write(insert(0), applied=(0, "m0"))
    assert [entry["event"] for entry in logs] == ["state_file_set_aside", "view_rebuilt"]
    assert len(aside(path)) == 1


async def test_a_view_damaged_in_use_records_no_offset_until_it_is_reset(tmp_path: Path) -> None:
    path = tmp_path / "view.sqlite"
    await view_of_many(path)
    async with ViewStore(path, schema=SCHEMA, identity="s") as store:
        assert store.last_applied == (41, "m41")
        garbage_in_the_middle(path)
        with pytest.raises(StateFileReplacedError):
            await store.read(count)
        assert (store.replaced, store.last_applied, store.next_offset) == (True, None, "first")
        # An offset written now would claim rows the fresh file does not have.
        with pytest.raises(StateFileReplacedError, match="reset the view"):
            await store.write(insert(42), applied=(42, "m42"))
        await store.write(lambda db: db.execute("DELETE FROM things"))  # no offset: harmless
        await store.reset(reason="its file was damaged and set aside")
        assert store.replaced is False
        await store.write(insert(0), applied=(0, "m0"))
    async with ViewStore(path, schema=SCHEMA, identity="s") as store:
        assert (store.last_applied, await store.read(count)) == ((0, "m0"), 1)


# --- the monitor's checkpoint ---------------------------------------------------------------------

IDENTITY = "vhost/hookline.telemetry.log"


async def test_a_damaged_checkpoint_reads_as_none_and_the_next_save_starts_afresh(tmp_path: Path) -> None:
    path = tmp_path / "monitor.checkpoint.sqlite"
    data = os.urandom(400_000)  # many overflow pages
    async with CheckpointStore(path) as store:
        await store.save(data, offset=99, identity=IDENTITY)
    garbage_over_the_header(path)
    async with CheckpointStore(path) as store:
        assert await store.read(IDENTITY) is None, "set aside at open: rebuilt from the stream"
        await store.save(data, offset=100, identity=IDENTITY)
    async with CheckpointStore(path) as store:
        garbage_in_the_middle(path)
        assert await store.read(IDENTITY) is None, "set aside in use"
        await store.save(b"whole", offset=101, identity=IDENTITY)
        assert await store.read(IDENTITY) == (b"whole", 101)
    assert len(aside(path)) == 2
