from __future__ import annotations

import re
import time

import pytest

from hookline.shared.contracts.ids import derived_id, encode_ulid, id_time_s, new_id


def test_ulid_encoding_of_known_values() -> None:
    assert encode_ulid(0, bytes(10)) == "0" * 26
    assert encode_ulid((1 << 48) - 1, b"\xff" * 10) == "7" + "Z" * 25
    assert encode_ulid(1, bytes(10)) == "0000000001" + "0" * 16


def test_ulids_sort_by_time() -> None:
    assert encode_ulid(1_700_000_000_000, b"\xff" * 10) < encode_ulid(1_700_000_000_001, bytes(10))


def test_new_id_has_prefix_and_ulid() -> None:
    assert re.fullmatch(r"evt_[0-9A-HJKMNP-TV-Z]{26}", new_id("evt"))


def test_ulid_needs_ten_random_bytes() -> None:
    with pytest.raises(ValueError, match="10 random bytes"):
        encode_ulid(0, b"short")


def test_an_ids_time_is_read_back_and_a_foreign_id_has_none() -> None:
    made = new_id("evt")
    made_s = id_time_s(made)
    assert made_s is not None
    assert abs(made_s - time.time()) < 5
    assert id_time_s("evt_" + encode_ulid(1_700_000_000_123, bytes(10))) == 1_700_000_000.123
    assert id_time_s("order-42") is None
    assert id_time_s("evt_" + "u" * 26) is None  # not Crockford base32


def test_a_derived_id_is_the_same_for_the_same_seed_and_never_looks_time_ordered() -> None:
    first = derived_id("evt", "acme\0pay-o_1")
    assert first == derived_id("evt", "acme\0pay-o_1")
    assert first != derived_id("evt", "acme\0pay-o_2")
    assert re.fullmatch(r"evt_[0-9A-HJKMNP-TV-Z]{32}", first)
    assert id_time_s(first) is None
