"""The table and the plot of a `postrain sweep` (cli/sweep.py): every run's summary.json, grouped
by the overrides it ran with, as min / median / max over its seeds.

Per group (one combination of `--set` values; seeds vary inside it) and per figure:

    eval_*      every accuracy the summaries hold (eval_before, eval_after_sft, eval_after,
                eval_sampled_*; the per-step ones, eval_step_N, are left out)
    rl_gain     RL's own gain: eval_after - eval_after_sft (eval_after - eval_before without a
                warm start)
    wall_s      the run's wall time
    eval_after_<task>, rl_gain_<task>
                a mixture's per-task accuracy after RL and RL's gain on each task (summary.json's
                eval_by_task; actors/tasks/mixture.py)

With `--target ACC`, each run's first held-out evaluation at or above ACC (its metrics.jsonl's
`eval` rows: before or after the warm start count as step 0) gives two more figures, over the
runs that reached it, and the group counts the runs that did (`reached_target`):

    steps_to_target   the RL step of that evaluation
    rl_s_to_target    RL's wall time at it, evaluations included (this start of the run: a
                      resumed run counts from its resume)

`collapses` counts the group's runs that collapsed: after RL below half of where RL started
(the warm start's accuracy, else the one before), or a collapse warning in its metrics.jsonl
(codes in COLLAPSE_CODES: a reward or an accuracy that fell by half). An entropy collapse
alone is not one: a policy that solves its task samples nearly one answer per prompt too. A
run without summary.json (failed, interrupted) is listed with its status and counts in no
figure.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

NOT_ACCURACIES = ("eval_s", "eval_repeats")   # summary.json's eval_* figures that are not accuracies
COLLAPSE_CODES = ("reward_collapse", "accuracy_collapse")
PLOT_FILE = "sweep.png"


def run_figures(summary: dict) -> dict[str, float]:
    """The figures of one run's summary.json that the table summarises."""
    figures = {k: float(v) for k, v in summary.items() if k.startswith("eval_") and k not in NOT_ACCURACIES
               and not k.startswith("eval_step_") and isinstance(v, (int, float))}
    start = figures.get("eval_after_sft", figures.get("eval_before"))
    if "eval_after" in figures and start is not None:
        figures["rl_gain"] = round(figures["eval_after"] - start, 6)
    if isinstance(summary.get("wall_s"), (int, float)):
        figures["wall_s"] = float(summary["wall_s"])
    for task, evals in (summary.get("eval_by_task") or {}).items():
        start = evals.get("after_sft", evals.get("before"))
        if isinstance(evals.get("after"), (int, float)):
            figures[f"eval_after_{task}"] = float(evals["after"])
            if start is not None:
                figures[f"rl_gain_{task}"] = round(evals["after"] - start, 6)
    return figures


def target_figures(folder: Path, target: float) -> dict[str, float]:
    """steps_to_target and rl_s_to_target of one run (module docstring); {} where no evaluation
    reached `target`."""
    metrics = folder / "metrics.jsonl"
    for line in (metrics.read_text().splitlines() if metrics.exists() else []):
        row = json.loads(line)
        if row.get("kind") == "eval" and isinstance(row.get("accuracy"), (int, float)) and row["accuracy"] >= target:
            return {"steps_to_target": float(row.get("step", 0)), "rl_s_to_target": float(row.get("rl_wall_s", 0.0))}
    return {}


def collapsed(summary: dict, folder: Path) -> bool:
    """True where the run collapsed (module docstring)."""
    figures = run_figures(summary)
    start = figures.get("eval_after_sft", figures.get("eval_before"))
    if start and "eval_after" in figures and figures["eval_after"] < start / 2:
        return True
    metrics = folder / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            if '"warning"' in line and any(code in line for code in COLLAPSE_CODES):
                return True
    return False


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def group_label(overrides: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items()) or "(config as is)"


def figures_of(run: dict) -> dict[str, float]:
    """A finished run's figures: its summary's and, with --target, its target ones."""
    return {**run_figures(run["summary"]), **run.get("target_figures", {})}


def build_table(runs: list[dict], target: float | None = None) -> list[dict]:
    """One row per override combination, in the order first seen: its runs' figures' spread."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(json.dumps(run["overrides"], sort_keys=True), []).append(run)
    table = []
    for members in groups.values():
        finished = [figures_of(r) for r in members if r.get("summary") is not None]
        names = sorted({k for figures in finished for k in figures})
        row = {"overrides": members[0]["overrides"], "num_runs": len(members), "num_finished": len(finished),
               "seeds": [r["seed"] for r in members if r.get("summary") is not None],
               "figures": {k: spread([figures[k] for figures in finished if k in figures]) for k in names},
               "collapses": sum(1 for r in members if r.get("summary") is not None and r.get("collapsed"))}
        if target is not None:
            row["target"] = target
            row["reached_target"] = sum(1 for figures in finished if "steps_to_target" in figures)
        table.append(row)
    return table


def format_table(table: list[dict]) -> list[str]:
    """The table as text lines: one block per group, one line per figure."""
    lines = []
    for row in table:
        reached = (f", {row['reached_target']}/{row['num_finished']} reached {row['target']:g}"
                   if "target" in row else "")
        lines.append(f"{group_label(row['overrides'])}: {row['num_finished']}/{row['num_runs']} runs finished, "
                     f"{row['collapses']} collapsed{reached}")
        for name, s in row["figures"].items():
            lines.append(f"  {name:<24} min {s['min']:8.3f}  median {s['median']:8.3f}  max {s['max']:8.3f}"
                         f"  (n={s['n']})")
    return lines


def plot_spread(table: list[dict], runs: list[dict], path: Path) -> Path | None:
    """One panel per figure (the accuracies and RL's gain; wall time on its own): each run a dot,
    each group's median a bar, groups side by side. None when no run finished."""
    names = sorted({k for row in table for k in row["figures"]})
    if not names:
        return None
    from matplotlib.figure import Figure

    figure = Figure(figsize=(max(6, 2.2 * len(names)), 4), dpi=100)
    keys = [json.dumps(row["overrides"], sort_keys=True) for row in table]
    for i, name in enumerate(names):
        axes = figure.add_subplot(1, len(names), i + 1)
        for g, row in enumerate(table):
            found = [figures_of(r).get(name) for r in runs if r.get("summary") is not None
                     and json.dumps(r["overrides"], sort_keys=True) == keys[g]]
            values = [v for v in found if v is not None]
            axes.scatter([g] * len(values), values, s=14, alpha=0.7)
            if values:
                axes.hlines(statistics.median(values), g - 0.3, g + 0.3, colors="black")
        axes.set_title(name, fontsize=9)
        axes.set_xticks(range(len(table)), [group_label(r["overrides"]) for r in table], rotation=30,
                        fontsize=7, ha="right")
        axes.grid(alpha=0.3)
    figure.suptitle(f"postrain sweep: {len(runs)} runs, one dot per run, bars the medians", fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    return path
