"""The scheduler's core: an inventory of pools and the placement of actors on them.

Design note. Placement is bin packing with one rule that the rest follows
from: an actor gets *specific* resources, never a share of "the machine".
A CPU actor is handed core ids (it pins itself to them and sets its torch
thread count to their number), a GPU actor is handed GPU ids. Whole-core
requests take whole free cores; a fractional request shares one core with
other fractional requests up to a capacity of 1.0. So actors on one machine
never oversubscribe it, and a request that cannot be met fails at once with
what was asked and what is free, before any process starts.

An actor whose spec is `elastic` is placed on cores no other elastic actor holds, so
the elastic actors' homes are disjoint (elastic cores lend and return whole homes:
core/elastic.py).

Invariants (checked by `check()` and tests/core/test_scheduler.py):
    all(0 <= used <= 1 for used in core_used.values())
    the cores of two elastic actors' placements never overlap
    sum of placed memory_mb <= inventory.memory_mb
    every GPU id is held by at most one actor
"""
from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field

import psutil

from .config import ActorSpec
from .errors import PlacementError

_EPS = 1e-9


@dataclass(frozen=True)
class GpuInfo:
    gpu_id: int
    name: str
    memory_mb: int


@dataclass(frozen=True)
class Inventory:
    """What this host offers. `detect()` reads it; tests build one by hand."""

    cpu_ids: tuple[int, ...]
    memory_mb: int
    gpus: tuple[GpuInfo, ...] = ()

    @classmethod
    def detect(cls) -> "Inventory":
        try:
            cpu_ids = tuple(sorted(os.sched_getaffinity(0)))
        except AttributeError:
            cpu_ids = tuple(range(psutil.cpu_count() or 1))
        memory_mb = psutil.virtual_memory().total // (1 << 20)
        return cls(cpu_ids, int(memory_mb), detect_gpus())


def detect_gpus() -> tuple[GpuInfo, ...]:
    """GPUs from NVML where present, else torch.cuda, else none. Never starts CUDA needlessly."""
    if not (os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi")):
        return ()
    try:
        import pynvml
        pynvml.nvmlInit()
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total // (1 << 20)
            gpus.append(GpuInfo(index, name if isinstance(name, str) else name.decode(), int(memory)))
        return tuple(gpus)
    except Exception:
        pass
    try:
        import torch
        return tuple(GpuInfo(i, torch.cuda.get_device_name(i),
                             torch.cuda.get_device_properties(i).total_memory // (1 << 20))
                     for i in range(torch.cuda.device_count()))
    except Exception:
        return ()


@dataclass(frozen=True)
class Placement:
    """Where one actor runs. num_threads: the torch/OpenMP thread count it should use."""

    name: str
    cpu_ids: tuple[int, ...]
    gpu_ids: tuple[int, ...]
    memory_mb: int
    num_threads: int

    def describe(self) -> str:
        gpus = f", gpus {list(self.gpu_ids)}" if self.gpu_ids else ""
        return f"{self.name}: cores {list(self.cpu_ids)}{gpus}, {self.memory_mb} MiB, {self.num_threads} threads"


@dataclass
class Scheduler:
    inventory: Inventory = field(default_factory=Inventory.detect)
    placements: dict[str, Placement] = field(default_factory=dict)
    _core_used: dict[int, float] = field(default_factory=dict)
    _cpu_share: dict[str, dict[int, float]] = field(default_factory=dict)
    _elastic: set[str] = field(default_factory=set)   # names of the placed elastic actors

    def __post_init__(self) -> None:
        self._core_used = {cpu: 0.0 for cpu in self.inventory.cpu_ids}

    # -- queries -------------------------------------------------------------

    def free_summary(self) -> str:
        free_cores = sum(1.0 - used for used in self._core_used.values())
        free_gpus = [g.gpu_id for g in self.inventory.gpus if g.gpu_id not in self._gpus_held()]
        return (f"{free_cores:.2f} of {len(self._core_used)} cores, "
                f"{self.free_memory_mb()} of {self.inventory.memory_mb} MiB, "
                f"GPUs free: {free_gpus or 'none'}")

    def free_memory_mb(self) -> int:
        return self.inventory.memory_mb - sum(p.memory_mb for p in self.placements.values())

    def _gpus_held(self) -> set[int]:
        return {gpu for p in self.placements.values() for gpu in p.gpu_ids}

    # -- placement -----------------------------------------------------------

    def place(self, spec: ActorSpec) -> Placement:
        """Reserve resources for `spec`. Atomic: on PlacementError nothing is reserved."""
        if spec.name in self.placements:
            raise PlacementError(f"actor {spec.name!r} is already placed; release it first")
        asked = f"actor {spec.name!r} asks for {spec.cpus:g} cores, {spec.gpus} GPUs, {spec.memory_mb} MiB"
        if spec.memory_mb > self.free_memory_mb():
            raise PlacementError(f"{asked}; free: {self.free_summary()}. Lower memory_mb or run fewer actors")
        gpu_ids = self._pick_gpus(spec.gpus, asked)
        elastic_cores = {cpu for name in self._elastic for cpu in self._cpu_share[name]}
        share = self._pick_cores(spec.cpus, asked, avoid=elastic_cores if spec.elastic else set())
        for cpu, amount in share.items():
            self._core_used[cpu] += amount
        self._cpu_share[spec.name] = share
        if spec.elastic:
            self._elastic.add(spec.name)
        placement = Placement(spec.name, tuple(sorted(share)), gpu_ids, spec.memory_mb,
                              max(1, math.floor(spec.cpus + _EPS)))
        self.placements[spec.name] = placement
        return placement

    def resize(self, name: str, cpus: float) -> Placement:
        """Change a placed actor's CPU reservation to `cpus` cores in all (the balancer's lever).

        Growing fills the actor's own cores first, then the fullest cores that still have room,
        so one actor may come to span several cores; shrinking gives back the cores it took last.
        Atomic: on PlacementError (not that much free) nothing changes."""
        placement = self.placements.get(name)
        if placement is None:
            raise PlacementError(f"actor {name!r} is not placed; place it before resizing it")
        if cpus <= _EPS:
            raise PlacementError(f"actor {name!r}: cpus must be > 0, got {cpus:g}; release it instead")
        share = dict(self._cpu_share[name])
        delta = cpus - sum(share.values())
        if delta > _EPS:
            for cpu in sorted(self._core_used, key=lambda c: (c not in share, -self._core_used[c])):
                room = 1.0 - self._core_used[cpu]
                take = min(room, delta)
                if take > _EPS:
                    share[cpu] = share.get(cpu, 0.0) + take
                    delta -= take
                if delta <= _EPS:
                    break
            if delta > _EPS:
                raise PlacementError(f"actor {name!r} asks to grow to {cpus:g} cores; free: "
                                     f"{self.free_summary()}. Free cores elsewhere or grow less")
        else:
            for cpu in reversed(list(share)):
                give = min(share[cpu], -delta)
                share[cpu] -= give
                delta += give
                if share[cpu] <= _EPS and len(share) > 1:
                    del share[cpu]
                if delta >= -_EPS:
                    break
        old = self._cpu_share[name]
        for cpu in self._core_used:
            self._core_used[cpu] += share.get(cpu, 0.0) - old.get(cpu, 0.0)
        self._cpu_share[name] = share
        resized = Placement(name, tuple(sorted(share)), placement.gpu_ids, placement.memory_mb,
                            max(1, math.floor(cpus + _EPS)))
        self.placements[name] = resized
        return resized

    def reserved_cpus(self, name: str) -> float:
        """Cores reserved for a placed actor (0 when it is not placed)."""
        return sum(self._cpu_share.get(name, {}).values())

    def free_cpus(self) -> float:
        return sum(1.0 - used for used in self._core_used.values())

    def release(self, name: str) -> None:
        self.placements.pop(name, None)
        self._elastic.discard(name)
        for cpu, amount in self._cpu_share.pop(name, {}).items():
            self._core_used[cpu] = max(0.0, self._core_used[cpu] - amount)

    def plan(self, specs: list[ActorSpec]) -> list[Placement]:
        """Place every spec on a scratch copy of this scheduler (a dry run)."""
        scratch = Scheduler(self.inventory)
        return [scratch.place(spec) for spec in specs]

    def check(self) -> None:
        assert all(-_EPS <= used <= 1 + _EPS for used in self._core_used.values()), self._core_used
        assert self.free_memory_mb() >= 0
        held = [gpu for p in self.placements.values() for gpu in p.gpu_ids]
        assert len(held) == len(set(held)), held
        elastic = [cpu for name in self._elastic for cpu in self._cpu_share[name]]
        assert len(elastic) == len(set(elastic)), f"elastic actors share a core: {elastic}"

    def _pick_gpus(self, count: int, asked: str) -> tuple[int, ...]:
        if count == 0:
            return ()
        held = self._gpus_held()
        free = [g.gpu_id for g in self.inventory.gpus if g.gpu_id not in held]
        if len(free) < count:
            raise PlacementError(f"{asked}; free: {self.free_summary()}. "
                                 "Ask for fewer GPUs (gpus = 0 runs on the CPU)")
        return tuple(free[:count])

    def elastic_names(self) -> set[str]:
        """The placed actors whose spec is elastic."""
        return set(self._elastic)

    def _pick_cores(self, cpus: float, asked: str, avoid: set[int]) -> dict[int, float]:
        """Whole idle cores, then the fullest core with room for the fraction, never one in `avoid`."""
        whole = math.floor(cpus + _EPS)
        fraction = cpus - whole if cpus - whole > _EPS else 0.0
        idle = [cpu for cpu, used in self._core_used.items() if used <= _EPS]
        if len(idle) < whole:
            raise PlacementError(f"{asked}; free: {self.free_summary()} ({len(idle)} idle cores). "
                                 "Lower cpus, or use fractions so actors share cores")
        share = {cpu: 1.0 for cpu in idle[:whole]}
        if fraction:
            # fullest core that still fits: keeps idle cores whole for whole-core requests
            fits = [(used, cpu) for cpu, used in self._core_used.items()
                    if cpu not in share and cpu not in avoid and used + fraction <= 1 + _EPS]
            if not fits:
                apart = " apart from the other elastic actors" if avoid else ""
                raise PlacementError(f"{asked}; free: {self.free_summary()}: no core{apart} has "
                                     f"{fraction:.2f} left. Lower cpus or run fewer actors")
            share[max(fits)[1]] = fraction
        return share
