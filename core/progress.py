"""Progress of a phase of a run (a fixed number of steps or episodes): done / total, elapsed, ETA.

    progress = PhaseProgress("training", total=250, report=figures_to_head)
    progress.advance()                   # one step (or episode) done
    progress.text()                      # "11/250, 0:12 elapsed, ETA 4:20"

The estimate is the rate of this start of the phase: ETA = elapsed / done_here * left, where
done_here counts only what this process did (a resumed phase starts at `done` > 0 and does
not credit the steps before it to the first seconds). Before anything is done there is no
ETA ("ETA ?"). Each advance also reports the head's live-view figures (`figures()`: phase,
phase_done, phase_total, phase_elapsed_s, phase_eta_s, phase_started, phase_updated), at most
every `report_interval_s` seconds and always on the last one. Tests pass their own `clock`.
"""
from __future__ import annotations

import time
from typing import Callable


def format_duration(seconds: float | None) -> str:
    """`m:ss` (or `h:mm:ss`); `?` for an unknown duration."""
    if seconds is None:
        return "?"
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def eta_seconds(done_here: int, left: int, elapsed_s: float) -> float | None:
    """Seconds left at the rate so far; None before anything is done; 0 when nothing is left."""
    if left <= 0:
        return 0.0
    if done_here <= 0:
        return None
    return elapsed_s / done_here * left


class PhaseProgress:
    """One phase's count of done work against its total (module docstring)."""

    def __init__(self, phase: str, total: int, report: Callable[[dict[str, object]], None] | None = None,
                 done: int = 0, clock: Callable[[], float] = time.monotonic, report_interval_s: float = 1.0):
        self.phase = phase
        self.total = total                   # work in the phase (steps, episodes); >= 0
        self.done = done                     # invariant: start_done <= done (<= total, unless over-counted)
        self.start_done = done               # done when this start of the phase began
        self.clock = clock
        self.started = clock()
        self.started_wall = time.time()
        self.report = report
        self.report_interval_s = report_interval_s
        self._last_report: float | None = None

    def elapsed_s(self) -> float:
        return self.clock() - self.started

    def eta_s(self) -> float | None:
        return eta_seconds(self.done - self.start_done, self.total - self.done, self.elapsed_s())

    def advance(self, num: int = 1) -> None:
        self.done += num
        now = self.clock()
        last = self.done >= self.total
        if self.report is not None and (last or self._last_report is None
                                        or now - self._last_report >= self.report_interval_s):
            self._last_report = now
            self.report(self.figures())

    def text(self) -> str:
        """`done/total, elapsed, ETA` for a progress line."""
        return f"{self.done}/{self.total}, {self.timing_text()}"

    def timing_text(self) -> str:
        """`elapsed, ETA`, for a line that says done / total itself."""
        return f"{format_duration(self.elapsed_s())} elapsed, ETA {format_duration(self.eta_s())}"

    def figures(self) -> dict[str, object]:
        eta = self.eta_s()
        return {"phase": self.phase, "phase_done": self.done, "phase_total": self.total,
                "phase_elapsed_s": round(self.elapsed_s(), 1),
                "phase_eta_s": None if eta is None else round(eta, 1),
                "phase_started": round(self.started_wall, 3), "phase_updated": round(time.time(), 3)}
