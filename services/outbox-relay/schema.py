"""The outbox table's schema, shipped as numbered SQL files (``migrations/``) that upstreams may also
apply themselves; this module applies those not yet applied, and checks that they were."""

from __future__ import annotations

from importlib import resources

import structlog
from psycopg import AsyncConnection
from psycopg.rows import TupleRow

log = structlog.get_logger(__name__)

Connection = AsyncConnection[TupleRow]

TABLE = "hookline_outbox"


async def connect(dsn: str, *, autocommit: bool = False) -> Connection:
    return await AsyncConnection.connect(dsn, autocommit=autocommit, application_name="hookline-outbox-relay")


class SchemaMissingError(RuntimeError):
    pass


def migrations() -> list[tuple[int, str, str]]:
    """(version, file name, SQL) of every shipped migration, in order."""
    folder = resources.files(__package__).joinpath("migrations")
    found = [
        (int(f.name.split("_")[0]), f.name, f.read_text())
        for f in folder.iterdir()
        if f.name.endswith(".sql")
    ]
    return sorted(found)


async def migrate(conn: Connection) -> list[str]:
    """Apply the migrations this database lacks (one transaction; replicas starting together wait
    for each other); the names of those applied."""
    applied: list[str] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('hookline_outbox_migrate'))")
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS hookline_outbox_migrations "
            "(version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        cursor = await conn.execute("SELECT version FROM hookline_outbox_migrations")
        done = {row[0] for row in await cursor.fetchall()}
        for version, name, sql in migrations():
            if version in done:
                continue
            await conn.execute(sql.encode())
            await conn.execute(
                "INSERT INTO hookline_outbox_migrations (version, name) VALUES (%s, %s)", (version, name)
            )
            applied.append(name)
    log.info("outbox_migrated", applied=applied)
    return applied


async def check(conn: Connection) -> None:
    """At start: the table exists (an upstream may apply the SQL its own way, so no version check)."""
    cursor = await conn.execute("SELECT to_regclass(%s) IS NOT NULL", (TABLE,))
    row = await cursor.fetchone()
    await conn.rollback()
    if not row or not row[0]:
        first = migrations()[0][1]
        raise SchemaMissingError(
            f"no {TABLE} table in this database: run `hookline outbox-relay --dsn ... --migrate`, "
            f"or apply services/outbox-relay/migrations/{first} yourself"
        )
