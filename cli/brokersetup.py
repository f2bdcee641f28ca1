"""``hookline broker-setup``: create the broker users of :mod:`permissions` and grant them exactly that.

Two ways to reach the broker: ``rabbitmqctl`` on the broker's host (the default), or RabbitMQ's
management HTTP API (``--management-url``; compose and Kubernetes). Either way the broker's definitions
are read, the users and permissions decided (:func:`plan`, pure) and loaded in one import. Idempotent:
run again, the permissions are set again and a user's password is kept unless a new one is given or
``--rotate``.

Passwords come from ``HOOKLINE_BROKER_PASSWORD_<USER>`` (the user name upper-cased, ``-`` as ``_``), or
are generated for a new user and printed once with the URL each service needs. A variable that is set
must hold :data:`MIN_PASSWORD_LENGTH` characters: a shorter one (empty included) is refused before the
broker is touched, so a placeholder left in a Secret stops the run instead of becoming a password.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import shlex
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import httpx
from pydantic import Field

from hookline.shared.broker.permissions import GRANTS, USERS, Grant, Role, TopicGrant, upstream_grant
from hookline.shared.contracts.models import Model, Tenant

#: Read the broker's alarms and file handles through the management API (/api/nodes).
_TAGS: dict[Role, tuple[str, ...]] = {
    Role.INGEST: ("monitoring",),
    Role.MONITOR: ("monitoring",),
    Role.DISPATCHER: (),
}
_PASSWORD_BYTES = 24
_SHA256 = "rabbit_password_hashing_sha256"  # how password_hash() hashes
#: What a given password must have at least (deploy/kubernetes' placeholders are shorter on purpose).
MIN_PASSWORD_LENGTH = 16
_EXPORT_ATTEMPTS = 3


class Upstream(Model):
    user: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    tenant: Tenant | None = None  # None: may publish for every tenant

    @classmethod
    def parse(cls, text: str) -> Upstream:
        """``NAME`` or ``NAME:TENANT`` (``NAME:`` is refused: an empty tenant, an unset variable perhaps,
        must not mean every tenant)."""
        user, colon, tenant = text.partition(":")
        if colon and not tenant:
            raise ValueError(f"--upstream {text!r}: the tenant after ':' is empty")
        if user in USERS.values():
            raise ValueError(f"--upstream {user!r} is one of hookline's own users")
        return cls(user=user, tenant=tenant or None)


class SetupUser(Model):
    user: str
    role: str  # ingest, dispatcher, monitor or upstream
    tenant: str | None = None
    password: str | None = None  # shown once, when it was set by this run
    amqp_url: str | None = None


class Admin(Protocol):
    """How the broker is reached: its definitions read and loaded in one call each (users, vhosts,
    permissions; ``rabbitmqctl`` costs most of a second per call)."""

    def export(self) -> dict[str, Any]: ...
    def load(self, definitions: dict[str, Any]) -> None: ...
    def clear_topic_permissions(self, vhost: str, user: str) -> None: ...


class SetupError(Exception):
    pass


class PasswordError(SetupError):
    """A given password is too short to be one: running again cannot help (the CLI exits 2)."""


class CtlAdmin:
    """Through ``rabbitmqctl`` (a command line, e.g. ``rabbitmqctl -n rabbit@host``)."""

    def __init__(self, command: str = "rabbitmqctl") -> None:
        self._command = shlex.split(command)

    def _run(self, *arguments: str, stdin: str | None = None) -> str:
        try:
            # The operator's own command line and fixed arguments, no shell.
            done = subprocess.run(  # noqa: S603
                [*self._command, "-q", *arguments],
                input=stdin,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
        except OSError as exc:
            raise SetupError(f"cannot run {self._command[0]}: {exc}") from None
        if done.returncode != 0:
            raise SetupError(f"rabbitmqctl {arguments[0]} failed: {(done.stderr or done.stdout).strip()}")
        return done.stdout

    # Through stdin and stdout: rabbitmqctl may run as another user than this process (no shared file).
    def export(self) -> dict[str, Any]:
        # RabbitMQ 3.10's rabbitmqctl has printed a lone "{" and exited 0 on a busy broker (seen once in
        # a test run, other vhosts being deleted meanwhile): asked again, it answers.
        for _ in range(_EXPORT_ATTEMPTS):
            printed = self._run("export_definitions", "-", "--format", "json")
            try:
                exported: dict[str, Any] = json.loads(printed)
            except json.JSONDecodeError:
                continue
            return exported
        # Only the start of it: the definitions hold password hashes.
        raise SetupError(
            f"rabbitmqctl export_definitions printed no JSON {_EXPORT_ATTEMPTS} times (the last time"
            f" {len(printed)} characters, beginning {printed[:12]!r})"
        )

    def load(self, definitions: dict[str, Any]) -> None:
        self._run("import_definitions", "--format", "json", stdin=json.dumps(definitions))

    def clear_topic_permissions(self, vhost: str, user: str) -> None:
        self._run("clear_topic_permissions", "-p", vhost, user)


class HttpAdmin:
    """Through the management HTTP API (``http://admin:password@host:15672``)."""

    def __init__(self, management_url: str) -> None:
        parts = urlsplit(management_url)
        auth = (unquote(parts.username or "guest"), unquote(parts.password or "guest"))
        base = f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        self._http = httpx.Client(base_url=base, auth=auth, timeout=60.0)

    def _call(self, method: str, path: str, body: object = None) -> httpx.Response:
        try:
            response = self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise SetupError(f"cannot reach the management API at {self._http.base_url}: {exc}") from None
        if response.status_code >= 400 and response.status_code != 404:
            raise SetupError(f"{method} {path}: {response.status_code} {response.text[:200]}")
        return response

    def export(self) -> dict[str, Any]:
        exported: dict[str, Any] = self._call("GET", "/api/definitions").json()
        return exported

    def load(self, definitions: dict[str, Any]) -> None:
        self._call("POST", "/api/definitions", definitions)

    def clear_topic_permissions(self, vhost: str, user: str) -> None:
        self._call("DELETE", f"/api/topic-permissions/{quote(vhost, safe='')}/{quote(user, safe='')}")


@dataclass(frozen=True)
class Wanted:
    user: str
    role: str
    tenant: str | None
    grant: Grant
    topic: TopicGrant | None
    tags: tuple[str, ...]


def wanted_users(upstreams: Sequence[Upstream]) -> list[Wanted]:
    users = [Wanted(USERS[role], role.value, None, GRANTS[role], None, _TAGS[role]) for role in Role]
    for upstream in upstreams:
        grant, topic = upstream_grant(upstream.tenant)
        users.append(Wanted(upstream.user, "upstream", upstream.tenant, grant, topic, ()))
    return users


def password_hash(password: str, salt: bytes) -> str:
    """RabbitMQ's ``rabbit_password_hashing_sha256``: base64(salt + SHA-256(salt + password))."""
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


@dataclass(frozen=True)
class Plan:
    definitions: dict[str, Any]  # what to load
    passwords: dict[str, str]  # user -> the password this run sets
    clear_topics: list[str]  # users whose topic permissions go (no tenant any more)


def plan(
    current: dict[str, Any],
    *,
    vhost: str,
    wanted: Sequence[Wanted],
    given: Mapping[str, str],
    rotate: bool,
    new_password: Callable[[], str],
    new_salt: Callable[[], bytes],
) -> Plan:
    """The definitions that give each wanted user its permissions on ``vhost``, keeping a password
    unless one is ``given`` (by user), the user is new, or ``rotate``. Pure: randomness is passed in."""
    existing = {user["name"]: user for user in current.get("users", [])}
    topics_now = {
        t["user"] for t in current.get("topic_permissions", []) if t["vhost"] == vhost and t["exchange"]
    }
    users, passwords, clear = [], {}, []
    for want in wanted:
        tags = existing.get(want.user, {}).get("tags") or []
        if want.role == "upstream" and tags:
            # An operator's user (an administrator, say) would lose its tags and permissions here.
            raise SetupError(f"{want.user!r} exists with tags {tags}: not a user for an upstream")
        password = given.get(want.user) or (new_password() if rotate or want.user not in existing else None)
        if password is not None:
            passwords[want.user] = password
            hashed, algorithm = password_hash(password, new_salt()), _SHA256
        else:
            # Kept as it is, with the algorithm it was hashed with (a broker may use SHA-512).
            hashed = existing[want.user]["password_hash"]
            algorithm = existing[want.user].get("hashing_algorithm", _SHA256)
        users.append(
            {
                "name": want.user,
                "password_hash": hashed,
                "hashing_algorithm": algorithm,
                "tags": list(want.tags),
            }
        )
        if want.topic is None and want.user in topics_now:
            clear.append(want.user)
    definitions = {
        "users": users,
        "vhosts": [{"name": vhost}],
        "permissions": [
            {"user": w.user, "vhost": vhost, "configure": w.grant.configure, "write": w.grant.write,
             "read": w.grant.read}
            for w in wanted
        ],
        "topic_permissions": [
            {"user": w.user, "vhost": vhost, "exchange": w.topic.exchange, "write": w.topic.write,
             "read": w.topic.read}
            for w in wanted
            if w.topic is not None
        ],
    }  # fmt: skip
    return Plan(definitions, passwords, clear)


def password_variable(user: str) -> str:
    return "HOOKLINE_BROKER_PASSWORD_" + user.upper().replace("-", "_").replace(".", "_")


def given_passwords(wanted: Sequence[Wanted], environ: Mapping[str, str]) -> dict[str, str]:
    """User -> the password its variable sets; :class:`PasswordError` for one set but too short."""
    given = {}
    for want in wanted:
        variable = password_variable(want.user)
        if variable not in environ:
            continue
        # Set but empty counts too: a Secret's key left blank would otherwise mean "generate one", and
        # the generated password would only be printed in a log nobody copies it from.
        if len(environ[variable]) < MIN_PASSWORD_LENGTH:
            raise PasswordError(
                f"{variable} is shorter than {MIN_PASSWORD_LENGTH} characters (a placeholder left in?); "
                "nothing was changed on the broker"
            )
        given[want.user] = environ[variable]
    return given


def setup(
    admin: Admin,
    *,
    vhost: str,
    amqp_url: str,
    upstreams: Sequence[Upstream] = (),
    rotate: bool = False,
    environ: Mapping[str, str] = os.environ,
) -> list[SetupUser]:
    """Create or update every role's user and each upstream's; what each one is, with the password
    (and URL) of those whose password this run generated."""
    wanted = wanted_users(upstreams)
    given = given_passwords(wanted, environ)
    decided = plan(
        admin.export(),
        vhost=vhost,
        wanted=wanted,
        given=given,
        rotate=rotate,
        new_password=lambda: secrets.token_urlsafe(_PASSWORD_BYTES),
        new_salt=lambda: secrets.token_bytes(4),
    )
    admin.load(decided.definitions)
    for user in decided.clear_topics:
        admin.clear_topic_permissions(vhost, user)
    done = []
    for want in wanted:
        # Shown once when generated; never echoed when the caller gave it.
        shown = None if want.user in given else decided.passwords.get(want.user)
        done.append(
            SetupUser(
                user=want.user,
                role=want.role,
                tenant=want.tenant,
                password=shown,
                amqp_url=None if shown is None else url_for(amqp_url, want.user, shown, vhost),
            )
        )
    return done


def url_for(amqp_url: str, user: str, password: str, vhost: str) -> str:
    """The broker URL(s) of ``amqp_url`` with this user's credentials and vhost (a list stays a list)."""
    urls = []
    for one in amqp_url.split(","):
        parts = urlsplit(one.strip())
        netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}"
        netloc += f":{parts.port}" if parts.port else ""
        urls.append(urlunsplit((parts.scheme, netloc, "/" + quote(vhost, safe=""), parts.query, "")))
    return ",".join(urls)
