"""Endpoint filters (CEL): what is refused when set, and what an event's verdict is (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from hookline.shared.outbound.filters import MAX_CHARS, FilterError, Needs, Verdict, check, compiled, context

EVENT: dict[str, Any] = {
    "id": "evt_1",
    "type": "order.created",
    "tenant": "acme",
    "subject": "o_1",
    "sequence": 3,
    "schema_version": 1,
    "occurred_at": "2026-12-07T10:00:00Z",
    "data": {"amount": 1500, "currency": "EUR", "items": [{"sku": "a", "qty": 2}], "note": None},
}


@pytest.mark.parametrize(
    ("source", "verdict"),
    [
        ('data.amount >= 1000 && data.currency == "EUR"', Verdict(True)),
        ('data.amount >= 1000 && data.currency == "USD"', Verdict(False)),
        ("data.amount >= 1000.0", Verdict(True)),  # int against double compares
        ('type.startsWith("order.") && tenant == "acme"', Verdict(True)),
        ('subject == "o_1" && sequence > 2u || sequence > 2', Verdict(True)),
        ("schema_version == 1", Verdict(True)),
        ('timestamp(occurred_at) > timestamp("2026-01-01T00:00:00Z")', Verdict(True)),
        ('data.items.exists(i, i.sku == "a" && i.qty >= 2)', Verdict(True)),
        ("has(data.refund)", Verdict(False)),  # asking whether a field is there is no error
        ("data.note == null", Verdict(True)),
        # Errors are no match, and say why.
        ("data.refund.amount > 0", Verdict(False, "no field 'refund' in the event")),
        (
            'data.amount >= "1000"',
            Verdict(False, "No such overload: the operation is not defined for the given operand types"),
        ),
        ("data.amount", Verdict(False, "the filter gave int, not true or false")),
        ("data.amount / 0 > 1", Verdict(False, "division by zero in CEL expression")),
    ],
)
def test_an_events_verdict(source: str, verdict: Verdict) -> None:
    check(source)
    assert compiled(source).verdict(context(EVENT)) == verdict
    # The same from a context holding only what the filter reads (what the fan-out builds).
    assert compiled(source).verdict(context(EVENT, compiled(source).needs)) == verdict


@pytest.mark.parametrize(
    ("source", "needs"),
    [
        ('data.amount >= 1000 && data.currency == "EUR"', Needs(frozenset({"data"}), frozenset({"amount", "currency"}))),
        ("has(data.refund) || data.items.exists(i, i.qty > 1)", Needs(frozenset({"data"}), frozenset({"refund", "items"}))),
        ('type == "data.amount"', Needs(frozenset({"type"}), frozenset())),  # in a string: text
        ("size(data) > 1", Needs(frozenset({"data"}), None)),
        ('data["amount"] > 1', Needs(frozenset({"data"}), None)),
        ('data.exists(key, key == "amount")', Needs(frozenset({"data"}), None)),  # a macro on data itself
    ],
)  # fmt: skip
def test_what_a_filter_reads_of_an_event(source: str, needs: Needs) -> None:
    assert compiled(source).needs == needs


def test_a_missing_optional_field_is_null() -> None:
    assert compiled("subject == null").verdict(context({**EVENT, "subject": None})) == Verdict(True)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("data.amount >=", "Syntax error: mismatched input '<EOF>' at line 1, column 15"),
        ("data.amount >= 1000 &&\n  data.currency ==", "Syntax error: mismatched input '<EOF>' at line 2, column 19"),
        ("amount >= 1000", "unknown variable 'amount': a filter sees data, occurred_at, schema_version, sequence, "
         "subject, tenant, type"),
        ("data.items.exists(i, j == 1)", "unknown variable 'j'"),
        ("id == 'evt_1'", "unknown variable 'id'"),
        ("(" * 33 + "true" + ")" * 33, "a filter nests at most 32 levels at line 1, column 33"),
        # Quadratic: 5 s over 3,000 items, measured.
        ("data.items.map(x, data.items.filter(y, y == x)).size() > 0",
         "a comprehension may not be nested in another at line 1, column 36"),
        # An escaped backslash ends a string like any: what follows is counted.
        ('data.note == "x\\\\" && data.items.map(x, data.items.filter(y, y == x)).size() > 0',
         "a comprehension may not be nested in another"),
        ("data.note == r'x\\' && data.items.map(x, data.items.filter(y, y == x)).size() > 0",
         "a comprehension may not be nested in another"),  # a raw string: no escapes
        ("true && " * 300 + "true", f"a filter is at most {MAX_CHARS} characters, not 2404"),
    ],
)  # fmt: skip
def test_a_filter_is_refused_when_set_naming_where(source: str, message: str) -> None:
    with pytest.raises(FilterError) as refused:
        check(source)
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize(
    "source",
    [
        "(" * 32 + "true" + ")" * 32,
        'data.note == "(.all(x, y.exists(z"',  # inside a string: not brackets, not a comprehension
        "data.items.exists(i, i.qty > 1) && data.items.all(i, i.sku != '')",  # side by side, not nested
    ],
)
def test_within_the_bounds_is_accepted(source: str) -> None:
    check(source)
