"""One learner, several processes: the learner data-parallel over ranks (torch.distributed).

    [[actors]]
    name = "learner"
    cls = "postrain.actors.learner:LearnerActor"
    ranks = 2                            # learner (rank 0) and learner-rank1, placed like any actor
    options = { group_timeout_s = 300 }  # every wait for the other ranks, joining included

Design note. Rank 0 leads, the other ranks follow it, and a group that breaks is never
mended in place: every rank's process ends and restarts, and the learner's keeper restores
the checkpoint (actors/learner/recovery.py). The rest follows from that rule:
- Forming. Each rank's spec carries its `Rendezvous` from the head (rank 0's node address, a
  free port there, the group's names). Rank 0 draws a new `generation` id per process and
  asks every other rank to `join` it at its own node's address and that port (over the
  run's ZeroMQ, until each answers or group_timeout_s passes; so a rank 0 placed again on
  another node after a node loss is still found). Then every rank calls
  `init_process_group` (gloo on CPU; on a GPU, NCCL for CUDA tensors and gloo for the
  step's CPU counters) over a store rank 0 serves there, which admits only ranks that prove
  the group's secret (rendezvous_store.py; torch's TCPStore admits anyone), with
  group_timeout_s as the timeout of every collective, and its Learner (built before READY,
  as a lone learner's) joins the group: rank 0's weights are broadcast. A rank asked to join
  another generation than its own belonged to a rank 0 that has since restarted: it ends its
  process, and its restart joins the new one.
- Working. The other actors talk to rank 0 alone. For a step rank 0 checks that every rank
  is in its generation (`group`), cuts the batch into one shard per rank (advantages
  computed over the whole batch first, so the shards train exactly what one process would),
  asks each rank `rank_step` with its shard and trains its own; gradients are all-reduced
  inside the Learner. Checkpoint saves and loads go to every rank the same way; only rank 0
  writes, publishes weights and answers.
- Breaking. A collective that fails or passes group_timeout_s, a rank that does not answer,
  answers from another generation or dies: the rank that sees it ends its process with one
  line naming the ranks (`Actor.crash`: the supervisor's exit event shows it), and the others
  follow (their collectives fail, or rank 0's next `join` tells them). Requests in flight to
  rank 0 fail with ActorDiedError, which the keeper answers by waiting for the new group,
  loading the checkpoint and replaying the steps since it.

The network interface is chosen explicitly: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name
the interface that holds the rank's node address (`lo` for 127.0.0.1), unless the user set
them already (then they are left, and the log says so).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
import uuid
from datetime import timedelta
from typing import Callable

import anyio

from postrain.core.config import Rendezvous
from postrain.core.errors import ActorError, PostrainError
from postrain.core.messages import MessageKind
from postrain.core.record import Record

from ..records import GROUP_STATE, JOIN_GROUP, RANK_STEP, GroupState, JoinGroup, RankStep, SftBatch, TrainBatch
from ..records.train import NOT_PER_SAMPLE

log = logging.getLogger("postrain.learner")

INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
PROBE_TIMEOUT_S = 10.0          # one `group` or `join` ask to another rank
STEP_ASK_TIMEOUT_S = 3600.0     # a `rank_step` reply (the collectives' own timeouts bound a hang)


class GroupBroken(PostrainError):
    """A rank of the learner's group is lost, hung or in another generation."""


# -- the network interface ---------------------------------------------------------------

def interface_holding(address: str) -> str | None:
    """The name of the network interface that holds IPv4 `address` (a hostname is resolved first),
    or None when none here does."""
    import psutil

    try:
        ip = socket.gethostbyname(address)
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addresses):
            return name
    return None


def choose_interface(node_address: str) -> None:
    """Point gloo and NCCL at the interface holding `node_address`, unless the user chose one
    (left as set, and logged)."""
    interface = interface_holding(node_address)
    for variable in INTERFACE_VARIABLES:
        if os.environ.get(variable):
            log.info("%s=%s was set before the learner started: left as it is (the node's address %s "
                     "is on %s)", variable, os.environ[variable], node_address,
                     interface or "no interface here")
        elif interface is not None:
            os.environ[variable] = interface
        else:
            log.warning("no interface here holds the node's address %s; %s is left unset (gloo and NCCL "
                        "then pick one themselves: set it if they pick the wrong one)",
                        node_address, variable)


# -- batches ------------------------------------------------------------------------------

def shard_batch(batch: TrainBatch | SftBatch, num_ranks: int) -> list[TrainBatch | SftBatch]:
    """`batch` (a TrainBatch with per-sample `advantages`: rank 0 computes them over the whole
    batch first; or an SftBatch) cut into `num_ranks` contiguous shards of the same record, whose
    sizes differ by at most one sample: every per-sample field sliced alike. LearnerError when
    there are fewer samples than ranks (every rank needs at least one)."""
    from .batch import LearnerError

    num = len(batch.token_ids)
    if num < num_ranks:
        raise LearnerError(f"a batch of {num} samples cannot be shared by {num_ranks} learner ranks (each "
                           "needs one): send larger batches or use fewer ranks")
    bounds = [num * rank // num_ranks for rank in range(num_ranks + 1)]
    per_sample = [f.name for f in dataclasses.fields(batch)
                  if f.name not in NOT_PER_SAMPLE and getattr(batch, f.name) is not None]
    return [dataclasses.replace(batch, **{name: _rows(getattr(batch, name), lo, hi) for name in per_sample})
            for lo, hi in zip(bounds, bounds[1:])]


def _rows(value, lo: int, hi: int):
    """Samples [lo, hi) of a per-sample field (a dict of them: each value's)."""
    if isinstance(value, dict):
        return {name: values[lo:hi] for name, values in value.items()}
    return value[lo:hi]


# -- the group ---------------------------------------------------------------------------

class LearnerGroup:
    """This process's place in the learner's group (one per rank process).

    state: "waiting" (a follower not yet asked to join) -> "joining" -> "formed".
    Invariant: state == "formed" iff `formed` is set iff torch.distributed is initialised in
    this process with `generation`'s group and the Learner has joined it."""

    def __init__(self, actor, rendezvous: Rendezvous, timeout_s: float, backend: str, learner):
        self.actor = actor                  # the LearnerActor this process runs
        self.rendezvous = rendezvous
        self.timeout_s = timeout_s          # group_timeout_s: joining, and every collective
        self.backend = backend              # "gloo" | "cpu:gloo,cuda:nccl"
        self.learner = learner              # built before the group: it joins it once formed
        self.generation: str | None = None
        self.state = "waiting"
        self.formed = anyio.Event()
        # where rank 0 hosts the group: its own node's address (rank 0 says it in `join`, so a
        # rank 0 placed on another node after a node loss is still found) and the head's port
        self.meeting_point: tuple[str, int] | None = None
        self._refs: dict[str, object] = {}

    @property
    def rank(self) -> int:
        return self.rendezvous.rank

    @property
    def names(self) -> list[str]:
        return self.rendezvous.names

    def describe(self, ranks) -> str:
        """'ranks 1, 2 (learner-rank1, learner-rank2)'."""
        ranks = sorted(ranks)
        word = "rank" if len(ranks) == 1 else "ranks"
        return f"{word} {', '.join(map(str, ranks))} ({', '.join(self.names[r] for r in ranks)})"

    # -- forming ---------------------------------------------------------------------------

    async def lead(self) -> None:
        """Rank 0: a new generation, every other rank asked to join it, then the group formed and
        the Learner in it. Any failure ends the process (Actor.crash). Cancelled: the process
        is ending."""
        self.generation, self.state = uuid.uuid4().hex[:12], "joining"
        assert self.rendezvous.address is not None and self.rendezvous.port is not None, \
            "the head completes the rendezvous (address, port) before the ranks start"
        self.meeting_point = (_host_of(self.actor.address) or self.rendezvous.address, self.rendezvous.port)
        try:
            await self._gather_ranks()
            await anyio.to_thread.run_sync(self._initialise)
        except Exception as exc:
            await self.actor.crash(f"the learner's group did not form: {_one_line(exc)}")
        self._mark_formed()

    async def join(self, generation: str, address: str, port: int) -> str:
        """A follower asked by rank 0 to join `generation`, hosted at address:port: start joining
        it (once), answer the state. From another generation than the one it joined: rank 0
        restarted, so this process ends and its restart joins the new group."""
        if self.state == "waiting":
            self.generation, self.state = generation, "joining"
            self.meeting_point = (address, int(port))
            self.actor.node.spawn(self._follow)
        elif generation != self.generation:
            await self.actor.crash(f"rank 0 ({self.names[0]}) restarted (group {generation}; this rank was "
                                   f"in {self.generation}): restarting to join the new group")
        return self.state

    async def _follow(self) -> None:
        """A follower: form the group rank 0 leads and put the Learner in it; a failure ends the
        process. Cancelled: the process is ending."""
        try:
            await anyio.to_thread.run_sync(self._initialise)
        except Exception as exc:
            assert self.meeting_point is not None, "set when this rank started joining (lead or join)"
            address, port = self.meeting_point
            await self.actor.crash(f"rank {self.rank} could not join the group that rank 0 ({self.names[0]}, "
                                   f"{address}:{port}) leads: {_one_line(exc)}")
        self._mark_formed()

    def _mark_formed(self) -> None:
        self.state = "formed"
        self.formed.set()
        log.info("learner group %s formed: rank %d of %d (%s backend, collectives time out after %g s)",
                 self.generation, self.rank, self.rendezvous.world_size, self.backend, self.timeout_s)

    async def _gather_ranks(self) -> None:
        """Ask every other rank to join this generation until each has said yes; GroupBroken
        naming the ranks that did not within timeout_s. Cancelled: some ranks may be joining."""
        missing = set(range(1, self.rendezvous.world_size))
        deadline = time.monotonic() + self.timeout_s
        last_error: dict[int, str] = {}
        while missing and time.monotonic() < deadline:
            for rank in sorted(missing):
                try:
                    ref = await self._ref(self.names[rank])
                    assert self.meeting_point is not None, "set when this rank started joining (lead or join)"
                    assert self.generation is not None, "lead made the generation"
                    address, port = self.meeting_point
                    await ref.call(JOIN_GROUP, JoinGroup(generation=self.generation, address=address, port=port),
                                   timeout_s=PROBE_TIMEOUT_S)
                    missing.discard(rank)
                except ActorError as exc:     # not started yet, restarting, or ending to rejoin
                    last_error[rank] = _one_line(exc)
            if missing:
                await anyio.sleep(0.5)
        if missing:
            why = "; ".join(f"rank {r}: {last_error.get(r, 'no answer')}" for r in sorted(missing))
            raise GroupBroken(f"{self.describe(missing)} did not answer rank 0's call to join within "
                              f"group_timeout_s = {self.timeout_s:g} s ({why}); look at their logs")

    def _initialise(self) -> None:
        """init_process_group on rank 0's address (blocking: the other ranks must come), then the
        Learner joins the group (rank 0's weights broadcast). Runs in a worker thread."""
        import torch.distributed as dist

        from .rendezvous_store import AuthenticatedStore
        assert self.meeting_point is not None, "set when this rank started joining (lead or join)"
        address, port = self.meeting_point
        own_host = _host_of(self.actor.address) or address
        choose_interface(own_host)
        log.info("rank %d of %d joins the learner group at %s:%d (%s; %s)", self.rank,
                 self.rendezvous.world_size, address, port, self.backend,
                 ", ".join(f"{k}={os.environ.get(k, '')}" for k in INTERFACE_VARIABLES))
        try:   # an authenticated store, served by rank 0 on its node's address (rendezvous_store.py)
            self._store = AuthenticatedStore(address, port, self.actor.group_secret, is_server=self.rank == 0,
                                             timeout=timedelta(seconds=self.timeout_s))
            dist.init_process_group(self.backend, store=self._store,
                                    rank=self.rank, world_size=self.rendezvous.world_size,
                                    timeout=timedelta(seconds=self.timeout_s))
        except Exception as exc:
            others = set(range(self.rendezvous.world_size)) - {self.rank}
            raise GroupBroken(f"init_process_group at {address}:{port} failed, waiting for "
                              f"{self.describe(others)} (group_timeout_s = {self.timeout_s:g} s): "
                              f"{_one_line(exc)}") from None
        self.learner.join_process_group()

    def leave(self) -> None:
        """Destroy this process's group (the actor stops). Runs in a worker thread."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        if getattr(self, "_store", None) is not None:
            self._store.close()

    # -- working (rank 0) --------------------------------------------------------------------

    async def run_step(self, kind: MessageKind, bodies: list[Record], own: Callable[[Record], object]):
        """Rank 0: every rank runs `kind` on its request record (rank r gets bodies[r], as a
        RankStep; rank 0 runs `own(bodies[0])` here) and rank 0's result is returned. A rank lost, hung or in another
        generation ends this process naming it. Cancelled: the ranks' step runs to its end."""
        await self._check_ranks(kind.name)
        failures: dict[int, str] = {}
        result = None

        async def remote(rank: int) -> None:
            """Rank `rank`'s part. Cancelled: that rank's step runs on."""
            try:
                ref = await self._ref(self.names[rank])
                assert self.generation is not None, "run_step runs in a formed group (it has its generation)"
                step = RankStep.of(self.generation, kind, bodies[rank])
                await ref.call(RANK_STEP, step, timeout_s=STEP_ASK_TIMEOUT_S)
            except ActorError as exc:
                failures[rank] = _one_line(exc)

        async def local() -> None:
            """Rank 0's part, in a worker thread. Cancelled: the thread runs to its end."""
            nonlocal result
            try:
                result = await anyio.to_thread.run_sync(own, bodies[0])
            except Exception as exc:
                failures[0] = f"{type(exc).__name__}: {_one_line(exc)}"
                log.error("rank 0's %s step failed (the other ranks' may wait on it until their collectives "
                          "time out): %s", kind.name, failures[0])

        async with anyio.create_task_group() as tg:
            for rank in range(1, self.rendezvous.world_size):
                tg.start_soon(remote, rank)
            tg.start_soon(local)
        if failures:
            lost = await self._unreachable_ranks()
            blame = (f"{self.describe(lost)} lost, hung or restarted" if lost else
                     f"{self.describe(failures)} failed")
            details = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
            await self.actor.crash(f"the learner's group broke during {kind.name}: {blame} ({details}); every "
                                   "rank restarts and the learner is restored from its last checkpoint")
        return result

    async def _check_ranks(self, kind: str) -> None:
        """Before a step: every rank answers formed in this generation (one still joining it is
        waited for, up to timeout_s), or the process ends naming those that do not.
        Cancelled: nothing changes."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            states = await self._probe_ranks()
            lost = [rank for rank, state in states.items() if state == "lost"]
            if lost:
                await self.actor.crash(f"{self.describe(lost)} of the learner's group lost or restarted "
                                       f"before {kind} (not in group {self.generation}); every rank restarts "
                                       "and the learner is restored from its last checkpoint")
            joining = [rank for rank, state in states.items() if state == "joining"]
            if not joining:
                return
            if time.monotonic() > deadline:
                await self.actor.crash(f"{self.describe(joining)} of the learner's group did not finish "
                                       f"joining within group_timeout_s = {self.timeout_s:g} s")
            await anyio.sleep(0.1)

    async def _unreachable_ranks(self) -> list[int]:
        """The other ranks that do not answer formed in this generation. Cancelled: nothing changes."""
        return sorted(rank for rank, state in (await self._probe_ranks()).items() if state != "formed")

    async def _probe_ranks(self) -> dict[int, str]:
        """Each other rank's state as seen from here, asked concurrently: "formed" or "joining"
        (in this generation), or "lost" (no answer within PROBE_TIMEOUT_S, or another
        generation). Cancelled: nothing changes."""
        states: dict[int, str] = {}

        async def probe(rank: int) -> None:
            """Ask one rank. Cancelled: nothing changes."""
            try:
                ref = await self._ref(self.names[rank])
                reply = await ref.call(GROUP_STATE, timeout_s=min(PROBE_TIMEOUT_S, self.timeout_s))
            except ActorError:
                states[rank] = "lost"
                return
            state = reply.state if reply.generation == self.generation else None
            states[rank] = state if state in ("formed", "joining") else "lost"

        async with anyio.create_task_group() as tg:
            for rank in range(1, self.rendezvous.world_size):
                tg.start_soon(probe, rank)
        return states

    async def _ref(self, name: str):
        """A (cached) reference to rank `name`: a rank restarts on the address it had. Cancelled:
        nothing is cached."""
        if name not in self._refs:
            self._refs[name] = await self.actor.lookup(name)
        return self._refs[name]

    # -- working (the other ranks) --------------------------------------------------------------

    def describe_state(self) -> GroupState:
        """This rank's generation and state (the `group` reply)."""
        return GroupState(generation=self.generation, state=self.state, rank=self.rank)

    async def follow_step(self, step: RankStep, run: Callable[[MessageKind, Record], object]) -> None:
        """A follower: run rank 0's `rank_step` (run(kind, request) in a worker thread). Refused
        when it names another generation; a failure of the step (a collective) ends the process.
        Cancelled: the step's thread runs to its end."""
        if step.generation != self.generation or self.state != "formed":
            raise GroupBroken(f"rank {self.rank} is in group {self.generation} ({self.state}), not "
                              f"{step.generation}")
        try:
            await anyio.to_thread.run_sync(run, step.message, step.request)
        except Exception as exc:
            await self.actor.crash(f"rank {self.rank}: {step.kind} with rank 0 ({self.names[0]}) failed: "
                                   f"{type(exc).__name__}: {_one_line(exc)}; restarting with the group")


def _host_of(address: str) -> str | None:
    """The host of a tcp:// address; None for ipc (one host: the rendezvous address serves)."""
    if address and address.startswith("tcp://"):
        return address[len("tcp://"):].rsplit(":", 1)[0]
    return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]
