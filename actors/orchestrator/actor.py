"""The orchestrator actor: the run's driver (`postrain up` follows its `run` stream).

    [[actors]]
    name = "orchestrator"
    cls = "postrain.actors.orchestrator:OrchestratorActor"
    options = { num_steps = 50, max_staleness = 1, sampling = { max_new_tokens = 64 } }   # options.py

Messages (records/run.py):
- `run` RunRequest {"run_folder", "resume"} -> a stream of RunUpdate items: {"line": str}
  (progress), {"figures": {...}} (one per RL step: the train metrics row plus num_steps and
  sample counts; and as each phase advances: phase, phase_done, phase_total, elapsed and ETA
  (progress.py); for the head's live view and exporter) and, last, {"summary": {...}};
- `stop` (no body) -> StopRun: the run finishes the step in progress, then evaluates and
  writes the summary.

A run stopped by a full disk ends the `run` stream with a RunStoppedError whose message is
one line (what was full, what to free, how to resume), as does one stopped by a broken
environment (the error, the user's line, in how many samples of which step: driver.py); any
other failure with its traceback.

The actor is thin: the run itself is a `RunDriver` (driver.py) made for each `run`, with
its parts (admission, rollout pool, train step, evaluation) in the modules beside it.
"""
from __future__ import annotations

import json
import math
import traceback
from pathlib import Path

import anyio

from postrain.core import Actor, Load, handler

from ..env.actor import load_tokenizer
from ..records import RUN, STOP_RUN, RunRequest, RunUpdate, StopRun
from .run_state import PromptSchedule, read_run_state
from ..tasks import TaskMixture
from .driver import RunDriver, RunStoppedError, open_run
from .options import OrchestratorOptions

# What the heartbeat load reports while no run has started (the balancer's figures).
IDLE_FIGURES = {"backpressure": "none", "num_trained": 0, "buffer_batches": 0, "buffer_samples": 0,
                "rollouts_in_flight": 0, "prompts_waiting": 0, "learner_idle_s": 0.0, "learner_busy_s": 0.0}


class OrchestratorActor(Actor):
    Options = OrchestratorOptions
    drives_work = True            # tells the head who works now (elastic cores: actors/orchestrator/work.py)

    async def setup(self):
        """The tasks (one, or a mixture), their prompt schedule and the tokenizer. Cancelled: the
        actor's start fails; nothing outside this process was changed."""
        options = self.options
        self.mixture = TaskMixture.of(options)
        self.schedule = PromptSchedule(self.mixture, options.seed, options.prompts_generated_per_step)
        self.tokenizer = load_tokenizer(options.model, options.chat_template)
        self.stop_requested = False          # set by `stop`; a run started later stops at once too
        self.driver: RunDriver | None = None  # the latest run (its figures stay after it ends)
        self.gone: dict[str, str] = {}       # actors gone for good (name -> reason): never used again

    def on_peers_gone(self, gone: dict[str, str]) -> None:
        """Actors gone for good leave the run's rotation (RunDriver.drop_actors), now and in a
        run started later. Atomic (it never awaits)."""
        self.gone.update(gone)
        if self.driver is not None:
            self.driver.drop_actors(gone)

    def load(self) -> Load:
        """The kernel's generic figures: rollouts waiting for a slot (queued) and running, why
        admission waits (backpressure, "" when it does not); the rest are the run's own figures."""
        figures = dict(self.driver.figures() if self.driver is not None else {
            **IDLE_FIGURES, "max_staleness": self.options.max_staleness})
        backpressure = figures.pop("backpressure", "none")
        return super().load().replace(
            queued=figures.pop("prompts_waiting", None), running=figures.pop("rollouts_in_flight", None),
            backpressure="" if backpressure == "none" else backpressure, figures=figures)

    @handler(STOP_RUN)
    async def stop(self, body: None) -> StopRun:
        """Finish the current step, then evaluate and write the summary. Atomic: it never awaits,
        so a cancellation cannot cut it in half."""
        self.stop_requested = True
        if self.driver is not None:
            self.driver.stop()
        return StopRun(running=self.driver is not None)

    # concurrent: a `stop` must not wait behind the run
    @handler(RUN, concurrent=True)
    async def run(self, request: RunRequest):
        """The run's items (module docstring). The run goes on in its own task (a stream handler
        must not yield from inside a task group); this handler relays what it reports.
        Cancelled: the relay ends; the run's task goes on until it finishes or fails."""
        send, receive = anyio.create_memory_object_stream[RunUpdate | Exception](math.inf)
        self.node.spawn(self._run_to_channel, Path(request.run_folder), request.resume, send)
        async with receive:
            async for item in receive:
                if isinstance(item, Exception):
                    raise item
                yield item

    async def _run_to_channel(self, folder: Path, resume: bool, send) -> None:
        """Run, reporting RunUpdates into `send`; an error becomes the stream's last item (the
        exception the stream raises: a RunStoppedError's one line, or any other with its
        traceback). Cancelled: the stream closes without a summary (see RunDriver.run for the files)."""
        async with send:
            try:
                await self._run(folder, resume, send.send_nowait)
            except RunStoppedError as exc:
                send.send_nowait(RunStoppedError(str(exc)))
            except Exception:
                send.send_nowait(RuntimeError(traceback.format_exc()))

    async def _run(self, folder: Path, resume: bool, report) -> None:
        """The whole run; with `resume`, from the run folder's checkpoint (driver.py).
        Cancelled: see RunDriver.run."""
        state = read_run_state(folder / "checkpoint") if resume else None
        if state is not None and state.phase == "done" and (folder / "summary.json").exists():
            report(RunUpdate(line=f"the run in {folder} already finished; its summary:"))
            report(RunUpdate(summary=json.loads((folder / "summary.json").read_text())))
            return
        self.driver = await open_run(options=self.options, mixture=self.mixture, schedule=self.schedule,
                                     tokenizer=self.tokenizer, folder=folder, state=state, resume=resume,
                                     lookup=self.lookup, report=report, head=self.head, gone=self.gone)
        if self.stop_requested:
            self.driver.stop()
        await self.driver.run()
