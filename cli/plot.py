"""`postrain plot RUN_DIR`: PNG charts of a run, from its metrics.jsonl (and ledger.jsonl).

Writes into RUN_DIR/plots:

    reward.png       mean reward (and mean `correct`) per RL step      train rows
    accuracy.png     held-out accuracy (greedy, sampled) against      eval rows (before, after
                     the run's wall time, a point per evaluation     the warm start, every
                                                                      eval_every RL steps, after)
    kl.png           KL to the reference per RL step                  train rows
    throughput.png   learner tokens/s per RL step                     train rows
    staleness.png    histogram of sample staleness (policy versions)  ledger `trained` events,
                                                                      else train rows' staleness_max
    queues.png       queue depths over time                           queue rows (the head's)

A chart whose series the run does not have is skipped with a note saying
which rows it needs; a missing or empty metrics.jsonl is an error. Drawn with
matplotlib's Agg canvas (no display needed).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Callable

from postrain.actors.ledger import read_events
from postrain.core.errors import PostrainError
from postrain.core.metrics import read_metrics

HELP = "draw a run's charts (reward, accuracy, KL, throughput, staleness, queues) as PNGs in RUN_DIR/plots"


def add_arguments(parser) -> None:
    parser.add_argument("run_folder", help="the run folder (run_dir/name) holding metrics.jsonl")


class PlotError(PostrainError, ValueError):
    """The run folder has no metrics to draw."""


def _numbers(rows: list[dict], x_key: str, y_key: str) -> tuple[list, list]:
    points = [(row[x_key], row[y_key]) for row in rows
              if isinstance(row.get(x_key), (int, float)) and isinstance(row.get(y_key), (int, float))]
    return [x for x, _ in points], [y for _, y in points]


def _new_figure():
    """A figure on matplotlib's Agg canvas; imported here so that `postrain --help` stays quick."""
    from matplotlib.figure import Figure
    return Figure(figsize=(7, 4), dpi=100)


def _line_chart(title: str, y_label: str, series: dict[str, tuple[list, list]], x_label: str = "RL step"):
    figure = _new_figure()
    axes = figure.add_subplot()
    for label, (xs, ys) in series.items():
        axes.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
    axes.set(title=title, xlabel=x_label, ylabel=y_label)
    axes.grid(alpha=0.3)
    if len(series) > 1:
        axes.legend()
    return figure


def _step_chart(key: str, title: str, y_label: str, extra: dict[str, str] | None = None):
    def chart(run: dict):
        train = run["train"]
        series = {label: _numbers(train, "step", k) for k, label in {key: key, **(extra or {})}.items()}
        series = {label: points for label, points in series.items() if points[0]}
        if key not in series:
            return f"no train rows with '{key}'"
        return _line_chart(title, y_label, series)
    return chart


def _accuracy_chart(run: dict):
    evals = [row for row in run["eval"] if isinstance(row.get("accuracy"), (int, float))]
    if not evals:
        return "no eval rows with 'accuracy'"
    minutes = [{**row, "minutes": (row["time"] - run["start_time"]) / 60} for row in evals]
    series = {"greedy": _numbers(minutes, "minutes", "accuracy")}
    sampled = _numbers(minutes, "minutes", "accuracy_sampled")
    if sampled[0]:
        series["sampled"] = sampled
    figure = _line_chart("held-out accuracy", "accuracy", series, x_label="minutes since the run started")
    axes = figure.axes[0]
    for row in minutes:
        axes.annotate(str(row.get("phase", "")).replace("_", " "), (row["minutes"], row["accuracy"]),
                      textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    axes.set_ylim(0, 1.1)
    return figure


def _staleness_chart(run: dict):
    trained = [round(e["staleness"]) for e in run["ledger"] if e["event"] == "trained"
               and isinstance(e.get("staleness"), (int, float))]
    what = "samples"
    if not trained:
        trained = [round(row["staleness_max"]) for row in run["train"]
                   if isinstance(row.get("staleness_max"), (int, float))]
        what = "RL steps (their max staleness; ledger.jsonl has no per-sample staleness)"
    if not trained:
        return "no ledger `trained` events with 'staleness' and no train rows with 'staleness_max'"
    counts = Counter(trained)
    figure = _new_figure()
    axes = figure.add_subplot()
    values = sorted(counts)
    axes.bar(values, [counts[v] for v in values])
    axes.set_xticks(values)
    axes.set(title="staleness (policy versions behind the learner)", xlabel="staleness", ylabel=what)
    return figure


def _queues_chart(run: dict):
    rows = run["queue"]
    if not rows:
        return "no queue rows (the head writes them while actors report queue depths)"
    origin = rows[0]["time"]
    names = list(dict.fromkeys(k for row in rows for k in row if k not in ("time", "kind")))
    series = {}
    for name in names:
        xs, ys = _numbers(rows, "time", name)
        if xs:
            series[name.replace("_", " ")] = ([x - origin for x in xs], ys)
    if not series:
        return "queue rows hold no numeric depths"
    return _line_chart("queue depths", "items", series, x_label="seconds since the first queue row")


CHARTS: dict[str, Callable] = {
    "reward.png": _step_chart("reward_mean", "mean reward per step", "reward", {"correct_mean": "correct_mean"}),
    "accuracy.png": _accuracy_chart,
    "kl.png": _step_chart("kl", "KL per step", "KL"),
    "throughput.png": _step_chart("tokens_per_s", "learner throughput", "tokens/s"),
    "staleness.png": _staleness_chart,
    "queues.png": _queues_chart,
}


def load_run(run_folder: str | Path) -> dict:
    """The run's metrics rows by kind and its ledger events; PlotError when there are no metrics."""
    folder = Path(run_folder)
    path = folder / "metrics.jsonl"
    rows = read_metrics(folder)
    if not rows:
        state = "is empty" if path.exists() else "does not exist"
        raise PlotError(f"{path} {state}; pass the run folder (run_dir/name) of a run that logged metrics")
    ledger_path = folder / "ledger.jsonl"
    run = {kind: [row for row in rows if row["kind"] == kind] for kind in ("train", "eval", "queue")}
    run["start_time"] = rows[0]["time"]
    run["ledger"] = read_events(ledger_path) if ledger_path.exists() else []
    return run


def plot_run(run_folder: str | Path) -> tuple[list[Path], dict[str, str]]:
    """Draw every chart the run has data for; returns (written paths, {skipped chart: why})."""
    run = load_run(run_folder)
    out = Path(run_folder) / "plots"
    out.mkdir(exist_ok=True)
    written, skipped = [], {}
    for name, chart in CHARTS.items():
        result = chart(run)
        if isinstance(result, str):
            skipped[name] = result
            continue
        result.tight_layout()
        result.savefig(out / name)
        written.append(out / name)
    return written, skipped


def main(args) -> int:
    try:
        written, skipped = plot_run(args.run_folder)
    except PlotError as exc:
        raise SystemExit(f"postrain plot: {exc}") from None
    for path in written:
        print(f"wrote {path}")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    return 0
