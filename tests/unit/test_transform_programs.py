"""Endpoint transforms (jq): what is refused when a program is set (pure: the compiler runs in-process,
which is safe; only evaluation can run away)."""

from __future__ import annotations

import pytest

from hookline.shared.outbound.transforms import MAX_CHARS, TransformError, check


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("$ENV.HOME", "$ENV is not allowed in a transform (no environment, files or clock)"),
        ("env.PATH", "env is not allowed"),
        ("input", "input is not allowed"),
        ("[inputs]", "inputs is not allowed"),
        ("{at: now}", "now is not allowed"),
        ('import "lib" as lib; .', "import is not allowed"),
        ('include "lib"; .', "include is not allowed"),
        ("input_filename", "input_filename is not allowed"),
        ('"sent at \\(now)"', "now is not allowed"),  # code inside a string's interpolation
        ('"\\("x" + "\\(env)")"', "env is not allowed"),  # nested interpolations
        ('"\\((1) | env)"', "env is not allowed"),  # parentheses inside an interpolation
        ("{a: .data.amount", "jq: error: syntax error"),
        ("." + " " * MAX_CHARS, f"a transform is at most {MAX_CHARS} characters"),
    ],
)
def test_a_program_is_refused_when_set(source: str, message: str) -> None:
    with pytest.raises(TransformError) as refused:
        check(source)
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize(
    "source",
    [
        '{text: "Order \\(.data.amount) placed now, env and input say nothing"}',  # words in a string
        ".data | {amount, currency}",
        ". # a comment naming env and now\n| .data",
        "def f: .; f",
        "{envelope: .id, inputs_seen: 1, nowhere: true}",  # names that only start like a refused one
    ],
)
def test_within_the_rules_is_accepted(source: str) -> None:
    check(source)
