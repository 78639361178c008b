"""Rendering an API conversation (tools, tool calls, tool results) with the model's chat template.

A template that takes `tools` (it names them: Qwen, Hermes, Llama 3.1) renders them itself:
the messages and `tools` go to it as Hugging Face passes them (tool-call `arguments` as
dicts). A template that does not (SmolLM2's, the byte tokenizer's ChatML, and ChatML for a
tokenizer with no template at all) gets the gateway's default, documented in docs/agents.md:
**ChatML with Hermes tools inline** -- the tool signatures appended to the system message
(one is added when there is none) with the instruction to answer in
`<tool_call>{"name", "arguments"}</tool_call>` tags; an assistant turn's calls written back
as those tags after its content; each tool result as a user turn
`<tool_response>\\n...\\n</tool_response>`; `developer` as `system`.

Invariant: rendering is a pure function of (template, messages, tools), so a conversation
rendered twice gives the same text (the token-in/token-out prefix checks rely on it).
"""
from __future__ import annotations

import copy
import functools
import json

from ..models.tokenizer import Tokenizer

TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def takes_tools(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's chat template renders `tools` itself."""
    return "tools" in (tokenizer.chat_template or "")


def render(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None,
           add_generation_prompt: bool = True) -> str:
    """The prompt text of an API conversation (see the module docstring for the two paths)."""
    if takes_tools(tokenizer):
        return _native(tokenizer, messages, tools or None, add_generation_prompt)
    return tokenizer.apply_chat_template(inline_tools(messages, tools or []),
                                         add_generation_prompt=add_generation_prompt)


def inline_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Plain {role, content} messages carrying tools, calls and results as Hermes text."""
    out = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "developer":
            role = "system"
        if role == "assistant" and message.get("tool_calls"):
            calls = "".join("\n<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                             "arguments": _arguments(c)}) + "\n</tool_call>"
                            for c in message["tool_calls"])
            content = (content + calls) if content else calls.lstrip("\n")
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        listing = "\n".join(json.dumps(tool, sort_keys=True) for tool in tools)
        prompt = TOOLS_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments(call: dict):
    """A tool call's arguments as a dict (the JSON string parsed), or the string when it is not JSON."""
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _native(tokenizer: Tokenizer, messages: list[dict], tools, add_generation_prompt: bool) -> str:
    messages = copy.deepcopy(messages)
    for message in messages:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = _arguments(call)
    bos = tokenizer.hf.id_to_token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else ""
    eos = tokenizer.hf.id_to_token(tokenizer.eos_token_id) if tokenizer.eos_token_id is not None else ""
    return _compiled(tokenizer.chat_template).render(
        messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
        bos_token=bos, eos_token=eos)


@functools.lru_cache(maxsize=16)
def _compiled(source: str):
    """A template compiled as Hugging Face compiles them (trim and lstrip blocks, a `tojson`
    that does not HTML-escape, `raise_exception`)."""
    import jinja2

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
