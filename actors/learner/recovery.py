"""Training that survives a learner crash, and generators kept on the published weights.

Design note (the learner's invariant). The supervisor restarts a learner killed mid-run,
but the new process has its initial weights. `LearnerKeeper` is the orchestrator's only
path to the learner, and it keeps, after every call that returned,

    learner weights == checkpoint (or the starting weights when none was written yet)
                       + each update in `since_checkpoint`, applied once, in order
    learner.policy_version == self.version == checkpoint_version + len(since_checkpoint)

`since_checkpoint` holds the batches (TrainBatch, SftBatch: actors/records/train.py) of the steps
since the last checkpoint.
When the learner dies (our ask fails with ActorDiedError) or turns out to have restarted
(every call names the version the invariant predicts, `expect_policy_version`, and a
learner at another version refuses it before touching anything), `_recover`
waits for the new process, loads the checkpoint into it, replays `since_checkpoint`
(noting "replayed" on each sample in the ledger) and republishes the weights to every
generator; then the failed call is made again. A step whose reply never came is in
neither `since_checkpoint` nor the ledger's trained samples, so its retry trains it once:
no update is lost or applied twice (tests/actors/learner/test_recovery.py checks the learner's
step count after kills). A checkpoint empties `since_checkpoint` only once it is written;
a learner that died between writing it and replying is handled by the version the
checkpoint holds (the steps it already contains are not replayed).

Generators: a restarted generator holds its initial weights (version 0). `resync_generators`
asks each generator its version (the ask waits until it is back) and republishes to any
that is behind the last publish. The orchestrator calls it when a rollout failed because an
actor died, or when a rollout carries tokens older than the version published before it
started (only a restarted generator makes those). A generator gone for good (its cluster node
lost, no room for it elsewhere: `drop_generator`) is skipped by both from then on.

Every method takes the keeper's lock: one learner operation at a time. Cancelled: the
lock is released; a call in flight may still complete on the learner, and the next call
sees its version and recovers.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence, TypeVar

import anyio

from postrain.core.errors import ActorDiedError, ActorError, ActorTimeoutError, PostrainError, RemoteError
from postrain.core.messages import MessageKind
from postrain.core.record import Record

from ..records import (GENERATOR_STATS, LEARNER_STATS, LOAD_CHECKPOINT, PUBLISH, SAVE_CHECKPOINT, SFT, TRAIN,
                       CheckpointSaved, GeneratorStats, LoadCheckpoint, PublishReport, PublishRequest,
                       SaveCheckpoint, SftBatch, StepMetrics, TrainBatch)

R = TypeVar("R", bound=Record)

log = logging.getLogger("postrain.recovery")

MAX_RECOVERIES_PER_CALL = 5     # a learner that dies this often in one call is not coming back
LEARNER_RESTART_TIMEOUT_S = 600.0
STATS_RETRY_S = 10.0   # one `stats` ask to a restarting actor; asked again after it


class LearnerLostError(PostrainError, RuntimeError):
    """The learner kept dying (or never came back); the run cannot go on."""


def is_actor_death(exc: BaseException) -> bool:
    """True when `exc` says an actor on a request's path died (here, or in an actor we asked
    that asked another: the remote error names ActorDiedError), so the request may be retried
    once the supervisor has restarted it."""
    if isinstance(exc, ActorDiedError):
        return True
    if isinstance(exc, RemoteError):
        return exc.error_type == "ActorDiedError" or "ActorDiedError" in exc.remote_message
    return False


def short_reason(exc: BaseException) -> str:
    return (getattr(exc, "remote_message", None) or str(exc) or type(exc).__name__)[:200]


class LearnerKeeper:
    """The orchestrator's handle to the learner: steps, publishes, checkpoints, recovery."""

    def __init__(self, learner, generators: list[str], lookup, ledger, emit, chunk_mb: float | None = None):
        self.learner = learner                   # ActorRef
        self.generator_names = list(generators)
        self.chunk_mb = chunk_mb                 # publish's chunk_mb: generators on other hosts
        self._lookup = lookup                    # async name -> ActorRef (the head's registry)
        self._generators: dict[str, object] = {}
        self.ledger = ledger
        self.emit = emit
        self.lock = anyio.Lock()
        self.version = 0                         # the learner's policy_version, by the invariant
        self.published_version = 0               # what every live generator holds (or newer)
        self.checkpoint_path: str | None = None
        self.checkpoint_version = 0
        # The steps since the checkpoint, in order, with their samples (noted "replayed" on a replay).
        self.since_checkpoint: list[tuple[TrainBatch | SftBatch, list[str]]] = []
        self.num_recoveries = 0
        self.num_generator_resyncs = 0

    # -- starting ------------------------------------------------------------------

    async def attach(self) -> None:
        """A fresh run: the learner holds the weights it starts with (initial, or its own
        `resume_from`), and a restarted learner starts with them again. They are published,
        so every generator samples (and the first evaluation scores) the learner's weights.
        Cancelled: the version is known; the publish may have reached some generators only
        (`resync_generators` republishes to those behind)."""
        async with self.lock:
            stats = await self.learner.call(LEARNER_STATS, timeout_s=120)
            self.version = self.checkpoint_version = stats.policy_version
            await self._with_recovery(self._publish_locked, "publish")

    async def restore(self, checkpoint_path: str) -> None:
        """A resumed run: load `checkpoint_path` into the learner and publish it to every generator.
        Cancelled: the keeper already points at the checkpoint; a learner not yet brought back
        fails the next call's version check and is brought back then."""
        from .state import checkpoint_info

        async with self.lock:
            self.checkpoint_path = checkpoint_path
            self.version = self.checkpoint_version = checkpoint_info(checkpoint_path)["policy_version"]
            self.since_checkpoint = []
            await self._bring_back()

    # -- the learner's work --------------------------------------------------------

    async def step(self, batch: TrainBatch | SftBatch, sample_ids: Sequence[str] = ()) -> StepMetrics:
        """One `train` (a TrainBatch) or `sft` (an SftBatch) step, applied exactly once whatever
        dies meanwhile. Returns its metrics. Cancelled: the learner may have applied the step
        (its thread runs to the end) without the keeper counting it; the next call's version
        check then restores the checkpoint plus the counted steps, which undoes it."""
        kind = _step_kind(batch)
        async with self.lock:
            async def once():
                """The step, once. Cancelled: as `step`."""
                metrics = await self._call(kind, batch, self.version, timeout_s=900)
                self._expect(metrics.policy_version, self.version + 1, kind.name)
                return metrics
            metrics = await self._with_recovery(once, kind.name)
            self.version += 1
            self.since_checkpoint.append((batch, list(sample_ids)))
            return metrics

    async def publish(self) -> PublishReport:
        """The learner's weights to every generator; returns the learner's publish report.
        Cancelled: some generators may hold the new version; published_version does not move."""
        async with self.lock:
            return await self._with_recovery(self._publish_locked, "publish")

    async def checkpoint(self, path: str, make_extra) -> CheckpointSaved:
        """Save the learner with `make_extra()` (called under the lock, before the save: the
        orchestrator's state at exactly this learner version). Cancelled: the file at `path` may
        be written (the learner's save runs to its end) but the keeper keeps its previous restore
        point and steps since it."""
        async with self.lock:
            extra = make_extra()

            async def once():
                """The save, once. Cancelled: as `checkpoint`."""
                reply = await self._call(SAVE_CHECKPOINT, SaveCheckpoint(path=path, extra=extra), self.version)
                self._expect(reply.policy_version, self.version, "save_checkpoint")
                return reply
            reply = await self._with_recovery(once, "save_checkpoint")
            self.checkpoint_path, self.checkpoint_version = path, self.version
            self.since_checkpoint = []
            return reply

    async def call(self, kind: MessageKind[Any, R], request: Record | None = None, timeout_s: float = 600) -> R:
        """Any other learner request (EXPORT_HF with an ExportHf, LEARNER_STATS with None) against
        the learner of the invariant; its reply record. Cancelled: the request may still run on
        the learner; see `_with_recovery`."""
        async with self.lock:
            async def once():
                """The request, once. Cancelled: as `call`."""
                if request is None:     # nothing to guard: no version check
                    return await self.learner.call(kind, timeout_s=timeout_s)
                return await self._call(kind, request, self.version, timeout_s=timeout_s)
            return await self._with_recovery(once, kind.name)

    async def resync_generators(self) -> int:
        """Republish to generators behind the last publish (restarted ones); returns how many.
        Cancelled: those behind may or may not have been republished; the next call looks again."""
        async with self.lock:
            behind = []
            for name in list(self.generator_names):
                stats = await self._wait_for_generator(name)
                if stats is not None and stats.policy_version < self.published_version:
                    behind.append(name)
            if behind:
                self.num_generator_resyncs += len(behind)
                self.emit(f"generator(s) {', '.join(behind)} came back with initial weights; "
                          f"republishing version {self.version}")
                await self._with_recovery(lambda: self._publish_locked(behind), "publish")
            return len(behind)

    def drop_generator(self, name: str) -> bool:
        """Generator `name` is gone for good (its node lost, no room elsewhere): publishes and
        resyncs skip it from now on, and one waiting for it stops waiting. True when it was one
        of the generators. Atomic (it never awaits, so it needs no lock)."""
        if name not in self.generator_names:
            return False
        assert len(self.generator_names) > 1, f"generator {name} is the last; the head stops the run instead"
        self.generator_names.remove(name)
        self._generators.pop(name, None)
        return True

    async def generator_stats(self) -> dict[str, GeneratorStats]:
        """Each generator's `stats`, by name; one that does not answer within STATS_RETRY_S (dead
        or restarting) is left out. Cancelled: nothing changes."""
        stats = {}
        for name in self.generator_names:
            try:
                stats[name] = await (await self._generator(name)).call(GENERATOR_STATS, timeout_s=STATS_RETRY_S)
            except ActorError:        # dead, restarting or not answering: no figures this time
                continue
        return stats

    # -- internals ------------------------------------------------------------------

    async def _with_recovery(self, once, what: str):
        """`once()`, recovering the learner between failed tries. Cancelled: during `once`, as its
        caller's note says; during a recovery, as `_bring_back`."""
        for attempt in range(MAX_RECOVERIES_PER_CALL + 1):
            try:
                return await once()
            except _LearnerRestarted as exc:
                reason = str(exc)
            except ActorDiedError as exc:
                reason = f"the learner died during {what}: {exc}"
            if attempt == MAX_RECOVERIES_PER_CALL:
                break
            await self._recover(reason)
        raise LearnerLostError(f"the learner failed {MAX_RECOVERIES_PER_CALL + 1} times during {what}; "
                               "look at its log (logs/learner.log) and raise its max_restarts only if "
                               "the cause is external")

    async def _call(self, kind: MessageKind[Any, R], request: Record, expect_version: int,
                    timeout_s: float = 600) -> R:
        """The learner's reply to `request` (a record with `expect_policy_version`), which it
        refuses when it is not at `expect_version` (it restarted). Cancelled: the request may
        still run on the learner; nothing here changes."""
        guarded = dataclasses.replace(request, expect_policy_version=expect_version)
        try:
            return await self.learner.call(kind, guarded, timeout_s=timeout_s)
        except RemoteError as exc:
            if exc.error_type == "PolicyVersionMismatch":
                raise _LearnerRestarted(exc.remote_message) from None
            raise

    async def _recover(self, reason: str) -> None:
        """Bring a restarted learner back to the invariant (module docstring). Lock held.
        Cancelled: as `_bring_back` (the recovery is counted already)."""
        self.num_recoveries += 1
        self.emit(f"learner recovery {self.num_recoveries}: {reason[:160]}; waiting for its restart")
        await self._bring_back()

    async def _bring_back(self) -> None:
        """Reload, replay and republish, retrying when the learner dies meanwhile. Cancelled: not
        atomic; the learner may be half replayed, but the keeper's version does not move, so the
        next call's version check brings it back again."""
        for _ in range(MAX_RECOVERIES_PER_CALL):
            try:
                await self._reload_and_replay()
                await self._publish_locked()
                self.emit(f"learner recovered at version {self.version} (checkpoint v{self.checkpoint_version} "
                          f"+ {len(self.since_checkpoint)} replayed steps); weights republished")
                return
            except (ActorDiedError, _LearnerRestarted) as exc:
                self.emit(f"learner recovery interrupted ({short_reason(exc)}); starting it again")
        raise LearnerLostError(f"the learner did not survive {MAX_RECOVERIES_PER_CALL} recoveries; see "
                               "logs/learner.log")

    async def _reload_and_replay(self) -> None:
        """Load the checkpoint into the learner, then replay the steps since it. Cancelled: the
        learner holds the checkpoint plus part of the replay; since_checkpoint and
        checkpoint_version stay consistent with each other (they change together)."""
        stats = await self._wait_for(self.learner, LEARNER_STATS)
        if self.checkpoint_path is not None:
            reply = await self.learner.call(LOAD_CHECKPOINT, LoadCheckpoint(path=self.checkpoint_path), timeout_s=600)
            loaded = reply.policy_version
            if not self.checkpoint_version <= loaded <= self.version:
                raise LearnerLostError(f"{self.checkpoint_path} holds policy version {loaded}, outside "
                                       f"{self.checkpoint_version}..{self.version}; it was overwritten")
            # a learner that died after writing a checkpoint and before replying: the new one is in place
            del self.since_checkpoint[:loaded - self.checkpoint_version]
            self.checkpoint_version = loaded
        else:  # no checkpoint yet: a restarted learner holds its starting weights again
            self._expect(stats.policy_version, self.checkpoint_version, "restart")
        version = self.checkpoint_version
        for batch, sample_ids in self.since_checkpoint:
            kind = _step_kind(batch)
            metrics = await self._call(kind, batch, version, timeout_s=900)
            version += 1
            self._expect(metrics.policy_version, version, f"replayed {kind.name}")
            for sid in sample_ids:
                self.ledger.note(sid, "replayed", policy_version=version)
        assert version == self.version, (version, self.version)

    async def _wait_for(self, ref, stats: MessageKind[None, R]) -> R:
        """`stats` (its declared message) of an actor that may be restarting, asked again every STATS_RETRY_S until it
        answers: a request sent into the gap between the old process's death and the new one's
        start can be lost without an error, so no single ask waits long. Cancelled: nothing changes."""
        with anyio.fail_after(LEARNER_RESTART_TIMEOUT_S):
            while True:
                try:
                    return await ref.call(stats, timeout_s=STATS_RETRY_S)
                except (ActorDiedError, ActorTimeoutError):
                    await anyio.sleep(0.2)

    async def _wait_for_generator(self, name: str) -> GeneratorStats | None:
        """`_wait_for` generator `name`; None once it is gone for good (`drop_generator`), then or
        while waiting. Cancelled: nothing changes."""
        with anyio.fail_after(LEARNER_RESTART_TIMEOUT_S):
            while name in self.generator_names:
                try:
                    return await (await self._generator(name)).call(GENERATOR_STATS, timeout_s=STATS_RETRY_S)
                except (ActorDiedError, ActorTimeoutError):
                    await anyio.sleep(0.2)
        return None

    async def _publish_locked(self, targets: list[str] | None = None) -> PublishReport:
        """Publish to `targets` (all generators by default), waiting out generators that die
        mid-sync and leaving out those gone for good. Cancelled: some targets may hold the new
        version; published_version does not move."""
        targets = list(targets or self.generator_names)
        for attempt in range(3):
            targets = [name for name in targets if name in self.generator_names]
            try:
                request = PublishRequest(targets=targets, chunk_mb=self.chunk_mb)
                result = await self._call(PUBLISH, request, self.version)
                break
            except RemoteError as exc:  # a generator died mid-sync: wait until it is back, again
                if attempt == 2:
                    raise
                log.warning("publish failed (%s); waiting for the generators and publishing again",
                            short_reason(exc))
                for name in targets:
                    await self._wait_for_generator(name)
        self._expect(result.version, self.version, "publish")
        if set(self.generator_names) <= set(targets):
            self.published_version = self.version
        return result

    async def _generator(self, name: str):
        """A (cached) reference to generator `name`. Cancelled: nothing is cached."""
        if name not in self._generators:
            self._generators[name] = await self._lookup(name)
        return self._generators[name]

    def _expect(self, got: int, expected: int, what: str) -> None:
        if got != expected:
            raise _LearnerRestarted(f"the learner answered {what} at policy version {got}, expected "
                                    f"{expected}: it restarted with other weights")


def _step_kind(batch: TrainBatch | SftBatch) -> MessageKind[Any, StepMetrics]:
    """The learner message that takes `batch`: TRAIN or SFT."""
    if isinstance(batch, TrainBatch):
        return TRAIN
    assert isinstance(batch, SftBatch), f"a learner step takes a TrainBatch or an SftBatch, got {type(batch)}"
    return SFT


class _LearnerRestarted(ActorError):
    """A learner reply whose version breaks the invariant: the process behind the ref is new."""
