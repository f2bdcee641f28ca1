"""Notifiers: the endpoint a tenant's operational notifications go to (``notify_url``), one per
tenant and URL, created or resumed when an endpoint names it."""

from __future__ import annotations

from datetime import UTC, datetime

import structlog

from hookline.ingest import queues, writes
from hookline.ingest.state import IngestState
from hookline.shared.contracts.models import (
    EndpointStatus,
    SigningSecret,
    StoredEndpoint,
)
from hookline.shared.outbound.signing import generate_secret
from hookline.shared.runtime.api import ApiError
from hookline.shared.state import notifications

log = structlog.get_logger(__name__)


async def notifier(state: IngestState, endpoint: StoredEndpoint) -> StoredEndpoint | None:
    """The notifier that delivers ``endpoint``'s notifications (notifications.py): registered in the
    operator tenant the first time a tenant names that URL and format, shared after that; one that was
    disabled (a 410, a breaker open too long) is resumed, since the tenant names the URL again."""
    notifier_id = notifications.notifier_of(endpoint)
    if notifier_id is None or endpoint.notify_url is None:
        return None
    if (existing := state.registry.get(notifier_id)) is not None:
        return await resumed(state, existing) if existing.status is EndpointStatus.DISABLED else existing
    await writes.check_target(endpoint.notify_url, state.settings, "notify_url")
    now = datetime.now(UTC)
    notifier = StoredEndpoint(
        id=notifier_id,
        tenant=notifications.OPERATOR_TENANT,
        url=endpoint.notify_url,
        event_types=[notifications.NOTIFIER_EVENT_TYPE],
        description=f"notifications for tenant {endpoint.tenant}",
        body_format=endpoint.notify_format,
        # No handshake: a notifier carries only hookline's own operational facts, and a Slack hook
        # would refuse the handshake's body.
        verified=True,
        created_at=now,
        updated_at=now,
        secrets=[SigningSecret(value=state.sealer.seal(generate_secret()), created_at=now)],
        routed=True,
        laned=True,
    )
    try:
        written = await writes.write(state, notifier, base_version=0)
    except ApiError:
        if (current := state.registry.get(notifier_id)) is None:
            raise
        return current  # another replica registered the same notifier first: one is enough
    # Notifications are addressed to it, never published to events: no pattern to bind.
    await queues.activate(state, written, patterns=[])
    log.info("notifier_created", endpoint_id=notifier_id, for_tenant=endpoint.tenant)
    return written


async def resumed(state: IngestState, notifier: StoredEndpoint) -> StoredEndpoint | None:
    def resumed(current: StoredEndpoint) -> StoredEndpoint | None:
        if current.status is not EndpointStatus.DISABLED:
            return None  # resumed meanwhile (or paused by an admin: left so)
        return current.model_copy(update={"status": EndpointStatus.ACTIVE, "updated_at": datetime.now(UTC)})

    written = await state.change_log.update(notifier.id, resumed, timeout_s=state.settings.registry_wait_s)
    if written is not None:
        log.info("notifier_resumed", endpoint_id=notifier.id)
    return state.registry.get(notifier.id)
