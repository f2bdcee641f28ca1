"""What an attempt's result means for the message: a pure function, tested with a table.

2xx                                   success   -> ack
408, 429, 5xx, timeouts, network, TLS  retry     -> try again later
410 Gone                               disable   -> dead letter, and the endpoint is disabled
other 4xx, 3xx (redirects are not followed), 1xx
refused target, invalid URL            permanent -> dead letter now
"""

from __future__ import annotations

import enum


class Outcome(enum.StrEnum):
    SUCCESS = "success"
    RETRY = "retry"
    PERMANENT = "permanent"
    DISABLE = "disable"


class ErrorKind(enum.StrEnum):
    """Why an attempt got no HTTP status."""

    TIMEOUT = "timeout"
    DNS = "dns"
    CONNECT = "connect"
    TLS = "tls"
    NETWORK = "network"  # the connection broke mid-exchange
    PROTOCOL = "protocol"  # the peer answered something that is not HTTP
    REFUSED_TARGET = "refused_target"  # the address is not allowed (SSRF protection)
    INVALID_URL = "invalid_url"


_PERMANENT_ERRORS = frozenset({ErrorKind.REFUSED_TARGET, ErrorKind.INVALID_URL})
_RETRIED_4XX = frozenset({408, 429})


def classify(status: int | None, error: ErrorKind | None) -> Outcome:
    """The outcome of one attempt from its HTTP status, or from the error when there is no status."""
    if status is None:
        if error in _PERMANENT_ERRORS:
            return Outcome.PERMANENT
        return Outcome.RETRY
    if 200 <= status < 300:
        return Outcome.SUCCESS
    if status == 410:
        return Outcome.DISABLE
    if status in _RETRIED_4XX or 500 <= status < 600:
        return Outcome.RETRY
    return Outcome.PERMANENT
