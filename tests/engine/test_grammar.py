"""JSON schema -> GBNF at the edge (actord.engine.grammar): llama-cpp-python's converter under
bounds, with typed refusals. Pure Python: no model, no libllama call."""

from __future__ import annotations

import pytest

from actord.vocabulary.types import CompletionRequest
from actord.engine import grammar as G
from actord.vocabulary.errors import InvalidParams


def test_a_pydantic_schema_with_defs_and_refs_converts():
    from typing import Literal

    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel, Field

    class Owner(BaseModel):
        name: str = Field(max_length=10)

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        owners: list[Owner] = Field(max_length=2)
        age: int | None

    g = G.schema_grammar(to_strict_json_schema(Pet))
    assert "root ::=" in g and "owners" in g and "null" in g


def test_json_strings_exclude_raw_control_characters():
    g = G.schema_grammar({"type": "string"})
    assert G._STRICT_CHAR in g and G._LOOSE_CHAR not in g
    assert "\\x00-\\x1F" in G.JSON_OBJECT_GBNF  # JSON mode's grammar already excludes them


@pytest.mark.parametrize("schema,why", [
    ({"type": "array", "minItems": 10**9}, "minItems"),
    ({"type": "string", "maxLength": 5000}, "maxLength"),
    ({"type": "string", "minLength": -1}, "minLength"),
    ({"type": "string", "pattern": "^((a{100}){100}){100}$"}, "expands"),
    ({"type": "string", "pattern": "^a{5000}$"}, "expands"),
    ({"type": "frob"}, "cannot be turned"),
    ({"$ref": "#/$defs/missing"}, "cannot be turned"),
    ({"$ref": "https://example.com/schema.json"}, "cannot be turned"),  # never fetched
    ("not a schema", "is an object"),
])
def test_a_schema_over_the_bounds_or_unconvertible_is_refused_naming_the_field(schema, why):
    with pytest.raises(InvalidParams) as e:
        G.schema_grammar(schema, "response_format")
    assert e.value.data["param"] == "response_format" and why in e.value.message


def test_deep_nesting_is_refused_before_the_converter_recurses():
    schema: dict = {"type": "string"}
    for _ in range(200):
        schema = {"type": "array", "items": schema}
    with pytest.raises(InvalidParams, match="nests"):
        G.schema_grammar(schema)


def test_pattern_cost_multiplies_nested_quantifiers():
    assert G.pattern_cost("^abc$") <= 5
    assert G.pattern_cost("^(ab){10}$") >= 20
    assert G.pattern_cost("^((a){10}){10}$") >= 100
    assert G.pattern_cost("^[a-z]{3,8}$") <= 12


def test_a_checked_completion_request_compiles_its_json_schema_into_its_grammar():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    req = G.compiled(CompletionRequest(prompt=[1], json_schema=schema).check())
    assert req.json_schema is None and req.grammar == G.schema_grammar(schema)
    with pytest.raises(InvalidParams) as e:
        CompletionRequest(prompt=[1], json_schema=schema, grammar='root ::= "a"').check()
    assert e.value.data["param"] == "json_schema"
    with pytest.raises(InvalidParams) as e:
        G.compiled(CompletionRequest(prompt=[1], grammar="x" * (G.MAX_GRAMMAR_BYTES + 1)).check())
    assert e.value.data["param"] == "grammar"


@pytest.mark.parametrize("kw,param", [
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": [[-3, 1.0]]}, "logit_bias"), ({"logit_bias": {"1": float("nan")}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"presence_penalty": float("inf")}, "presence_penalty"), ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_last_n": -2}, "repeat_last_n"), ({"min_p": 2}, "min_p"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_sampling_fields_on_the_socket_are_refused_naming_them(kw, param):
    with pytest.raises(InvalidParams) as e:
        CompletionRequest(prompt=[1], **kw).check()
    assert e.value.data["param"] == param


def test_logit_bias_takes_both_shapes_and_minus_100_bans():
    a = CompletionRequest(prompt=[1], logit_bias={"5": -100, "7": 3}).check()
    b = CompletionRequest(prompt=[1], logit_bias=[[7, 3], [5, -150]]).check()
    assert a.bias_pairs() == b.bias_pairs() == ((5, float("-inf")), (7, 3.0))
