"""A request's output constraint: OpenAI's `response_format`, or SGLang's `regex` / `ebnf`, or `lark`.

At most one may be given. The shapes are checked here (400 naming the field); the grammar
itself is compiled by the engine at submit, and its GrammarError becomes a 400 naming the
field it came from (`GenerationArgs.grammar_field`).
"""
from __future__ import annotations

from typing import Any

from akv_core.constrain import Grammar
from akv_core.server.errors import APIError

FIELDS = ("response_format", "regex", "ebnf", "lark")
SCHEMA_FIELD = "response_format.json_schema.schema"


def output_constraint(request: Any) -> tuple[Grammar | None, str | None]:
    """(grammar, the field it came from), or (None, None) for free text."""
    given = [field for field in FIELDS if _given(request, field)]
    if len(given) > 1:
        raise APIError(f"{given[1]}: send at most one of {', '.join(FIELDS)}; got {' and '.join(given)}",
                       param=given[1])
    if not given:
        return None, None
    field = given[0]
    if field == "response_format":
        return _response_format(request.response_format)
    text = getattr(request, field)
    if not text.strip():
        raise APIError(f"{field}: the {field} grammar is empty", param=field)
    return Grammar(field, text), field


def _given(request: Any, field: str) -> bool:
    value = getattr(request, field)
    if field == "response_format":
        return value is not None and value.get("type") != "text"
    return value is not None


def _response_format(value: dict[str, Any]) -> tuple[Grammar, str]:
    kind = value.get("type")
    if kind == "json_object":
        return Grammar.json_object(), "response_format"
    if kind != "json_schema":
        raise APIError(f"response_format.type: expected text, json_object or json_schema, got {kind!r}",
                       param="response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError("response_format.json_schema: expected an object with the schema under 'schema'",
                       param="response_format.json_schema")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, (dict, bool)):
        raise APIError(f"{SCHEMA_FIELD}: a JSON schema is an object, got {type(schema).__name__}",
                       param=SCHEMA_FIELD)
    return Grammar.json_schema(schema), SCHEMA_FIELD
