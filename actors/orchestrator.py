"""The orchestrator: the driver actor that runs the RL loop (`postrain up` follows its `run`).

    evaluate (held-out, greedy) -> supervised warm start -> GRPO steps -> evaluate -> summary

Design note (the admission rule). Batch b, `prompts_per_step` prompts with
`samples_per_prompt` samples each, may start generating only once the learner
has trained batch b - 1 - max_staleness. So every token of batch b was
sampled by a policy at most `max_staleness` versions behind the one that
trains on it; `max_staleness = 0` is the synchronous on-policy loop, through
the same code. While the learner trains batch b, generation of the next
`max_staleness` batches goes on. Stale tokens carry their version, and the
learner's decoupled objective handles them. `max_buffered_batches` (0: no bound
beyond the staleness rule) also bounds the rollout buffer: batches admitted
and not yet trained (1 makes the loop synchronous, like max_staleness 0). Why
admission waits ("staleness" or "buffer_full") is in the heartbeat load as
`backpressure`, with the buffer, in-flight rollouts and the learner's idle and
busy seconds; the head's balancer logs each change.

Every sample is in the ledger (postrain.actors.ledger): created on admission,
generated and rewarded when its rollout returns, trained after the learner's
step, or dropped with the reason (the environment failed, its group is
incomplete). A group with any failed sample is dropped whole: GRPO compares
samples of one prompt, so a partial group would bias its baseline.

Surviving crashes (design note). Any actor may be killed mid-run; the supervisor
restarts it, and the run goes on without losing or doubling training:
- a rollout that fails because an actor on its path died (environment, generator,
  sandbox) is retried once the actor is back (`max_rollout_retries` times, each a
  "retry" note in the ledger), and so is a rollout carrying tokens older than the
  version published before it started (a restarted generator's initial weights);
  before a retry, generators behind the last publish get the weights again;
- the learner is reached only through `LearnerKeeper` (actors/recovery.py): a
  checkpoint every `checkpoint_every` steps, the steps since then kept, and a dead
  learner restored from the checkpoint plus a replay of those steps, exactly once;
- a checkpoint holds the learner, the ledger and the data cursor `num_trained`
  (actors/run_state.py). `postrain up --resume RUN_DIR` restores it and rolls the
  ledger and metrics files back to it (later steps are trained again): the samples
  in flight then are dropped as "interrupted", and batches num_trained.. are
  created again with the same prompts (the data order is a function of (seed, b))
  under new sample ids. Invariant: the trained samples of the ledger are exactly
  those of batches 0..num_trained-1, one creation of each, and the learner holds
  exactly their updates, across any number of kills and resumes
  (tests/actors/test_recovery.py).

Options (the actor spec's `options`): task, task_options (the task's knobs, the same
dict as the environment actor's env_options), seed, learner, generators, envs
(actor names), num_steps, prompts_per_step, samples_per_prompt, max_staleness,
sampling (SamplingParams fields), sft_steps, sft_batch_size, num_eval_tasks,
eval_samples_per_task (each evaluation also samples this many episodes per held-out task at
the run's sampling settings, seeded, and reports their mean as sampled accuracy; 0: greedy
only), max_concurrent_rollouts, max_buffered_batches, checkpoint_every (RL steps between
checkpoints; the last step always checkpoints), max_rollout_retries.
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
from postrain.actors.ledger import SampleLedger
from postrain.core.metrics import MetricsWriter

from .env_actor import load_tokenizer
from .environment import Reward
from .recovery import LearnerKeeper, is_actor_death, short_reason
from .run_state import (RUN_STATE_FORMAT, PromptSchedule, batch_sample_id, check_same_data_order, cut_back, data_order,
                        note_resume, read_run_state)
from .tasks import get_task
from .timeline import note_hops
from .tools import STOP_STRINGS

DEFAULTS = {
    "task": "arithmetic", "model": "tiny", "seed": 0, "learner": "learner",
    "generators": ["generator"], "envs": ["env"], "num_steps": 10, "prompts_per_step": 8,
    "samples_per_prompt": 8, "max_staleness": 0, "sft_steps": 0, "sft_batch_size": 16,
    "num_eval_tasks": 50, "eval_samples_per_task": 0, "max_concurrent_rollouts": 64,
    "max_buffered_batches": 0, "task_options": {}, "checkpoint_every": 10, "max_rollout_retries": 3,
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
        if self.cfg["max_buffered_batches"] < 0:
            raise ValueError(f"max_buffered_batches must be >= 0 (0: no bound), got "
                             f"{self.cfg['max_buffered_batches']}")
        if self.cfg["checkpoint_every"] < 1:
            raise ValueError(f"checkpoint_every must be >= 1 (RL steps between checkpoints), got "
                             f"{self.cfg['checkpoint_every']}")
        self.task = get_task(self.cfg["task"])
        self.schedule = PromptSchedule(self.task, self.cfg["seed"], self.cfg["task_options"],
                                       self.cfg["prompts_per_step"])
        self.resume_index = 0           # 0: a fresh start; k: the k-th `postrain up --resume`
        self.num_rollout_retries = 0
        self.tokenizer = load_tokenizer(self.cfg["model"])
        self.stopping = False
        self.limiter = anyio.Semaphore(self.cfg["max_concurrent_rollouts"])
        self.env_cycle = None
        # What the heartbeat load reports (the balancer's figures); written by `_rl` only.
        self.backpressure = "none"      # why admission waits: "none" | "staleness" | "buffer_full"
        self.num_trained = 0            # the data cursor: batches 0..num_trained-1 are trained
        self.buffered = {}              # batch -> samples, admitted and not yet trained
        self.num_rollouts = 0           # rollouts running now (limiter held)
        self.learner_idle_s = 0.0       # RL time the learner waited for a batch
        self.learner_busy_s = 0.0       # RL time spent in train + publish

    def load(self) -> dict:
        return {**super().load(), "backpressure": self.backpressure, "num_trained": self.num_trained,
                "buffer_batches": len(self.buffered), "buffer_samples": sum(self.buffered.values()),
                "rollouts_in_flight": self.num_rollouts,
                "prompts_waiting": self.limiter.statistics().tasks_waiting,
                "learner_idle_s": round(self.learner_idle_s, 3), "learner_busy_s": round(self.learner_busy_s, 3),
                "max_staleness": self.cfg["max_staleness"]}

    @handler("stop")
    async def stop(self, body):
        """Finish the current step, then evaluate and write the summary."""
        self.stopping = True

    @handler("run", stream=True, concurrent=True)  # concurrent: a `stop` must not wait behind the run
    async def run(self, body):
        """Progress lines ({"line"}) and, per RL step, that step's figures ({"figures"}: the train
        metrics row plus num_steps and sample counts, for the head's live view and exporter), then
        {"summary"}. The loop runs in its own task (a stream
        handler must not yield from inside a task group); this handler relays what it emits."""
        send, receive = anyio.create_memory_object_stream(math.inf)
        self.node.spawn(self._run_to_channel, Path(body["run_folder"]), bool(body.get("resume")), send)
        async with receive:
            async for item in receive:
                if "error" in item:
                    raise RuntimeError(item["error"])
                yield item

    async def _run_to_channel(self, folder: Path, resume: bool, send) -> None:
        self.emit_figures = lambda figures: send.send_nowait({"figures": figures})  # one per RL step
        async with send:
            try:
                await self._run(folder, lambda line: send.send_nowait({"line": line}),
                                lambda summary: send.send_nowait({"summary": summary}), resume)
            except Exception:
                send.send_nowait({"error": traceback.format_exc()})

    async def _run(self, folder: Path, emit, finish, resume: bool = False) -> None:
        """The whole run; with `resume`, from the run folder's checkpoint (module docstring)."""
        self.folder = folder
        state = read_run_state(folder / "checkpoint") if resume else None
        if state is not None and state["phase"] == "done" and (folder / "summary.json").exists():
            emit(f"the run in {folder} already finished; its summary:")
            finish(json.loads((folder / "summary.json").read_text()))
            return
        if resume:
            self._roll_back_files(state)
        self.ledger = SampleLedger(folder / "ledger.jsonl")
        self.metrics = MetricsWriter(folder)
        self.learner = await self.lookup(self.cfg["learner"])
        self.keeper = LearnerKeeper(self.learner, self.cfg["generators"], self.lookup, self.ledger, emit)
        self.env_cycle = itertools.cycle([await self.lookup(name) for name in self.cfg["envs"]])
        start = time.time()
        self.evals: dict[str, float] = {}
        if resume:
            self.resume_index = note_resume(folder, state["next_batch"] if state else None)
        if state is None:
            if resume:
                emit("no checkpoint was written before the run stopped; starting it from the beginning")
            await self.keeper.attach()
            await self._warm_up(emit)
        else:
            await self._restore(state, emit)
        rl_start = time.time()
        steps = await self._rl(emit)
        rl_wall_s = time.time() - rl_start
        await self._evaluate_phase("after", "after RL", emit)
        checkpoint = await self._checkpoint("done" if steps == self.cfg["num_steps"] else "rl")
        policy = await self.keeper.call("export_hf", {"path": str(folder / "policy")})
        self.ledger.check()
        summary = {**{f"eval_{phase}": accuracy for phase, accuracy in self.evals.items()},
                   "steps": steps, "sft_steps": self.cfg["sft_steps"],
                   "samples": self.ledger.counts()["trained"],
                   "ledger": self.ledger.counts(), "wall_s": round(time.time() - start, 1),
                   "rl_wall_s": round(rl_wall_s, 2), "learner_idle_s": round(self.learner_idle_s, 2),
                   "learner_busy_s": round(self.learner_busy_s, 2),
                   "checkpoint": checkpoint["path"], "policy": policy["path"], "task": self.cfg["task"],
                   "max_staleness": self.cfg["max_staleness"], "resumes": self.resume_index,
                   "learner_recoveries": self.keeper.num_recoveries,
                   "generator_resyncs": self.keeper.num_generator_resyncs,
                   "rollout_retries": self.num_rollout_retries}
        (folder / "summary.json").write_text(json.dumps(summary, indent=2))
        self.ledger.close()
        self.metrics.close()
        finish(summary)

    async def _warm_up(self, emit) -> None:
        """Evaluate, warm-start (SFT), evaluate again; then the first checkpoint (phase "rl")."""
        emit(f"evaluating the initial policy on {self.cfg['num_eval_tasks']} held-out tasks")
        await self._evaluate_phase("before", "before", emit)
        if self.cfg["sft_steps"]:
            await self._sft(emit)
            await self._evaluate_phase("after_sft", "after the warm start", emit)
        else:
            self.evals.update({k.replace("before", "after_sft"): v for k, v in self.evals.items()})
        self.num_trained = 0
        await self._checkpoint("rl")

    # -- checkpoints and resume ----------------------------------------------------------

    async def _checkpoint(self, phase: str) -> dict:
        """Learner + run state (actors/run_state.py) at the learner's current version."""
        def make_extra() -> dict:  # synchronous: one consistent moment of the ledger and the files
            return {"format": RUN_STATE_FORMAT, "phase": phase, "next_batch": self.num_trained,
                    "evals": dict(self.evals), "ledger": self.ledger.state_dict(),
                    "ledger_events_offset": self.ledger.events_offset(),
                    "metrics_offset": _file_size(self.metrics.path), "data_order": data_order(self.cfg)}
        return await self.keeper.checkpoint(str(self.folder / "checkpoint"), make_extra)

    def _roll_back_files(self, state: dict | None) -> None:
        """Cut the ledger's events and the metrics back to the checkpoint (none: to empty)."""
        cut_back(self.folder / "ledger.jsonl", state["ledger_events_offset"] if state else 0)
        cut_back(self.folder / "metrics.jsonl", state["metrics_offset"] if state else 0)

    async def _restore(self, state: dict, emit) -> None:
        check_same_data_order(state, self.cfg)
        self.ledger.load_state_dict(state["ledger"])
        interrupted = self.ledger.in_flight()
        for sid in interrupted:
            self.ledger.drop(sid, "interrupted", resume=self.resume_index)
        self.evals = dict(state["evals"])
        self.num_trained = int(state["next_batch"])
        await self.keeper.restore(str(self.folder / "checkpoint"))
        self.metrics.log("resume", resume=self.resume_index, next_batch=self.num_trained,
                         policy_version=self.keeper.version, num_interrupted=len(interrupted))
        emit(f"resumed at batch {self.num_trained} (policy version {self.keeper.version}); "
             f"{len(interrupted)} samples in flight at the stop dropped as interrupted; batches from "
             f"{self.num_trained} on are created again under ids ending .r{self.resume_index}")

    # -- evaluation ---------------------------------------------------------------

    async def _evaluate_phase(self, phase: str, label: str, emit) -> None:
        """Evaluate the current policy into `self.evals` (`phase`, and `sampled_<phase>` when
        `eval_samples_per_task` > 0), its metrics row and a printed line."""
        greedy = await self._evaluate(0.0, 1)
        self.evals[phase] = greedy
        line = f"held-out accuracy {label}: {greedy:.3f}"
        row = {"accuracy": greedy}
        num_samples = self.cfg["eval_samples_per_task"]
        if num_samples:
            temperature = self.cfg["sampling"].get("temperature", 1.0)
            sampled = await self._evaluate(temperature, num_samples)
            self.evals[f"sampled_{phase}"] = row["accuracy_sampled"] = sampled
            line += f" greedy, {sampled:.3f} sampled (temperature {temperature}, {num_samples} per task)"
        self.metrics.log("eval", phase=phase, **row)
        emit(line)

    async def _evaluate(self, temperature: float, samples_per_task: int) -> float:
        """Mean `correct` component (or total reward) over held-out episodes: `samples_per_task`
        per task at `temperature` (0: greedy), each with its own fixed seed, so that every
        evaluation of a run meets the same random draws."""
        tasks = self.task.eval_tasks(self.cfg["task_options"])[: self.cfg["num_eval_tasks"]]
        episodes = [(task, i * samples_per_task + k) for i, task in enumerate(tasks)
                    for k in range(samples_per_task)]
        scores = [0.0] * len(episodes)

        async def one(index, task, episode_seed):
            sampling = {**self.cfg["sampling"], "temperature": temperature, "stop": list(STOP_STRINGS),
                        "seed": self.cfg["seed"] * 1_000_003 + episode_seed}
            try:
                rollout = await self._rollout(task, sampling)
            except Exception:
                return  # a failed episode scores 0
            reward = Reward.from_dict(rollout["reward"])
            scores[index] = reward.components.get("correct", reward.total)
        async with anyio.create_task_group() as tg:
            for index, (task, episode_seed) in enumerate(episodes):
                tg.start_soon(one, index, task, episode_seed)
        return statistics.fmean(scores) if scores else 0.0

    async def _rollout(self, task: dict, sampling: dict, sample_id: str | None = None,
                       min_version: int | None = None) -> dict:
        """One episode on an environment actor, retried (at most `max_rollout_retries` times, a
        "retry" note on `sample_id` each) when an actor on its path died or when its tokens are
        older than `min_version` (default: the version published now), which only a restarted
        generator's initial weights produce; generators behind get the weights before a retry."""
        min_version = self.keeper.published_version if min_version is None else min_version
        max_retries = self.cfg["max_rollout_retries"]
        for attempt in range(max_retries + 1):
            try:
                rollout = await self._rollout_once(task, sampling)
            except Exception as exc:
                if not is_actor_death(exc) or attempt == max_retries:
                    raise
                reason = f"an actor on its path died: {short_reason(exc)}"
            else:
                oldest = min((v for v in rollout["policy_versions"] if v >= 0), default=min_version)
                if oldest >= min_version:
                    return rollout
                reason = (f"sampled by policy version {oldest}, older than the version {min_version} "
                          "published before it started (a restarted generator's initial weights)")
                if attempt == max_retries:
                    raise RuntimeError(f"{reason}, {max_retries} retries in a row")
            self.num_rollout_retries += 1
            if sample_id is not None:
                self.ledger.note(sample_id, "retry", attempt=attempt + 1, reason=reason)
            await self.keeper.resync_generators()
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _rollout_once(self, task: dict, sampling: dict) -> dict:
        async with self.limiter:
            self.num_rollouts += 1
            try:
                return await next(self.env_cycle).ask("rollout", {"task": task, "sampling": sampling},
                                                      timeout_s=900)
            finally:
                self.num_rollouts -= 1

    # -- supervised warm start -------------------------------------------------------

    async def _sft(self, emit) -> None:
        num_steps, batch_size = self.cfg["sft_steps"], self.cfg["sft_batch_size"]
        demos = self.task.demonstrations(num_steps * batch_size, seed=self.cfg["seed"],
                                         options=self.cfg["task_options"])
        for step in range(num_steps):
            batch = [chat_to_tokens(self.tokenizer, d["messages"])
                     for d in demos[step * batch_size:(step + 1) * batch_size]]
            metrics = await self.keeper.step("sft", {"token_ids": [b[0] for b in batch],
                                                     "loss_mask": [b[1] for b in batch]})
            self.metrics.log("sft", **metrics)
            if step % 10 == 0 or step == num_steps - 1:
                emit(f"sft step {step + 1}/{num_steps}: loss {metrics['loss']:.3f}")
        await self._publish()

    async def _publish(self) -> dict:
        result = await self.keeper.publish()
        self.metrics.log("sync", version=result["version"], total_s=result["total_s"])
        return result

    # -- RL ---------------------------------------------------------------------------

    async def _rl(self, emit) -> int:
        """GRPO steps num_trained..num_steps-1 under the admission rule, a checkpoint every
        `checkpoint_every` steps and after the last; returns how many batches are trained in all."""
        cfg = self.cfg
        num_steps, staleness = cfg["num_steps"], cfg["max_staleness"]
        sampling = {**cfg["sampling"], "stop": list(STOP_STRINGS)}
        first_batch = self.num_trained
        batches: dict[int, list] = {}
        done_events = {b: anyio.Event() for b in range(first_batch, num_steps)}
        trained = anyio.Event()

        async def generate_batch(b):
            groups = [[] for _ in range(cfg["prompts_per_step"])]
            min_version = self.keeper.published_version
            async with anyio.create_task_group() as tg:
                for g, task in enumerate(self.schedule.prompts(b)):
                    for s in range(cfg["samples_per_prompt"]):
                        sid = batch_sample_id(b, g, s, self.resume_index)
                        self.ledger.create(sid, batch=b, group=g, prompt=str(task.get("question", ""))[:80])
                        tg.start_soon(self._sample, sid, task, sampling, groups[g], min_version)
            batches[b] = groups
            done_events[b].set()

        def admission_wait(b) -> str:
            """Why batch b may not start yet ("none": it may)."""
            if b - self.num_trained > staleness:
                return "staleness"
            if max_buffered and len(self.buffered) >= max_buffered:
                return "buffer_full"
            return "none"

        max_buffered = cfg["max_buffered_batches"]
        batch_size = cfg["prompts_per_step"] * cfg["samples_per_prompt"]
        async with anyio.create_task_group() as tg:
            async def producer():
                for b in range(first_batch, num_steps):
                    while (wait := admission_wait(b)) != "none" and not self.stopping:
                        self.backpressure = wait
                        await trained.wait()
                    self.backpressure = "none"
                    if self.stopping:
                        return
                    self.buffered[b] = batch_size
                    tg.start_soon(generate_batch, b)
            tg.start_soon(producer)
            for b in range(first_batch, num_steps):
                if self.stopping:
                    break
                idle_from = time.monotonic()
                await done_events[b].wait()
                busy_from = time.monotonic()
                self.learner_idle_s += busy_from - idle_from
                emit(await self._train(b, batches.pop(b)))
                self.learner_busy_s += time.monotonic() - busy_from
                self.buffered.pop(b, None)
                self.num_trained += 1
                trained.set()
                trained = anyio.Event()
                if self.num_trained % cfg["checkpoint_every"] == 0 or self.num_trained == num_steps:
                    await self._checkpoint("rl")
            tg.cancel_scope.cancel()
        self.backpressure = "none"
        for sample_id in self.ledger.in_flight():
            self.ledger.drop(sample_id, "run stopped before it was trained")
        return self.num_trained

    async def _sample(self, sample_id: str, task: dict, sampling: dict, group: list, min_version: int) -> None:
        try:
            rollout = await self._rollout(task, sampling, sample_id, min_version)
        except Exception as exc:
            self.ledger.drop(sample_id, f"rollout failed: {short_reason(exc)}")
            group.append(None)
            return
        note_hops(self.ledger, sample_id, rollout.get("timeline"))
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
        metrics = await self.keeper.step("train", batch, [sid for sid, _, _ in samples])
        trained_version = metrics.get("policy_version", 1) - 1  # the weights this step started from
        staleness = [trained_version - min([v for v in ro["policy_versions"] if v >= 0] or [trained_version])
                     for _, ro, _ in samples]
        for (sample_id, _, _), sample_staleness in zip(samples, staleness):
            self.ledger.advance(sample_id, "trained", step=b + 1, staleness=round(sample_staleness))
        sync = await self._publish()
        correct = statistics.fmean(r.components.get("correct", r.total) for _, _, r in samples)
        learner_figures = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        row = self.metrics.log("train", **{**learner_figures, "step": b + 1, "reward_mean": statistics.fmean(rewards),
                                           "correct_mean": correct, "sync_s": sync["total_s"],
                                           "staleness_max": max(staleness),
                                           "staleness_mean": statistics.fmean(staleness)})
        self.emit_figures({**{k: v for k, v in row.items() if k not in ("time", "kind")},
                           "num_steps": self.cfg["num_steps"], "samples_trained": self.ledger.counts()["trained"],
                           "samples_dropped": self.ledger.counts()["dropped"]})
        return (f"step {b + 1}/{self.cfg['num_steps']}: reward {statistics.fmean(rewards):.3f} "
                f"correct {correct:.3f} loss {metrics.get('loss', 0):.4f} kl {metrics.get('kl', 0):.4f} "
                f"tokens/s {metrics.get('tokens_per_s', 0):.0f} sync {sync['total_s']:.2f}s")


def _file_size(path: Path) -> int:
    """Bytes in a line-buffered log file (every written line is already flushed)."""
    return path.stat().st_size if path.exists() else 0


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
