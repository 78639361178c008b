"""Elastic cores: the rule that lends an idle actor's cores to a busy one, and takes them back.

    [[actors]]
    name = "learner"
    cpus = 0.75
    elastic = true        # its cores may be lent while it is idle; it may borrow while it works

Design note. The cores of the elastic actors form one pool, and at every moment each of its
cores is *held* by exactly one elastic actor: its owner (the actor it was placed for, its
*home*) or a borrower. Who holds what is a function of one thing only, which actors have work
now (`busy`), so the rule (`assign`) is a pure function of the homes and the busy set:

- no busy actor that borrows: every actor holds its home;
- otherwise every busy actor holds its home, and the home cores of the idle actors are dealt
  out to the busy ones that borrow, one core at a time to the one holding the fewest (ties
  by name), so an idle actor holds nothing: it is *parked*.

An actor declared `elastic = "lend"` lends its cores while idle but never borrows (a
generator of a small model, whose decoding a second thread slows down: each of its many
small operations then waits for one more wake-up).

Moving from one holding to the next (`plan`) is two phases: first every actor that loses
cores is re-pinned to what it keeps (`revokes`), and only once all of them acknowledged are
the actors that gain cores re-pinned to their new sets (`grants`). So an owner whose work
starts gets its cores back from the borrower before it is told to use them, and at every
moment, between any two steps of the plan, no core is in the pinned set of two actors.

What an actor holds becomes its CPU affinity (every thread of its process) and its torch
thread count (`Holding.num_threads`: its home's thread count plus one per borrowed core).
A parked actor has no core of its own to run on, and Linux pins a process to at least one
core: it stays pinned to its home cores with one thread for its event loop (heartbeats,
messages), and it is given no work until its cores come back (`Holding.parked`). Its
compute threads are where the invariant bites: they run only on held cores.

Invariants (checked by `check_holdings`; tests/core/test_elastic.py tests them with
hypothesis at every step of every plan):
    the held sets are pairwise disjoint and their union is the union of the homes
    a busy actor holds its whole home; an idle actor holds its home or nothing
    a core is held by someone other than its owner only while its owner is idle
    an actor that does not borrow holds its home or nothing
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

@dataclass(frozen=True)
class Home:
    """An elastic actor's own cores and the torch threads its placement gives it there."""

    cpu_ids: frozenset[int]
    num_threads: int
    borrows: bool = True    # False: it lends while idle but never takes another's cores


@dataclass(frozen=True)
class Holding:
    """What one actor may use now: `cpu_ids` (empty: parked) and its thread count."""

    actor: str
    cpu_ids: frozenset[int]
    home: Home

    @property
    def parked(self) -> bool:
        return not self.cpu_ids

    @property
    def num_threads(self) -> int:
        """The home's threads plus one per borrowed core; 1 when parked (its event loop)."""
        if self.parked:
            return 1
        return self.home.num_threads + len(self.cpu_ids - self.home.cpu_ids)

    @property
    def affinity(self) -> tuple[int, ...]:
        """The cores its process is pinned to: the held ones, or its home while parked."""
        return tuple(sorted(self.cpu_ids or self.home.cpu_ids))


@dataclass(frozen=True)
class Transfer:
    """Cores that change holder in one plan: `lend` (owner -> borrower), `return` (borrower ->
    owner) or `move` (one borrower -> another)."""

    action: str
    cpu_ids: tuple[int, ...]
    giver: str
    taker: str

    def describe(self) -> str:
        why = {"lend": f"{self.giver} is idle and {self.taker} has work",
               "return": f"{self.taker} has work again",
               "move": f"{self.giver}'s borrowed cores are dealt again"}[self.action]
        return f"elastic cores: {self.action} {list(self.cpu_ids)} {self.giver} -> {self.taker} ({why})"

    def to_row(self) -> dict[str, Any]:
        return {"action": self.action, "cpu_ids": list(self.cpu_ids), "giver": self.giver,
                "taker": self.taker}


@dataclass(frozen=True)
class Plan:
    """How to go from one holding to the next: re-pin `revokes` (actors keeping part of what
    they hold), wait for every acknowledgement, then re-pin `grants` (actors gaining cores).
    `held` is the holding after the plan; `transfers` say which cores changed hands."""

    revokes: tuple[Holding, ...]
    grants: tuple[Holding, ...]
    held: Mapping[str, frozenset[int]]
    transfers: tuple[Transfer, ...]


def check_homes(homes: Mapping[str, Home]) -> None:
    """Elastic actors' homes must be disjoint and non-empty (the scheduler places them so)."""
    seen: dict[int, str] = {}
    for actor, home in homes.items():
        if not home.cpu_ids:
            raise ValueError(f"elastic actor {actor!r} has no home core")
        for core in home.cpu_ids:
            if core in seen:
                raise ValueError(f"elastic actors {seen[core]!r} and {actor!r} share core {core}; elastic "
                                 "actors need cores of their own (the scheduler places them apart)")
            seen[core] = actor


def assign(homes: Mapping[str, Home], busy: frozenset[str]) -> dict[str, frozenset[int]]:
    """Who holds which cores when the actors in `busy` have work (design note). Pure."""
    takers = sorted(actor for actor, home in homes.items() if actor in busy and home.borrows)
    if not takers:
        return {actor: home.cpu_ids for actor, home in homes.items()}
    held = {actor: set(homes[actor].cpu_ids) if actor in busy else set() for actor in homes}
    spare = sorted(core for actor, home in homes.items() if actor not in busy for core in home.cpu_ids)
    for core in spare:
        taker = min(takers, key=lambda actor: (len(held[actor]), actor))
        held[taker].add(core)
    return {actor: frozenset(cores) for actor, cores in held.items()}


def plan(homes: Mapping[str, Home], held: Mapping[str, frozenset[int]], busy: frozenset[str]) -> Plan:
    """The steps from holding `held` to `assign(homes, busy)` (design note). Pure."""
    target = assign(homes, busy)
    revokes = tuple(Holding(actor, held[actor] & target[actor], homes[actor])
                    for actor in sorted(homes) if held[actor] - target[actor])
    grants = tuple(Holding(actor, target[actor], homes[actor])
                   for actor in sorted(homes) if target[actor] - held[actor])
    return Plan(revokes, grants, target, _transfers(homes, held, target))


def _transfers(homes: Mapping[str, Home], held: Mapping[str, frozenset[int]],
               target: Mapping[str, frozenset[int]]) -> tuple[Transfer, ...]:
    """The cores whose holder changes, grouped by (giver, taker)."""
    holder_before = {core: actor for actor, cores in held.items() for core in cores}
    holder_after = {core: actor for actor, cores in target.items() for core in cores}
    owner = {core: actor for actor, home in homes.items() for core in home.cpu_ids}
    moved: dict[tuple[str, str, str], list[int]] = {}
    for core in sorted(holder_after):
        giver, taker = holder_before[core], holder_after[core]
        if giver != taker:
            action = "lend" if giver == owner[core] else "return" if taker == owner[core] else "move"
            moved.setdefault((action, giver, taker), []).append(core)
    return tuple(Transfer(action, tuple(cores), giver, taker)
                 for (action, giver, taker), cores in moved.items())


def check_holdings(homes: Mapping[str, Home], held: Mapping[str, frozenset[int]],
                   busy: frozenset[str]) -> None:
    """Assert the module's invariants for a settled holding (after a whole plan)."""
    pool = set().union(*(home.cpu_ids for home in homes.values()))
    all_held = [core for cores in held.values() for core in cores]
    assert len(all_held) == len(set(all_held)), f"a core held twice: {held}"
    assert set(all_held) == pool, f"cores {pool - set(all_held)} held by nobody: {held}"
    for actor, home in homes.items():
        if actor in busy:
            assert home.cpu_ids <= held[actor], f"busy {actor} lacks its home {set(home.cpu_ids)}: {held}"
            assert home.borrows or held[actor] == home.cpu_ids, f"{actor} borrows: {held}"
        else:
            assert held[actor] in (home.cpu_ids, frozenset()), f"idle {actor} holds {set(held[actor])}"
