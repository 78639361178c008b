"""Speculative decoding rows of `postrain bench generate`: the engine with and without it.

Run by `postrain bench generate` (these rows are part of its run); alone, for the figures of
this page only:

    POSTRAIN_TORCH_THREADS=1 python -m postrain.bench.speculative [--quick]

Workloads (replayed episodes, built from the tasks' own text; no sandbox runs):
- agentic: the code task's revise-after-failure turn (the task, the model's first attempt
  with one planted bug, the test failures, "send the whole corrected function") and the
  arithmetic task's answer turn (the question, the model's `<python>` call, the tool's
  `<output>`), alternating; 96 new tokens, EOS ignored (at temperature 1 the two runs draw
  different samples, and a fixed length keeps the prefill's share equal in both);
- chat: the plain chat prompts of `bench generate` (64 new tokens, EOS ignored).

With and without speculation (method "ngram", k = 4, adaptive) run the same prompts with
the same sampling, interleaved within each repeat; tokens/s = generated tokens over wall
time (prefill included), and over this process's CPU time (steadier on a loaded machine).

Figures (ratio = with / without speculation, medians over repeats):
- spec_speedup_b1_agentic, spec_speedup_b8_agentic, spec_speedup_b32_chat (temperature 1,
  the RL setting), and *_greedy (temperature 0) for the agentic rows; cpu_* the same from
  CPU time;
- spec_acceptance_*: accepted over drafted tokens; spec_tokens_per_verify_*: tokens a
  sequence emitted per step in which it verified drafts;
- spec_verify_cost_b{1,8}_k4: CPU time of one forward of 5 new tokens per sequence over one
  of 1 (the decode step), at a 300-token context: what a fully accepted draft must beat;
- spec_dist_pvalue: chi-square p-value that the tokens emitted with forced low-acceptance
  drafts follow the model's distribution (`distribution_pvalue`: a 6-token vocabulary
  model, temperature 1 and top-p 0.8, the smaller of the two p-values); spec_dist_acceptance:
  the larger of the two runs' acceptance rates.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.attention import GatherSdpaBackend, PagedMetadata
from postrain.actors.models.llama import LlamaModel, ModelConfig
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.generator.speculative import DraftModelProposer, SpeculativeOptions
from postrain.actors.tasks import arithmetic, code
from postrain.actors.env.tools import format_observation, format_tool_output

SPECULATIVE = SpeculativeOptions(method="ngram", num_draft_tokens=4)


def agentic_prompts(tokenizer, count: int) -> list[list[int]]:
    """Replayed agentic turns: code revisions and arithmetic answers after a tool call, alternating."""
    problems = code.train_problems()
    questions = arithmetic.eval_tasks({"num_eval": count})
    out = []
    for i in range(count):
        if i % 2 == 0:
            problem = problems[(i // 2) % len(problems)]
            task = code.problem_to_task(problem, "train")
            attempt = _plant_bug(problem["reference"])
            failure = (f"{len(task['visible_tests']) - 1} of {len(task['visible_tests'])} visible tests "
                       f"passed.\nFAIL test_0: assert {task['visible_tests'][0]}\nYou have 2 attempts left: "
                       "send the whole corrected function in <python></python>.")
            messages = code.prompt_messages(task) + [
                {"role": "assistant", "content": f"<python>\n{attempt}</python>"},
                {"role": "user", "content": format_observation(failure)}]
        else:
            task = questions[i // 2]
            messages = arithmetic.prompt_messages(task["question"]) + [
                {"role": "assistant", "content": f"<python>print({task['expression']})</python>"},
                {"role": "user", "content": format_tool_output({"status": "ok", "stdout": f"{task['answer']}\n"})}]
        out.append(tokenizer.encode(tokenizer.apply_chat_template(messages)))
    return out


def _plant_bug(source: str) -> str:
    """The reference solution with its first integer literal off by one (a plausible slip)."""
    for i, ch in enumerate(source):
        if ch.isdigit() and not source[i - 1].isalnum():
            return source[:i] + str((int(ch) + 1) % 10) + source[i + 1:]
    return source.replace("return ", "return not ", 1)


def _timed(engine: Engine, prompts, params: SamplingParams) -> tuple[float, float]:
    """(wall tokens/s, CPU tokens/s) of running prompts to completion."""
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    num_tokens = sum(len(s.token_ids) for out in outputs for s in out.outputs)
    return num_tokens / wall, num_tokens / cpu


def verify_cost(model, batch: int, num_new: int, context: int = 300) -> float:
    """CPU seconds of one paged forward of num_new tokens per sequence (best of 5)."""
    engine = Engine(model, None, num_blocks=batch * (context // 8 + 4))
    block_size = engine.block_size_tokens
    num_blocks = -(-(context + num_new) // block_size)
    tables = torch.arange(batch * num_blocks).view(batch, num_blocks)
    positions = (context + torch.arange(num_new))[None].expand(batch, num_new)
    slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
    paged = PagedMetadata(positions, slots, tables, torch.full((batch,), context + num_new), num_padding=0)
    ids = torch.randint(0, model.config.vocab_size, (batch, num_new))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(5):
            start = time.process_time()
            model(ids, paged=GatherSdpaBackend().bind(paged, engine.kv_caches))
            best = min(best, time.process_time() - start)
    return best


class _UnlikelyDrafts:
    """A proposer that always drafts one fixed token (an unlikely one): mostly rejections."""

    def __init__(self, token: int):
        self.token = token

    def propose_batch(self, requests):
        return [[self.token] * k for _, _, k in requests]

    def record(self, prompt_key, completion_ids):
        pass


def distribution_pvalue(top_p: float = 1.0, num_seeds: int = 6, samples_per_seed: int = 1000,
                        drafts: str = "unlikely") -> tuple[float, float]:
    """(chi-square p-value, acceptance rate): three tokens per sample from a 6-token vocabulary
    model whose second and third tokens come from verify steps with drafts ("unlikely": one
    fixed unlikely token; "draft_model": the greedy tokens of another random model), against
    the model's joint distribution of the three (computed here from full forwards,
    independently of the engine's sampler; 216 cells)."""
    config = ModelConfig(vocab_size=6, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, max_position_embeddings=64)
    model = LlamaModel(config).init_weights(seed=5, std=0.6).eval()
    prompt = [1, 2, 3]
    params: dict[str, Any] = dict(temperature=1.0, top_p=top_p, max_new_tokens=4, ignore_eos=True)
    prefixes = [[a, b] for a in range(6) for b in range(6)]
    with torch.no_grad():
        first = _target(model(torch.tensor([prompt]))[0, -1], top_p)                      # (6,)
        second = torch.stack([_target(r, top_p) for r in model(torch.tensor([prompt + [a] for a in range(6)]))[:, -1]])
        third = torch.stack([_target(r, top_p) for r in model(torch.tensor([prompt + p for p in prefixes]))[:, -1]])
    joint = (first[:, None, None] * second[:, :, None] * third.view(6, 6, 6)).flatten()  # (216,)
    forced = int((second.mean(0) - 0.1).abs().argmin())   # a draft accepted about 1 time in 10
    engine = Engine(model, None, num_blocks=1024, block_size_tokens=4, max_num_seqs=256,
                    speculative=SpeculativeOptions(method="ngram", num_draft_tokens=2, adaptive=False),
                    proposer=_UnlikelyDrafts(forced) if drafts == "unlikely" else
                    DraftModelProposer(Engine(LlamaModel(config).init_weights(seed=6, std=0.6).eval(), None,
                                              num_blocks=256, block_size_tokens=4)))
    counts = torch.zeros(216, dtype=torch.float64)
    for seed in range(num_seeds):
        out = engine.generate([prompt], SamplingParams(n=samples_per_seed, seed=seed, **params))[0]
        for sample in out.outputs:
            a, b, c = sample.token_ids[:3]
            counts[a * 36 + b * 6 + c] += 1
    return _chi_square_pvalue(counts, joint), engine.stats()["acceptance_rate"]


def _target(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    probs = torch.softmax(logits.double(), -1)
    if top_p < 1.0:
        order = probs.argsort(descending=True)
        before = probs[order].cumsum(0) - probs[order]
        probs = probs * torch.zeros_like(probs).index_fill_(0, order[before < top_p], 1.0)
    return probs / probs.sum()


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs; cells expecting < 5 are pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    counts = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2.0), statistic / 2.0))


def speculative_rows(model, tokenizer, chat_prompts, quick: bool) -> tuple[dict, dict]:
    """(results, peer): ours with speculation and, in peer, the same runs without it."""
    repeats = 1 if quick else 3
    rows = [(1, "agentic", 1.0), (1, "agentic", 0.0), (8, "agentic", 1.0), (8, "agentic", 0.0),
            (32, "chat", 1.0)]
    if quick:
        rows = [(1, "agentic", 1.0), (1, "agentic", 0.0), (4, "chat", 1.0)]
    results, peer = {}, {}
    for batch, kind, temperature in rows:
        prompts = agentic_prompts(tokenizer, batch) if kind == "agentic" else chat_prompts(batch)
        params = SamplingParams(temperature=temperature, seed=0, max_new_tokens=96 if kind == "agentic" else 64,
                                ignore_eos=True)
        runs: dict[str, list] = {"on": [], "on_cpu": [], "off": [], "off_cpu": []}
        stats = []
        for _ in range(repeats):
            engine = Engine(model, tokenizer, max_num_seqs=max(64, batch))
            wall, cpu = _timed(engine, prompts, params)
            runs["off"].append(wall)
            runs["off_cpu"].append(cpu)
            engine = Engine(model, tokenizer, max_num_seqs=max(64, batch), speculative=SPECULATIVE)
            wall, cpu = _timed(engine, prompts, params)
            runs["on"].append(wall)
            runs["on_cpu"].append(cpu)
            stats.append(engine.stats())
        name = f"b{batch}_{kind}" + ("_greedy" if temperature == 0 else "")
        for suffix, on, off in (("", "on", "off"), ("_cpu", "on_cpu", "off_cpu")):
            results[f"tok_per_s_{name}_spec{suffix}"] = _median(runs[on])
            peer[f"tok_per_s_{name}_spec{suffix}"] = _median(runs[off])
        results[f"spec_speedup_{name}"] = round(statistics.median(runs["on"]) / statistics.median(runs["off"]), 2)
        results[f"spec_speedup_cpu_{name}"] = round(statistics.median(runs["on_cpu"])
                                                    / statistics.median(runs["off_cpu"]), 2)
        results[f"spec_acceptance_{name}"] = round(statistics.mean(s["acceptance_rate"] for s in stats), 3)
        results[f"spec_tokens_per_verify_{name}"] = round(statistics.mean(s["tokens_per_verify_step"]
                                                                          for s in stats), 2)
        results[f"spec_draft_time_share_{name}"] = round(statistics.mean(s["draft_time_share"] for s in stats), 4)
    for batch in (1, 8):
        results[f"spec_verify_cost_b{batch}_k4"] = round(verify_cost(model, batch, 5) / verify_cost(model, batch, 1), 2)
    num_seeds = 2 if quick else 6
    pvalues, acceptance = zip(*(distribution_pvalue(top_p, num_seeds) for top_p in (1.0, 0.8)))
    results["spec_dist_pvalue"] = round(min(pvalues), 4)
    results["spec_dist_acceptance"] = round(max(acceptance), 3)
    return results, peer


def _median(values) -> float:
    return round(statistics.median(values), 1)


def main() -> None:
    from postrain.actors.models.loading import load_model, packaged_model_path
    from postrain.bench.prompts import chat_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, fewer rows, one repeat")
    args = parser.parse_args()
    if os.environ.get("POSTRAIN_TORCH_THREADS"):
        torch.set_num_threads(int(os.environ["POSTRAIN_TORCH_THREADS"]))
    load_before = round(os.getloadavg()[0], 1)
    gguf = None if args.quick else packaged_model_path("smollm2")
    model, tokenizer = load_model(gguf or "tiny")
    results, peer = speculative_rows(model, tokenizer, lambda n: chat_prompts(tokenizer, n), args.quick)
    print(json.dumps({"bench": "generate (speculative rows)", "config": {
        "model": Path(gguf).name if gguf else "tiny", "torch_threads": torch.get_num_threads(),
        "speculative": SPECULATIVE.model_dump(), "load_avg_1m": [load_before, round(os.getloadavg()[0], 1)]},
        "results": results, "peer": peer}))


if __name__ == "__main__":
    main()
