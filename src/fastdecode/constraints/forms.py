"""Output constraints as users write them -> one llguidance grammar text.

Every request form (OpenAI ``response_format``, vLLM ``structured_outputs``, llama.cpp
``json_schema`` / ``grammar``, the CLI's ``--json-schema`` / ``--grammar``, a Pydantic model
class) is first turned into a ``response_format`` dict of one of these types, then into the
grammar text llguidance compiles (``grammar_text``):

- ``{"type": "text"}``: no constraint;
- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
- ``{"type": "regex", "regex": "..."}``;
- ``{"type": "choice", "choice": ["a", "b"]}``: exactly one of the strings;
- ``{"type": "grammar", "grammar": "..."}``: GBNF (llama.cpp) or Lark (llguidance's dialect).

Nothing here needs a tokenizer; compiling against one is ``constraints.compiler``'s job.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidOptionError

MAX_GRAMMAR_CHARS = 256 * 1024  # a schema or grammar text past this is refused before compiling
# JSON as OpenAI writes it: one space after ':' and ',', no free whitespace (a small model left free
# to add whitespace may add it until max_tokens); a schema's own "x-guidance" options override these.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FORM_TYPES = ("text", "json_object", "json_schema", "regex", "choice", "grammar")


def response_format_from(value: Any, name: str = "response_format") -> dict | None:
    """A user's constraint (a dict form, or a Pydantic model class) -> a checked dict form, or None
    for no constraint. Raises InvalidOptionError naming ``name`` and the bad part."""
    if value is None:
        return None
    if isinstance(value, type):
        return {"type": "json_schema", "json_schema": {"name": value.__name__, "schema": pydantic_schema(value, name),
                                                       "strict": True}}
    if not isinstance(value, dict):
        raise InvalidOptionError(f"{name} must be a dict like {{'type': 'json_schema', ...}} or a Pydantic model "
                                 f"class, got {type(value).__name__}")
    kind = value.get("type")
    if kind not in FORM_TYPES:
        raise InvalidOptionError(f"{name}.type must be one of {', '.join(FORM_TYPES)}, got {kind!r}")
    _known_keys(value, FORM_KEYS[kind], name)
    if kind == "text":
        return None
    if kind == "json_object" and value.get("schema") is not None:  # llama.cpp's form: that schema's JSON
        value = {"type": "json_schema", "json_schema": {"name": "json_object", "schema": value["schema"]}}
        kind = "json_schema"
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise InvalidOptionError(f"{name}.json_schema must be an object with a 'schema' object")
        _known_keys(spec, {"name", "schema", "strict", "description"}, f"{name}.json_schema")
    elif kind in ("regex", "grammar"):
        if not isinstance(value.get(kind), str) or not value[kind].strip():
            raise InvalidOptionError(f"{name}.{kind} must be a non-empty string")
    elif kind == "choice":
        choice = value.get("choice")
        if not isinstance(choice, list) or not choice or not all(isinstance(c, str) for c in choice):
            raise InvalidOptionError(f"{name}.choice must be a non-empty list of strings")
    return value


# The keys each form takes (json_object's schema: llama.cpp's server constrains to it).
FORM_KEYS = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"},
             "regex": {"type", "regex"}, "choice": {"type", "choice"}, "grammar": {"type", "grammar"}}


def _known_keys(value: dict, keys: set[str], name: str) -> None:
    unknown = sorted(k for k, v in value.items() if v is not None and k not in keys)
    if unknown:  # never silently dropped: it may have been meant to shape the output
        raise InvalidOptionError(f"{name}.{unknown[0]} is not a key of this form (it takes {', '.join(sorted(keys))})")


def pydantic_schema(model_class: type, name: str) -> dict:
    schema_of = getattr(model_class, "model_json_schema", None)
    if schema_of is None:
        raise InvalidOptionError(f"{name}: the class {model_class.__name__} is not a Pydantic model (no "
                                 "model_json_schema); give a dict form instead")
    return schema_of()


def grammar_text(form: dict, name: str = "response_format") -> str:
    """A checked dict form (``response_format_from``) -> llguidance's grammar text (the cache key)."""
    from llguidance import LLMatcher, grammar_from

    kind = form["type"]
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
    if kind == "json_schema":
        schema = closed_objects(form["json_schema"].get("schema", {}))
        text = json.dumps(schema)
        check_size(text, f"{name}.json_schema.schema")
        try:
            return LLMatcher.grammar_from_json_schema(text, defaults=JSON_STYLE)
        except ValueError as exc:
            raise InvalidOptionError(f"{name}.json_schema.schema is not valid: {exc}") from None
    if kind == "choice":
        return grammar_from("choice", form["choice"])
    text = form[kind]
    name = name if name == kind else f"{name}.{kind}"
    check_size(text, name)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    try:
        return grammar_from("grammar", text)
    except ValueError as exc:  # GBNF that does not convert to Lark
        raise InvalidOptionError(f"{name} is not a valid GBNF or Lark grammar: {exc}") from None


SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems", "prefixItems", "anyOf", "oneOf", "allOf")


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its properties and
    says nothing about others (OpenAI's strict mode, xgrammar's default): the output then holds
    only the named fields, still valid against the original schema, and a small model cannot add
    fields until it runs out of tokens. A schema that sets additionalProperties keeps its choice."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in SUBSCHEMAS:
            out[key] = closed_objects(value)
        else:
            out[key] = value
    if "properties" in out and not {"additionalProperties", "unevaluatedProperties", "patternProperties"} & set(out):
        out["additionalProperties"] = False
    return out


def check_size(text: str, name: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidOptionError(f"{name} is {len(text)} characters; the limit is {MAX_GRAMMAR_CHARS}")


def lark_string(text: str) -> str:
    """A Lark string literal matching ``text`` exactly."""
    return json.dumps(text)
