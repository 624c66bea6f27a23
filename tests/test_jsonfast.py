"""Hot-path JSON gives the standard library's results, including for what orjson refuses."""

from __future__ import annotations

import json

import pytest

from gateway.core import jsonfast

ODD_INPUTS = [
    '{"text": "a lone \\ud800 surrogate"}',  # valid JSON, not valid text: orjson refuses it
    "[NaN, Infinity]",  # not JSON at all, but the standard library reads it
    '{"plain": "text", "n": 1.5, "nested": [{"ok": true}], "none": null}',
]


@pytest.mark.parametrize("text", ODD_INPUTS)
def test_loads_reads_what_the_standard_library_reads(text: str) -> None:
    assert repr(jsonfast.loads(text)) == repr(json.loads(text))


def test_loads_reads_an_integer_past_64_bits_as_a_float() -> None:
    """orjson's choice, kept: nothing read on the hot path (provider chunks) carries such numbers."""
    assert jsonfast.loads("[123456789012345678901234567890]") == [1.2345678901234568e29]


@pytest.mark.parametrize("text", ["{bad", "", "[1,]"])
def test_loads_refuses_what_the_standard_library_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        jsonfast.loads(text)


@pytest.mark.parametrize("value", [{"t": "a lone \ud800"}, {1: "int key"}, [2 ** 70], {"t": "Здравствуйте"}])
def test_dumps_always_gives_valid_json_with_the_same_value(value: object) -> None:
    raw = jsonfast.dumps(value)
    assert json.loads(raw) == json.loads(json.dumps(value))
    assert b"\\u04" not in raw  # text travels as text where it can


def test_dumps_text_leaves_a_lone_surrogate_for_the_caller_to_find() -> None:
    assert "\ud800" in jsonfast.dumps_text({"t": "\ud800"})
