"""The gateway over real HTTP with the real `openai` client: `postrain serve`'s generator and gateway
actors (tiny model, byte tokenizer) started once for the module, with an API key (--api-key-file):
a call without it gets 401, and the episodes' own keys admit their calls.

Greedy chat completions equal `postrain generate`'s tokens; n choices; streaming yields the same
text; the bad-request table gets 400s naming the field while concurrent good requests finish;
token-in/token-out through HTTP (a 5-turn tool episode trains exactly the sampled ids, a history
edit gives two segments).

Images: a second module server serves tiny-vl (a vision-language policy). A greedy chat with a
base64 PNG data URL equals the engine's greedy decoding of `render_prompt`'s ids and images, and
another image changes its logprobs (the pixels reach the tower); tools and text-only content parts
render beside images; every bad image (for a text-only policy, an http URL, truncated, empty, an
unsupported format, oversized, outside a user message, in a recorded episode) is a 400 naming the
part, while a good image request beside them finishes."""
from __future__ import annotations

import argparse
import base64
import concurrent.futures
import dataclasses
import functools
import io
import json
import struct
import threading
import zlib

import httpx
import openai
import pytest
import trio

from postrain.cli import generate as generate_cli
from postrain.cli.serve import add_arguments, serve

pytestmark = pytest.mark.slow
MODEL = "tiny"
VL_MODEL = "tiny-vl"
KEY = "gateway-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclasses.dataclass
class Gateway:
    base_url: str
    ask: object


def serve_gateway(tmp_path_factory, model: str):
    """Serve `model` (generator + gateway, with KEY) from a thread; yields the Gateway while serving."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    key_file = tmp_path_factory.mktemp("gateway") / "key"
    key_file.write_text(KEY + "\n")
    args = parser.parse_args(["--model", model, "--port", "0", "--kv-cache-mb", "16",
                              "--api-key-file", str(key_file)])
    ready, box = threading.Event(), {}

    async def main():
        box["stop"], box["token"] = trio.Event(), trio.lowlevel.current_trio_token()
        await serve(args, ready=lambda address, ref: (box.update(address=address, ref=ref), ready.set()),
                    until=box["stop"])

    def run():
        try:
            trio.run(main)
        except BaseException as exc:  # reported by the assertion below
            box["error"] = exc
            ready.set()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(180) and "error" not in box, box.get("error")
    address = box["address"]
    ask = functools.partial(trio.from_thread.run, trio_token=box["token"])
    yield Gateway(address.base_url, lambda kind, body: ask(box["ref"].ask, kind, body))
    trio.from_thread.run_sync(box["stop"].set, trio_token=box["token"])
    thread.join(60)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """The GatewayAddress while serving; `.ask(kind, body)` asks the gateway actor (from this thread)."""
    yield from serve_gateway(tmp_path_factory, MODEL)


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.base_url, api_key=KEY, max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_greedy_chat_completion_equals_postrain_generate(client, capsys):
    reply = client.chat.completions.create(model=MODEL, messages=user("What is 2+3?"), max_tokens=12,
                                           temperature=0, logprobs=True)
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    assert generate_cli.main(parser.parse_args(["--model", MODEL, "--prompt", "What is 2+3?", "--chat",
                                                "--max-tokens", "12", "--temperature", "0", "--json"])) == 0
    expected = json.loads(capsys.readouterr().out)
    choice = reply.choices[0]
    assert reply.model_extra["prompt_token_ids"] == expected["prompt_token_ids"]
    assert choice.model_extra["token_ids"] == expected["samples"][0]["token_ids"]
    assert choice.message.content == expected["samples"][0]["text"]
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(expected["samples"][0]["logprobs"], abs=1e-4)
    assert reply.usage.completion_tokens == len(expected["samples"][0]["token_ids"])
    assert reply.system_fingerprint == "policy-v0"


def test_n_choices_streaming_models_and_completions(client, gateway):
    four = client.chat.completions.create(model=MODEL, messages=user("hi"), n=4, max_tokens=6, seed=1)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert len({tuple(c.model_extra["token_ids"]) for c in four.choices}) > 1   # seeds differ per choice
    whole = client.chat.completions.create(model=MODEL, messages=user("stream me"), max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("stream me"), max_tokens=10,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert [m.id for m in client.models.list()] == [MODEL]
    ids = whole.model_extra["prompt_token_ids"]
    completion = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert completion.choices[0].model_extra["token_ids"] == whole.choices[0].model_extra["token_ids"]


BAD_REQUESTS = [  # (body change, the field the 400 names)
    ({"messages": None}, "messages"),
    ({"model": "gpt-5"}, "model"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": {"not": "a list"}}, "tools"),
    ({"messages": user("x" * 2000)}, "messages"),           # over the tiny model's 1024-token context
    ({"temperature": 3}, "temperature"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
]


def test_bad_requests_get_400_naming_the_field_while_good_ones_finish(gateway):
    good = {"model": MODEL, "messages": user("hello"), "max_tokens": 24, "temperature": 0}

    def post(body):
        body = {k: v for k, v in body.items() if v is not None}
        return httpx.post(gateway.base_url + "/chat/completions", json=body, headers=AUTH, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(post, good) for _ in range(4)]
        bads = [(pool.submit(post, {**good, **change}), field) for change, field in BAD_REQUESTS]
        for future, field in bads:
            response = future.result()
            assert response.status_code == 400, (field, response.text)
            error = response.json()["error"]
            assert error["param"] == field and f"'{field}'" in error["message"]
            assert error["type"] == "invalid_request_error"
        assert all(f.result().status_code == 200 for f in goods)
        texts = {f.result().json()["choices"][0]["message"]["content"] for f in goods}
    assert len(texts) == 1   # greedy: untouched by the bad requests beside them
    response = httpx.post(gateway.base_url + "/chat/completions", content=b"{not json", headers=AUTH,
                          timeout=30)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="'max_tokens': must be an integer >= 1, got -1"):
        openai.OpenAI(base_url=gateway.base_url, api_key=KEY, max_retries=0).chat.completions.create(
            model=MODEL, messages=user("hi"), max_tokens=-1)
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
        openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0).chat.completions.create(
            model=MODEL, messages=user("hi"))


def test_token_in_token_out_through_the_api(gateway):
    """A 5-turn episode (its API key) trains exactly the ids the generator sampled, each in the prompt it
    was given; a harness that edits history gets a second segment."""
    key = "episode-0"
    gateway.ask("open_episode", {"key": key})
    agent = openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)
    messages, replies = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "turn 0"}], []
    for turn in range(5):
        reply = agent.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=turn)
        replies.append(reply)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "tool" if turn % 2 else "user", "content": f"result {turn}", "tool_call_id": "c"}]
    closed = gateway.ask("close_episode", {"key": key})
    assert closed["num_calls"] == 5 and len(closed["segments"]) == 1
    with pytest.raises(openai.AuthenticationError):   # a closed episode's key no longer admits
        agent.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    segment = closed["segments"][0]
    for call, reply in zip(segment["calls"], replies):
        sampled = reply.choices[0].model_extra["token_ids"]
        assert segment["token_ids"][:call["prompt_len"]] == reply.model_extra["prompt_token_ids"]
        assert segment["token_ids"][call["prompt_len"]:call["prompt_len"] + call["num_tokens"]] == sampled
        assert call["policy_versions"] == [0]
    assert sum(segment["loss_mask"]) == sum(len(r.choices[0].model_extra["token_ids"]) for r in replies)
    # history edited (the first reply rewritten): a new segment from a fresh rendering
    gateway.ask("open_episode", {"key": "episode-1"})
    agent = openai.OpenAI(base_url=gateway.base_url, api_key="episode-1", max_retries=0)
    first = agent.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=6)
    edited = user("hi") + [{"role": "assistant", "content": "(edited)"}, {"role": "user", "content": "go on"}]
    second = agent.chat.completions.create(model=MODEL, messages=edited, max_tokens=6)
    segments = gateway.ask("close_episode", {"key": "episode-1"})["segments"]
    assert [s["token_ids"][:s["calls"][0]["prompt_len"]] for s in segments] == [
        first.model_extra["prompt_token_ids"], second.model_extra["prompt_token_ids"]]
    assert [sum(s["loss_mask"]) for s in segments] == [len(r.choices[0].model_extra["token_ids"])
                                                       for r in (first, second)]


def test_parallel_tool_calls_and_their_results_render_back_through_the_api(client):
    """A harness sends back an assistant turn with two tool calls and both results: the prompt the
    generator got holds both calls as the model writes them and both results, tools first."""
    from postrain.actors.models.tokenizer import byte_tokenizer
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": f'{{"a": {i}}}'}}
             for i in (1, 2)]
    messages = [{"role": "user", "content": "add twice"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "11"},
                {"role": "tool", "tool_call_id": "call_2", "content": "12"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=4)
    prompt = byte_tokenizer().decode(reply.model_extra["prompt_token_ids"])
    assert prompt.index('"name": "add"') < prompt.index("add twice")   # the tool list, in the system turn
    for i in (1, 2):
        assert f'<tool_call>\n{{"name": "add", "arguments": {{"a": {i}}}}}\n</tool_call>' in prompt
        assert f"<tool_response>\n1{i}\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


# --------------------------------------------------------------------------- images (tiny-vl)
@pytest.fixture(scope="module")
def vl_gateway(tmp_path_factory):
    yield from serve_gateway(tmp_path_factory, VL_MODEL)


def png(seed: int, size=(64, 48), fmt: str = "PNG") -> bytes:
    """A noise image's file bytes (noise: its PNG is long enough to cut mid-pixels)."""
    import numpy as np
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (its pixels are never there)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_chat(text: str, *urls: str, role: str = "user") -> list[dict]:
    return [{"role": role, "content": [{"type": "text", "text": text},
                                       *({"type": "image_url", "image_url": {"url": url}} for url in urls)]}]


def test_greedy_chat_with_an_image_equals_the_engine(vl_gateway):
    from postrain.actors.generator.engine import Engine
    from postrain.actors.models.loading import load_model, spec_image_layout
    from postrain.actors.models.images import render_prompt
    from postrain.actors.records import SamplingParams
    client = openai.OpenAI(base_url=vl_gateway.base_url, api_key=KEY, max_retries=0)
    messages = image_chat("What is in the picture?", data_url(png(0)))
    reply = client.chat.completions.create(model=VL_MODEL, messages=messages, max_tokens=12, temperature=0,
                                           logprobs=True)
    model, tokenizer = load_model(VL_MODEL)
    layout = spec_image_layout(VL_MODEL)
    ids, images = render_prompt(tokenizer, layout, messages)
    engine = Engine(model, tokenizer)
    request_id = engine.add_request(ids, SamplingParams(temperature=0, max_new_tokens=12), images=images)
    done = {}
    while engine.has_unfinished():
        done.update((out.request_id, out) for out in engine.step())
    expected = done[request_id].outputs[0]
    choice = reply.choices[0]
    assert reply.model_extra["prompt_token_ids"] == ids and ids.count(layout.image_token_id) == 48
    assert choice.model_extra["token_ids"] == expected.token_ids
    assert choice.message.content == expected.text
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(expected.logprobs, abs=1e-4)
    # the pixels reach the tower: the same prompt ids with another image give other logprobs
    other = client.chat.completions.create(model=VL_MODEL, messages=image_chat("What is in the picture?",
                                                                               data_url(png(1))),
                                           max_tokens=1, temperature=0, logprobs=True)
    assert other.model_extra["prompt_token_ids"] == ids
    assert other.choices[0].logprobs.content[0].logprob != pytest.approx(choice.logprobs.content[0].logprob, abs=1e-6)
    # tools beside an image: the tool listing in the system turn, the image's run in the user turn
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with_tools = client.chat.completions.create(model=VL_MODEL, messages=messages, tools=tools, max_tokens=2)
    prompt_ids = with_tools.model_extra["prompt_token_ids"]
    prompt = tokenizer.decode(prompt_ids)
    assert prompt_ids.count(layout.image_token_id) == 48 and prompt.index('"name": "add"') < prompt.index("picture")
    # text-only content parts: the joined text, for a vision-language policy as for any other
    parts = client.chat.completions.create(model=VL_MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is "}, {"type": "text", "text": "2+3?"}]}], max_tokens=1)
    assert parts.model_extra["prompt_token_ids"] == tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}]))


BAD_IMAGES = [  # (messages, the part the 400 names, what its message says)
    (image_chat("look", "https://example.com/cat.png"), "messages[0].content[1]",
     "is not a data URL; the gateway never fetches URLs; fix: inline the image's bytes as a base64 data URL"),
    (image_chat("look", data_url(png(2)[:700])), "messages[0].content[1]", "does not decode completely"),
    (image_chat("look", "data:image/png;base64,"), "messages[0].content[1]", "the image is empty (0 bytes); fix:"),
    (image_chat("look", data_url(png(3, fmt="TIFF"), "image/tiff")), "messages[0].content[1]",
     "image format TIFF is not supported; fix: convert it to PNG or JPEG"),
    (image_chat("look", data_url(png_header(9000, 9000))), "messages[0].content[1]",
     "the image is 9000 x 9000 pixels; at most 64,000,000 pixels are accepted; fix: downscale it"),
    (image_chat("a", data_url(png(0)), role="system") + image_chat("b"), "messages[0].content[1]",
     "images are accepted in 'user' messages only"),
    (image_chat("look", data_url(png(0)), "data:image/png;base64,%%%"), "messages[0].content[2]",
     "base64 does not decode"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "messages[0].content[0].type",
     "must be 'text' or 'image_url'"),
    ([{"role": "user", "content": "<|image|> what is this?"}], "messages", "the text writes the marker; fix:"),
]


def test_bad_images_get_400_naming_the_part_while_good_ones_finish(vl_gateway, gateway):
    good = {"model": VL_MODEL, "messages": image_chat("hello", data_url(png(0))), "max_tokens": 8, "temperature": 0}

    def post(base_url, body, key=KEY):
        return httpx.post(base_url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                          timeout=120)

    def check(response, field, says):
        assert response.status_code == 400, (field, response.text)
        error = response.json()["error"]
        assert error["param"] == field and error["type"] == "invalid_request_error", error
        assert error["message"].startswith(f"'{field}': ") and says in error["message"], error["message"]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(post, vl_gateway.base_url, good) for _ in range(3)]
        bads = [(pool.submit(post, vl_gateway.base_url, {**good, "messages": messages}), field, says)
                for messages, field, says in BAD_IMAGES]
        for future, field, says in bads:
            check(future.result(), field, says)
        assert all(f.result().status_code == 200 for f in goods)
        assert len({tuple(f.result().json()["choices"][0]["token_ids"]) for f in goods}) == 1
    # an image for a text-only policy
    check(post(gateway.base_url, {**good, "model": MODEL}), "messages[0].content[1]",
          "is an image, but the served model 'tiny' reads text only (its config has no vision tower); fix:")
    # a recorded episode records token ids only: its calls may not show images (text ones still may)
    vl_gateway.ask("open_episode", {"key": "vl-episode"})
    check(post(vl_gateway.base_url, good, key="vl-episode"), "messages[0].content[1]",
          "is an image in a call of a recorded episode")
    assert post(vl_gateway.base_url, {**good, "messages": user("hi")}, key="vl-episode").status_code == 200
    assert vl_gateway.ask("close_episode", {"key": "vl-episode"})["num_calls"] == 1
    with pytest.raises(openai.BadRequestError, match="never fetches URLs"):
        openai.OpenAI(base_url=vl_gateway.base_url, api_key=KEY, max_retries=0).chat.completions.create(
            model=VL_MODEL, messages=image_chat("look", "http://example.com/cat.png"))
