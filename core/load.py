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
from typing import Any, Union

from .errors import LoadError

RESIZE = "resize"  # the message kind of the pool protocol

Figure = Union[int, float, str, bool, None]
_COUNTS = ("in_flight", "served", "rejected")
_POOL = ("queued", "running", "workers")


@dataclass(frozen=True, slots=True)
class Load:
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
    figures: dict[str, Figure] = field(default_factory=dict)   # the actor's own numbers

    def __post_init__(self):
        for name in _COUNTS:
            _check_count(name, getattr(self, name), optional=False)
        for name in _POOL:
            _check_count(name, getattr(self, name), optional=True)
        if self.backpressure is not None and not isinstance(self.backpressure, str):
            raise LoadError(f"load.backpressure must be a str or None, got {self.backpressure!r}")
        if not isinstance(self.figures, dict):
            raise LoadError(f"load.figures must be a dict of str to numbers or text, got "
                            f"{type(self.figures).__name__}")
        for key, value in self.figures.items():
            if not isinstance(key, str) or not isinstance(value, (int, float, str, bool, type(None))):
                raise LoadError(f"load.figures[{key!r}] = {value!r}: keys must be str and values int, "
                                "float, str, bool or None (what msgpack and Prometheus carry)")

    @property
    def is_pool(self) -> bool:
        """It reports workers, so it handles RESIZE."""
        return self.workers is not None

    def replace(self, **changes) -> "Load":
        """A copy with `changes` applied (and checked): how a subclass extends `super().load()`."""
        return dataclasses.replace(self, **changes)

    def to_wire(self) -> dict[str, Any]:
        """A msgpack- and JSON-friendly map; the fields left unset (None, empty) are left out."""
        wire = {name: getattr(self, name) for name in _COUNTS}
        for name in (*_POOL, "backpressure"):
            value = getattr(self, name)
            if value is not None:
                wire[name] = value
        if self.figures:
            wire["figures"] = dict(self.figures)
        return wire

    @classmethod
    def from_wire(cls, data: Any) -> "Load":
        """The Load a heartbeat carried; LoadError naming what is wrong otherwise."""
        if not isinstance(data, dict):
            raise LoadError(f"a heartbeat's load must be a map, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise LoadError(f"a heartbeat's load has unknown fields {unknown}; an actor's own "
                            "numbers belong in load.figures")
        return cls(**data)


@dataclass(frozen=True, slots=True)
class ResizeRequest:
    """The body of RESIZE: the pool's new size and, optionally, the cores it now has."""

    num_workers: int
    cpu_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise LoadError(f"resize needs an int num_workers >= 1, got {self.num_workers!r}; "
                            "fix: send {'num_workers': 2}")

    def to_wire(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "cpu_ids": list(self.cpu_ids)}

    @classmethod
    def from_wire(cls, body: Any) -> "ResizeRequest":
        if not isinstance(body, dict):
            raise LoadError(f"a resize body must be a map {{'num_workers': n}}, got {type(body).__name__}")
        unknown = sorted(set(body) - {"num_workers", "cpu_ids"})
        if unknown:
            raise LoadError(f"a resize body has unknown fields {unknown}; it takes num_workers and cpu_ids")
        return cls(body.get("num_workers"), tuple(int(c) for c in body.get("cpu_ids") or ()))



@dataclass(frozen=True, slots=True)
class ResizeReply:
    """The reply to RESIZE: the pool's new worker count and the one before."""

    num_workers: int
    previous: int

    def to_wire(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "previous": self.previous}

    @classmethod
    def from_wire(cls, body: Any) -> "ResizeReply":
        return cls(int(body["num_workers"]), int(body["previous"]))

def _check_count(name: str, value, *, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        what = "an int >= 0" + (" or None" if optional else "")
        raise LoadError(f"load.{name} must be {what}, got {value!r}")
