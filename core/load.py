"""An actor's load: the typed record each heartbeat carries, and the pool protocol.

    from postrain.core import Actor, Load

    class Workers(Actor):
        def load(self) -> Load:
            return super().load().replace(queued=self.num_waiting, running=self.num_busy,
                                          workers=self.num_workers, figures={"hits": self.hits})

Design note. The head reads every actor's load without knowing what the actor
is: the inbox's counters (`in_flight`, `served`, `rejected`), three generic
figures of work (`queued`: waiting to start, `running`: started, `workers`:
how many pieces of work it can run at once) and a free map `figures` of the
actor's own numbers, which the kernel carries and never reads. An actor whose
load has `workers` set is a *pool*: it promises to handle `RESIZE`, so the
head's balancing rules may grow and shrink it from its figures alone.
`backpressure` is the generic reason an actor holds back new work ("" when
it does not; None for an actor that never does), so the head can log why work
waits without knowing whose rule it is.

On the wire a load is a plain msgpack map (`to_wire`); the supervisor's
records hold it decoded (`from_wire`), and a malformed one is a `LoadError`.

The pool protocol (`RESIZE`, a request any pool actor may implement):

    body  {"num_workers": n, "cpu_ids": [core, ...]}   cpu_ids: optional; the cores the
          scheduler now reserves for it (re-pin before starting workers)
    reply {"num_workers": applied, "previous": before}

`ResizeRequest.from_wire(body)` checks a body and says what is wrong with it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NoReturn, Union

from .errors import LoadError
from .messages import MessageKind
from .record import Record

Figure = Union[int, float, str, bool, None]
_COUNTS = ("in_flight", "served", "rejected")
_POOL = ("queued", "running", "workers")


@dataclass(frozen=True, slots=True)
class Load(Record):
    """What an actor reports with each heartbeat (`Actor.load()`).

    Invariants (checked on construction): every count is an int >= 0; queued,
    running and workers are None (not reported) or an int >= 0; figures maps
    str to int, float, str, bool or None."""

    in_flight: int = 0                 # handlers running now (the inbox's count)
    served: int = 0                    # messages answered since start
    rejected: int = 0                  # malformed or unknown messages refused since start
    queued: int | None = None          # work waiting to start (None: does not say)
    running: int | None = None         # work started and not finished
    workers: int | None = None         # work it can run at once; set only by a pool (handles RESIZE)
    backpressure: str | None = None    # why it holds back new work now; "" when it does not
    figures: dict[str, Any] = field(default_factory=dict)   # the actor's own numbers (Figure values)

    def fail_field(self, name: str, value: Any, rule: str) -> NoReturn:
        raise LoadError(f"load.{name} must be {rule}, got {value!r}")

    def _check(self) -> None:
        for name in _COUNTS:
            _check_count(name, getattr(self, name), optional=False)
        for name in _POOL:
            _check_count(name, getattr(self, name), optional=True)
        for key, value in self.figures.items():
            if not isinstance(value, (int, float, str, bool, type(None))):
                raise LoadError(f"load.figures[{key!r}] = {value!r}: keys must be str and values int, "
                                "float, str, bool or None (what msgpack and Prometheus carry)")

    @property
    def is_pool(self) -> bool:
        """It reports workers, so it handles RESIZE."""
        return self.workers is not None

    def replace(self, **changes: Any) -> "Load":
        """A copy with `changes` applied (and checked): how a subclass extends `super().load()`."""
        return dataclasses.replace(self, **changes)

    def to_wire(self) -> dict[str, Any]:
        """A msgpack- and JSON-friendly map; the fields left unset (None, empty) are left out."""
        wire = Record.to_wire(self)   # (slots dataclasses cannot use super())
        if not self.figures:
            wire.pop("figures")
        return wire

    @classmethod
    def from_wire(cls, data: Any) -> "Load":
        """The Load a heartbeat carried; LoadError naming what is wrong otherwise."""
        if isinstance(data, dict):
            unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise LoadError(f"a heartbeat's load has unknown fields {unknown}; an actor's own "
                                "numbers belong in load.figures")
        return Record.from_wire.__func__(cls, data)   # type: ignore[attr-defined, no-any-return]


@dataclass(frozen=True, slots=True)
class ResizeRequest(Record):
    """The body of RESIZE: the pool's new size and, optionally, the cores it now has."""

    num_workers: int
    cpu_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise LoadError(f"resize needs an int num_workers >= 1, got {self.num_workers!r}; "
                            "fix: send {'num_workers': 2}")
        object.__setattr__(self, "cpu_ids", [int(c) for c in self.cpu_ids])
        Record.__post_init__(self)


@dataclass(frozen=True, slots=True)
class ResizeReply(Record):
    """The reply to RESIZE: the pool's new worker count and the one before."""

    num_workers: int
    previous: int


# The pool protocol: the head's balancer resizes a pool actor.
RESIZE = MessageKind("resize", ResizeRequest, ResizeReply)


def _check_count(name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        what = "an int >= 0" + (" or None" if optional else "")
        raise LoadError(f"load.{name} must be {what}, got {value!r}")
