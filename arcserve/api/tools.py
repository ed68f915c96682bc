"""Tool calls a chat request forces (tool_choice "required", or one function named): vLLM's way.

The output is held to a JSON schema (structured outputs, engine/structured.py): a named function's
`parameters` schema (its arguments), or for "required" a list of at least one {"name", "parameters"}
object, each naming one of the request's tools (at most one with parallel_tool_calls false). The
answer then carries the calls as `tool_calls` (arguments as JSON text) and an empty content; a
"required" answer that ended normally has finish_reason "tool_calls", a named call keeps "stop"
(OpenAI's and vLLM's rule). tool_choice "auto" would need a model-specific parser of free text and
is refused (as vLLM refuses it unless started with a tool-call parser).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from arcserve.api.errors import FieldError

EMPTY_OBJECT = {"type": "object", "properties": {}}


def _functions(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of each function tool (checked)."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise FieldError("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                     "'parameters': {...}}}")  # fmt: skip
        name, params = fn.get("name"), fn.get("parameters")
        if not isinstance(name, str) or not name:
            raise FieldError("tools", f"tools[{i}].function.name must be a non-empty string")
        if params is not None and not isinstance(params, dict):
            raise FieldError("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        if name in out:
            raise FieldError("tools", f"tools name the function {name!r} twice")
        out[name] = params or EMPTY_OBJECT
    return out


def forced(tool_choice, tools: list[dict[str, Any]] | None) -> str | None:
    """The function a tool_choice names, "required", or None (no call forced: "none", "auto" or absent;
    "auto" with tools is refused before, protocol's unsupported()). FieldError for a choice that names
    no tool of the request."""
    if tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        name = "required"
    elif isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function" \
            and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        name = tool_choice["function"]["name"]
    else:
        raise FieldError("tool_choice", f"tool_choice must be 'none', 'required' or {{'type': 'function', 'function': "
                                       f"{{'name': ...}}}}; got {tool_choice!r}")  # fmt: skip
    if not tools:
        raise FieldError("tool_choice", f"tool_choice {tool_choice!r} needs tools")
    if name != "required" and name not in _functions(tools):
        raise FieldError("tool_choice", f"tool_choice names the function {name!r}, which is not among the tools")
    return name


def schema(choice: str, tools: list[dict[str, Any]], parallel: bool | None) -> dict[str, Any]:
    """The JSON schema the output must follow for a forced call (see the module's docstring)."""
    fns = _functions(tools)
    if choice != "required":
        return fns[choice]
    defs: dict[str, Any] = {}
    calls = []
    for name, params in fns.items():
        params = dict(params)
        defs_of = params.pop("$defs", None) or {}
        if not isinstance(defs_of, dict):
            raise FieldError("tools", f"the parameters of tool {name!r} have a $defs that is not an object")
        for k, v in defs_of.items():  # one $defs for all (refs point at the root)
            if k in defs and defs[k] != v:
                raise FieldError("tools", f"tools define {k!r} in $defs differently; give each definition one name")
            defs[k] = v
        calls.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                      "required": ["name", "parameters"]})  # fmt: skip
    out: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if parallel is False:
        out["maxItems"] = 1
    if defs:
        out["$defs"] = defs
    return out


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def calls(choice: str, text: str) -> list[dict[str, Any]] | None:
    """The tool calls in a forced call's output, or None where the text is not a complete call (it
    was cut short by max_tokens or a stop string): the answer then keeps the text as its content."""
    if choice != "required":
        try:
            json.loads(text)
        except ValueError:
            return None
        return [_call(choice, text)]
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(c, dict) and "name" in c for c in items):
        return None
    return [_call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in items]


def message(choice: str, role: str, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """(the answer's message, its finish_reason) for a forced call's output."""
    got = calls(choice, text)
    if got is None:
        return {"role": role, "content": text}, finish_reason
    reason = "tool_calls" if choice == "required" and finish_reason == "stop" else finish_reason
    return {"role": role, "content": "", "tool_calls": got}, reason


class StreamedCalls:
    """A forced call's deltas as a stream's tool_calls deltas. A named function's arguments stream as
    they come (the first delta with the call's id and name); "required" output is a JSON list whose
    calls are known only as a whole, so they go out together when the choice finishes."""

    def __init__(self, choice: str) -> None:
        self.choice = choice
        self.text = ""
        self.id = f"chatcmpl-tool-{uuid.uuid4().hex}"
        self.started = False

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the chunk's delta, its finish_reason) for new output text."""
        self.text += text
        if self.choice != "required":
            if not text:
                return {}, finish_reason
            fn: dict[str, Any] = {"arguments": text}
            call: dict[str, Any] = {"index": 0, "function": fn}
            if not self.started:
                self.started = True
                call.update(id=self.id, type="function")
                fn["name"] = self.choice
            return {"tool_calls": [call]}, finish_reason
        if finish_reason is None:
            return {}, None
        msg, reason = message(self.choice, "assistant", self.text, finish_reason)
        if "tool_calls" not in msg:
            return {"content": self.text}, reason
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]}, reason
