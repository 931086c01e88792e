"""Constrained decoding in the engine (llguidance masks, constraints/): random schemas validate,
constrained rows leave their batch neighbours untouched, beams validate, compiles are cached."""

from __future__ import annotations

import json
import random

import pytest
import torch

from serve_helpers import shared_chat_generator

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from fastdecode.errors import InvalidOptionError  # noqa: E402

torch.set_num_threads(1)
WORDS = ["alpha", "beta", "gamma", "delta"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A small JSON schema: objects (required and optional fields), arrays, enums, bounded
    integers and numbers, strings with lengths or patterns, nested up to depth 2."""
    kinds = ["integer", "number", "string", "pattern", "enum", "boolean"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{2,5}$", "^[0-9]{3}-[A-Z]{2}$", "^(yes|no)$"])}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 3))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": 0, "maxItems": rng.randint(1, 3)}
    names = rng.sample(["a", "b", "c", "d", "e"], rng.randint(1, 3))
    properties = {name: random_schema(rng, depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.6]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def as_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.fixture(scope="module")
def gen():
    return shared_chat_generator()


def test_random_schemas_200_sampled_outputs_validate(gen):
    rng = random.Random(0)
    tokenizer = gen.tokenizer
    prompt = tokenizer.encode("Hello, how are you today?")
    checked = 0
    for index in range(20):  # 20 schemas x 10 samples, each call one batch
        schema = {"type": "object", "properties": {"v": random_schema(rng)}, "required": ["v"],
                  "additionalProperties": False}
        results = gen.generate_ids_with_details([prompt], max_new_tokens=160, do_sample=True, seed=index,
                                                num_return_sequences=10, response_format=as_format(schema))
        for result in results:
            text = tokenizer.decode(result.tokens)
            assert result.finish_reason == "eos", (schema, text)
            jsonschema.validate(json.loads(text), schema)
            checked += 1
    assert checked == 200


def test_constrained_row_leaves_unconstrained_rows_identical(gen):
    tokenizer = gen.tokenizer
    prompts = [tokenizer.encode(t) for t in ("The capital of France", "A cat sat on", "Numbers like 12")]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "w": {"enum": WORDS}},
              "required": ["n", "w"], "additionalProperties": False}
    alone = [gen.generate_ids([p], max_new_tokens=24)[0] for p in prompts]
    constrained_alone = gen.generate_ids([prompts[1]], max_new_tokens=48, response_format=as_format(schema))[0]
    engine = gen.engine()
    options = {"max_new_tokens": 24}
    sequences = [engine.submit(prompts[0], options),
                 engine.submit(prompts[1], {"max_new_tokens": 48, "response_format": as_format(schema)}),
                 engine.submit(prompts[2], options)]
    while engine.has_work():
        engine.step()
    assert sequences[0].output_ids == alone[0] and sequences[2].output_ids == alone[2]
    assert sequences[1].output_ids == constrained_alone  # greedy constrained: the same alone and batched
    assert sequences[1].stop_kind == "eos"
    assert set(json.loads(tokenizer.decode(constrained_alone))) == {"n", "w"}
    assert sequences[1].selector.grammar_states is not None and sequences[0].selector.grammar_states is None


def test_beam_search_every_beam_validates(gen):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": WORDS}},
              "required": ["ok", "tag"], "additionalProperties": False}
    prompt = gen.tokenizer.encode("A cat sat on the mat")
    results = gen.generate_ids_with_details([prompt], max_new_tokens=40, num_beams=4, num_return_sequences=4,
                                            response_format=as_format(schema))
    assert len(results) == 4
    for result in results:
        jsonschema.validate(json.loads(gen.tokenizer.decode(result.tokens)), schema)


def test_other_forms_streaming_cache_and_sampling_follow_the_grammar(gen):
    prompt = "Hello, how are you today?"
    assert gen.generate(prompt, max_new_tokens=20, response_format={"type": "choice", "choice": ["yes", "no"]}) \
        in ("yes", "no")
    text = gen.generate(prompt, max_new_tokens=20, n_ctx=64,
                        response_format={"type": "regex", "regex": "[0-9]{3}-[a-z]{2}"})
    assert len(text) == 6 and text[3] == "-" and text[:3].isdigit()
    texts = gen.generate([prompt] * 2, max_new_tokens=30, do_sample=True, seed=3,
                         response_format={"type": "grammar", "grammar": 'root ::= "id" [0-9] [0-9]?'})
    assert all(t.startswith("id") and t[2:].isdigit() for t in texts)
    assert gen.generate(prompt, max_new_tokens=8, response_format={"type": "json_object"}).startswith("{")
    # llama.cpp's json_object with a schema constrains to that schema (it was silently any JSON object)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    text = gen.generate(prompt, max_new_tokens=20, response_format={"type": "json_object", "schema": schema})
    jsonschema.validate(json.loads(text), schema)


def test_pydantic_model_class_and_the_compile_cache(gen):
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int = pydantic.Field(ge=0, le=99)  # bounded: a random model would write digits forever
        y: int = pydantic.Field(ge=0, le=99)

    gen.compile_constraint(Point)  # makes gen.requests._grammars (the factory's grammar cache)
    before = gen.requests._grammars.compiles
    for _ in range(3):
        Point.model_validate_json(gen.generate("Numbers like 12", max_new_tokens=40, response_format=Point))
    assert gen.requests._grammars.compiles == before  # compiled once (above), then found in the cache


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}, "Invalid type"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "if": {}}}}, "if"),
    ({"type": "regex", "regex": "("}, "unclosed group"),
    ({"type": "grammar", "grammar": "root ::= missing"}, "missing"),
    ({"type": "choice", "choice": []}, "choice"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "regex", "regex": "a" * 300_000}, "the limit is"),  # refused before compiling
    ({"type": "grammar", "grammar": "start: " + " ".join(f"x{i}" for i in range(20_000)) + "\n"
      + "".join(f'x{i}: "a" | "b"\n' for i in range(20_000))}, "the limit is"),
    ("json", "response_format must be"),
    # keys a form does not take (silently dropped before)
    ({"type": "regex", "regex": "a+", "flags": "i"}, "response_format.flags is not a key"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strictly": True}}, "response_format.json_schema.strictly"),
])
def test_bad_constraints_are_typed_errors_naming_the_problem(gen, response_format, message):
    with pytest.raises(InvalidOptionError, match="response_format") as caught:
        gen.generate("Hello", max_new_tokens=4, response_format=response_format)
    assert message in str(caught.value)


def test_encoder_decoder_models_follow_the_grammar_too():
    from serve_helpers import tiny_bart_generator

    bart = tiny_bart_generator()
    texts = bart.generate(["The capital of France is Paris.", "A cat sat on the mat."], max_new_tokens=12,
                          response_format={"type": "regex", "regex": "(yes|no)[0-9]"})
    assert all(t[:-1] in ("yes", "no") and t[-1].isdigit() for t in texts), texts
