"""A request's structured-output constraint, from `response_format` or vLLM's `structured_outputs`.

As vLLM does: `response_format` of type json_schema sets `json` (the schema under
`json_schema.schema`), json_object sets `json_object`, structural_tag sets `structural_tag` (the whole
response_format as JSON, either form: `format`, or the legacy `structures` and `triggers`), text sets
nothing; the body's `structured_outputs` is vLLM's StructuredOutputsParams as a JSON object, and
`response_format` replaces its constraint when both are given. The constraint is parsed here, so a bad
schema, regex, grammar or tag is a 400 naming the field before any work starts.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from kvllm.entrypoints.openai.errors import OpenAIError
from kvllm.sampling_params import CONSTRAINT_FIELDS, StructuredOutputsParams
from kvllm.structured_output.backend_xgrammar import validate

_FIELDS = {f.name for f in fields(StructuredOutputsParams)}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


def response_format_constraint(response_format: dict[str, Any] | None) -> dict[str, Any]:
    """The StructuredOutputsParams fields `response_format` sets ({} for none or type text)."""
    if response_format is None:
        return {}
    if not isinstance(response_format, dict):
        raise OpenAIError("response_format must be an object with a type", param="response_format")
    kind = response_format.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise OpenAIError(
                "When response_format type is 'json_schema', the 'json_schema' field must be provided "
                "(an object with name and schema)",
                param="response_format",
            )
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise OpenAIError(
                "response_format.json_schema.schema is missing: give the JSON schema there",
                param="response_format",
            )
        return {"json": schema}
    if kind == "structural_tag":
        if "format" not in response_format and "structures" not in response_format:
            raise OpenAIError(
                "response_format type 'structural_tag' needs 'format' (xgrammar's structural tag) or the "
                "legacy 'structures' and 'triggers'",
                param="response_format",
            )
        return {"structural_tag": json.dumps(response_format)}
    raise OpenAIError(
        f"response_format type {kind!r} is not valid; allowed: {', '.join(RESPONSE_FORMAT_TYPES)}",
        param="response_format",
    )


def structured_outputs_params(
    structured_outputs: dict[str, Any] | None, response_format: dict[str, Any] | None
) -> StructuredOutputsParams | None:
    """The request's constraint, checked (400 naming the field), or None."""
    from_format = response_format_constraint(response_format)
    param = "response_format" if from_format else "structured_outputs"
    try:
        if structured_outputs is not None:
            if not isinstance(structured_outputs, dict):
                raise ValueError("structured_outputs must be an object (vLLM's StructuredOutputsParams)")
            unknown = sorted(set(structured_outputs) - _FIELDS)
            if unknown:
                raise ValueError(
                    f"structured_outputs has unknown field(s) {unknown}; allowed: {', '.join(sorted(_FIELDS))}"
                )
            given = {k: v for k, v in structured_outputs.items() if v is not None}
            if from_format:
                # response_format's constraint replaces the body's (vLLM's rule); options are kept.
                given = {k: v for k, v in given.items() if k not in CONSTRAINT_FIELDS}
                params = StructuredOutputsParams(**given, **from_format)
            else:
                params = StructuredOutputsParams(**given)
        elif from_format:
            params = StructuredOutputsParams(**from_format)
        else:
            return None
        validate(params)
    except ValueError as exc:
        raise OpenAIError(str(exc), param=param) from None
    return params
