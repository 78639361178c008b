"""Experiment trackers: the rows of a run's metrics.jsonl, mirrored to W&B, MLflow or trackio.

    [tracking]
    backends = ["mlflow"]          # any of "wandb", "mlflow", "trackio"; none by default
    project = "postrain"

`postrain up` opens each backend before the first actor starts (a backend that is not installed
is an error naming the extra to install: `pip install 'postrain[mlflow]'`), logs the run's config
as the run's parameters, then follows RUN_FOLDER/metrics.jsonl from a thread of the head: every
row any writer appends (config, eval, train, sync, queue, balance, ...) is logged to every backend
as the figures `KIND/NAME` (numbers only; a row's step is its `step` figure, else the count of
rows of its kind so far, as in TensorBoard). When the run ends, the rows left are logged, then
summary.json's numbers as `summary/NAME` (nested: `summary/ledger/trained`; W&B: its run summary;
MLflow also keeps the whole summary as the artifact summary.json), and the backend's run is closed.

Offline by default where the service may be unreachable: W&B runs in offline mode unless
WANDB_API_KEY is set or `offline = false` (sync later with `wandb sync RUN_FOLDER/wandb`); MLflow
writes to a local store in RUN_FOLDER/mlruns unless `mlflow_tracking_uri` (or
MLFLOW_TRACKING_URI) names a server; trackio writes its local database unless `trackio_space_id`
names a Space. A backend that fails while the run goes on is logged once and left out from then
on: a tracker never stops a run.

A resumed run logs to a new tracker run, from the first row of its metrics.jsonl (the file holds
the resumed run's whole history).

Samples. Every `samples_every_steps` RL steps (default 10; 0: none), and for the run's last
step, a table of that step's samples from RUN_FOLDER/samples.jsonl (sample id, group,
outcome, reward, advantage, prompt, completion, tool output; at most SAMPLE_TABLE_ROWS rows,
texts cut to SAMPLE_TABLE_CHARS) goes to each backend that keeps tables: W&B a `samples`
wandb.Table, MLflow the table artifact `samples/step_NNNNNN.json` (log_table), trackio a
trackio.Table where its version has one. Where tensorboard is installed the same table is a
TensorBoard text summary `samples` in RUN_FOLDER/tensorboard (markdown), with or without a
[tracking] backend. What TRL's and veRL's users look at to see what the model writes.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from postrain.actors.configs.run_config import TrackingSection
from postrain.core.errors import PostrainError
from postrain.core.metrics import open_tensorboard

if TYPE_CHECKING:
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

log = logging.getLogger("postrain.tracking")

SAMPLES_FILE = "samples.jsonl"   # postrain.actors.orchestrator.sample_log.SAMPLES_FILE
SAMPLE_TABLE_ROWS = 16           # rows of a samples table, at most
SAMPLE_TABLE_CHARS = 1000        # characters of a text in a samples table, at most
SAMPLE_COLUMNS = ("sample_id", "group", "outcome", "reward", "advantage", "prompt", "completion", "tool_output")


# --------------------------------------------------------------------------- rows -> figures
def row_figures(row: dict) -> dict[str, float]:
    """The numeric figures of a metrics row as `KIND/NAME` (booleans and strings left out)."""
    kind = row.get("kind", "row")
    return {f"{kind}/{name}": float(value) for name, value in row.items()
            if name not in ("time", "kind", "step") and isinstance(value, (int, float))
            and not isinstance(value, bool)}


def summary_figures(summary: dict, prefix: str = "summary/") -> dict[str, float]:
    """The numbers of a run's summary, nested ones too: `summary/ledger/trained` (names only:
    a table keyed by free text, such as the ledger's drop reasons, is left out)."""
    figures = {}
    for name, value in summary.items():
        if not name.isidentifier():
            continue
        if isinstance(value, dict):
            figures.update(summary_figures(value, f"{prefix}{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            figures[f"{prefix}{name}"] = float(value)
    return figures


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as `a.b.c` -> its value's text (MLflow parameters are flat strings)."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value):
                flat.update(flatten(item, f"{name}.{item.get('name', i)}."))
        else:
            flat[name] = json.dumps(value) if not isinstance(value, str) else value
    return flat


def _short(text: str, max_chars: int = SAMPLE_TABLE_CHARS) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + f" [... {len(text) - max_chars} more]"


def sample_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """(columns, data) of a samples table: one row per sample (at most SAMPLE_TABLE_ROWS), the
    turns' completions and tool outputs joined, each text cut to SAMPLE_TABLE_CHARS."""
    data = []
    for row in rows[:SAMPLE_TABLE_ROWS]:
        turns = row.get("turns") or []
        completion = "\n---\n".join(turn.get("completion", "") for turn in turns)
        tool_output = "\n---\n".join(turn.get("tool_output", "") for turn in turns if turn.get("tool_output"))
        data.append([row.get("sample_id"), row.get("group"), row.get("outcome"), row.get("reward"),
                     row.get("advantage"), _short(row.get("prompt", "")), _short(completion), _short(tool_output)])
    return list(SAMPLE_COLUMNS), data


def markdown_table(columns: list[str], data: list[list]) -> str:
    """A samples table as markdown (TensorBoard's text plugin renders it)."""
    def cell(value) -> str:
        text = f"{value:.3f}" if isinstance(value, float) else "" if value is None else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in values) + " |" for values in data]
    return "\n".join(lines)


# --------------------------------------------------------------------------- backends
class WandbTracker:
    def __init__(self, section: TrackingSection, folder: Path, name: str, config: dict) -> None:
        import wandb
        offline = section.offline if section.offline is not None else not os.environ.get("WANDB_API_KEY")
        self.run = wandb.init(project=section.project, name=name, dir=str(folder), config=config,
                              mode="offline" if offline else "online", reinit="create_new")

    def log(self, figures: dict[str, float], kind: str, step: int) -> None:
        self.run.log({**figures, f"{kind}/step": step})

    def log_samples(self, columns: list[str], data: list[list], step: int) -> None:
        import wandb
        self.run.log({"samples": wandb.Table(columns=columns, data=data), "samples/step": step})

    def finish(self, summary: dict | None) -> None:
        if summary:
            self.run.summary.update(summary)
        self.run.finish()


class MlflowTracker:
    def __init__(self, section: TrackingSection, folder: Path, name: str, config: dict) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        uri = section.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:   # a local file store: needs no database package (MLflow 3 asks for the opt-in)
            uri = (folder / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(section.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(section.project)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(k, v[:6000]) for k, v in flatten(config).items()]
        for start in range(0, len(params), 100):   # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, figures: dict[str, float], kind: str, step: int) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in figures.items()])

    def log_samples(self, columns: list[str], data: list[list], step: int) -> None:
        table = {column: [values[i] for values in data] for i, column in enumerate(columns)}
        name = f"samples/step_{step:06d}.json"
        try:
            self.client.log_table(self.run_id, data=table, artifact_file=name)
        except ImportError:   # log_table needs pandas; the same columns as a JSON artifact
            self.client.log_dict(self.run_id, table, name)

    def finish(self, summary: dict | None) -> None:
        if summary:
            self.log(summary_figures(summary), "summary", 0)
            self.client.log_dict(self.run_id, summary, "summary.json")
        self.client.set_terminated(self.run_id)


class TrackioTracker:
    def __init__(self, section: TrackingSection, folder: Path, name: str, config: dict) -> None:
        import trackio
        self.trackio = trackio
        self.run = trackio.init(project=section.project, name=name, config=config,
                                space_id=section.trackio_space_id)

    def log(self, figures: dict[str, float], kind: str, step: int) -> None:
        self.trackio.log({**figures, f"{kind}/step": step})

    def log_samples(self, columns: list[str], data: list[list], step: int) -> None:
        table = getattr(self.trackio, "Table", None)
        if table is not None:   # trackio versions without tables get none
            self.trackio.log({"samples": table(columns=columns, data=data), "samples/step": step})

    def finish(self, summary: dict | None) -> None:
        if summary:
            self.trackio.log(summary_figures(summary))
        self.trackio.finish()


_CLASSES = {"wandb": WandbTracker, "mlflow": MlflowTracker, "trackio": TrackioTracker}


class TensorBoardSamples:
    """Samples tables as TensorBoard text summaries in RUN_FOLDER/tensorboard, where tensorboard
    is installed (else nothing, without a word, as for the scalars); opened at the first table."""

    def __init__(self, folder: Path) -> None:
        self.log_dir = Path(folder) / "tensorboard"
        self._writer: EventFileWriter | None = None   # opened at the first table
        self.available = True

    def log_samples(self, columns: list[str], data: list[list], step: int) -> None:
        if self._writer is None:
            self._writer = open_tensorboard(self.log_dir)
            if self._writer is None:
                self.available = False
                return
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.plugins.text.summary_v2 import text_pb

        summary = text_pb("samples", markdown_table(columns, data))
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()

    def finish(self, summary: dict | None) -> None:
        if self._writer is not None:
            self._writer.close()


# --------------------------------------------------------------------------- following the run
class RunTracking:
    """The trackers of one run and the thread that feeds them metrics.jsonl's rows.

        with RunTracking(folder, config.tracking, name, config_dict).start():
            ...   # the run; rows reach the trackers every interval_s
        # on exit: the last rows, the summary, each tracker's run closed

    Invariant: `offset` is the byte just after the last whole line sent (a line still being
    written waits for the next poll). Only the feeding thread calls the trackers while it runs;
    `__exit__` joins it before the final rows and the summary."""

    def __init__(self, folder: Path, section: TrackingSection, name: str, config: dict) -> None:
        self.folder, self.section, self.name, self.config = Path(folder), section, name, config
        self.trackers: dict[str, object] = {}
        self.offset = 0
        self.rows_per_kind: Counter = Counter()
        self.num_rows = 0
        self.samples_offset = 0                  # as `offset`, in samples.jsonl
        self.pending_samples: dict[int, list[dict]] = {}   # step -> its rows read so far (not yet sent)
        self.num_sample_tables = 0               # tables sent (per step, to all sinks)
        self.samples_tensorboard: TensorBoardSamples | None = (
            TensorBoardSamples(self.folder) if section.samples_every_steps else None)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "RunTracking":
        """Open every backend; PostrainError names one that is not installed or will not open."""
        for backend in self.section.backends:
            try:
                self.trackers[backend] = _CLASSES[backend](self.section, self.folder, self.name, self.config)
            except ImportError as exc:
                raise PostrainError(f"[tracking] backend {backend!r} is not installed ({exc}); fix: "
                                    f"pip install 'postrain[{backend}]'") from None
            except Exception as exc:  # noqa: BLE001 - a tracker's own error, named
                raise PostrainError(f"[tracking] backend {backend!r} did not open: "
                                    f"{type(exc).__name__}: {exc}") from None
        if self.trackers or self.samples_tensorboard is not None:
            self._thread = threading.Thread(target=self._follow, name="tracking", daemon=True)
            self._thread.start()
        return self

    def __enter__(self) -> "RunTracking":
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self.poll_samples(final=True)
        if self.samples_tensorboard is not None:
            self.samples_tensorboard.finish(None)
        if not self.trackers:
            return
        self.poll()
        summary_path = self.folder / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        for backend in list(self.trackers):
            self._call(backend, "finish", summary)

    def _follow(self) -> None:
        while not self._stop.wait(self.section.interval_s):
            if self.trackers:
                self.poll()
            self.poll_samples()

    def poll(self) -> int:
        """Send the whole rows appended since the last poll; the number sent."""
        rows, self.offset = _new_rows(self.folder / "metrics.jsonl", self.offset)
        for row in rows:
            self.send(row)
        return len(rows)

    def poll_samples(self, final: bool = False) -> int:
        """Read the samples.jsonl lines appended since the last poll and send a table for each
        step that is complete (a later step's line came, or `final`) and due (a multiple of
        `samples_every_steps`, or the last step at the end); the number of tables sent."""
        every = self.section.samples_every_steps
        if not every:
            return 0
        rows, self.samples_offset = _new_rows(self.folder / SAMPLES_FILE, self.samples_offset)
        for row in rows:
            if isinstance(row.get("step"), int):
                self.pending_samples.setdefault(row["step"], []).append(row)
        if not self.pending_samples:
            return 0
        last = max(self.pending_samples)
        sent = 0
        for step in sorted(self.pending_samples):
            if step == last and not final:
                break   # its lines may still be coming
            rows = self.pending_samples.pop(step)
            if step % every == 0 or (final and step == last):
                self.send_samples(step, rows)
                sent += 1
        return sent

    def send_samples(self, step: int, rows: list[dict]) -> None:
        """One step's samples table to every backend that keeps tables, and to TensorBoard."""
        columns, data = sample_table(rows)
        for backend in list(self.trackers):
            if hasattr(self.trackers[backend], "log_samples"):
                self._call(backend, "log_samples", columns, data, step)
        if self.samples_tensorboard is not None:
            try:
                self.samples_tensorboard.log_samples(columns, data, step)
            except Exception as exc:  # noqa: BLE001 - like a tracker: never stops the run
                log.warning("TensorBoard samples table failed (%s: %s); no more tables there",
                            type(exc).__name__, exc)
                self.samples_tensorboard = None
        self.num_sample_tables += 1

    def send(self, row: dict) -> None:
        kind = row.get("kind", "row")
        self.rows_per_kind[kind] += 1
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            step = self.rows_per_kind[kind]
        figures = row_figures(row)
        if figures:
            for backend in list(self.trackers):
                self._call(backend, "log", figures, kind, step)
        self.num_rows += 1

    def _call(self, backend: str, method: str, *args) -> None:
        """One tracker call; a failure drops that tracker for the rest of the run, with one warning."""
        try:
            getattr(self.trackers[backend], method)(*args)
        except Exception as exc:  # noqa: BLE001 - a tracker must never stop the run
            log.warning("tracking backend %s failed (%s: %s); it is left out for the rest of the run",
                        backend, type(exc).__name__, exc)
            self.trackers.pop(backend, None)


def _new_rows(path: Path, offset: int) -> tuple[list[dict], int]:
    """The JSON rows of the whole lines of `path` after byte `offset`, and the new offset (just
    after the last whole line: a line still being written waits for the next read)."""
    if not path.exists():
        return [], offset
    with path.open("rb") as file:
        file.seek(offset)
        data = file.read()
    whole = data[:data.rfind(b"\n") + 1]
    rows = []
    for line in whole.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue   # a torn line a killed writer left (read_metrics skips it too)
    return rows, offset + len(whole)
