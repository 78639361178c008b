"""What `postrain up` shows while a run goes: a live terminal view, or plain lines.

The head keeps one `RunSnapshot`: the driver's latest figures (its `run` stream
sends `{"figures": {...}}` once per training step), the supervisor's status
(every actor's state, pid, restarts, heartbeat age and load) and the last
progress line. A view turns snapshots into output:

- `LiveView` redraws one rich frame in place below the scrolling progress
  lines (the phase under way with done / total, elapsed and ETA; step, reward,
  KL, tokens/s, staleness, sync time, each actor's queue, an actors table);
- `PlainView` prints each progress line as it comes (`--quiet`, or stdout
  is not a terminal: logs, CI, pipes).

`make_view(quiet)` picks one. `render_frame(snapshot)` is the frame itself, a
pure function of the snapshot (tests render it into a string).

Queues are read from the generic figures of each actor's heartbeat load
(`postrain.core.Load`: queued, running, workers), so the view names no role;
an actor's own figures show in its row of the actors table.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import IO

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from postrain.core.progress import format_duration
from postrain.core.load import Load


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


def actor_loads(status: dict | None) -> dict[str, Load]:
    """Each actor's last heartbeat load, decoded (an actor with none yet is left out)."""
    return {actor["name"]: Load.from_wire(actor["load"])
            for actor in (status or {}).get("actors", []) if actor.get("load")}


def queue_depths(snapshot: RunSnapshot) -> dict[str, int]:
    """`NAME_queued` and `NAME_running` of every actor whose load reports them (a depth nobody
    reports is absent, not zero): fresh figures from the heartbeats, not the driver's steps."""
    depths = {}
    for name, load in actor_loads(snapshot.status).items():
        if load.queued is not None:
            depths[f"{name}_queued"] = load.queued
        if load.running is not None:
            depths[f"{name}_running"] = load.running
    return depths


def load_items(load: Load) -> list[tuple[str, object]]:
    """A load's figures in reading order: work (queued, running, workers), why it holds back,
    the inbox's counters, then the actor's own figures. Unreported ones are left out."""
    items = [(name, getattr(load, name)) for name in ("queued", "running", "workers")
             if getattr(load, name) is not None]
    if load.backpressure:
        items.append(("backpressure", load.backpressure))
    items += [("in_flight", load.in_flight), ("served", load.served), ("rejected", load.rejected)]
    return items + sorted(load.figures.items())


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
    """One row per actor that reports queued or running work: its queue, its running, its workers."""
    table = Table(title="queues", title_justify="left", box=None, padding=(0, 1))
    for column in ("actor", "queued", "running", "workers"):
        table.add_column(column, justify="left" if column == "actor" else "right")
    for name, load in actor_loads(snapshot.status).items():
        if load.queued is not None or load.running is not None:
            table.add_row(name, _number(load.queued, 0), _number(load.running, 0), _number(load.workers, 0))
    return table


def load_text(load: dict | None) -> str:
    """A heartbeat load (its wire map) as `key=value` words, in `load_items` order."""
    if not load:
        return "-"
    return " ".join(f"{key}={_number(value, 2)}" for key, value in load_items(Load.from_wire(load)))


def _actors_table(status: dict | None) -> Table:
    """Every actor's health; a run on a cluster adds the node each runs on."""
    table = Table(title="actors", title_justify="left", expand=False, box=box.SIMPLE_HEAD)
    on_cluster = "nodes" in (status or {})
    columns = ("actor", *(("node",) if on_cluster else ()), "state", "pid", "restarts", "heartbeat s", "load")
    for column in columns:
        table.add_column(column, overflow="fold")
    for actor in (status or {}).get("actors", []):
        state = actor["state"]
        style = "green" if state == "running" else "yellow" if state in ("starting", "restarting") else "red"
        age = actor.get("heartbeat_age_s")
        node = (actor.get("node", "head"),) if on_cluster else ()
        table.add_row(actor["name"], *node, Text(state, style=style), str(actor.get("pid") or "-"),
                      str(actor.get("restarts", 0)), "-" if age is None else f"{age:.1f}",
                      load_text(actor.get("load")))
    return table


def progress_text(figures: dict, now: float) -> str:
    """The phase under way (the driver's `phase*` figures, postrain.core.progress):
    `warm start 11/250  elapsed 0:12  ETA 4:20`, its clock running between the driver's updates
    (`now`: time.time()); "" before the driver reports a phase."""
    phase, done, total = figures.get("phase"), figures.get("phase_done"), figures.get("phase_total")
    if phase is None or done is None or total is None:
        return ""
    started, updated = figures.get("phase_started"), figures.get("phase_updated")
    elapsed = now - started if isinstance(started, (int, float)) else figures.get("phase_elapsed_s")
    eta = figures.get("phase_eta_s")
    if isinstance(eta, (int, float)) and isinstance(updated, (int, float)):
        eta = max(0.0, eta - (now - updated))
    return f"{phase} {done}/{total}  elapsed {format_duration(elapsed)}  ETA {format_duration(eta)}"


def render_frame(snapshot: RunSnapshot, now: float | None = None) -> Group:
    """One frame of the live view: a header with the latest progress line, training figures and
    queues side by side, and the actors table."""
    now = now if now is not None else time.time()
    elapsed_s = now - snapshot.started
    header = Text(f"postrain up: {snapshot.run_name}   {int(elapsed_s // 60)}m{int(elapsed_s % 60):02d}s",
                  style="bold")
    figures_row = Table.grid(padding=(0, 4))
    figures_row.add_row(_training_table(snapshot.figures), _queue_table(snapshot))
    last_line = Text(snapshot.last_line or "(no progress yet)", style="dim")
    phase = progress_text(snapshot.figures, now)
    parts: list[RenderableType] = [header, *([Text(phase, style="bold cyan")] if phase else []), last_line,
                                   figures_row]
    return Group(*parts, _actors_table(snapshot.status))


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
