"""JSON schemas as the structured-outputs grammar takes them: a walk over every subschema, objects
closed unless opened, and string formats llguidance lacks read as the annotations JSON Schema makes
them."""

from __future__ import annotations

import functools
from typing import Any, Callable

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
              "unevaluatedItems", "additionalProperties", "unevaluatedProperties")
SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")


def each_schema(schema: Any, fn: Callable[[dict], dict]) -> Any:
    """A copy of ``schema`` with ``fn`` applied to every (sub)schema object in it, innermost first."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: each_schema(sub, fn) for name, sub in out[key].items()}
    for key in SCHEMA_ONE:
        if key in out:
            out[key] = each_schema(out[key], fn) if not isinstance(out[key], list) else \
                [each_schema(sub, fn) for sub in out[key]]
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [each_schema(sub, fn) for sub in out[key]]
    return fn(out)


def closed_objects(schema: Any) -> Any:
    """Every object schema that does not say otherwise takes no properties beyond those it lists
    (``additionalProperties: false``, which OpenAI's strict mode requires be written and xgrammar,
    vLLM's default, and llama.cpp assume), through the nested schemas; a copy."""
    def close(out: dict) -> dict:
        kind = out.get("type")
        if (kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out) and \
                not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(out):
            out["additionalProperties"] = False
        return out
    return each_schema(schema, close)


def known_formats_only(schema: Any) -> Any:
    """The schema without the string formats llguidance does not implement (Pydantic's ``path``,
    ``binary``, ``password``, OpenAPI's ``int64``, ...): JSON Schema makes ``format`` an annotation
    a validator may ignore, as xgrammar and llama.cpp do with formats they lack; a copy."""
    def strip(out: dict) -> dict:
        if isinstance(out.get("format"), str) and not _format_known(out["format"]):
            del out["format"]
        return out
    return each_schema(schema, strip)


@functools.lru_cache(maxsize=64)
def _format_known(name: str) -> bool:
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "format": name})
    return not llguidance.LLMatcher.validate_grammar(grammar)


def prepared(schema: Any, closed: bool = True) -> Any:
    """A JSON schema as every structured-outputs grammar takes it (response formats, vLLM's fields,
    a forced tool's parameters): ``true`` as ``{}`` (any value), the formats llguidance lacks left
    out, and (``closed``) objects closed where it does not open them. ValueError for ``false``."""
    if schema is False:
        raise ValueError("the schema false accepts no value")
    schema = known_formats_only({} if schema is True else schema)
    return closed_objects(schema) if closed else schema
