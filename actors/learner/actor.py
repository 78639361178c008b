"""The learner as an actor: train on batches, checkpoint, and publish weights to generators.

    spec = ActorSpec(name="learner", cls="postrain.actors.learner:LearnerActor",
                     options={"model": "tiny", "learner": {"lr": 1e-5}, "resume_from": None})
    ref = await supervisor.start(spec)
    metrics = await ref.call(TRAIN, batch)                  # batch: a TrainBatch (postrain.actors.records)
    report = await ref.call(PUBLISH, PublishRequest(targets=["gen0"]))     # a PublishReport

Handlers (request/reply; every body and reply is a record, postrain.actors.records:
records/train.py, records/weights.py, records/learner.py; declared on `@handler`, so the
kernel decodes and encodes them, core/typed.py):

    train(TrainBatch) -> StepMetrics          sft(SftBatch) -> StepMetrics
    save_checkpoint(SaveCheckpoint) -> CheckpointSaved
    load_checkpoint(LoadCheckpoint) -> CheckpointLoaded
    export_hf(ExportHf) -> ExportedHf
    get_weights(None) -> WeightSync (the whole version, {hf_name: tensor})
    publish(PublishRequest) -> PublishReport
    stats(None) -> LearnerStats

The requests of train, sft, save_checkpoint, export_hf and publish may carry
`expect_policy_version` (below).

Data parallel (`ranks = N` on the actor's entry): the other actors talk to rank 0 alone,
which shards train/sft batches over the ranks and sends checkpoint saves and loads to every
rank; the other ranks take only what rank 0 sends them (actors/learner/group.py):

    join(JoinGroup) -> GroupState    group(None) -> GroupState    rank_step(RankStep) -> GroupState

Weight-sync contract (what a generator implements): the learner asks each target
`load_weights` with a WeightSync {"version": int, "weights": {name: CPU tensor}}, Hugging Face
names, no tied `lm_head.weight` duplicate; the target swaps them in at a safe point and
replies a WeightSyncReply {"version": int}. Under `weight_transport` "auto" (the default;
"message" and "sealed" send every target the one way or the other: actors/weights/transport.py),
a target on this host (the registry placed it on this node, or its address is ipc or loopback)
gets one such message: its tensors >= 1 MiB cross through /dev/shm
(the wire does it), so a sync costs one write and one mapped read per tensor. A target on
another node gets one sync as several messages ("chunk": i of "num_chunks": n, of at most
`chunk_mb` MiB of whole tensors each), sent pipelined (chunks 0..n-2 as tells, chunk n - 1
asked) on the Curve connection, each naming its tensors ("sealed"), whose bytes travel on the
target's sealed channel (`weights_channel`; core/sealed.py: plain tcp, AES-256-GCM pieces,
sealed once per publish and sent alike to every target on another node: `num_pieces_sealed`);
the target applies the version when chunk n - 1 is whole (actors/weights/assembly.py).
The protocol's two ends are actors/weights/: WeightPublisher sends, WeightReceiver receives
(the generator and `WeightReceiverActor`, the reference receiver tests and the bench use).

Restarts: a learner restarted by the supervisor holds its initial weights (or its
`resume_from` checkpoint). A caller that tracks the version names it in
`expect_policy_version` (train, sft, save_checkpoint, export_hf, publish); a learner at
another version refuses with `PolicyVersionMismatch` instead of training, saving,
exporting or publishing the wrong weights (the orchestrator then restores it:
actors/learner/recovery.py).

The compute handlers run in a worker thread (`anyio.to_thread.run_sync`), so the event
loop keeps answering heartbeats during a long step. Cancelled: the step still completes
in its thread (atomic: no half-applied update), and its reply is dropped.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Annotated, Any, Literal

import anyio
from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from postrain.core import Actor, MessageKind, Options, handler
from postrain.core.errors import PostrainError
from postrain.core.record import Record

from ..models.spec import check_model_spec
from ..records import (EXPORT_HF, GET_WEIGHTS, GROUP_STATE, JOIN_GROUP, LEARNER_STATS, LOAD_CHECKPOINT,
                       PUBLISH, RANK_STEP, SAVE_CHECKPOINT, SFT, TRAIN, CheckpointLoaded, CheckpointSaved,
                       ExportedHf, ExportHf, GroupState, JoinGroup, LearnerStats, LoadCheckpoint,
                       PublishReport, PublishRequest, RankStep, SaveCheckpoint, SftBatch, StepMetrics,
                       TrainBatch, WeightSync)
from ..weights import (SyncPlanner, WeightPublisher, WeightSyncMode, WeightTransportChoice,
                       weight_transport)
from .context_parallel_step import check_ranks, rank_shards
from .group import LearnerGroup

log = logging.getLogger("postrain.learner")


class PolicyVersionMismatch(PostrainError, RuntimeError):
    """The learner is not at the policy version the caller expects (it restarted)."""


class LearnerGroupMisuse(PostrainError, RuntimeError):
    """A request sent to a rank of a learner group that only rank 0 (or only a follower) takes."""


class LearnerOptions(Options):
    model: Annotated[str | dict, AfterValidator(check_model_spec)] = Field(
        "tiny", description="the policy: a built-in name, a Hugging Face folder, a "
        ".gguf file, or ModelConfig fields")
    seed: int = Field(0, description="init of a from-scratch model and the torch RNG")
    exact: bool = Field(False, description="batch-invariant ops: the learner's logprobs equal an exact "
                        "generator's bit for bit (set `exact = true` in [shared]; docs/exactness.md)")
    learner: dict[str, Any] = Field(default_factory=dict, description="LearnerConfig fields "
                                    "(actors/learner/learner.py): optimizer, schedule, objective, KL, advantages")
    resume_from: str | None = Field(None, description="a checkpoint folder to start from (weights, "
                                    "optimizer, RNG); none: fresh weights")
    weight_sync: WeightSyncMode = Field("auto", description="after a generator's first full "
                             "sync, send it only what changed ('delta': the LoRA adapters, or the changed "
                             "elements), or always the whole weights ('full'); 'auto': delta under LoRA, "
                             "else full (actors/weights/sync_plan.py)")
    weight_transport: WeightTransportChoice = Field("auto", description="how a publish reaches its "
                             "targets: 'message', one load_weights message each (its tensors through /dev/shm "
                             "on this host, inline to another node; patches as weight_sync allows); 'sealed', "
                             "the whole weights in chunks of at most the publish's chunk_mb MiB, sealed once "
                             "for all targets and sent on each one's sealed channel, also on this host "
                             "(targets bound to tcp with the run's keys: to test and bench the cluster path "
                             "on one machine); 'auto', message to targets on this host, sealed to other nodes "
                             "(actors/weights/transport.py)")
    publish_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="the dtype weights travel in and generators run (the rollout dtype): "
        "'bfloat16' halves a sync of float32 weights, and most elements of a step's update round away "
        "in it (a delta sync sends the rest); none: the learner's dtype")
    group_timeout_s: float = Field(300.0, gt=0, description="a learner of several ranks (`ranks = N` on its "
                                   "spec): how long a rank waits for the others, to form the group and in "
                                   "every collective, before the wait is an error naming the missing ranks")

    @field_validator("learner")
    @classmethod
    def _check_learner_config(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """Each LearnerConfig field's type (a bad one is named as learner.FIELD = VALUE: RULE),
        then its rules (LearnerConfig.__post_init__)."""
        for name in ("model", "seed", "exact"):
            if name in value:
                raise ValueError(f"learner.{name} is the learner actor's own option: set options.{name} "
                                 f"(or {name} in [shared]) instead")
        from pydantic import TypeAdapter
        from .learner import LearnerConfig
        TypeAdapter(LearnerConfig).validate_python(
            {**value, "model": info.data.get("model", "tiny"), "seed": info.data.get("seed", 0),
             "exact": info.data.get("exact", False)})
        return value

    @model_validator(mode="after")
    def _exact_publishes_float32(self):
        if self.exact and self.publish_dtype not in (None, "float32"):
            raise ValueError(f"exact = true sends the generators the learner's float32 weights; publish_dtype = "
                             f"{self.publish_dtype!r} would round them: leave publish_dtype unset")
        return self

    def learner_config(self):
        """The LearnerConfig these options describe."""
        from .learner import LearnerConfig
        return LearnerConfig.from_dict({**self.learner, "model": self.model, "seed": self.seed,
                                        "exact": self.exact})


class LearnerActor(Actor):
    Options = LearnerOptions
    keeps_freed_memory = True     # each step frees and reallocates (vocab x hidden) gradients
    needs_bulk_key = True         # seals the weights it publishes to other nodes (core/identity.py)

    def _check_expected_version(self, request: TrainBatch | SftBatch | SaveCheckpoint | ExportHf
                                | PublishRequest) -> None:
        """PolicyVersionMismatch when `request` names an `expect_policy_version` (records/learner.py)
        and the learner is at another version."""
        expected = request.expect_policy_version
        if expected is not None and expected != self.learner.policy_version:
            raise PolicyVersionMismatch(
                f"this learner is at policy version {self.learner.policy_version}, the caller expects "
                f"{expected}: it restarted; load the last checkpoint and replay the steps since")

    async def setup(self):
        """Build the learner (and load resume_from). A rank of a group (`ranks = N`) joins its group
        after READY (actors/learner/group.py); rank 0 starts forming it.
        Cancelled: the process is ending (a start past its timeout), so nothing outlives it."""
        from ..models.device import resolve_device

        self.learner = None
        self.publisher: WeightPublisher | None = None   # the sync protocol's sending end (built with the learner)
        self.group: LearnerGroup | None = None
        check_ranks(self.options.learner_config().context_parallel,
                    1 if self.rendezvous is None else self.rendezvous.world_size)
        await anyio.to_thread.run_sync(self._build)
        if self.rendezvous is None:
            return
        device = resolve_device(self.options.learner_config().device)
        # On a GPU the gradients go over NCCL and the step's small CPU counters over gloo.
        self.group = LearnerGroup(self, self.rendezvous, self.options.group_timeout_s,
                                  "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", self.learner)
        if self.group.rank == 0:
            self.node.spawn(self.group.lead)

    async def teardown(self):
        """Leave the learner's group, if any (its sockets close now, not at interpreter exit).
        Cancelled: the process ends anyway."""
        if self.publisher is not None:
            self.publisher.close()
        if self.group is not None:
            await anyio.to_thread.run_sync(self.group.leave)

    def _build(self):
        """The Learner (resume_from loaded). Runs in a worker thread."""
        from .learner import Learner

        self.learner = Learner(self.options.learner_config())
        self.publisher = WeightPublisher(self.lookup, SyncPlanner(
            self.options.weight_sync, self.learner.lora, self.options.publish_dtype),
            weight_transport(self.options.weight_transport, self.name, self.node.keys))
        # Elastic cores: a step takes up the actor's current torch thread count at the start of each
        # micro-batch's forward (every forward of the policy starts with its embedding).
        embedding = self.learner.model.model.embed_tokens
        embedding.register_forward_pre_hook(lambda module, args: self.apply_num_threads())
        if self.options.resume_from:
            self.learner.load_checkpoint(self.options.resume_from)
        return self.learner

    async def _ready(self, leader_only: bool = True):
        """The Learner, once built (a rank of a group waits for the group). `leader_only`: a
        request other actors send to the learner, which a rank other than 0 refuses. Cancelled:
        nothing changes."""
        if self.group is not None:
            if leader_only and self.group.rank != 0:
                raise LearnerGroupMisuse(f"{self.name} is rank {self.group.rank} of the learner "
                                         f"{self.group.names[0]}; send requests to {self.group.names[0]}")
            await self.group.formed.wait()
        return self.learner

    def _run(self, kind: MessageKind, request: Record):
        """One rank's part of a group request (every rank runs it on its own request record: a
        TrainBatch, SftBatch, SaveCheckpoint or LoadCheckpoint). Runs in a worker thread."""
        learner = self.learner
        if kind is TRAIN:
            return learner.train_step(request)
        if kind is SFT:
            return learner.sft_step(request)
        if kind is SAVE_CHECKPOINT:
            assert isinstance(request, SaveCheckpoint), request
            return learner.save_checkpoint(request.path, request.extra)
        if kind is PUBLISH:             # sharded: every rank gathers, rank 0 keeps (weights/sync_plan.py)
            assert self.publisher is not None, "_build made the publisher (setup)"
            return self.publisher.planner.prepare(learner.base_weights(), learner.policy_version)
        if kind is EXPORT_HF:
            assert isinstance(request, ExportHf), request
            return learner.export_hf(request.path)
        assert kind is LOAD_CHECKPOINT, kind
        assert isinstance(request, LoadCheckpoint), request
        return learner.load_checkpoint(request.path)

    async def _step(self, kind: MessageKind, batch: TrainBatch | SftBatch) -> dict[str, float]:
        """A train or sft step: in this process, or (rank 0 of a group) on every rank, each on its
        shard of the batch. Cancelled: atomic, the step runs to its end on every rank."""
        learner = self.learner
        if self.group is None:
            return await self.in_compute_thread(learner.train_step if kind is TRAIN else learner.sft_step,
                                                batch)  # torch threads: as many as its cores now

        def cut():
            """Validate the whole batch, compute its advantages, cut it into shards (a thread)."""
            from .batch import pack_batch
            reward_metrics, advantages = learner.batch_advantages(batch) if kind is TRAIN else ({}, None)
            pack_batch(batch, advantages=advantages)
            whole = batch if advantages is None else dataclasses.replace(batch, advantages=advantages.tolist())
            return reward_metrics, rank_shards(whole, self.group.rendezvous.world_size,
                                               learner.config.context_parallel)   # one per ring

        reward_metrics, shards = await anyio.to_thread.run_sync(cut)
        metrics = await self.group.run_step(kind, shards, lambda shard: self._run(kind, shard))
        return {**metrics, **reward_metrics}

    def _sharded_group(self) -> bool:
        """A group whose learner is sharded: reading its weights is a collective of every rank."""
        return self.group is not None and self.learner.sharded

    async def _publish_plan(self, request: PublishRequest):
        """The plan of a publish (weights/sync_plan.py): built here, or, sharded, with every rank gathering.
        Cancelled: the gather runs to its end on every rank."""
        if self._sharded_group():
            return await self._everywhere(PUBLISH, request)
        assert self.publisher is not None, "_build made the publisher (setup)"
        return self.publisher.planner.prepare(self.learner.base_weights(), self.learner.policy_version)

    async def _everywhere(self, kind: MessageKind, body: SaveCheckpoint | LoadCheckpoint | PublishRequest | ExportHf):
        """A checkpoint save or load: in this process, or on every rank of its group (rank 0's
        result). Cancelled: it runs to its end on every rank."""
        if self.group is None:
            return await anyio.to_thread.run_sync(self._run, kind, body)
        return await self.group.run_step(kind, [body] * self.group.rendezvous.world_size,
                                         lambda b: self._run(kind, b))

    @handler(JOIN_GROUP, concurrent=True)
    async def join(self, request: JoinGroup) -> GroupState:
        """A rank other than 0: rank 0 asks it to join its group (`generation`, hosted at address:
        port). Does not wait."""
        if self.group is None or self.group.rank == 0:
            raise LearnerGroupMisuse(f"{self.name} is not a follower rank of a learner group")
        await self.group.join(request.generation, request.address, request.port)
        return self.group.describe_state()

    @handler(GROUP_STATE, concurrent=True)
    async def group_state(self, body: None) -> GroupState:
        """This rank's generation and state (rank 0 probes its ranks). Does not wait."""
        if self.group is None:
            return GroupState(generation=None, state="alone", rank=0)
        return self.group.describe_state()

    @handler(RANK_STEP)
    async def rank_step(self, step: RankStep) -> GroupState:
        """A rank other than 0: its part of rank 0's request (a shard's step, a checkpoint).
        Cancelled: the step runs to its end in its thread."""
        if self.group is None or self.group.rank == 0:
            raise LearnerGroupMisuse(f"{self.name} is not a follower rank of a learner group")
        await self.group.follow_step(step, self._run)
        return self.group.describe_state()

    @handler(TRAIN)
    async def train(self, batch: TrainBatch) -> StepMetrics:
        """One RL step. Cancelled: atomic; the step in its thread runs to the end (it cannot be
        abandoned), and its reply is dropped."""
        await self._ready()
        self._check_expected_version(batch)
        return StepMetrics(values=await self._step(TRAIN, batch))

    @handler(SFT)
    async def sft(self, batch: SftBatch) -> StepMetrics:
        """One supervised step. Cancelled: atomic, as `train`."""
        await self._ready()
        self._check_expected_version(batch)
        return StepMetrics(values=await self._step(SFT, batch))

    @handler(SAVE_CHECKPOINT)
    async def save_checkpoint(self, request: SaveCheckpoint) -> CheckpointSaved:
        """Write a checkpoint. Cancelled: it is still written whole (its thread runs to the end);
        the reply is dropped."""
        await self._ready()
        self._check_expected_version(request)
        path = await self._everywhere(SAVE_CHECKPOINT, request)
        return CheckpointSaved(path=str(path), step=self.learner.step, policy_version=self.learner.policy_version)

    @handler(LOAD_CHECKPOINT)
    async def load_checkpoint(self, request: LoadCheckpoint) -> CheckpointLoaded:
        """Load a checkpoint. Cancelled: still loaded whole (its thread runs to the end)."""
        await self._ready()
        extra = await self._everywhere(LOAD_CHECKPOINT, request)
        return CheckpointLoaded(step=self.learner.step, policy_version=self.learner.policy_version, extra=extra)

    @handler(EXPORT_HF)
    async def export_hf(self, request: ExportHf) -> ExportedHf:
        """Write a Hugging Face folder. Cancelled: still written whole (its thread runs to the end)."""
        await self._ready()
        self._check_expected_version(request)
        if self._sharded_group():
            return ExportedHf(path=str(await self._everywhere(EXPORT_HF, request)))
        return ExportedHf(path=str(await anyio.to_thread.run_sync(self.learner.export_hf, request.path)))

    @handler(GET_WEIGHTS)
    async def get_weights(self, body: None) -> WeightSync:
        """The current weights and version. Waits only for a group to form (cancel-safe)."""
        await self._ready()
        if self._sharded_group():
            plan = await self._publish_plan(PublishRequest(targets=[]))
            return WeightSync(version=plan.version, weights=plan.weights)
        return WeightSync(version=self.learner.policy_version, weights=self.learner.state_dict())

    @handler(PUBLISH)
    async def publish(self, request: PublishRequest) -> PublishReport:
        """Push the current weights (version = learner.policy_version) to every target, concurrently.

        body: a PublishRequest: targets (actor names), timeout_s (per message; a chunked sync's last reply waits
        for all its chunks), chunk_mb (under the default weight_transport "auto", a target on
        this host, by node identity or address, gets one message, its tensors through /dev/shm;
        the targets on other nodes get chunks of at most chunk_mb MiB of whole tensors (None: one
        chunk), their bytes sealed once for all of them on their sealed channels:
        actors/weights/transport.py). A target that fails does not stop the
        others: they all finish, then the publish fails naming every target that failed and why
        (the others hold the new version). Cancelled: targets that already replied hold the new
        version; the others may or may not."""
        await self._ready()
        self._check_expected_version(request)
        plan = await self._publish_plan(request)      # the whole weights, or patches (weights/sync_plan.py)
        assert self.publisher is not None, "_build made the publisher (setup)"
        return await self.publisher.publish(plan, request)

    @handler(LEARNER_STATS)
    async def stats(self, body: None) -> LearnerStats:
        """Step, version, size, last publish. Waits only for a group to form (cancel-safe)."""
        await self._ready(leader_only=False)
        assert self.publisher is not None, "_build made the publisher (setup)"
        return LearnerStats(step=self.learner.step, policy_version=self.learner.policy_version,
                            num_params=sum(p.numel() for p in self.learner.params),
                            last_publish=self.publisher.last_publish,
                            num_pieces_sealed=self.publisher.num_pieces_sealed)
