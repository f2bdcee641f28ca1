"""The PostgreSQL the outbox tests use, and a fresh database per test module.

``HOOKLINE_TEST_POSTGRES_URL`` names a server and a user that may create databases (default: this
machine's, ``postgresql://postgres@127.0.0.1:5432/postgres``). A server that cannot be reached is a test
failure, never a skip.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import psycopg

LOCAL_DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def server_url() -> str:
    return os.environ.get("HOOKLINE_TEST_POSTGRES_URL", LOCAL_DEFAULT_URL)


@contextmanager
def database(label: str) -> Iterator[str]:
    """A new database for ``label``'s tests, dropped afterwards (its connections ended first)."""
    base = server_url()
    name = f"hookline_test_{re.sub(r'[^a-z0-9]+', '_', label.lower())[:30]}_{uuid.uuid4().hex[:8]}"
    try:
        admin = psycopg.connect(base, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as exc:
        raise AssertionError(
            f"no PostgreSQL at {base} ({exc}); start it (scripts/start-postgres.sh) or set "
            "HOOKLINE_TEST_POSTGRES_URL"
        ) from None
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield urlunsplit(urlsplit(base)._replace(path=f"/{name}"))
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
