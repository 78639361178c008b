"""The rollout pool: episodes on the environment actors, each sample's ledger transitions, retries.

A rollout goes to the next environment actor in turn (one gone for good, its node
lost and no room for it elsewhere, leaves the turn: `drop`), holding one of
`max_concurrent_rollouts` slots (training and evaluation share them). A rollout
that fails because an actor on its path died (environment, generator, sandbox)
is retried once the actor is back, at most `max_rollout_retries` times, each a
"retry" note in the ledger; so is a rollout carrying tokens older than the
version published before it started (only a restarted generator's initial
weights make those). Before a retry, generators behind the last publish get the
weights again (`LearnerKeeper.resync_generators`). While any rollout holds a slot the
generators count as busy (`WorkSignal`: elastic cores follow the work).

A sample the environment failed (the user's code raised, hung or returned garbage) is shown
at once when it is the run's first such failure, with the user's traceback, and its reason
joins its batch's `environment_failures`, which the driver checks after the batch is generated
(actors/env/user_errors.py: a step that fails mostly by one error stops the run).

Every RL sample is in the ledger (postrain.actors.orchestrator.ledger), and this pool moves it:
created on admission, generated and rewarded when its rollout returns, or dropped
with the reason when the rollout fails for good (or, when the run distils, when the teacher
cannot score it: teacher.py). (Trained, and dropped for an
incomplete group, are the train step's.) An episode of several segments (records/rollout.py)
creates its segments' samples when it comes back (`ledger.segment_id`), each then generated
and rewarded with the episode's reward, and notes "segments" on the episode's own sample.
"""
from __future__ import annotations


import anyio

from postrain.core.errors import PostrainError

from ..learner.recovery import is_actor_death, short_reason
from .ledger import segment_id
from ..records import ROLLOUT, Rollout, RolloutRequest, SamplingParams
from .run_state import batch_sample_id
from ..env.timeline import note_hops
from ..env.user_errors import EnvironmentErrors
from .admission import AdmittedBatch
from .scored_sample import ScoredSample
from .teacher import Teacher, TeacherFailed
from ..tasks import MixtureTask

__all__ = ["RolloutPool", "ScoredSample", "StaleRolloutError"]

ROLLOUT_TIMEOUT_S = 900


class StaleRolloutError(PostrainError, RuntimeError):
    """A rollout kept coming back sampled by weights older than the last publish (a generator
    that kept restarting), after every retry."""


class RolloutPool:
    """Rollouts on the environment actors `envs` (ActorRefs, used in turn)."""

    def __init__(self, envs: list, keeper, ledger, max_concurrent_rollouts: int, max_rollout_retries: int,
                 work, generators: list[str], errors: EnvironmentErrors, teacher: Teacher | None = None):
        assert envs, "at least one environment actor"
        self.keeper = keeper                   # LearnerKeeper: published_version, resync_generators
        self.ledger = ledger
        self.errors = errors                   # the run's environment failures: the first shown at once
        self.max_rollout_retries = max_rollout_retries
        self.limiter = anyio.Semaphore(max_concurrent_rollouts)
        self.envs = list(envs)                 # the rotation; never empty (see `drop`)
        self._turn = 0                         # rollouts sent so far: the next goes to envs[_turn % len]
        self.num_running = 0                   # rollouts holding a slot now: 0 <= num_running <= max
        self.num_retries = 0                   # retries so far, in all
        self.work = work                       # WorkSignal: the generators are busy while rollouts run
        self.generators = list(generators)
        self.teacher = teacher                 # distillation: scores each sample as it comes back, or None

    def drop(self, name: str) -> bool:
        """Actor `name` is gone for good: rollouts go to it no more (an environment) and no
        longer mark it busy (a generator). True when it was one of them. Atomic."""
        envs = [env for env in self.envs if env.name != name]
        assert envs, f"environment actor {name} is the last one; the head stops the run instead"
        known = name in self.generators or len(envs) < len(self.envs)
        self.generators = [g for g in self.generators if g != name]
        self.envs = envs
        return known

    def figures(self) -> dict:
        """The pool's part of the orchestrator's heartbeat load."""
        return {"rollouts_in_flight": self.num_running,
                "prompts_waiting": self.limiter.statistics().tasks_waiting}

    # -- one RL batch --------------------------------------------------------------------

    async def generate_batch(self, batch: AdmittedBatch, prompts: list[tuple[MixtureTask, dict]],
                             samples_per_prompt: int, sampling: SamplingParams, resume_index: int) -> None:
        """Create batch's samples in the ledger (each with its group's task), roll them all out,
        and set `batch.generated`.

        Cancelled: samples whose rollout had not come back stay in flight in the ledger (the
        caller drops them: the run stopped), and `generated` is not set."""
        min_version = self.keeper.published_version
        async with anyio.create_task_group() as tg:
            for g, (of, task) in enumerate(prompts):
                for s in range(samples_per_prompt):
                    sample_id = batch_sample_id(batch.index, g, s, resume_index)
                    where = {"batch": batch.index, "group": g}
                    self.ledger.create(sample_id, **where, task=of.name,
                                       prompt=str(task.get("question", ""))[:80])
                    tg.start_soon(self._sample, sample_id, of.name, task, sampling, batch.groups[g],
                                  min_version, where, batch.environment_failures)
        batch.generated.set()

    async def _sample(self, sample_id: str, task_name: str, task: dict, sampling: SamplingParams,
                      group: list, min_version: int, where: dict | None = None,
                      environment_failures: list[str] | None = None) -> None:
        """One sample: its outcome appended to `group`, its ledger state moved (its segments'
        too: module docstring); the reason of a failure that is the environment's appended to
        `environment_failures`. Cancelled: the sample stays in flight in the ledger and `group`
        lacks its outcome."""
        try:
            rollout = await self.rollout(task, sampling, sample_id, min_version, task_name)
        except Exception as exc:
            reason = None if is_actor_death(exc) else self.errors.record(exc)
            if reason is not None and environment_failures is not None:
                environment_failures.append(reason)
            self.ledger.drop(sample_id, f"rollout failed: {reason or short_reason(exc)}")
            group.append(None)
            return
        teacher_rows = None
        if self.teacher is not None:   # distillation: the teacher's rows, or the sample fails (teacher.py)
            try:
                teacher_rows = await self.teacher.score(rollout)
            except TeacherFailed as exc:
                self.ledger.drop(sample_id, str(exc))
                group.append(None)
                return
        note_hops(self.ledger, sample_id, rollout.timeline)
        segments = rollout.segments()
        ids = [segment_id(sample_id, k) for k in range(len(segments))]
        for k, sid in enumerate(ids[1:], start=1):
            self.ledger.create(sid, **(where or {}), segment_of=sample_id, segment=k,
                               prompt=f"segment {k} of {sample_id}")
        if len(ids) > 1:
            self.ledger.note(sample_id, "segments", num_segments=len(ids), segment_ids=ids[1:],
                             policy_tokens=[s.num_policy_tokens for s in segments])
        for sid, segment in zip(ids, segments):
            self.ledger.advance(sid, "generated", tokens=segment.num_policy_tokens)
            self.ledger.advance(sid, "rewarded", reward=rollout.reward.total,
                                components=rollout.reward.components, tool_statuses=rollout.tool_statuses,
                                **({"cause": rollout.cause} if rollout.cause else {}))
        group.append(ScoredSample(sample_id, rollout, teacher_rows, task_name))

    # -- one episode ------------------------------------------------------------------

    async def rollout(self, task: dict, sampling: SamplingParams, sample_id: str | None = None,
                      min_version: int | None = None, task_name: str = "") -> Rollout:
        """One episode of `task` (a task dict of the mixture's task `task_name`), retried (module
        docstring) when an actor on its path died or when its
        tokens are older than `min_version` (default: the version published now).

        Cancelled: the environment's episode is abandoned (its reply, if any, is dropped);
        retries so far stay counted and noted."""
        min_version = self.keeper.published_version if min_version is None else min_version
        max_retries = self.max_rollout_retries
        for attempt in range(max_retries + 1):
            try:
                rollout = await self._rollout_once(task, sampling, task_name)
            except Exception as exc:
                if not is_actor_death(exc) or attempt == max_retries:
                    raise
                reason = f"an actor on its path died: {short_reason(exc)}"
            else:
                oldest = rollout.oldest_policy_version(default=min_version)
                if oldest >= min_version:
                    return rollout
                reason = (f"sampled by policy version {oldest}, older than the version {min_version} "
                          "published before it started (a restarted generator's initial weights)")
                if attempt == max_retries:
                    raise StaleRolloutError(f"{reason}, {max_retries} retries in a row")
            self.num_retries += 1
            if sample_id is not None:
                self.ledger.note(sample_id, "retry", attempt=attempt + 1, reason=reason)
            await self.keeper.resync_generators()
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _rollout_once(self, task: dict, sampling: SamplingParams, task_name: str) -> Rollout:
        """Cancelled: the slot is released and num_running restored."""
        request = RolloutRequest(task=task, sampling=sampling, task_name=task_name)
        async with self.limiter, self.work.busy(*self.generators):
            self.num_running += 1
            env, self._turn = self.envs[self._turn % len(self.envs)], self._turn + 1
            try:
                return await env.call(ROLLOUT, request, timeout_s=ROLLOUT_TIMEOUT_S)
            finally:
                self.num_running -= 1
