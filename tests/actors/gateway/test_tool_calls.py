"""Tool calls parsed from the model's text (Hermes/Qwen `<tool_call>` JSON and Llama 3 JSON, parallel
calls too), rendered back through a chat template, the request checks that name the field, and
image content parts rendered with tools (`render_ids`)."""
from __future__ import annotations

import json

import pytest

from postrain.actors.gateway.protocol import APIError, parse_chat, parse_completion
from postrain.actors.gateway.templates import render, render_ids
from postrain.actors.gateway.tool_calls import parse_tool_calls, tool_call_format
from postrain.actors.models.chat_template import CHATML_TEMPLATE
from postrain.actors.models.tokenizer import byte_tokenizer


def calls(parsed) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


def test_hermes_calls_single_parallel_and_broken():
    one = parse_tool_calls('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                           '</tool_call>')
    assert one.content == "I will look." and calls(one) == [("get_weather", {"city": "Oslo"})]
    assert one.tool_calls[0]["type"] == "function" and one.tool_calls[0]["id"].startswith("call_")
    two = parse_tool_calls('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
                           '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>')
    assert two.content is None and calls(two) == [("a", {"x": 1}), ("b", {"y": 2})]
    assert len({c["id"] for c in two.tool_calls}) == 2
    broken = '<tool_call>{"name": "a", "arguments": {"x": 1</tool_call>'
    assert parse_tool_calls(broken).content == broken and parse_tool_calls(broken).tool_calls == []
    assert parse_tool_calls("just text").tool_calls == []


def test_llama3_json_calls_single_parallel_and_plain_text():
    one = parse_tool_calls('<|python_tag|>{"name": "search", "parameters": {"q": "trio"}}', "llama3")
    assert one.content is None and calls(one) == [("search", {"q": "trio"})]
    semi = parse_tool_calls('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', "llama3")
    assert calls(semi) == [("a", {"x": 1}), ("b", {})]
    listed = parse_tool_calls('[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": 2}}]',
                              "llama3")
    assert calls(listed) == [("a", {"x": 1}), ("b", {"y": 2})]
    for text in ("The answer is 4.", '{"not": "a call"}', '{"name": "a", "parameters": {} trailing'):
        assert parse_tool_calls(text, "llama3").tool_calls == [] and parse_tool_calls(text, "llama3").content == text
    with pytest.raises(ValueError, match="tool-call format must be one of"):
        parse_tool_calls("x", "xml")


def test_the_format_follows_the_template():
    assert tool_call_format("{{ '<tool_call>' }}") == "hermes"
    assert tool_call_format("{% if ipython %}<|python_tag|>{% endif %}") == "llama3"
    assert tool_call_format(None) == "hermes"


QWEN_LIKE = (  # a template that renders tools itself, the way Qwen 2.5's does
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, QWEN_LIKE], ids=["default-inline", "native"])
def test_a_parsed_call_and_its_result_render_back_through_the_template(template):
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = template
    parsed = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    messages = [{"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls},
                {"role": "tool", "tool_call_id": parsed.tool_calls[0]["id"], "content": "3"}]
    text = render(tokenizer, messages, TOOLS)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<tool_response>\n3\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    assert '"name": "add"' in text.split("<|im_start|>user")[0]   # the tools come first, in the system turn
    assert parse_tool_calls(text.split("<|im_start|>assistant\n")[1]).tool_calls[0]["function"]["name"] == "add"


def test_requests_are_checked_naming_the_field():
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    call = parse_chat({**base, "max_completion_tokens": 7, "stop": "x", "n": 2, "seed": 3, "tools": TOOLS,
                       "frequency_penalty": 0.5}, ("tiny",), max_n=4)
    assert (call.sampling.max_new_tokens, call.sampling.stop, call.sampling.n, call.sampling.seed) == (7, ("x",), 2, 3)
    assert call.tool_choice == "auto" and call.parses_tool_calls
    content_parts = parse_chat({**base, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, ("tiny",), 4)
    assert content_parts.messages[0]["content"] == "ab"
    cases = [({"n": 5}, "n"), ({"top_p": 0}, "top_p"), ({"stop": ["a"] * 5}, "stop"),
             ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
             ({"messages": [{"role": "assistant"}]}, "messages[0].content"), ({"logprobs": "yes"}, "logprobs"),
             ({"model": None}, "model")]
    for change, field in cases:
        with pytest.raises(APIError) as info:
            parse_chat({**base, **change}, ("tiny",), max_n=4)
        assert info.value.status == 400 and info.value.param == field, (change, info.value.message)
    with pytest.raises(APIError, match="'prompt': must be a string or a non-empty list of token ids"):
        parse_completion({"model": "tiny", "prompt": [1, -2]}, ("tiny",), 4)
    assert parse_completion({"model": "tiny", "prompt": ["hello"]}, ("tiny",), 4).prompt == "hello"


def test_image_parts_render_with_tools_as_render_prompt_lays_them_out():
    import base64
    import io

    from PIL import Image

    from postrain.actors.models.loading import spec_image_layout
    from postrain.actors.models.images import ImageInputError, render_prompt
    out = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 10, 10)).save(out, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    tokenizer, layout = byte_tokenizer(), spec_image_layout("tiny-vl")
    messages = [{"role": "user", "content": [{"type": "text", "text": "and this?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    call = parse_chat({"model": "tiny-vl", "messages": messages}, ("tiny-vl",), 4, reads_images=True)
    assert call.messages[0]["content"] == messages[0]["content"] and call.image_parts == ["messages[0].content[1]"]
    ids, images = render_ids(tokenizer, layout, call.messages)
    assert (ids, images) == render_prompt(tokenizer, layout, messages) and images == [out.getvalue()]
    with_tools, _ = render_ids(tokenizer, layout, call.messages, TOOLS)
    text = tokenizer.decode(with_tools)
    assert with_tools.count(layout.image_token_id) == layout.num_image_tokens
    assert text.index('"name": "add"') < text.index("and this?") < text.index(layout.marker)
    with pytest.raises(ImageInputError, match="reads text only"):
        render_ids(tokenizer, None, call.messages)
    with pytest.raises(APIError, match=r"'messages\[0\]\.content\[1\]': is an image, but the served model "):
        parse_chat({"model": "tiny", "messages": messages}, ("tiny",), 4)
