"""What a receiver answers hookline, whichever framework serves it.

hookline retries 408, 429 and 5xx and dead-letters other 4xx (services/dispatcher/outcome.py): a
forged or stale request is refused for good, a delivery another request is handling right now is
answered 503 with Retry-After, so that it comes back once that one has finished (or failed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hookline.receiver.once import Outcome
from hookline.receiver.verify import NoMatchingSignatureError, VerificationError

IN_PROGRESS_RETRY_AFTER_S = 10


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    media_type: str | None = None


def for_outcome(outcome: Outcome) -> Reply:
    match outcome:
        case Outcome.HANDLED:
            return Reply(204)
        case Outcome.DUPLICATE:
            return Reply(200, b'{"status":"duplicate"}', media_type="application/json")
        case Outcome.IN_PROGRESS:
            return Reply(
                503,
                b'{"status":"in_progress"}',
                {"retry-after": str(IN_PROGRESS_RETRY_AFTER_S)},
                media_type="application/json",
            )


def for_error(error: VerificationError) -> Reply:
    # The reason code only: the message may say how far off the clock is, which a prober need not know.
    status = 401 if isinstance(error, NoMatchingSignatureError) else 400
    return Reply(status, b'{"error":"%s"}' % error.reason.encode(), media_type="application/json")
