"""`postrain plot RUN_DIR`: PNG charts of a run, from its metrics.jsonl (and ledger.jsonl).

Writes into RUN_DIR/plots:

    reward.png       mean reward (and mean `correct`) per RL step      train rows
    accuracy.png     held-out accuracy (greedy, sampled) against      eval rows (before, after
                     the run's wall time, a point per evaluation     the warm start, every
                                                                      eval_every RL steps, after)
    warm_start.png   the warm start's loss per SFT step              sft rows
    kl.png           KL to the reference per RL step, only where      train rows with a nonzero
                     the run uses KL (kl_coef or kl_target)          `kl`
    throughput.png   learner tokens/s per RL step                     train rows
    staleness.png    histogram of sample staleness (policy versions)  ledger `trained` events,
                                                                      else train rows' staleness_max
    queues.png       queue depths over time, one panel per actor      queue rows (the head's)
                     (its queued and running work), a moving
                     average over the raw samples

A chart whose series the run does not have is skipped with a note saying
which rows it needs (or why it is not drawn: KL 0 at every step); a missing or
empty metrics.jsonl is an error. Drawn with matplotlib's Agg canvas (no display
needed).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Callable

from postrain.actors.orchestrator.ledger import read_events
from postrain.core.errors import PostrainError
from postrain.core.metrics import read_metrics

HELP = ("draw a run's charts (reward, accuracy, warm-start loss, KL, throughput, staleness, queues) as PNGs "
        "in RUN_DIR/plots")
QUEUE_SMOOTHING_ROWS = 5   # queue rows in the moving average of queues.png (the head writes one every 2 s)
QUEUE_SUFFIXES = ("queued", "running", "workers")


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


def _kl_chart(run: dict):
    """KL per step, only when the run uses KL: a learner without kl_coef or kl_target reports
    0.0 at every step, a flat line that says nothing."""
    xs, ys = _numbers(run["train"], "step", "kl")
    if not xs:
        return "no train rows with 'kl'"
    if not any(ys):
        return "KL is 0 at every step: the run does not use KL (kl_coef = 0, no kl_target)"
    return _line_chart("KL per step", "KL", {"kl": (xs, ys)})


def _warm_start_chart(run: dict):
    """The warm start's loss against its step (1..n, in the order of the sft rows)."""
    losses = [row["loss"] for row in run["sft"] if isinstance(row.get("loss"), (int, float))]
    if not losses:
        return "no sft rows with 'loss' (the run has no warm start: sft_steps = 0)"
    return _line_chart("warm start (supervised) loss", "loss", {"loss": (list(range(1, len(losses) + 1)), losses)},
                       x_label="warm-start step")


def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of each value and the `window - 1` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def queue_panels(names: list[str]) -> dict[str, list[str]]:
    """Queue figures grouped by actor: `env_queued` and `env_running` share the panel `env`; a
    name without such a suffix is a panel of its own."""
    panels: dict[str, list[str]] = {}
    for name in names:
        actor, _, suffix = name.rpartition("_")
        panels.setdefault(actor if actor and suffix in QUEUE_SUFFIXES else name, []).append(name)
    return panels


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
    names = [name for name in dict.fromkeys(k for row in rows for k in row if k not in ("time", "kind"))
             if _numbers(rows, "time", name)[0]]
    if not names:
        return "queue rows hold no numeric depths"
    panels = queue_panels(names)
    from matplotlib.figure import Figure
    figure = Figure(figsize=(7, 1.0 + 1.6 * len(panels)), dpi=100)
    axes_list = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for axes, (panel, members) in zip(axes_list, panels.items()):
        peak = 1.0
        for name in members:
            xs, ys = _numbers(rows, "time", name)
            peak = max(peak, *ys)
            xs = [x - origin for x in xs]
            line, = axes.plot(xs, moving_average(ys, QUEUE_SMOOTHING_ROWS), label=name.rpartition("_")[2]
                              if len(members) > 1 else name.replace("_", " "))
            axes.plot(xs, ys, color=line.get_color(), alpha=0.2, linewidth=0.8)
        axes.set_ylabel(panel.replace("_", " "), fontsize=8)
        axes.set_ylim(0, peak * 1.1)   # an idle actor's panel reads 0..1, not 0..0.05
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7, loc="upper right")
    axes_list[0].set_title(f"queue depths (moving average of {QUEUE_SMOOTHING_ROWS} rows; raw faint)")
    axes_list[-1].set_xlabel("seconds since the first queue row")
    return figure


CHARTS: dict[str, Callable] = {
    "reward.png": _step_chart("reward_mean", "mean reward per step", "reward", {"correct_mean": "correct_mean"}),
    "accuracy.png": _accuracy_chart,
    "warm_start.png": _warm_start_chart,
    "kl.png": _kl_chart,
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
    run = {kind: [row for row in rows if row["kind"] == kind] for kind in ("train", "eval", "queue", "sft")}
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
