"""`run`, `stop`: the head drives a run on the orchestrator, and follows it (the `run` stream's
items); `RunState`: the orchestrator's part of a checkpoint (actors/orchestrator/run_state.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from postrain.core.messages import MessageKind
from postrain.core.record import Record

RUN_STATE_FORMAT = "postrain-run-1"
RUN_PHASES = ("sft", "rl", "done")


@dataclass(frozen=True, slots=True)
class RunRequest(Record):
    """The orchestrator's `run`: the run folder, and whether to resume from its checkpoint."""

    run_folder: str
    resume: bool = False


@dataclass(frozen=True, slots=True)
class RunUpdate(Record):
    """One item of the orchestrator's `run` stream: exactly one of `line` (a line of progress),
    `figures` (one per RL step: the train metrics row plus num_steps and the sample counts; and
    a phase's progress: phase, phase_done, phase_total, phase_elapsed_s, phase_eta_s; for the
    head's live view and exporters) or `summary` (the last item: the run's summary.json)."""

    line: str | None = None
    figures: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None

    def _check(self) -> None:
        given = [name for name in ("line", "figures", "summary") if getattr(self, name) is not None]
        if len(given) != 1:
            self.fail_field("line", self.line, f"given alone: one of line, figures, summary (got {given or 'none'})")


@dataclass(frozen=True, slots=True)
class StopRun(Record):
    """The orchestrator's `stop`: finish the step in progress, then evaluate and write the summary.
    Its reply says whether a run was under way (one started later stops at once too)."""

    running: bool


@dataclass(frozen=True, slots=True)
class RunState(Record):
    """The orchestrator's part of a learner checkpoint (its `extra`): what a resumed run continues
    from. Written between two train (or warm-start) steps; the fields are described in
    actors/orchestrator/run_state.py. `sft_step` and `sft_shape` are absent from checkpoints written before
    the warm start checkpointed (None: the warm start is done)."""

    phase: str
    next_batch: int
    evals: dict[str, float]
    ledger: dict[str, Any]
    ledger_events_offset: int
    metrics_offset: int
    data_order: dict[str, Any]
    sft_step: int | None = None
    sft_shape: dict[str, int] | None = None
    samples_offset: int | None = None   # bytes of samples.jsonl; None: a checkpoint from before it
    task_weights: dict[str, Any] | None = None   # a mixture's shares that follow the signal (task_weights.py)
    format: str = RUN_STATE_FORMAT

    def _check(self) -> None:
        if self.format != RUN_STATE_FORMAT:
            self.fail_field("format", self.format, repr(RUN_STATE_FORMAT))
        if self.phase not in RUN_PHASES:
            self.fail_field("phase", self.phase, f"one of {RUN_PHASES}")
        if self.next_batch < 0 or self.ledger_events_offset < 0 or self.metrics_offset < 0:
            self.fail_field("next_batch", self.next_batch, ">= 0, with the file offsets >= 0")
        if self.phase == "sft" and self.sft_step is None:
            self.fail_field("sft_step", None, "given in phase 'sft' (the SFT steps trained)")


# The orchestrator's messages (actors/orchestrator/actor.py): the head starts and stops the run.
RUN = MessageKind("run", RunRequest, RunUpdate, stream=True)
STOP_RUN = MessageKind("stop", None, StopRun)
