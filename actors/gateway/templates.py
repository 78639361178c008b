"""Rendering an API conversation (tools, tool calls, tool results) with the model's chat template.

A template that takes `tools` (it names them: Qwen, Hermes, Llama 3.1) renders them itself:
the messages and `tools` go to it as Hugging Face passes them (tool-call `arguments` as
dicts); a model with a named `tool_use` template renders with that one when tools are given.
A template that does not (SmolLM2's, the byte tokenizer's ChatML) gets the gateway's default,
documented in docs/agents.md:
**ChatML with Hermes tools inline** -- the tool signatures appended to the system message
(one is added when there is none) with the instruction to answer in
`<tool_call>{"name", "arguments"}</tool_call>` tags; an assistant turn's calls written back
as those tags after its content; each tool result as a user turn
`<tool_response>\\n...\\n</tool_response>`; `developer` as `system`.

Images (`render_ids`, a vision-language policy): a user message's `image_url` content parts go
to the template as `{"type": "image"}` parts, which it renders as the layout's marker token, and
each marker becomes that image's placeholder run (models/vision.py `render_prompt`, with tools).

Invariant: rendering is a pure function of (template, messages, tools), so a conversation
rendered twice gives the same text (the token-in/token-out prefix checks rely on it).
"""
from __future__ import annotations

import copy
import json

from ..models.tokenizer import Tokenizer
from ..models.images import ImageInputError, ImageLayout, content_parts_for_template, image_bytes

TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def takes_tools(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's chat template (or its `tool_use` one) renders `tools` itself."""
    return "tools" in (tokenizer.chat_template or "") or "tool_use" in tokenizer.named_templates


def render(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None,
           add_generation_prompt: bool = True) -> str:
    """The prompt text of an API conversation (see the module docstring for the two paths)."""
    if takes_tools(tokenizer):
        return _native(tokenizer, messages, tools or None, add_generation_prompt)
    return tokenizer.apply_chat_template(inline_tools(messages, tools or []),
                                         add_generation_prompt=add_generation_prompt)


def render_ids(tokenizer: Tokenizer, layout: ImageLayout | None, messages: list[dict],
               tools: list[dict] | None = None) -> tuple[list[int], list[bytes]]:
    """(prompt ids, image file bytes in order) of an API conversation whose user messages may hold
    image content parts: without tools, exactly `render_prompt(tokenizer, layout, messages)`'s.
    With a layout, every image marker in the ids must be an image's (a marker typed as text is
    refused). ImageInputError: an image for a text-only model (layout None), a marker without its
    image, or an image that does not decode."""
    template_messages, urls = content_parts_for_template(messages)
    if layout is None:
        if urls:
            raise ImageInputError(f"the messages hold {len(urls)} image(s), but the model reads text only; "
                                  "fix: use a vision-language model, or send text")
        return tokenizer.encode(render(tokenizer, messages, tools)), []
    text = render(tokenizer, template_messages, tools)
    ids = tokenizer.encode(text)
    marker = marker_id(tokenizer, layout)
    count = ids.count(marker)
    if count > len(urls):
        raise ImageInputError(f"the prompt holds {count} image marker(s) {layout.marker!r} for {len(urls)} image "
                              f"part(s): the text writes the marker; fix: leave {layout.marker!r} out of the text "
                              "(each image_url part renders one)")
    if count < len(urls):
        raise ImageInputError(f"the chat template rendered {count} image marker(s) for {len(urls)} image part(s); "
                              "fix: a chat template that renders {'type': 'image'} content parts")
    images = [image_bytes(url) for url in urls]
    expanded = layout.expand_text(text)           # Gemma 3: its runs written as text (vision.py)
    return layout.expand(ids if expanded == text else tokenizer.encode(expanded), marker, images), images


def marker_id(tokenizer: Tokenizer, layout: ImageLayout) -> int:
    """The token id of the layout's image marker; ImageInputError when the tokenizer lacks it."""
    token_id = tokenizer.hf.token_to_id(layout.marker)
    if token_id is None:
        raise ImageInputError(f"the tokenizer ({tokenizer.source}) has no token {layout.marker!r}, the vision "
                              "model's image marker; fix: the tokenizer with the vision model's special tokens")
    return token_id


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
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         template="tool_use" if tools else None, tools=tools)
