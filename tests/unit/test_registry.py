"""The registry is the change log applied in order: upserts, deletes, listeners and read-back waits."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from hookline.shared.contracts.models import (
    EndpointDeleted,
    EndpointUpserted,
    SigningSecret,
    StoredEndpoint,
)
from hookline.shared.state.changefold import Stale
from hookline.shared.state.registry import EndpointRegistry

NOW = datetime(2026, 11, 29, tzinfo=UTC)


def _endpoint(endpoint_id: str, url: str = "https://example.com/") -> StoredEndpoint:
    return StoredEndpoint(
        id=endpoint_id,
        tenant="acme",
        url=url,
        event_types=["#"],
        created_at=NOW,
        updated_at=NOW,
        secrets=[SigningSecret(value="whsec_" + "A" * 44, created_at=NOW)],
    )


EP1 = "ep_" + "1" * 26
EP2 = "ep_" + "2" * 26


def test_upsert_replace_and_delete_notify_listeners_with_before_and_after() -> None:
    registry = EndpointRegistry()
    changes: list[tuple[str | None, str | None]] = []
    registry.subscribe(lambda before, after: changes.append((before and before.url, after and after.url)))

    registry.apply(EndpointUpserted(change_id="c1", at=NOW, endpoint=_endpoint(EP1, "https://a/")))
    registry.apply(EndpointUpserted(change_id="c2", at=NOW, endpoint=_endpoint(EP1, "https://b/")))
    registry.apply(EndpointUpserted(change_id="c3", at=NOW, endpoint=_endpoint(EP2)))
    registry.apply(EndpointDeleted(change_id="c4", at=NOW, endpoint_id=EP1))
    registry.apply(EndpointDeleted(change_id="c5", at=NOW, endpoint_id=EP1))  # already gone: no-op

    assert changes == [
        (None, "https://a/"),
        ("https://a/", "https://b/"),
        (None, "https://example.com/"),
        ("https://b/", None),
    ]
    assert [endpoint.id for endpoint in registry.rows.all()] == [EP2]
    assert registry.get(EP1) is None


# --- conditional changes ------------------------------------------------------------------------
# Every reader applies the same records in the same order with this rule, so all agree on which of two
# writes based on one version won: a change applies only if the endpoint is still at its base_version
# (0: it must not exist yet); None (records of earlier versions) applies unconditionally.

LATER = datetime(2026, 11, 30, tzinfo=UTC)


def _up(base: int | None, url: str = "https://example.com/", *, version: int = 0) -> EndpointUpserted:
    endpoint = _endpoint(EP1, url).model_copy(update={"version": version})
    return EndpointUpserted(change_id="c", at=NOW, endpoint=endpoint, base_version=base)


def _rm(base: int | None, at: datetime = NOW) -> EndpointDeleted:
    return EndpointDeleted(change_id="d", at=at, endpoint_id=EP1, base_version=base)


def _at_version(version: int) -> list[EndpointUpserted | EndpointDeleted]:
    """Records that leave EP1 at ``version`` (conditional, each based on the one before)."""
    return [_up(n, f"https://v{n + 1}.example/") for n in range(version)]


@pytest.mark.parametrize(
    ("before", "record", "outcome", "version_after", "url_after"),
    [
        # create: base 0 means "must not exist yet"
        pytest.param([], _up(0, "https://new/"), "applied", 1, "https://new/", id="create-base-0"),
        pytest.param(_at_version(1), _up(0, "https://new/"), "stale", 1, "https://v1.example/", id="create-exists"),
        pytest.param(_at_version(1), _rm(None), "deleted", None, None, id="legacy-delete"),
        # update at the right / a wrong version
        pytest.param(_at_version(1), _up(1, "https://b/"), "applied", 2, "https://b/", id="update-current"),
        pytest.param(_at_version(3), _up(3, "https://b/"), "applied", 4, "https://b/", id="update-current-3"),
        pytest.param(_at_version(3), _up(2, "https://b/"), "stale", 3, "https://v3.example/", id="update-older"),
        pytest.param(_at_version(3), _up(4, "https://b/"), "stale", 3, "https://v3.example/", id="update-newer"),
        pytest.param([], _up(1, "https://b/"), "stale", None, None, id="update-missing"),
        pytest.param(_at_version(2), _up(2, "https://b/", version=99), "applied", 3, "https://b/", id="record-version-ignored"),
        # delete at the right / a wrong version
        pytest.param(_at_version(2), _rm(2), "deleted", None, None, id="delete-current"),
        pytest.param(_at_version(2), _rm(1), "stale", 2, "https://v2.example/", id="delete-older"),
        pytest.param(_at_version(2), _rm(0), "stale", 2, "https://v2.example/", id="delete-as-if-new"),
        pytest.param([], _rm(1), "stale", None, None, id="delete-missing"),
        # unconditional records of earlier versions: always applied, the version still counts up
        pytest.param([], _up(None, "https://legacy/"), "applied", 1, "https://legacy/", id="legacy-create"),
        pytest.param(_at_version(3), _up(None, "https://legacy/"), "applied", 4, "https://legacy/", id="legacy-over"),
        pytest.param(
            [_up(None), _up(None), _up(None)], _up(3, "https://b/"), "applied", 4, "https://b/", id="legacy-counts"
        ),
        pytest.param([_up(None), _rm(None)], _up(0, "https://again/"), "applied", 1, "https://again/", id="recreate"),
    ],
)  # fmt: skip
def test_a_change_applies_only_at_its_base_version(
    before: list[EndpointUpserted | EndpointDeleted],
    record: EndpointUpserted | EndpointDeleted,
    outcome: str,
    version_after: int | None,
    url_after: str | None,
) -> None:
    registry = EndpointRegistry()
    for earlier in before:
        assert not isinstance(registry.apply(earlier), Stale)
    current = registry.get(EP1)
    notified: list[tuple[StoredEndpoint | None, StoredEndpoint | None]] = []
    registry.subscribe(lambda old, new: notified.append((old, new)))

    result = registry.apply(record)

    after = registry.get(EP1)
    assert (after and after.version, after and after.url) == (version_after, url_after)
    if outcome == "stale":
        # Nothing changed, nobody is told, and the loser learns what won.
        assert isinstance(result, Stale)
        assert result.current == current
        assert after == current
        assert notified == []
    elif outcome == "deleted":
        assert result is None
        assert notified == [(current, None)]
    else:
        assert isinstance(result, StoredEndpoint)
        assert result == after
        assert notified == [(current, after)]


def test_versions_count_every_applied_change_and_skip_the_stale_ones() -> None:
    registry = EndpointRegistry()
    versions = []
    for record in [_up(0), _up(1), _up(1), _up(2), _up(None), _up(2), _up(4)]:
        result = registry.apply(record)
        versions.append(result.current.version if isinstance(result, Stale) else result and result.version)
    # stale writes report the version that won and do not count
    assert versions == [1, 2, 2, 3, 4, 4, 5]


def test_deleted_endpoints_are_remembered_with_their_last_definition() -> None:
    registry = EndpointRegistry()
    registry.apply(_up(0, "https://a/"))
    registry.apply(_up(1, "https://last/"))
    assert isinstance(registry.apply(_rm(1, at=LATER)), Stale), "a stale delete deletes nothing"
    assert registry.deletions.deleted_since(NOW) == []
    registry.apply(_rm(2, at=LATER))

    assert registry.get(EP1) is None
    assert len(registry) == 0
    gone = registry.deletions.last_known(EP1)
    assert gone is not None
    assert (gone.url, gone.version) == ("https://last/", 2)
    assert registry.deletions.deleted_since(NOW) == [gone]
    assert registry.deletions.deleted_since(LATER) == [gone], "deleted at or after"
    assert registry.deletions.deleted_since(datetime(2026, 12, 1, tzinfo=UTC)) == []


def test_an_endpoint_created_again_under_a_deleted_id_is_no_longer_deleted() -> None:
    """A notifier's id is derived from its tenant and URL: removed, then named again, it comes back
    under the same id, and its queue must be neither drained nor removed as a deleted endpoint's."""
    registry = EndpointRegistry()
    registry.apply(_up(0, "https://notify/"))
    registry.apply(_rm(1, at=LATER))
    assert [gone.id for gone in registry.deletions.deleted_since(NOW)] == [EP1]
    again = registry.apply(_up(0, "https://notify/"))
    assert isinstance(again, StoredEndpoint)
    assert again.version == 1
    assert registry.deletions.deleted_since(NOW) == []
    assert registry.deletions.last_known(EP1) == again


def test_a_polling_endpoint_is_never_fanned_out_to_nor_bound_for() -> None:
    registry = EndpointRegistry()
    pushed = _endpoint(EP1).model_copy(update={"laned": True, "event_types": ["order.*"]})
    polled = _endpoint(EP2).model_copy(
        update={"laned": True, "kind": "polling", "url": None, "event_types": ["invoice.*"]}
    )
    registry.apply(EndpointUpserted(change_id="c1", at=NOW, endpoint=pushed))
    registry.apply(EndpointUpserted(change_id="c2", at=NOW, endpoint=polled))

    assert [e.id for e in registry.subscriptions.matching("acme", "order.created")] == [EP1]
    assert registry.subscriptions.matching("acme", "invoice.paid") == ()
    assert [e.id for e in registry.subscriptions.subscribed("acme", "invoice.paid")] == [
        EP2
    ]  # the delivery log's
    assert registry.subscriptions.patterns_needed("acme") == {"order.*"}
    kept = registry.get(EP2)  # kept, listed and counted as any endpoint
    assert kept is not None
    assert kept.kind == "polling"
    assert registry.rows.count_of_tenant("acme") == 2
