"""Endpoint filters: a CEL expression over an event (``data.amount >= 1000 && data.currency == "EUR"``)
that an endpoint's events must match. Checked when an endpoint's filter is set (the ingest) and
evaluated where an event is fanned out to its endpoints (the dispatchers), so one definition here.

CEL (``common-expression-language``, compiled in Rust) has no cost limit of its own, so an expression is
bounded when it is set: at most ``MAX_CHARS`` characters, ``MAX_DEPTH`` levels of brackets, and no
comprehension (``map``, ``filter``, ``all``, ``exists``, ``exists_one``) inside another, whose cost
would grow with the square of a list's length (measured: 5.3 s over a list of 3,000 numbers). Only the
event's fields are variables: an expression naming another is refused when set, not at each event.
An evaluation error (a missing field, a type mismatch) is "no match", and says why.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import cel

MAX_CHARS = 2000
MAX_DEPTH = 32
#: What a filter sees of an event (its id is no criterion: it is random).
VARIABLES = frozenset({"type", "subject", "tenant", "schema_version", "occurred_at", "sequence", "data"})
_COMPREHENSIONS = ("map", "filter", "all", "exists", "exists_one")
_BOUND = re.compile(r"\.(map|filter|all|exists|exists_one)\(\s*([A-Za-z_][A-Za-z_0-9]*)\s*,")
_PREFIX = re.compile(r"\b[bBrR]{1,2}$")  # a string literal's prefix: bytes, raw
_DATA = re.compile(r"(?<![.\w])data\b(?:\s*\.\s*([A-Za-z_][A-Za-z_0-9]*)(\s*\()?)?")
_POSITION = re.compile(r"<input>:(\d+):(\d+):\s*(.*)")
_OPENING, _CLOSING = "([{", ")]}"


class FilterError(ValueError):
    """An expression refused when set: what is wrong, and where (1-based line and column, when known)."""

    def __init__(self, message: str, *, line: int | None = None, column: int | None = None) -> None:
        where = f" at line {line}, column {column}" if line is not None else ""
        super().__init__(f"{message}{where}")
        self.line = line
        self.column = column


@dataclass(frozen=True)
class Verdict:
    matches: bool
    error: str | None = None  # why it could not be evaluated (counted as no match)


@dataclass(frozen=True)
class Needs:
    """What of an event an expression reads: converting an event's ``data`` to CEL's values is most of
    an evaluation's cost (measured: 81 µs for an order with five items, 11 µs for its two fields read),
    so a context holds only what its filters read."""

    variables: frozenset[str]
    data_keys: frozenset[str] | None  # the keys of ``data`` read as data.<key>; None: all of it


NOTHING = Needs(frozenset(), frozenset())


_MATCH, _NO_MATCH = Verdict(True), Verdict(False)


class Filter:
    """A compiled expression, evaluated against events' contexts (``context``)."""

    def __init__(self, source: str) -> None:
        _bounded(source)
        try:
            self._program = cel.compile(source)
        except ValueError as exc:
            raise _syntax_error(str(exc)) from None
        # A comprehension's own variable (``exists(i, ...)``) is listed among the variables too.
        bound = {name for _, name in _BOUND.findall(source)}
        unknown = set(self._program.variables()) - VARIABLES - bound
        if unknown:
            raise FilterError(
                f"unknown variable {sorted(unknown)[0]!r}: a filter sees {', '.join(sorted(VARIABLES))}"
            )
        self.source = source
        self.needs = Needs(frozenset(self._program.variables()) & VARIABLES, _data_keys(source))

    def verdict(self, context: cel.Context) -> Verdict:
        try:
            result = self._program.execute(context)
        except Exception as exc:  # the library's errors are KeyError, TypeError, RuntimeError...
            return Verdict(False, _evaluation_error(exc))
        if not isinstance(result, bool):
            return Verdict(False, f"the filter gave {type(result).__name__}, not true or false")
        return _MATCH if result else _NO_MATCH


@lru_cache(maxsize=4096)
def compiled(source: str) -> Filter:
    """The filter of ``source`` (checked when it was set), compiled once per process."""
    return Filter(source)


def verdict(source: str, event: cel.Context) -> Verdict:
    """``source``'s verdict on an event (its ``context``). A filter not checked when it was set (a
    record from an import of an older version's backup) is no match, saying why."""
    try:
        return compiled(source).verdict(event)
    except FilterError as exc:
        return Verdict(False, f"the filter is invalid: {exc}")


def admits(source: str | None, event: Mapping[str, Any]) -> bool:
    """Whether an endpoint with the filter ``source`` (None: none) takes this event (as parsed JSON):
    what a replay or a redrive asks of each event, the endpoint's filter as it is now."""
    return source is None or verdict(source, context(event)).matches


def context(event: Mapping[str, Any], needs: Needs | None = None) -> cel.Context:
    """An event's variables, converted to CEL's values once for all of its endpoints' filters; with
    ``needs``, only what those filters read."""
    if needs is None:
        return cel.Context({name: event.get(name) for name in VARIABLES})
    variables = {name: event.get(name) for name in needs.variables}
    data = variables.get("data")
    if needs.data_keys is not None and isinstance(data, Mapping):
        variables["data"] = {key: data[key] for key in needs.data_keys if key in data}
    return cel.Context(variables)


def check(source: str) -> None:
    """Refuse an expression (FilterError) as ``Filter`` would, without keeping it."""
    Filter(source)


def _code(source: str) -> str:
    """``source`` with what is inside string literals blanked out: brackets and names there are text.
    CEL's strings: single, double or tripled quotes; backslash escapes, except in raw strings (``r"…"``)."""
    kept: list[str] = []
    index = 0
    while index < len(source):
        char = source[index]
        if char not in "\"'":
            kept.append(char)
            index += 1
            continue
        prefix = _PREFIX.search(source[:index])
        raw = prefix is not None and "r" in prefix.group(0).lower()
        quote = source[index : index + 3] if source[index : index + 3] in ('"""', "'''") else char
        kept.append(quote)
        index += len(quote)
        while index < len(source) and not source.startswith(quote, index):
            step = 2 if source[index] == "\\" and not raw else 1
            kept.append(" " * len(source[index : index + step]))
            index += step
        kept.append(source[index : index + len(quote)])
        index += len(quote)
    return "".join(kept)


def _data_keys(source: str) -> frozenset[str] | None:
    """The keys of ``data`` an expression reads (``data.amount``), or None when it reads ``data`` any other
    way (``size(data)``, ``data["a b"]``, ``data.all(k, ...)``): then all of it."""
    keys = set()
    for found in _DATA.finditer(_code(source)):
        key, call = found.group(1), found.group(2)
        if key is None or call:
            return None
        keys.add(key)
    return frozenset(keys)


def _bounded(source: str) -> None:
    if len(source) > MAX_CHARS:
        raise FilterError(f"a filter is at most {MAX_CHARS} characters, not {len(source)}")
    depth = 0
    inside: list[bool] = []  # for each bracket open, whether a comprehension opened it
    for index, char in enumerate(_code(source)):
        if char in _OPENING:
            comprehension = char == "(" and _called(source, index) in _COMPREHENSIONS
            if comprehension and any(inside):
                raise FilterError("a comprehension may not be nested in another", column=index + 1, line=1)
            inside.append(comprehension)
            depth = max(depth, len(inside))
            if depth > MAX_DEPTH:
                raise FilterError(f"a filter nests at most {MAX_DEPTH} levels", column=index + 1, line=1)
        elif char in _CLOSING and inside:
            inside.pop()


def _called(source: str, paren: int) -> str:
    """The name of the macro or function whose call opens at ``paren`` (``.all(`` → ``all``)."""
    match = re.search(r"\.([A-Za-z_][A-Za-z_0-9]*)\s*$", source[:paren])
    return match.group(1) if match else ""


def _syntax_error(message: str) -> FilterError:
    found = _POSITION.search(message)
    if found is None:
        return FilterError(message.splitlines()[0])
    detail = found.group(3).split(" expecting ")[0]
    return FilterError(detail, line=int(found.group(1)), column=int(found.group(2)))


def _evaluation_error(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"no field {exc.args[0]!r} in the event"
    return str(exc).split(". ")[0][:200]
