"""Tool calls out of the model's own text, into the API's `tool_calls`.

Two formats, parallel calls included:

- **hermes** (Hermes, Qwen 2/2.5/3, and the gateway's default template): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text outside the tags is the
  message's content.
- **llama3** (Llama 3.1+ JSON tool calling): the whole reply is a JSON object
  `{"name": ..., "parameters": {...}}` (or `"arguments"`), optionally after `<|python_tag|>`;
  parallel calls are several objects separated by `;` or new lines, or one JSON list.

`parse_tool_calls(text, fmt)` never raises on the model's output: text that is not a
well-formed call stays content, and the reply is then an ordinary message (a policy that
writes broken calls is trained on that, it is not a server error). `tool_call_format(template)`
picks the format a chat template speaks.

Invariant: every returned call has `function.arguments` as a JSON string of an object (what
the API carries), and `id`s unique within the message.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import cast

FORMATS = ("hermes", "llama3")
HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ParsedReply:
    """A reply split into its text and its tool calls (API form)."""

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


def tool_call_format(chat_template: str | None) -> str:
    """The tool-call format a chat template speaks: 'llama3' for Llama 3's ipython/python_tag
    templates, else 'hermes' (Qwen, Hermes and the gateway's default)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3"
    return "hermes"


def parse_tool_calls(text: str, fmt: str = "hermes") -> ParsedReply:
    """Split `text` into content and tool calls in format `fmt` (one of FORMATS)."""
    if fmt not in FORMATS:
        raise ValueError(f"tool-call format must be one of {FORMATS}, got {fmt!r}")
    return _parse_hermes(text) if fmt == "hermes" else _parse_llama3(text)


def _call(name, arguments) -> dict | None:
    """One API tool call, or None when `name`/`arguments` are not a call."""
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):   # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _parse_hermes(text: str) -> ParsedReply:
    calls, kept, last = [], [], 0
    for match in HERMES.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue   # a broken call stays in the content
        call = _call(obj.get("name"), obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) else None
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:match.start()])
        last = match.end()
    if not calls:
        return ParsedReply(content=text)
    content = ("".join(kept) + text[last:]).strip()
    return ParsedReply(content=content or None, tool_calls=calls)


def _objects(text: str) -> list | None:
    """The JSON values of `text`: one value (a list is its items), or several separated by ';' or
    whitespace; None when any part is not JSON."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            break
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.extend(value if isinstance(value, list) else [value])
    return values


def _parse_llama3(text: str) -> ParsedReply:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith(("{", "[")):
        return ParsedReply(content=text)
    values = _objects(body)
    if not values or not all(isinstance(v, dict) for v in values):
        return ParsedReply(content=text)
    calls = [_call(v.get("name"), v.get("parameters", v.get("arguments"))) for v in values]
    if any(c is None for c in calls):
        return ParsedReply(content=text)
    return ParsedReply(content=None, tool_calls=cast(list[dict], calls))   # none is None (checked above)
