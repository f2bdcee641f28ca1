"""The AMQP headers hookline adds to messages. Never ``x-death``: that belongs to the broker."""

from __future__ import annotations

import enum


class Header(enum.StrEnum):
    ATTEMPT = "x-hookline-attempt"  # the attempt this delivery will be, starting at 1
    FIRST_ATTEMPT_AT = "x-hookline-first-attempt-at"  # unix seconds of attempt 1
    EVENT_ID = "x-hookline-event-id"
    ENDPOINT_ID = "x-hookline-endpoint-id"
    TENANT = "x-hookline-tenant"
    REASON = "x-hookline-reason"
    ATTEMPTS = "x-hookline-attempts"
    LAST_STATUS = "x-hookline-last-status"
    LAST_ERROR = "x-hookline-last-error"
    DEAD_AT = "x-hookline-dead-at"
    SEQUENCE = "x-hookline-seq"  # ordered endpoints: when the dispatcher first saw the event (ns)
    ACCEPTED_AT_MS = "x-hookline-accepted-at-ms"  # set by the ingest API: when the event was accepted
    # Set by the ingest API on an event sent with an Idempotency-Key: a digest of the request, so that
    # the key sent again with another request is refused.
    REQUEST_DIGEST = "x-hookline-request-digest"
    # The fence an ingest puts in the lane of an endpoint deleted or leaving it (its value: the endpoint's
    # id): every lane message before it was published before the deletion, or the endpoint's binding.
    FENCE = "x-hookline-fence"
    # On the fence of an endpoint leaving its lane (made ordered): the version that wrote it, so that a
    # replica behind the change log can tell a fence too early from one a later change made stale.
    FENCE_VERSION = "x-hookline-fence-version"
    # A lane copy handed on to an ordered endpoint whose queue is bound to ``events`` too (it leaves, or
    # left, its lane): most likely a second copy, skipped by the replica that settled the first.
    SECOND_COPY = "x-hookline-second-copy"
    # A message forwarded after it came back unroutable: how many times (it stops past a few).
    FORWARDS = "x-hookline-forwards"
    ORIGIN = (
        "x-hookline-origin"  # an event put back by hand: "replay" or "redrive" (the delivery log says so)
    )
