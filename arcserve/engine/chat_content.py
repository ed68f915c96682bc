"""Chat messages as a chat template reads them (vLLM's chat_template_content_format).

OpenAI messages carry content as a string or as a list of parts ({"type": "text", "text": ...}).
Templates read it one of two ways: as text ("string": the parts' texts joined one per line, empty
ones left out) or as the list of parts ("openai": a string becomes one text part, no content an
empty list). "auto" reads the template: a loop over a message's content means it expects parts.
A tool message's content is always text (most templates print a tool result as a string).

OpenAI's "developer" role (the application's instructions; the newer name of "system") reaches a
template that does not name it as "system", the system messages then merged into one in front
(many templates take a system message only there), as vLLM renders it; a template that names the
role gets it as it is. An assistant's tool calls reach the template with their arguments parsed
from JSON text into a mapping, as vLLM passes them.
"""

from __future__ import annotations

import functools
import json

FORMATS = ("auto", "string", "openai")


def template_messages(messages: list, content_format: str, template: str | None) -> list[dict]:
    """The conversation for apply_chat_template; ValueError for a malformed message or a part that
    is not text (arcserve takes no images or audio)."""
    if content_format not in FORMATS:
        raise ValueError(f"chat_template_content_format must be 'auto', 'string' or 'openai'; got {content_format!r}")
    if content_format == "auto":
        content_format = detect_content_format(template) if isinstance(template, str) else "string"
    return [_message(m, content_format) for m in developer_as_system(messages, template)]


def _parsed_tool_calls(m: dict) -> dict:
    """An assistant message whose tool calls carry their arguments as a mapping: OpenAI sends them
    as JSON text, templates read them as a mapping (`| tojson`, `.items()`). As vLLM: text that is
    not a JSON object becomes {}."""
    calls = m.get("tool_calls")
    if m.get("role") != "assistant" or not isinstance(calls, list):
        return m
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                args = {}
            call = {**call, "function": {**fn, "arguments": args if isinstance(args, dict) else {}}}
        out.append(call)
    return {**m, "tool_calls": out}


def developer_as_system(messages: list, template: str | None) -> list:
    """The conversation with its "developer" messages as "system" ones where the template does not
    name that role, and then every system message merged into one first message (their texts
    one after another, a blank line between) unless a single one is first already."""
    if not any(_role(m) == "developer" for m in messages):
        return messages
    if isinstance(template, str) and ('"developer"' in template or "'developer'" in template):
        return messages
    msgs = [{**m, "role": "system"} if _role(m) == "developer" else m for m in messages]
    first = [i for i, m in enumerate(msgs) if _role(m) == "system"]
    if first == [0]:
        return msgs
    texts = [join_texts(_texts(msgs[i])) for i in first]
    merged = {"role": "system", "content": "\n\n".join(t for t in texts if t)}
    return [merged, *(m for m in msgs if _role(m) != "system")]


def _role(m) -> str | None:
    return m.get("role") if isinstance(m, dict) else None


def _message(m, content_format: str) -> dict:
    texts = _texts(m)
    m = _parsed_tool_calls(m)
    if content_format == "openai" and m["role"] != "tool":
        return {**m, "content": [{"type": "text", "text": t} for t in texts]}
    return {**m, "content": join_texts(texts)}


def _texts(m) -> list[str]:
    """A message's content as a list of texts; ValueError for a malformed one."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"Each chat message needs a 'role' (and its 'content'); got {m!r}")
    content = m.get("content")
    if isinstance(content, list):
        texts = [text_of_part(p) for p in content]
    elif isinstance(content, str):
        texts = [content]
    elif content is None:
        texts = []
    else:
        raise ValueError(f"message content must be a string or a list of text parts; got {type(content).__name__}")
    return texts


_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}


def text_of_part(part) -> str:
    """The text of a content part read as text, as vLLM reads them (text, input_text, output_text,
    refusal, thinking); ValueError for any other (arcserve takes no images or audio)."""
    kind = part.get("type") if isinstance(part, dict) else None
    key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if key is None or not isinstance(part.get(key), str):
        raise ValueError(f"message content parts must be text parts ({{'type': 'text', 'text': ...}}; arcserve "
                         f"takes no images or audio); got {str(part)[:200]}")  # fmt: skip
    return part[key]


def join_texts(texts) -> str:
    """Text parts as one text: one per line, empty ones left out (vLLM's "string" rendering)."""
    return "\n".join(t for t in texts if t)


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """ "openai" when the template loops over a message's content, else "string" (also when it
    does not parse)."""
    try:
        ast = _parse(template)
        return "openai" if _loops_over_content(ast) else "string"
    except Exception:  # noqa: BLE001 (a template we cannot read: the common form)
        return "string"


def _parse(template: str):
    try:  # transformers' environment knows the tags templates use (e.g. {% generation %})
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(template).environment.parse(template)
    except ImportError:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        return ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)


def _refers(node, names: set[str], key: str | None = None) -> bool:
    """node reads one of `names` (key given: its `key` item or attribute), through filters, tests
    and slices."""
    from jinja2 import nodes

    while isinstance(node, (nodes.Filter, nodes.Test)) or (
        isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
    ):
        node = node.node
    if key is not None:
        if isinstance(node, nodes.Getattr) and node.attr == key:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key:
            node = node.node
        else:
            return False
    return isinstance(node, nodes.Name) and node.name in names


def _closure(ast, names: set[str], key: str | None = None) -> set[str]:
    """`names`' readers: variables assigned from them (`key` of them, for the first round), and so on."""
    from jinja2 import nodes

    found, changed = set(), True
    while changed:
        changed = False
        for a in ast.find_all(nodes.Assign):
            if isinstance(a.target, nodes.Name) and a.target.name not in found:
                if _refers(a.node, names, key) or _refers(a.node, found):
                    found.add(a.target.name)
                    changed = True
    return found


def _loops_over_content(ast) -> bool:
    from jinja2 import nodes

    lists = {"messages"} | _closure(ast, {"messages"})  # messages, and variables holding (part of) them
    loops = list(ast.find_all(nodes.For))
    msgs = {f.target.name for f in loops if isinstance(f.target, nodes.Name) and _refers(f.iter, lists)}
    msgs |= {a.target.name for a in ast.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)
             and isinstance(a.node, nodes.Getitem) and _refers(a.node.node, lists)}  # m = messages[0]  # fmt: skip
    contents = _closure(ast, msgs, "content") | {"content"}  # (a variable named content: vLLM's guess too)
    in_macros: dict[int, set[str]] = {}  # loops inside a macro -> its parameters that receive a content
    for macro in ast.find_all(nodes.Macro):
        params = [a.name for a in macro.args]
        bound = set()
        for call in ast.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                bound |= {params[i] for i, a in enumerate(call.args[: len(params)]) if _is_content(a, msgs, contents)}
                bound |= {k.key for k in call.kwargs if k.key in params and _is_content(k.value, msgs, contents)}
        for loop in macro.find_all(nodes.For):
            in_macros[id(loop)] = bound
    for loop in loops:
        if _refers(loop.iter, msgs, "content"):
            return True
        names = in_macros.get(id(loop), contents)
        if _refers(loop.iter, names):
            return True
    return False


def _is_content(node, msgs: set[str], contents: set[str]) -> bool:
    return _refers(node, msgs, "content") or _refers(node, contents - {"content"})
