"""A mixture's task shares per batch: fixed by the weights, or following the learning signal.

    task_weights = "signal"     # the orchestrator's options; "fixed" (the default): the weights
    min_task_share = 0.05

With "signal", tasks whose groups carry a learning signal get more groups. After each trained
step, each task's signal is updated from that step's groups of it: the fraction of them whose
rewards are not all equal (a group of equal rewards has advantage 0 everywhere and teaches
nothing), as an exponential moving average (SIGNAL_DECAY; every task starts at 1). A task's
share is then its weight times its signal (plus SIGNAL_FLOOR, so a task at 0 can come back),
normalised, with every share raised to at least `min_task_share` (the others scaled down to
make room): no task starves, and a task that stops teaching is still sampled and measured.

Determinism (design note). Batch b's shares are those after batch b - 1 - max_staleness was
trained: exactly the batch the admission rule waits for before b may start (admission.py),
so the shares a batch draws with do not depend on timing, and batch b's prompts are a function
of (seed, b, the rewards of the batches before it). A checkpoint holds the signals and the
shares of the batches that later ones draw with (`state_dict`), so a resumed run draws its
batches again with the same shares. Each step writes a `task_weights` metrics row: the step,
each task's `share_<task>` (of the next batch to draw with them) and `signal_<task>`.
"""
from __future__ import annotations

from typing import Any

from ..tasks import TaskMixture
from .scored_sample import ScoredSample

SIGNAL_DECAY = 0.7      # weight of the previous signal in the moving average
SIGNAL_FLOOR = 0.05     # added to every signal, so a task whose signal reached 0 keeps a share to come back


def with_floor(shares: list[float], floor: float) -> list[float]:
    """`shares` (summing to 1) with each at least `floor`, the others scaled down to make room;
    sums to 1. Requires floor * len(shares) <= 1."""
    fixed = [False] * len(shares)
    out = list(shares)
    while True:
        free = sum(1.0 for f in fixed if not f)
        room = 1.0 - floor * (len(shares) - free)
        total = sum(s for s, f in zip(shares, fixed) if not f)
        out = [floor if f else room * s / total for s, f in zip(shares, fixed)]
        low = [i for i, s in enumerate(out) if not fixed[i] and s < floor]
        if not low:
            return out
        for i in low:
            fixed[i] = True


class TaskWeights:
    """The shares each batch draws its groups' tasks with (module docstring)."""

    def __init__(self, mixture: TaskMixture, mode: str = "fixed", min_share: float = 0.0,
                 max_staleness: int = 0):
        assert mode in ("fixed", "signal"), mode
        self.mixture = mixture
        self.mode = mode
        self.min_share = min_share
        self.max_staleness = max_staleness
        self.signals = {name: 1.0 for name in mixture.names}   # the moving averages, each in [0, 1]
        self.initial = self._shares()   # before any batch was trained: the weights, floored
        # shares after batch k was trained (k -> shares), the last max_staleness + 1 of them
        self.after: dict[int, list[float]] = {}

    @property
    def follows_signal(self) -> bool:
        return self.mode == "signal" and not self.mixture.is_single

    def shares_for(self, batch: int) -> list[float]:
        """The shares batch `batch` draws with: after batch - 1 - max_staleness (the weights before any)."""
        if not self.follows_signal:
            return self.mixture.shares
        trained = batch - 1 - self.max_staleness
        return self.initial if trained < 0 else self.after[trained]   # the admission rule: it is trained

    def update(self, batch: int, groups: list[list[ScoredSample]], reward) -> dict[str, float] | None:
        """Batch `batch` is trained with `groups` (`reward(sample)`: the reward it trained on):
        the signals and the shares after it; returns the metrics row's figures (None: fixed)."""
        if not self.follows_signal:
            return None
        for name in self.mixture.names:
            mine = [[reward(s) for s in group] for group in groups if group and group[0].task == name]
            if mine:
                teaching = sum(max(r) != min(r) for r in mine) / len(mine)
                self.signals[name] = SIGNAL_DECAY * self.signals[name] + (1 - SIGNAL_DECAY) * teaching
        self.after[batch] = self._shares()
        for old in [k for k in self.after if k < batch - self.max_staleness]:
            del self.after[old]
        return {**{f"share_{name}": round(share, 4) for name, share in zip(self.mixture.names, self.after[batch])},
                **{f"signal_{name}": round(value, 4) for name, value in self.signals.items()}}

    def _shares(self) -> list[float]:
        raw = [share * (self.signals[name] + SIGNAL_FLOOR)
               for name, share in zip(self.mixture.names, self.mixture.shares)]
        total = sum(raw)
        return with_floor([r / total for r in raw], self.min_share)

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps (None: nothing to keep)."""
        if not self.follows_signal:
            return None
        return {"signals": dict(self.signals), "after": {str(k): v for k, v in self.after.items()}}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state or not self.follows_signal:
            return
        self.signals.update(state["signals"])
        self.after = {int(k): list(v) for k, v in state["after"].items()}
