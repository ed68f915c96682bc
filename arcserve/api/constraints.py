"""A request's structured-output constraint: from OpenAI's response_format, vLLM's structured_outputs
and its older guided_* fields, or a tool call the request forces (api/tools.py); checked against the
tokenizer off the event loop before anything is queued (engine/structured.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from arcserve.api import tools
from arcserve.api.errors import FieldError, bad_request
from arcserve.sampling_params import CONSTRAINT_KINDS, StructuredOutputsParams

# vLLM's older guided_* fields and the StructuredOutputsParams field each sets
_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))  # fmt: skip


def of(body) -> tuple[str, StructuredOutputsParams] | None:
    """(the field that set the constraint, the constraint), or None. As in vLLM, response_format's
    constraint takes the place of one of the same kind in structured_outputs (whose options stay);
    two constraints in all are a FieldError naming the first field that set one, as is a malformed
    one. A forced tool call's schema takes no other constraint (structured_outputs' options, such as
    disable_any_whitespace, apply to it)."""
    choice = getattr(body, "forced_call", None)  # (chat requests)
    setters, others, fields = _fields(body)
    if choice is not None:
        if setters:
            kind = next(k for k in CONSTRAINT_KINDS if fields.get(k) is not None)
            named = setters[0] if setters[0] != "structured_outputs" else f"structured_outputs.{kind}"
            raise FieldError("tool_choice", f"tool_choice {body.tool_choice!r} cannot be combined with {named}: "
                             "a forced tool call is itself a structured output")  # fmt: skip
        fields["json"] = tools.schema(choice, body.tools, body.parallel_tool_calls)
        return _made(body, "tool_choice", fields)
    if not setters and not others:
        return None
    return _made(body, (setters or others)[0], fields)


async def checked(body, grammars) -> StructuredOutputsParams | None:
    """The body's constraint (None if it has none), its grammar checked in a worker thread (a schema can
    take milliseconds; the first request may wait for the grammar engine's view of the tokenizer):
    a ValueError names the field that set it (a 400 through bad_request)."""
    try:
        got = of(body)
        if got is None:
            return None
        field, so = got
        await asyncio.to_thread(_check, grammars, field, so)
    except ValueError as e:
        raise bad_request(e) from e
    return so


def _check(grammars, field: str, so: StructuredOutputsParams) -> None:
    try:
        grammars.check(so)
    except ValueError as e:
        raise FieldError(field, str(e)) from None


def _fields(body) -> tuple[list[str], list[str], dict[str, Any]]:
    """(the fields that set a constraint, those that set only options, StructuredOutputsParams' fields
    from all of them)."""
    fields = dict(body.structured_outputs or {})
    setters, others = [], []
    if body.structured_outputs is not None:
        (setters if any(fields.get(k) is not None for k in CONSTRAINT_KINDS) else others).append("structured_outputs")
    rf = body.response_format
    if rf is not None and rf.type in ("json_object", "json_schema"):
        setters.append("response_format")
        if rf.type == "json_object":
            fields["json_object"] = True
        elif rf.json_schema is None or rf.json_schema.json_schema is None:
            raise FieldError("response_format", "response_format of type 'json_schema' needs json_schema.schema "
                             "(the JSON schema)")  # fmt: skip
        else:
            fields["json"] = rf.json_schema.json_schema
    for name, key in _GUIDED:
        if getattr(body, name) is not None:
            setters.append(name)
            fields[key] = getattr(body, name)
    return setters, others, fields


def _made(body, field: str, fields: dict[str, Any]) -> tuple[str, StructuredOutputsParams]:
    if body.use_beam_search:
        raise FieldError(field, f"{field} does not apply to use_beam_search (beams follow the model's logprobs alone)")
    try:
        return field, StructuredOutputsParams(**fields)
    except TypeError as e:  # a key StructuredOutputsParams does not have
        raise FieldError(field, f"structured_outputs: {e}".replace("StructuredOutputsParams.__init__() ", "")) from None
    except ValueError as e:
        raise FieldError(field, str(e)) from None
