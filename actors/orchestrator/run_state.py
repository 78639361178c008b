"""A run's data order and the orchestrator's part of a checkpoint: what a resumed run continues from.

Data order. Batch b's prompts are items [b * P, (b + 1) * P) of the task's training
stream for the run's seed (P = prompts_per_step): a function of (seed, b) alone, so a
resumed run gives batch b exactly the prompts it had before the kill. Sample ids name
batch, group and sample, and the resume that created them (`b3-g0-s1` in the first
start, `b3-g0-s1.r2` after the second resume), so an id is never reused, not even by a
batch that is created again.

Run state: a `RunState` record (records/run.py), the learner checkpoint's `extra`
(actors/learner/state.py) in its wire form, written by the orchestrator between two train
(or warm-start) steps; the same dict shape as before the record, so older checkpoints load.
Fields:

    format            RUN_STATE_FORMAT
    phase             "sft": the warm start is under way: SFT steps 0..sft_step-1 are trained
                      (the first evaluation is done); "rl": batches next_batch.. remain
                      (evaluations and warm start are done); "done": the run finished
                      (final evaluation, policy export)
    sft_step          SFT steps trained so far (all of them once the phase is "rl")
    sft_shape         `sft_shape(options)`: sft_steps, sft_batch_size and (when set)
                      sft_distinct_demonstrations: the demonstrations step s trains on depend on
                      them; a resume in phase "sft" with other values is refused
    next_batch        the data cursor: batches 0..next_batch-1 are trained, each exactly once,
                      and the learner's weights hold exactly those updates
    evals             held-out accuracies so far ({"before": x, "after_sft": y})
    ledger            SampleLedger.state_dict() at the same moment
    ledger_events_offset, metrics_offset
                      bytes of ledger.jsonl and metrics.jsonl at that moment; a resumed run
                      moves what came later to *.rolled-back.jsonl (those steps are trained
                      again), so the files tell the history of the restored weights
    samples_offset    bytes of samples.jsonl (each RL sample's text) at that moment, cut back
                      the same way; absent (None) in checkpoints from before that file
    data_order        the knobs the data order depends on (task, task_options, seed, prompts_per_step,
                      samples_per_prompt; a mixture's tasks); a resume with other values is refused
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator

from postrain.core.errors import PostrainError
from postrain.core.jsonl import repair_torn_tail

from postrain.core.atomic_write import repair_interrupted_write
from ..records import RUN_STATE_FORMAT, RecordError, RunState
from ..tasks import MixtureTask

DATA_ORDER_KEYS = ("task", "seed", "prompts_per_step", "samples_per_prompt", "task_options", "tasks",
                   "task_weights", "min_task_share")
RESUMES_FILE = "resumes.jsonl"   # one line per `postrain up --resume`: when, from which batch


class ResumeError(PostrainError, ValueError):
    """A run folder that cannot be resumed as asked; the message says why and what to do."""


class PromptSchedule:
    """prompts(b): (task, task dict) of each group of batch b, the same for every call with the same
    (seed, b, shares). Group g's task is the mixture's draw for (seed, b, g) with the batch's
    shares, and its item is item b * P + g of that task's training stream (P: prompts_per_step;
    actors/tasks/mixture.py), so a run of one task takes items [b * P, (b + 1) * P) of its stream.

    Keeps one iterator per task, positioned after the last item taken; asking for an earlier
    batch starts the streams again (batches are asked for in order, so that is rare)."""

    def __init__(self, mixture, seed: int, prompts_per_step: int):
        self.mixture, self.seed = mixture, seed
        self.prompts_per_step = prompts_per_step
        self._streams: dict[str, Iterator[dict]] = {}
        self._positions: dict[str, int] = {}   # task -> index of the next item its stream yields
        self._next_batch = 0

    def prompts(self, batch: int, shares: list[float] | None = None) -> list[tuple[MixtureTask, dict]]:
        if batch < self._next_batch or not self._streams:
            self._streams = {t.name: t.spec.train_tasks(seed=self.seed, options=t.options)
                             for t in self.mixture.tasks}
            self._positions = {t.name: 0 for t in self.mixture.tasks}
        out = []
        for group in range(self.prompts_per_step):
            task = self.mixture.draw(self.seed, batch, group, shares)
            out.append((task, self._item(task.name, batch * self.prompts_per_step + group)))
        self._next_batch = batch + 1
        return out

    def _item(self, task: str, index: int) -> dict:
        """Item `index` of the task's stream (at or after its position)."""
        stream = self._streams[task]
        while self._positions[task] < index:
            next(stream)
            self._positions[task] += 1
        self._positions[task] += 1
        return next(stream)


def batch_sample_id(batch: int, group: int, sample: int, resume_index: int = 0) -> str:
    base = f"b{batch}-g{group}-s{sample}"
    return base if resume_index == 0 else f"{base}.r{resume_index}"


def data_order(cfg) -> dict:
    """The knobs the data order depends on, of the orchestrator's options (OrchestratorOptions or
    a dict of them), as plain JSON data."""
    values = cfg.model_dump(mode="json", include=set(DATA_ORDER_KEYS)) if hasattr(cfg, "model_dump") else cfg
    # a mixture's keys only where they matter: a run of one task has the keys it had before mixtures
    signal = bool(values.get("tasks")) and values.get("task_weights") == "signal"
    used = {"tasks": bool(values.get("tasks")), "task_weights": signal, "min_task_share": signal}
    return {key: values[key] for key in DATA_ORDER_KEYS if used.get(key, True)}


def read_run_state(checkpoint_dir: str | Path) -> RunState | None:
    """The run state in a learner checkpoint folder, or None when there is no checkpoint yet.
    A checkpoint write that a kill interrupted is repaired first (the previous one is put back)."""
    repair_interrupted_write(checkpoint_dir)
    path = Path(checkpoint_dir) / "state.json"
    if not path.exists():
        return None
    extra = json.loads(path.read_text()).get("extra") or {}
    if extra.get("format") != RUN_STATE_FORMAT:
        raise ResumeError(f"{checkpoint_dir} holds no run state (format {extra.get('format')!r}, expected "
                          f"{RUN_STATE_FORMAT!r}); it was not written by the orchestrator of a run that "
                          "can be resumed; start a new run instead")
    try:
        return RunState.from_wire(extra)
    except RecordError as exc:
        raise ResumeError(f"{checkpoint_dir} holds a run state that cannot be read ({exc}); start a new "
                          "run instead") from None


def check_same_data_order(state: RunState, cfg) -> None:
    saved, now = state.data_order, data_order(cfg)
    changed = {key: (saved.get(key), now.get(key)) for key in DATA_ORDER_KEYS if saved.get(key) != now.get(key)}
    if changed:
        detail = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changed.items())
        raise ResumeError(f"cannot resume: the data order changed ({detail}); batch b must get the same "
                          "prompts as before the restart; put the old values back or start a new run")


def sft_shape(cfg) -> dict:
    """What decides the demonstrations of SFT step s (the distinct count only where it is set,
    so a state saved before that option existed still matches)."""
    shape = {"sft_steps": cfg.sft_steps, "sft_batch_size": cfg.sft_batch_size}
    if cfg.sft_distinct_demonstrations:
        shape["sft_distinct_demonstrations"] = cfg.sft_distinct_demonstrations
    return shape


def check_same_sft_shape(state: RunState, cfg) -> None:
    """A resume inside the warm start must give SFT step s the same demonstrations."""
    saved = state.sft_shape or {}
    now = sft_shape(cfg)
    changed = {key: (saved.get(key), now.get(key)) for key in {**saved, **now} if saved.get(key) != now.get(key)}
    if state.phase == "sft" and changed:
        detail = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changed.items())
        raise ResumeError(f"cannot resume inside the warm start: its shape changed ({detail}); SFT step s "
                          "must train on the same demonstrations as before; put the old values back or "
                          "start a new run")


def repair_torn_lines(path: str | Path) -> str | None:
    """Cut a half-written last line (a process killed mid-write) off a JSONL file of the run;
    return the warning that names it, None when the file ends on a whole line."""
    torn = repair_torn_tail(path)
    if torn is None:
        return None
    offset, data = torn
    return (f"warning: {path} ended in a half-written line ({len(data)} bytes at offset {offset}: "
            f"{data[:60]!r}), left by a process stopped mid-write; cut it")


def cut_back(path: str | Path, offset: int) -> int:
    """Move everything after byte `offset` of `path` to the end of NAME.rolled-back.jsonl (a
    record, not history); return the number of bytes moved. A missing file counts as empty."""
    path = Path(path)
    if not path.exists() or path.stat().st_size <= offset:
        return 0
    with open(path, "rb+") as handle:
        handle.seek(offset)
        tail = handle.read()
        aside = path.with_name(path.name.removesuffix(".jsonl") + ".rolled-back.jsonl")
        with open(aside, "ab") as out:
            out.write(tail if tail.endswith(b"\n") else tail + b"\n")
            out.flush()
            os.fsync(out.fileno())
        handle.truncate(offset)
    return len(tail)


def note_resume(folder: str | Path, from_batch: int | None) -> int:
    """Append this resume to the run folder's record; return its index (1 for the first)."""
    path = Path(folder) / RESUMES_FILE
    previous = len(path.read_text().splitlines()) if path.exists() else 0
    with open(path, "a") as handle:
        handle.write(json.dumps({"time": time.time(), "resume": previous + 1, "from_batch": from_batch}) + "\n")
    return previous + 1
