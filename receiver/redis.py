"""Handled webhook ids in Redis: shared by every process and machine of a receiver.

One key per id (``prefix + webhook_id``): a claim is ``claim:<token>`` with a lease (PX), a handled
id is ``done`` with ``ttl_s`` (EX); Redis expires them. Claiming is one Lua script, so that of
concurrent duplicates exactly one sees its SET NX succeed and the others learn DONE or BUSY atomically.
"""

from __future__ import annotations

from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from hookline.receiver.stores import DEFAULT_LEASE_S, DEFAULT_TTL_S, Claim, Status, new_token

DEFAULT_PREFIX = "hookline:webhook:"
_DONE = "done"

# 1: claimed; 2: handled before; 3: another caller holds the lease.
_CLAIM = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('get', KEYS[1]) == ARGV[3] then return 2 end
return 3
"""
# Only the caller's own lease: after it ran out another request may hold the id, or it may be done.
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
_STATUSES = {1: Status.CLAIMED, 2: Status.DONE, 3: Status.BUSY}


class _Keys:
    def __init__(self, prefix: str, ttl_s: float, lease_s: float) -> None:
        if ttl_s < 1 or lease_s <= 0:
            raise ValueError("ttl_s must be at least 1 and lease_s positive")
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.lease_s = lease_s

    def key(self, webhook_id: str) -> str:
        return self.prefix + webhook_id

    def lease_ms(self) -> int:
        return max(1, round(self.lease_s * 1000))

    @staticmethod
    def result(webhook_id: str, token: str, answer: object) -> Claim:
        status = _STATUSES[int(answer)]  # type: ignore[call-overload]
        return Claim(webhook_id, status, token if status is Status.CLAIMED else "")


class RedisStore:
    """With a ``redis.Redis`` client (decode_responses either way)."""

    def __init__(
        self,
        client: Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl_s: float = DEFAULT_TTL_S,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        self.client = client
        self._keys = _Keys(prefix, ttl_s, lease_s)

    def claim(self, webhook_id: str) -> Claim:
        token = "claim:" + new_token()
        key = self._keys.key(webhook_id)
        answer = self.client.eval(_CLAIM, 1, key, token, self._keys.lease_ms(), _DONE)
        return self._keys.result(webhook_id, token, answer)

    def complete(self, claim: Claim) -> None:
        self.client.set(self._keys.key(claim.webhook_id), _DONE, ex=round(self._keys.ttl_s))

    def release(self, claim: Claim) -> None:
        self.client.eval(_RELEASE, 1, self._keys.key(claim.webhook_id), claim.token)


class AsyncRedisStore:
    """With a ``redis.asyncio.Redis`` client: for AsyncReceiver and the FastAPI dependency."""

    def __init__(
        self,
        client: AsyncRedis,
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl_s: float = DEFAULT_TTL_S,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        self.client = client
        self._keys = _Keys(prefix, ttl_s, lease_s)

    async def claim(self, webhook_id: str) -> Claim:
        token = "claim:" + new_token()
        key = self._keys.key(webhook_id)
        answer = await self.client.eval(_CLAIM, 1, key, token, self._keys.lease_ms(), _DONE)
        return self._keys.result(webhook_id, token, answer)

    async def complete(self, claim: Claim) -> None:
        await self.client.set(self._keys.key(claim.webhook_id), _DONE, ex=round(self._keys.ttl_s))

    async def release(self, claim: Claim) -> None:
        await self.client.eval(_RELEASE, 1, self._keys.key(claim.webhook_id), claim.token)
