"""What `postrain up` shows while a run goes: a live terminal view, or plain lines.

The head keeps one `RunSnapshot`: the driver's latest figures (its `run` stream
sends `{"figures": {...}}` once per training step), the supervisor's status
(every actor's state, pid, restarts, heartbeat age and load) and the last
progress line. A view turns snapshots into output:

- `LiveView` redraws one rich frame in place below the scrolling progress
  lines (step, reward, KL, tokens/s, staleness, queue depths, sync time,
  an actors table);
- `PlainView` prints each progress line as it comes (`--quiet`, or stdout
  is not a terminal: logs, CI, pipes).

`make_view(quiet)` picks one. `render_frame(snapshot)` is the frame itself, a
pure function of the snapshot (tests render it into a string).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import IO

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

# Queue depths a view and the exporter show: name -> the heartbeat load key that reports it
# (summed over actors). The driver's step figures stand in for a depth no actor reports.
QUEUE_LOAD_KEYS: dict[str, str] = {
    "prompts_waiting": "prompts_waiting",        # orchestrator: rollouts waiting for a slot
    "rollouts_in_flight": "rollouts_in_flight",  # orchestrator: rollouts running
    "rollout_buffer": "buffer_samples",          # orchestrator: samples admitted, not yet trained
    "sandbox_queue": "sandbox_queued",           # sandbox actors: tool calls waiting for a worker
    "generator_waiting": "gen_waiting",          # generators: requests waiting for a batch slot
}


@dataclass
class RunSnapshot:
    """The head's picture of a run. Only the head's event loop changes it."""

    run_name: str
    started: float = field(default_factory=time.time)
    figures: dict = field(default_factory=dict)       # the driver's latest figures, merged step over step
    status: dict | None = None                        # Supervisor.status(), refreshed every tick
    last_line: str = ""                               # the driver's latest progress line

    def add_figures(self, figures: dict) -> None:
        self.figures.update(figures)


def queue_depths(snapshot: RunSnapshot) -> dict[str, float]:
    """Each queue depth that something reports: heartbeat loads first (fresh), else the driver's
    last step figures. A depth nobody reports is absent, not zero."""
    actors = (snapshot.status or {}).get("actors", [])
    depths = {}
    for name, load_key in QUEUE_LOAD_KEYS.items():
        values = [actor["load"][load_key] for actor in actors
                  if isinstance((actor.get("load") or {}).get(load_key), (int, float))]
        if values:
            depths[name] = sum(values)
        elif isinstance(snapshot.figures.get(name), (int, float)):
            depths[name] = snapshot.figures[name]
    return depths


def _number(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}f}"
    return str(value)


def _training_table(figures: dict) -> Table:
    """Two figures per row, so the frame fits a small terminal."""
    table = Table(title="training", title_justify="left", show_header=False, box=None, padding=(0, 1))
    step = figures.get("step")
    num_steps = figures.get("num_steps")
    step_text = "-" if step is None else f"{step}/{num_steps}" if num_steps else str(step)
    pairs = [("step", step_text), ("policy version", _number(figures.get("policy_version"), 0)),
             ("reward", _number(figures.get("reward_mean"), 3)), ("correct", _number(figures.get("correct_mean"), 3)),
             ("loss", _number(figures.get("loss"), 4)), ("KL", _number(figures.get("kl"), 4)),
             ("tokens/s", _number(figures.get("tokens_per_s"), 0)), ("sync s", _number(figures.get("sync_s"), 2)),
             ("staleness max", _number(figures.get("staleness_max"), 0)),
             ("staleness mean", _number(figures.get("staleness_mean"), 2))]
    for left, right in zip(pairs[::2], pairs[1::2]):
        table.add_row(left[0], left[1], " ", right[0], right[1])
    return table


def _queue_table(snapshot: RunSnapshot) -> Table:
    table = Table(title="queues", title_justify="left", show_header=False, box=None, padding=(0, 1))
    depths = queue_depths(snapshot)
    for name in QUEUE_LOAD_KEYS:
        table.add_row(name.replace("_", " "), _number(depths.get(name), 0))
    return table


def _load_text(load: dict) -> str:
    return " ".join(f"{key}={_number(value, 2)}" for key, value in sorted((load or {}).items()))


def _actors_table(status: dict | None) -> Table:
    table = Table(title="actors", title_justify="left", expand=False, box=box.SIMPLE_HEAD)
    for column in ("actor", "state", "pid", "restarts", "heartbeat s", "load"):
        table.add_column(column, overflow="fold")
    for actor in (status or {}).get("actors", []):
        state = actor["state"]
        style = "green" if state == "running" else "yellow" if state in ("starting", "restarting") else "red"
        age = actor.get("heartbeat_age_s")
        table.add_row(actor["name"], Text(state, style=style), str(actor.get("pid") or "-"),
                      str(actor.get("restarts", 0)), "-" if age is None else f"{age:.1f}",
                      _load_text(actor.get("load")))
    return table


def render_frame(snapshot: RunSnapshot, now: float | None = None) -> Group:
    """One frame of the live view: a header with the latest progress line, training figures and
    queues side by side, and the actors table."""
    elapsed_s = (now if now is not None else time.time()) - snapshot.started
    header = Text(f"postrain up: {snapshot.run_name}   {int(elapsed_s // 60)}m{int(elapsed_s % 60):02d}s",
                  style="bold")
    figures_row = Table.grid(padding=(0, 4))
    figures_row.add_row(_training_table(snapshot.figures), _queue_table(snapshot))
    last_line = Text(snapshot.last_line or "(no progress yet)", style="dim")
    return Group(header, last_line, figures_row, _actors_table(snapshot.status))


class PlainView:
    """Progress lines as plain text, one per line, as they come (the `--quiet` output)."""

    def __init__(self, stream: IO[str] | None = None):
        self.stream = stream or sys.stdout

    def __enter__(self) -> "PlainView":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def line(self, text: str, snapshot: RunSnapshot) -> None:
        print(text, file=self.stream, flush=True)

    def refresh(self, snapshot: RunSnapshot) -> None:
        """Plain output shows lines only; figures and status go to metrics and the exporter."""


class LiveView:
    """A rich frame redrawn in place on each line, figures item and tick. Redraws happen on the
    caller's thread (no refresh thread), so a snapshot is never read while it changes."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console()
        self._live: Live | None = None
        self._last: RunSnapshot | None = None

    def __enter__(self) -> "LiveView":
        self._live = Live(console=self.console, auto_refresh=False, transient=False, redirect_stdout=True,
                          redirect_stderr=False)
        self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            if self._last is not None:
                self._live.update(render_frame(self._last), refresh=True)
            self._live.__exit__(*exc)
            self._live = None

    def line(self, text: str, snapshot: RunSnapshot) -> None:
        """The line scrolls above the frame (the full history stays in the terminal)."""
        self.console.print(text, markup=False, highlight=False)
        self.refresh(snapshot)

    def refresh(self, snapshot: RunSnapshot) -> None:
        self._last = snapshot
        if self._live is not None:
            self._live.update(render_frame(snapshot), refresh=True)


def make_view(quiet: bool, stream: IO[str] | None = None) -> PlainView | LiveView:
    """The live view on a terminal; plain lines with `quiet` or when the stream is not a TTY."""
    stream = stream or sys.stdout
    if quiet or not stream.isatty():
        return PlainView(stream)
    return LiveView(Console(file=stream))
