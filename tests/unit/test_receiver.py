"""The receiver library: verification as Standard Webhooks defines it (signed by hookline's own signer and by
the standardwebhooks library), the stores' claim/complete/release lifecycle, handling once, and the
FastAPI and Flask integrations. Redis is the real one on 127.0.0.1:6379: unreachable, these tests fail."""

from __future__ import annotations

import asyncio
import gzip
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import flask
import httpx
import pytest
import redis
import redis.asyncio
from standardwebhooks.webhooks import Webhook
from support.receiver_apps import fastapi_app

from hookline.receiver import (
    AsyncReceiver,
    BodyEncodingError,
    Delivery,
    InvalidTimestampError,
    MalformedSignatureError,
    MemoryStore,
    MissingHeaderError,
    NoMatchingSignatureError,
    Outcome,
    Receiver,
    SeenStore,
    SQLiteStore,
    Status,
    TimestampTooNewError,
    TimestampTooOldError,
    VerificationError,
    verify,
)
from hookline.receiver.flask import webhook
from hookline.receiver.redis import AsyncRedisStore, RedisStore
from hookline.receiver.verify import MAX_INFLATED_BYTES, signing_keys
from hookline.shared.outbound import signing

SECRET = signing.generate_secret()
OLD_SECRET = signing.generate_secret()
OTHER_SECRET = signing.generate_secret()
NOW_S = 1_760_000_000
BODY = b'{"id":"evt_1","type":"order.created","data":{"n":1}}'
REDIS_URL = "redis://127.0.0.1:6379/15"


def signed(
    secrets: list[str], *, webhook_id: str = "evt_1", timestamp_s: int = NOW_S, body: bytes = BODY
) -> dict[str, str]:
    """Headers as hookline's dispatcher signs them."""
    keys = [signing.secret_key(s) for s in secrets]
    return signing.webhook_headers(keys, webhook_id, body, timestamp_s=timestamp_s)


class Clock:
    def __init__(self, now_s: float = NOW_S) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


# --- verification -----------------------------------------------------------------------------------


def _one_valid_among_bogus() -> dict[str, str]:
    headers = signed([SECRET])
    bogus = signing.sign(signing.secret_key(OTHER_SECRET), "evt_1", NOW_S, BODY)
    headers["webhook-signature"] = f"{bogus} v1a,c29tZXRoaW5n {headers['webhook-signature']} {bogus}"
    return headers


@pytest.mark.parametrize(
    ("headers", "held", "now_s"),
    [
        pytest.param(signed([SECRET]), [SECRET], NOW_S, id="valid"),
        pytest.param(_one_valid_among_bogus(), [SECRET], NOW_S, id="several-signatures-one-valid"),
        pytest.param(signed([SECRET, OLD_SECRET]), [SECRET], NOW_S, id="sender-rotating-receiver-new"),
        pytest.param(signed([SECRET, OLD_SECRET]), [OLD_SECRET], NOW_S, id="sender-rotating-receiver-old"),
        pytest.param(signed([SECRET]), [OLD_SECRET, SECRET], NOW_S, id="receiver-holds-two"),
        pytest.param(signed([SECRET]), [SECRET], NOW_S + 300, id="at-the-tolerance-late"),
        pytest.param(signed([SECRET]), [SECRET], NOW_S - 300, id="at-the-tolerance-early"),
        pytest.param({k.title(): v for k, v in signed([SECRET]).items()}, [SECRET], NOW_S, id="header-case"),
    ],
)
def test_genuine_deliveries_verify(headers: dict[str, str], held: list[str], now_s: float) -> None:
    assert verify(headers, BODY, held, now_s=now_s) == Delivery("evt_1", NOW_S, BODY)


def test_the_spec_test_vector_and_the_standardwebhooks_signer_verify() -> None:
    spec = {
        "webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
        "webhook-timestamp": "1614265330",
        "webhook-signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
    }
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"test": 2432232314}'
    assert verify(spec, body, secret, now_s=1614265330).webhook_id == "msg_p5jXN8AQM9LWM0D4loKWxJek"

    at = datetime.fromtimestamp(NOW_S, UTC)
    by_library = Webhook(SECRET).sign("msg_1", at, BODY.decode())
    headers = {"webhook-id": "msg_1", "webhook-timestamp": str(NOW_S), "webhook-signature": by_library}
    assert verify(headers, BODY, SECRET, now_s=NOW_S).json()["type"] == "order.created"


def _with(**changes: str | None) -> dict[str, str]:
    headers = signed([SECRET])
    for name, value in changes.items():
        header = name.replace("_", "-")
        if value is None:
            del headers[header]
        else:
            headers[header] = value
    return headers


@pytest.mark.parametrize(
    ("headers", "body", "held", "now_s", "error"),
    [
        pytest.param(signed([OTHER_SECRET]), BODY, [SECRET], NOW_S, NoMatchingSignatureError, id="wrong-secret"),
        pytest.param(signed([SECRET]), BODY + b" ", [SECRET], NOW_S, NoMatchingSignatureError, id="tampered-body"),
        pytest.param(_with(webhook_id="evt_2"), BODY, [SECRET], NOW_S, NoMatchingSignatureError, id="other-id"),
        pytest.param(
            _with(webhook_timestamp=str(NOW_S + 1)), BODY, [SECRET], NOW_S, NoMatchingSignatureError,
            id="other-timestamp",
        ),
        pytest.param(signed([SECRET]), BODY, [SECRET], NOW_S + 301, TimestampTooOldError, id="too-old"),
        pytest.param(signed([SECRET]), BODY, [SECRET], NOW_S - 301, TimestampTooNewError, id="too-new"),
        pytest.param(_with(webhook_id=None), BODY, [SECRET], NOW_S, MissingHeaderError, id="no-id"),
        pytest.param(_with(webhook_timestamp=None), BODY, [SECRET], NOW_S, MissingHeaderError, id="no-timestamp"),
        pytest.param(_with(webhook_signature=None), BODY, [SECRET], NOW_S, MissingHeaderError, id="no-signature"),
        pytest.param(_with(webhook_signature="  "), BODY, [SECRET], NOW_S, MissingHeaderError, id="blank-signature"),
        pytest.param(_with(webhook_timestamp="soon"), BODY, [SECRET], NOW_S, InvalidTimestampError, id="word-timestamp"),
        pytest.param(_with(webhook_timestamp="-5"), BODY, [SECRET], NOW_S, InvalidTimestampError, id="negative-timestamp"),
        pytest.param(_with(webhook_timestamp="1.5e9"), BODY, [SECRET], NOW_S, InvalidTimestampError, id="float-timestamp"),
        pytest.param(_with(webhook_timestamp="١٧٦٠"), BODY, [SECRET], NOW_S, InvalidTimestampError, id="non-ascii-digits"),
        pytest.param(_with(webhook_signature="garbage"), BODY, [SECRET], NOW_S, MalformedSignatureError, id="no-comma"),
        pytest.param(_with(webhook_signature="v1,"), BODY, [SECRET], NOW_S, MalformedSignatureError, id="empty-signature"),
        pytest.param(_with(webhook_signature=",abc"), BODY, [SECRET], NOW_S, MalformedSignatureError, id="empty-version"),
        pytest.param(_with(webhook_signature="v2,abc"), BODY, [SECRET], NOW_S, MalformedSignatureError, id="no-v1"),
        pytest.param(
            _with(webhook_signature=" ".join(["v1,abc"] * 17)), BODY, [SECRET], NOW_S, MalformedSignatureError,
            id="too-many",
        ),
    ],
)  # fmt: skip
def test_refused_deliveries_name_the_problem(
    headers: dict[str, str], body: bytes, held: list[str], now_s: float, error: type[VerificationError]
) -> None:
    with pytest.raises(error) as raised:
        verify(headers, body, held, now_s=now_s)
    assert raised.value.reason == error.reason
    text = str(raised.value)
    # Never a secret, a signature or the payload in the text.
    for secret in (SECRET, OTHER_SECRET):
        assert secret.removeprefix("whsec_") not in text
    signatures = [entry.partition(",")[2] for entry in headers.get("webhook-signature", "").split()]
    assert not [s for s in signatures if len(s) > 8 and s in text]
    assert "order.created" not in text


def _gzipped(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)  # the same bytes in every process: pytest-xdist compares test ids


@pytest.mark.parametrize(
    ("encoding", "body", "detail"),
    [
        pytest.param("br", BODY, "is not gzip", id="brotli"),
        pytest.param("gzip", BODY, "does not inflate", id="not-gzip"),
        pytest.param("gzip", _gzipped(BODY)[:-9], "truncated", id="truncated"),
        pytest.param("gzip", _gzipped(b" " * (MAX_INFLATED_BYTES + 1)), "more than", id="bomb"),
    ],
)
def test_a_body_that_does_not_inflate_is_refused(encoding: str, body: bytes, detail: str) -> None:
    with pytest.raises(BodyEncodingError, match=detail) as raised:
        verify({**signed([SECRET]), "Content-Encoding": encoding}, body, SECRET, now_s=NOW_S)
    assert raised.value.reason == "invalid_body_encoding"


def test_a_gzip_body_is_verified_and_handed_over_inflated() -> None:
    headers = {**signed([SECRET]), "content-encoding": "gzip"}
    assert verify(headers, _gzipped(BODY), SECRET, now_s=NOW_S).body == BODY
    # Compressed bytes that were not what was signed are refused as any tampered body.
    with pytest.raises(NoMatchingSignatureError):
        verify(headers, _gzipped(BODY + b" "), SECRET, now_s=NOW_S)


def test_a_missing_header_is_named() -> None:
    with pytest.raises(MissingHeaderError) as raised:
        verify(_with(webhook_timestamp=None), BODY, SECRET, now_s=NOW_S)
    assert raised.value.header == "webhook-timestamp"


@pytest.mark.parametrize(
    "secrets",
    [[], ["MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"], ["whsec_not base64!"], ["whsec_"], [SECRET, "whsec_%%%"]],
)
def test_malformed_secrets_are_refused_at_start_without_being_repeated(secrets: list[str]) -> None:
    with pytest.raises(ValueError) as raised:  # noqa: PT011 - the message is checked below
        signing_keys(secrets)
    keys = [secret.removeprefix("whsec_") for secret in secrets]
    assert not [key for key in keys if key and key in str(raised.value)]
    with pytest.raises(ValueError):  # noqa: PT011
        Receiver(secrets)


# --- stores ----------------------------------------------------------------------------------------


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A key prefix of this test's own in db 15, deleted after; Redis must answer (no skip)."""
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    prefix = f"test-receiver:{uuid.uuid4().hex}:"
    try:
        yield prefix
    finally:
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        yield client
    finally:
        client.close()


StoreFactory = Callable[..., SeenStore]


@pytest.fixture(params=["memory", "sqlite"])
def store_with_clock(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[SeenStore, Clock]]:
    clock = Clock()
    if request.param == "memory":
        yield MemoryStore(ttl_s=1000, lease_s=10, clock=clock), clock
    else:
        with SQLiteStore(tmp_path / "seen.db", ttl_s=1000, lease_s=10, clock=clock) as store:
            yield store, clock


def test_the_claim_lifecycle(store_with_clock: tuple[SeenStore, Clock]) -> None:
    store, _ = store_with_clock
    first = store.claim("evt_1")
    assert first.status is Status.CLAIMED
    assert store.claim("evt_1").status is Status.BUSY  # another request meanwhile
    store.release(first)  # the handler failed
    second = store.claim("evt_1")
    assert second.status is Status.CLAIMED
    store.release(first)  # a stale release frees nothing
    assert store.claim("evt_1").status is Status.BUSY
    store.complete(second)
    assert store.claim("evt_1").status is Status.DONE
    store.release(second)  # nor does a release after completion
    assert store.claim("evt_1").status is Status.DONE
    assert store.claim("evt_2").status is Status.CLAIMED  # ids are independent


def test_a_lease_and_a_record_expire(store_with_clock: tuple[SeenStore, Clock]) -> None:
    store, clock = store_with_clock
    crashed = store.claim("evt_crashed")
    assert crashed.status is Status.CLAIMED
    clock.now_s += 9.9
    assert store.claim("evt_crashed").status is Status.BUSY
    clock.now_s += 0.2  # the lease (10 s) ran out: the process that claimed it died
    retried = store.claim("evt_crashed")
    assert retried.status is Status.CLAIMED
    store.complete(retried)
    clock.now_s += 999
    assert store.claim("evt_crashed").status is Status.DONE
    clock.now_s += 2  # ttl_s (1000) after completion
    assert store.claim("evt_crashed").status is Status.CLAIMED


def test_the_memory_store_forgets_the_least_recently_seen_first() -> None:
    store = MemoryStore(max_entries=2, clock=Clock())
    for webhook_id in ("a", "b"):
        store.complete(store.claim(webhook_id))
    assert store.claim("a").status is Status.DONE  # a is now more recent than b
    store.complete(store.claim("c"))
    assert len(store) == 2
    assert store.claim("a").status is Status.DONE
    assert store.claim("c").status is Status.DONE
    assert store.claim("b").status is Status.CLAIMED  # evicted: a duplicate of it would run again


def test_the_sqlite_store_survives_a_restart_and_purges_expired_rows(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "seen.db"
    with SQLiteStore(path, ttl_s=100, clock=clock) as store:
        store.complete(store.claim("evt_kept"))
        store.complete(store.claim("evt_old"))
    clock.now_s += 50
    with SQLiteStore(path, ttl_s=100, clock=clock, purge_every=2) as store:
        store.complete(store.claim("evt_new"))
        assert store.claim("evt_kept").status is Status.DONE  # the second claim purges: nothing expired yet
        assert len(store) == 3
        clock.now_s += 60
        assert store.purge() == 2
        assert len(store) == 1
        assert store.claim("evt_old").status is Status.CLAIMED


def _race(claim: Callable[[], Status], contenders: int = 16) -> list[Status]:
    """Every contender claims at the same moment (a barrier), each in its own thread."""
    barrier = threading.Barrier(contenders)
    results: list[Status] = []
    lock = threading.Lock()

    def run() -> None:
        barrier.wait(timeout=10)
        status = claim()
        with lock:
            results.append(status)

    threads = [threading.Thread(target=run) for _ in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_concurrent_claims_one_wins_memory() -> None:
    store = MemoryStore()
    results = _race(lambda: store.claim("evt_race").status)
    assert sorted(r.value for r in results) == ["busy"] * 15 + ["claimed"]


def test_concurrent_claims_one_wins_sqlite_across_connections(tmp_path: Path) -> None:
    # A store per thread: as the workers of a server each open the file.
    path = tmp_path / "seen.db"
    SQLiteStore(path).close()

    def claim() -> Status:
        with SQLiteStore(path) as store:
            return store.claim("evt_race").status

    results = _race(claim)
    assert sorted(r.value for r in results) == ["busy"] * 15 + ["claimed"]
    shared = SQLiteStore(path)
    try:
        results = _race(lambda: shared.claim("evt_race_shared").status)
    finally:
        shared.close()
    assert sorted(r.value for r in results) == ["busy"] * 15 + ["claimed"]


def test_redis_store_lifecycle_and_expiry(redis_client: redis.Redis, redis_prefix: str) -> None:
    store = RedisStore(redis_client, prefix=redis_prefix, ttl_s=3600, lease_s=30)
    first = store.claim("evt_1")
    assert first.status is Status.CLAIMED
    assert 0 < redis_client.pttl(f"{redis_prefix}evt_1") <= 30_000
    assert store.claim("evt_1").status is Status.BUSY
    store.release(first)
    second = store.claim("evt_1")
    assert second.status is Status.CLAIMED
    store.release(first)  # stale: frees nothing
    assert store.claim("evt_1").status is Status.BUSY
    store.complete(second)
    assert 3590 < redis_client.ttl(f"{redis_prefix}evt_1") <= 3600
    assert store.claim("evt_1").status is Status.DONE
    store.release(second)
    assert store.claim("evt_1").status is Status.DONE

    # A lease runs out on the server's clock: poll until it has (bounded), never a fixed sleep.
    short = RedisStore(redis_client, prefix=redis_prefix, lease_s=0.05)
    assert short.claim("evt_crashed").status is Status.CLAIMED
    deadline = time.monotonic() + 5
    while (status := short.claim("evt_crashed").status) is Status.BUSY and time.monotonic() < deadline:
        time.sleep(0.01)
    assert status is Status.CLAIMED


def test_redis_store_works_with_decoded_responses(redis_prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        store = RedisStore(client, prefix=redis_prefix)
        store.complete(store.claim("evt_1"))
        assert store.claim("evt_1").status is Status.DONE
    finally:
        client.close()


def test_concurrent_claims_one_wins_redis(redis_client: redis.Redis, redis_prefix: str) -> None:
    store = RedisStore(redis_client, prefix=redis_prefix)
    results = _race(lambda: store.claim("evt_race").status)
    assert sorted(r.value for r in results) == ["busy"] * 15 + ["claimed"]


async def test_concurrent_claims_one_wins_async_redis(redis_prefix: str) -> None:
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    try:
        store = AsyncRedisStore(client, prefix=redis_prefix)
        claims = await asyncio.gather(*(store.claim("evt_race") for _ in range(16)))
        assert sorted(c.status.value for c in claims) == ["busy"] * 15 + ["claimed"]
        [won] = [c for c in claims if c.status is Status.CLAIMED]
        await store.complete(won)
        assert (await store.claim("evt_race")).status is Status.DONE
    finally:
        await client.aclose()


# --- handling once ----------------------------------------------------------------------------------


def test_the_handler_runs_once_and_a_failure_leaves_the_id_open() -> None:
    receiver = Receiver(SECRET, MemoryStore(), clock=Clock())
    runs: list[str] = []

    def handler(delivery: Delivery) -> str:
        runs.append(delivery.webhook_id)
        if len(runs) == 1:
            raise RuntimeError("the database is down")
        return "stored"

    headers = signed([SECRET])
    with pytest.raises(RuntimeError):
        receiver.handle(headers, BODY, handler)
    handled = receiver.handle(headers, BODY, handler)  # hookline's retry
    assert (handled.outcome, handled.result) == (Outcome.HANDLED, "stored")
    assert receiver.handle(headers, BODY, handler).outcome is Outcome.DUPLICATE
    assert runs == ["evt_1", "evt_1"]
    with pytest.raises(NoMatchingSignatureError):
        receiver.handle(signed([OTHER_SECRET], webhook_id="evt_2"), BODY, handler)
    assert runs == ["evt_1", "evt_1"]


def test_a_duplicate_arriving_while_the_first_is_handled_is_in_progress() -> None:
    receiver = Receiver(SECRET, MemoryStore(), clock=Clock())
    delivery = receiver.verify(signed([SECRET]), BODY)
    inner = []

    def handler(d: Delivery) -> None:
        inner.append(receiver.once(d, lambda _: None).outcome)

    assert receiver.once(delivery, handler).outcome is Outcome.HANDLED
    assert inner == [Outcome.IN_PROGRESS]


def test_a_sync_receiver_refuses_an_async_store(redis_prefix: str) -> None:
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    with pytest.raises(TypeError):
        Receiver(SECRET, AsyncRedisStore(client, prefix=redis_prefix))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis"])
async def test_async_receiver_runs_concurrent_duplicates_once(
    kind: str, tmp_path: Path, redis_prefix: str
) -> None:
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    stores: dict[str, Any] = {
        "memory": MemoryStore(),
        "sqlite": SQLiteStore(tmp_path / "seen.db"),
        "redis": AsyncRedisStore(client, prefix=redis_prefix),
    }
    receiver = AsyncReceiver([OLD_SECRET, SECRET], stores[kind], clock=Clock())
    started, release = asyncio.Event(), asyncio.Event()
    runs = 0

    async def handler(_: Delivery) -> None:
        nonlocal runs
        runs += 1
        started.set()
        await release.wait()

    headers = signed([SECRET])
    first = asyncio.create_task(receiver.handle(headers, BODY, handler))
    await asyncio.wait_for(started.wait(), timeout=10)
    others = await asyncio.gather(*(receiver.handle(headers, BODY, handler) for _ in range(5)))
    assert {o.outcome for o in others} == {Outcome.IN_PROGRESS}
    release.set()
    assert (await first).outcome is Outcome.HANDLED
    assert (await receiver.handle(headers, BODY, handler)).outcome is Outcome.DUPLICATE
    assert runs == 1
    stores["sqlite"].close()
    await client.aclose()


# --- integrations ----------------------------------------------------------------------------------


async def _fastapi_handler(delivery: Delivery, runs: list[str]) -> None:
    if delivery.json()["data"].get("fail"):
        runs.append(f"failed {delivery.webhook_id}")
        raise RuntimeError("handler failed")
    runs.append(delivery.webhook_id)


@pytest.fixture
async def fastapi_client() -> AsyncIterator[tuple[httpx.AsyncClient, list[str]]]:
    runs: list[str] = []
    app = fastapi_app([OLD_SECRET, SECRET], MemoryStore(), lambda d: _fastapi_handler(d, runs))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://receiver") as client:
        yield client, runs


def _fresh(secrets: list[str], webhook_id: str, body: bytes = BODY) -> dict[str, str]:
    return signed(secrets, webhook_id=webhook_id, timestamp_s=int(time.time()), body=body)


async def test_the_fastapi_dependency(fastapi_client: tuple[httpx.AsyncClient, list[str]]) -> None:
    client, runs = fastapi_client
    headers = _fresh([SECRET], "evt_1")
    assert (await client.post("/hooks", content=BODY, headers=headers)).status_code == 204
    duplicate = await client.post("/hooks", content=BODY, headers=headers)
    assert (duplicate.status_code, duplicate.json()) == (200, {"status": "duplicate"})
    forged = await client.post("/hooks", content=BODY, headers=_fresh([OTHER_SECRET], "evt_2"))
    assert (forged.status_code, forged.json()) == (401, {"detail": "no_matching_signature"})
    stale = signed([SECRET], webhook_id="evt_3", timestamp_s=int(time.time()) - 3600)
    answer = await client.post("/hooks", content=BODY, headers=stale)
    assert (answer.status_code, answer.json()) == (400, {"detail": "timestamp_too_old"})
    failing = b'{"id":"evt_4","data":{"fail":true}}'
    answer = await client.post("/hooks", content=failing, headers=_fresh([SECRET], "evt_4", failing))
    assert answer.status_code == 500
    assert runs == ["evt_1", "failed evt_4"]


def test_the_flask_decorator() -> None:
    app = flask.Flask(__name__)
    runs: list[tuple[str, str]] = []

    @app.post("/hooks/<source>")
    @webhook(secret=SECRET, store=MemoryStore())
    def hooks(delivery: Delivery, source: str) -> None:
        if delivery.json()["data"].get("fail"):
            raise RuntimeError("handler failed")
        runs.append((source, delivery.webhook_id))

    client = app.test_client()
    headers = _fresh([SECRET], "evt_1")
    assert client.post("/hooks/shop", data=BODY, headers=headers).status_code == 204
    duplicate = client.post("/hooks/shop", data=BODY, headers=headers)
    assert (duplicate.status_code, duplicate.json) == (200, {"status": "duplicate"})
    forged = client.post("/hooks/shop", data=BODY, headers=_fresh([OTHER_SECRET], "evt_2"))
    assert (forged.status_code, forged.json) == (401, {"error": "no_matching_signature"})
    missing = {k: v for k, v in _fresh([SECRET], "evt_3").items() if k != "webhook-id"}
    assert client.post("/hooks/shop", data=BODY, headers=missing).json == {"error": "missing_header"}
    failing = b'{"id":"evt_4","data":{"fail":true}}'
    answer = client.post("/hooks/shop", data=failing, headers=_fresh([SECRET], "evt_4", failing))
    assert answer.status_code == 500  # hookline retries it: the id was left open
    assert runs == [("shop", "evt_1")]


def test_importing_the_library_pulls_no_service_or_framework_dependency() -> None:
    probe = (
        "import sys, hookline.receiver; "
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules} "
        "& {'aio_pika', 'aiohttp', 'fastapi', 'starlette', 'flask', 'redis', 'pydantic', 'structlog'}))); "
        "print('hookline.shared' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split("\n")[:2] == ["", "False"]
