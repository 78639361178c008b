"""The orchestrator: the driver actor that runs the RL loop (`postrain up` follows its `run`).

    evaluate (held-out, greedy) -> supervised warm start -> GRPO steps -> evaluate -> summary

Design note (the admission rule). Batch b, `prompts_per_step` prompts with
`samples_per_prompt` samples each, may start generating only once the learner
has trained batch b - 1 - max_staleness. So every token of batch b was
sampled by a policy at most `max_staleness` versions behind the one that
trains on it; `max_staleness = 0` is the synchronous on-policy loop, through
the same code. While the learner trains batch b, generation of the next
`max_staleness` batches goes on. Stale tokens carry their version, and the
learner's decoupled objective handles them.

Every sample is in the ledger (postrain.core.ledger): created on admission,
generated and rewarded when its rollout returns, trained after the learner's
step, or dropped with the reason (the environment failed, its group is
incomplete). A group with any failed sample is dropped whole: GRPO compares
samples of one prompt, so a partial group would bias its baseline.

Options (the actor spec's `options`): task, task_options (the task's knobs, the same
dict as the environment actor's env_options), seed, learner, generators, envs
(actor names), num_steps, prompts_per_step, samples_per_prompt, max_staleness,
sampling (SamplingParams fields), sft_steps, sft_batch_size, num_eval_tasks,
max_concurrent_rollouts.
"""
from __future__ import annotations

import itertools
import json
import math
import statistics
import time
import traceback
from pathlib import Path

import anyio

from postrain.core import Actor, handler
from postrain.core.ledger import SampleLedger
from postrain.core.metrics import MetricsWriter

from .env_actor import load_tokenizer
from .environment import Reward
from .tasks import get_task
from .tools import STOP_STRINGS

DEFAULTS = {
    "task": "arithmetic", "model": "tiny", "seed": 0, "learner": "learner",
    "generators": ["generator"], "envs": ["env"], "num_steps": 10, "prompts_per_step": 8,
    "samples_per_prompt": 8, "max_staleness": 0, "sft_steps": 0, "sft_batch_size": 16,
    "num_eval_tasks": 50, "max_concurrent_rollouts": 64, "task_options": {},
    "sampling": {"temperature": 1.0, "max_new_tokens": 96},
}


class OrchestratorActor(Actor):
    async def setup(self):
        unknown = set(self.options) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown orchestrator option(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
        self.cfg = {**DEFAULTS, **self.options}
        if self.cfg["max_staleness"] < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.cfg['max_staleness']}")
        self.task = get_task(self.cfg["task"])
        self.tokenizer = load_tokenizer(self.cfg["model"])
        self.stopping = False
        self.limiter = anyio.Semaphore(self.cfg["max_concurrent_rollouts"])
        self.env_cycle = None

    @handler("stop")
    async def stop(self, body):
        """Finish the current step, then evaluate and write the summary."""
        self.stopping = True

    @handler("run", stream=True)
    async def run(self, body):
        """Progress lines ({"line"}), then {"summary"}. The loop runs in its own task (a stream
        handler must not yield from inside a task group); this handler relays what it emits."""
        send, receive = anyio.create_memory_object_stream(math.inf)
        self.node.spawn(self._run_to_channel, Path(body["run_folder"]), send)
        async with receive:
            async for item in receive:
                if "error" in item:
                    raise RuntimeError(item["error"])
                yield item

    async def _run_to_channel(self, folder: Path, send) -> None:
        async with send:
            try:
                await self._run(folder, lambda line: send.send_nowait({"line": line}),
                                lambda summary: send.send_nowait({"summary": summary}))
            except Exception:
                send.send_nowait({"error": traceback.format_exc()})

    async def _run(self, folder: Path, emit, finish) -> None:
        self.ledger = SampleLedger(folder / "ledger.jsonl")
        self.metrics = MetricsWriter(folder)
        self.learner = await self.lookup(self.cfg["learner"])
        self.env_cycle = itertools.cycle([await self.lookup(name) for name in self.cfg["envs"]])
        start = time.time()
        emit(f"evaluating the initial policy on {self.cfg['num_eval_tasks']} held-out tasks")
        eval_before = await self._evaluate()
        self.metrics.log("eval", phase="before", accuracy=eval_before)
        emit(f"held-out accuracy before: {eval_before:.3f}")
        eval_after_sft = eval_before
        if self.cfg["sft_steps"]:
            await self._sft(emit)
            eval_after_sft = await self._evaluate()
            self.metrics.log("eval", phase="after_sft", accuracy=eval_after_sft)
            emit(f"held-out accuracy after the warm start: {eval_after_sft:.3f}")
        steps = await self._rl(emit)
        eval_after = await self._evaluate()
        self.metrics.log("eval", phase="after", accuracy=eval_after)
        emit(f"held-out accuracy after RL: {eval_after:.3f}")
        checkpoint = await self.learner.ask("save_checkpoint", {"path": str(folder / "checkpoint"),
                                                                "extra": {"ledger": self.ledger.counts()}},
                                            timeout_s=600)
        policy = await self.learner.ask("export_hf", {"path": str(folder / "policy")}, timeout_s=600)
        self.ledger.check()
        summary = {"eval_before": eval_before, "eval_after_sft": eval_after_sft, "eval_after": eval_after,
                   "steps": steps, "sft_steps": self.cfg["sft_steps"], "samples": self.ledger.counts()["trained"],
                   "ledger": self.ledger.counts(), "wall_s": round(time.time() - start, 1),
                   "checkpoint": checkpoint["path"], "policy": policy["path"], "task": self.cfg["task"],
                   "max_staleness": self.cfg["max_staleness"]}
        (folder / "summary.json").write_text(json.dumps(summary, indent=2))
        self.ledger.close()
        self.metrics.close()
        finish(summary)

    # -- evaluation ---------------------------------------------------------------

    async def _evaluate(self) -> float:
        """Mean `correct` component (or total reward) over held-out tasks, greedy decoding."""
        tasks = self.task.eval_tasks(self.cfg["task_options"])[: self.cfg["num_eval_tasks"]]
        scores = [0.0] * len(tasks)
        sampling = {**self.cfg["sampling"], "temperature": 0.0, "stop": list(STOP_STRINGS)}

        async def one(index, task):
            try:
                rollout = await self._rollout(task, sampling)
            except Exception:
                return  # a failed episode scores 0
            reward = Reward.from_dict(rollout["reward"])
            scores[index] = reward.components.get("correct", reward.total)
        async with anyio.create_task_group() as tg:
            for index, task in enumerate(tasks):
                tg.start_soon(one, index, task)
        return statistics.fmean(scores) if scores else 0.0

    async def _rollout(self, task: dict, sampling: dict) -> dict:
        async with self.limiter:
            return await next(self.env_cycle).ask("rollout", {"task": task, "sampling": sampling},
                                                  timeout_s=900)

    # -- supervised warm start -------------------------------------------------------

    async def _sft(self, emit) -> None:
        num_steps, batch_size = self.cfg["sft_steps"], self.cfg["sft_batch_size"]
        demos = self.task.demonstrations(num_steps * batch_size, seed=self.cfg["seed"],
                                         options=self.cfg["task_options"])
        for step in range(num_steps):
            batch = [chat_to_tokens(self.tokenizer, d["messages"])
                     for d in demos[step * batch_size:(step + 1) * batch_size]]
            metrics = await self.learner.ask("sft", {"token_ids": [b[0] for b in batch],
                                                     "loss_mask": [b[1] for b in batch]}, timeout_s=600)
            self.metrics.log("sft", **metrics)
            if step % 10 == 0 or step == num_steps - 1:
                emit(f"sft step {step + 1}/{num_steps}: loss {metrics['loss']:.3f}")
        await self._publish()

    async def _publish(self) -> dict:
        result = await self.learner.ask("publish", {"targets": self.cfg["generators"]}, timeout_s=600)
        self.metrics.log("sync", version=result["version"], total_s=result["total_s"])
        return result

    # -- RL ---------------------------------------------------------------------------

    async def _rl(self, emit) -> int:
        """GRPO steps under the admission rule; returns how many were trained."""
        cfg = self.cfg
        num_steps, staleness = cfg["num_steps"], cfg["max_staleness"]
        sampling = {**cfg["sampling"], "stop": list(STOP_STRINGS)}
        tasks = self.task.train_tasks(seed=cfg["seed"], options=cfg["task_options"])
        batches: dict[int, list] = {}
        done_events = {b: anyio.Event() for b in range(num_steps)}
        trained = anyio.Event()
        self.num_trained = 0

        async def generate_batch(b):
            groups = [[] for _ in range(cfg["prompts_per_step"])]
            async with anyio.create_task_group() as tg:
                for g in range(cfg["prompts_per_step"]):
                    task = next(tasks)
                    for s in range(cfg["samples_per_prompt"]):
                        sample_id = f"b{b}-g{g}-s{s}"
                        self.ledger.create(sample_id, batch=b, group=g, prompt=str(task.get("question", ""))[:80])
                        tg.start_soon(self._sample, sample_id, task, sampling, groups[g])
            batches[b] = groups
            done_events[b].set()

        async with anyio.create_task_group() as tg:
            async def producer():
                for b in range(num_steps):
                    while b - self.num_trained > staleness and not self.stopping:
                        await trained.wait()
                    if self.stopping:
                        return
                    tg.start_soon(generate_batch, b)
            tg.start_soon(producer)
            for b in range(num_steps):
                if self.stopping:
                    break
                await done_events[b].wait()
                emit(await self._train(b, batches.pop(b)))
                self.num_trained += 1
                trained.set()
                trained = anyio.Event()
            tg.cancel_scope.cancel()
        for sample_id in self.ledger.in_flight():
            self.ledger.drop(sample_id, "run stopped before it was trained")
        return self.num_trained

    async def _sample(self, sample_id: str, task: dict, sampling: dict, group: list) -> None:
        try:
            rollout = await self._rollout(task, sampling)
        except Exception as exc:
            reason = getattr(exc, "remote_message", None) or str(exc)
            self.ledger.drop(sample_id, f"rollout failed: {reason[:200]}")
            group.append(None)
            return
        self.ledger.advance(sample_id, "generated", tokens=rollout["num_policy_tokens"])
        reward = Reward.from_dict(rollout["reward"])
        self.ledger.advance(sample_id, "rewarded", reward=reward.total, components=reward.components,
                            tool_statuses=rollout["tool_statuses"])
        group.append((sample_id, rollout, reward))

    async def _train(self, b: int, groups: list) -> str:
        samples = []
        for group in groups:
            if any(item is None for item in group):
                for item in group:
                    if item is not None:
                        self.ledger.drop(item[0], "group incomplete: another sample of its prompt failed")
                continue
            samples.extend(group)
        if not samples:
            return f"step {b + 1}: every group failed; nothing to train"
        rewards = [r.total for _, _, r in samples]
        batch = {"token_ids": [ro["token_ids"] for _, ro, _ in samples],
                 "loss_mask": [ro["loss_mask"] for _, ro, _ in samples],
                 "behavior_logprobs": [ro["behavior_logprobs"] for _, ro, _ in samples],
                 "policy_versions": [ro["policy_versions"] for _, ro, _ in samples],
                 "rewards": rewards,
                 "group_ids": [i // self.cfg["samples_per_prompt"] for i in range(len(samples))]}
        metrics = await self.learner.ask("train", batch, timeout_s=900)
        for sample_id, _, _ in samples:
            self.ledger.advance(sample_id, "trained", step=b + 1)
        sync = await self._publish()
        correct = statistics.fmean(r.components.get("correct", r.total) for _, _, r in samples)
        trained_version = metrics.get("policy_version", 1) - 1  # the weights this step started from
        staleness = [trained_version - min([v for v in ro["policy_versions"] if v >= 0] or [trained_version])
                     for _, ro, _ in samples]
        learner_figures = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        self.metrics.log("train", **{**learner_figures, "step": b + 1, "reward_mean": statistics.fmean(rewards),
                                     "correct_mean": correct, "sync_s": sync["total_s"],
                                     "staleness_max": max(staleness)})
        return (f"step {b + 1}/{self.cfg['num_steps']}: reward {statistics.fmean(rewards):.3f} "
                f"correct {correct:.3f} loss {metrics.get('loss', 0):.4f} kl {metrics.get('kl', 0):.4f} "
                f"tokens/s {metrics.get('tokens_per_s', 0):.0f} sync {sync['total_s']:.2f}s")


def chat_to_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a rendered conversation and a mask that is 1 on assistant turns' tokens
    (their content and the template's end-of-turn), for supervised training."""
    ids, mask = [], []
    rendered = ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)
            segment = prompt[len(rendered):]
            ids += tokenizer.encode(segment, add_bos=not rendered and None)
            mask += [0] * (len(ids) - len(mask))
            through = tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False)
            answer = tokenizer.encode(through[len(prompt):], add_bos=False)
            ids += answer
            mask += [1] * len(answer)
            rendered = through
    tail = tokenizer.apply_chat_template(messages, add_generation_prompt=False)[len(rendered):]
    if tail:
        tail_ids = tokenizer.encode(tail, add_bos=False)
        ids += tail_ids
        mask += [0] * len(tail_ids)
    mask[0] = 0
    return ids, mask
