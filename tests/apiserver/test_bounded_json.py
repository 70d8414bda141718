"""Nesting depth of user JSON: refused with the limit named, never a RecursionError."""

from __future__ import annotations

import json

import pytest

from dra_driver.apiserver.bounded_json import MAX_DEPTH, TooDeep, loads, loads_pruned


def nested(depth: int, leaf: str = "1") -> str:
    return '{"a":' * depth + leaf + "}" * depth


def test_a_3000_deep_document_is_refused_naming_the_limit() -> None:
    with pytest.raises(TooDeep) as refused:
        loads(nested(3000), "the claim")
    message = str(refused.value)
    assert message.startswith(
        f"the claim nests JSON deeper than {MAX_DEPTH} levels, the most the driver decodes"
    )
    assert "\n" not in message


def test_the_limit_itself_is_decoded() -> None:
    assert loads(nested(MAX_DEPTH), "x") == json.loads(nested(MAX_DEPTH))
    with pytest.raises(TooDeep):
        loads(nested(MAX_DEPTH + 1), "x")


def test_brackets_in_strings_do_not_nest() -> None:
    text = json.dumps({"a": "[[[[{{{{" * 100, "b": ['"]]]', "x"], "c": '\\"[{'})
    assert loads(text, "x") == json.loads(text)


def test_pruning_keeps_the_top_of_the_document() -> None:
    text = '{"request": {"uid": "u-1", "object": ' + nested(3000, "[1, 2]") + "}}"
    document, pruned = loads_pruned(text)
    assert pruned
    assert document["request"]["uid"] == "u-1"
    assert loads_pruned('{"a": [1, {"b": null}]}') == ({"a": [1, {"b": None}]}, False)


def test_not_json_is_still_a_value_error() -> None:
    with pytest.raises(json.JSONDecodeError):
        loads_pruned(b"{" * 100)
    with pytest.raises(json.JSONDecodeError):
        loads_pruned(b"not json")


@pytest.mark.parametrize(
    "inside",
    [
        '"\\\\"',  # a string ending in an escaped backslash: the next quote closes it
        '"\\"]]]]"',  # an escaped quote: the brackets after it are still in the string
        '"\\u005b{["',  # brackets beside an escape
        '"multi\\nline"',
    ],
)
def test_escapes_in_strings_neither_nest_nor_hide_a_level(inside: str) -> None:
    at_limit = '{"a":' * (MAX_DEPTH - 1) + "[" + inside + "]" + "}" * (MAX_DEPTH - 1)
    assert loads(at_limit, "x") == json.loads(at_limit)
    one_more = '{"a":' * MAX_DEPTH + "[" + inside + "]" + "}" * MAX_DEPTH
    with pytest.raises(TooDeep):
        loads(one_more, "x")
    document, pruned = loads_pruned(one_more)
    assert pruned
    assert document == json.loads('{"a":' * MAX_DEPTH + "null" + "}" * MAX_DEPTH)


def test_an_unterminated_string_is_not_json_at_any_depth() -> None:
    with pytest.raises(json.JSONDecodeError):
        loads_pruned(b'{"a": "[[[')
    with pytest.raises(json.JSONDecodeError):
        loads_pruned(b'{"a": "' + b"{" * (MAX_DEPTH + 5))
