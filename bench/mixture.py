"""Benchmark `mixture`: a four-task mixture's throughput against the same tasks run one after another.

    postrain bench mixture --json [--quick]

The built-in default run's actors (the tiny model, the warm nsjail sandbox, 8 prompts x 8
samples per step, every role its own process), from their initial weights (throughput only, no
warm start), on four tasks of different shapes:

    arithmetic          a Python tool in the sandbox, several turns
    mental              arithmetic answered in one turn, no tool, no sandbox
    chain_sum           reasoning-gym's sums, one turn, no sandbox
    code                a function graded by tests in the sandbox

(finance_docs is not among them: its shortest report, ~2,000 byte tokens, is over the tiny
model's 1,024 positions.)

Arm "sequential" (the peer): four runs, one task each, `steps_per_run` steps each, one after the
other, as a user without mixtures would train them. Arm "mixture": four runs of the four tasks as
`[[tasks]]` (equal weights; seeds 0-3, so their draws differ), `steps_per_run` steps each: the
same samples in runs of the same shape, so what differs is only that each batch mixes the tasks
(a run's first batch generates, and its last step trains, with nothing beside it: arms of runs of
different lengths would differ by that too). Figures: trained samples per second of the RL phase
(summary `rl_wall_s`: from the first admission to the last publish; start-up, evaluation and
export excluded; each arm sums its four runs), so `ratio` of `samples_per_s` is
`mixture_throughput_ratio`. The arms alternate over repeats. Beside
them, the CAD grader's time per sample (`postrain bench cad`'s grading figures, a few variants).
Set POSTRAIN_BENCH_DIR to keep the runs' folders.
"""
from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from .e2e import bench_folder, default_run_config, orchestrator_options, run_arm

TASKS: list[dict[str, Any]] = [
    {"name": "arithmetic", "task": "arithmetic", "options": {"include_instructions": False, "max_digits": 2}},
    {"name": "mental", "task": "arithmetic", "options": {"include_instructions": False, "answer_format": "plain"}},
    {"name": "chain_sum", "task": "reasoning_gym:chain_sum"},
    {"name": "code", "task": "code"},
]
FULL = {"steps_per_run": 3, "repeats": 2, "cad_samples": 6}
QUICK = {"steps_per_run": 1, "repeats": 1, "cad_samples": 2}


def arm_specs(config, tasks: list[dict], num_steps: int, seed: int = 0) -> list:
    """The default run's actors with `tasks` as the run's tasks (a mixture, or one of them) and
    `seed`, the driver sized for one run: no warm start, no evaluation."""
    specs = []
    for spec in config.actors:
        options = {k: v for k, v in spec.options.items() if k not in ("task", "task_options", "tasks")}
        if "tasks" in spec.options or "task" in spec.options:   # the roles that read the run's tasks
            options["tasks"] = tasks
        if "seed" in options:
            options["seed"] = seed
        if spec.name == config.run.driver:
            options.update(num_steps=num_steps, sft_steps=0, num_eval_tasks=0, eval_samples_per_task=0,
                           checkpoint_every=num_steps)
        specs.append(spec.model_copy(update={"options": options}))
    return specs


def run(quick: bool) -> dict:
    import anyio

    from .cad import grading_figures

    config = default_run_config()
    options = orchestrator_options(config)
    sizes = QUICK if quick else FULL
    arms = {"mixture": [(f"mixture-{k}", TASKS, k) for k in range(len(TASKS))],
            "sequential": [(task["name"], [task], 0) for task in TASKS]}
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    with bench_folder(os.environ.get("POSTRAIN_BENCH_DIR")) as tmp:
        for repeat in range(sizes["repeats"]):
            for arm, runs in arms.items():
                samples = rl_s = 0.0
                for name, tasks, seed in runs:
                    summary = anyio.run(run_arm, config, arm_specs(config, tasks, sizes["steps_per_run"], seed),
                                        Path(tmp) / f"{name}-r{repeat}", backend="trio")
                    samples += summary["samples"]
                    rl_s += summary["rl_wall_s"]
                rates[arm].append(samples / rl_s)
                seconds[arm].append(rl_s)
    cad = grading_figures(sizes["cad_samples"], num_warm_runs=10)
    return {
        "config": {**sizes, "tasks": [t["name"] for t in TASKS], "runs_per_arm": len(TASKS),
                   "prompts_per_step": options["prompts_per_step"],
                   "samples_per_prompt": options["samples_per_prompt"], "model": "tiny, initial weights",
                   "rl_wall_s": {arm: [round(s, 1) for s in values] for arm, values in seconds.items()},
                   "arms": "four runs of the mixture (ours) vs four runs of one task each (peer), alternating"},
        "results": {"samples_per_s": round(statistics.median(rates["mixture"]), 3),
                    **{f"cad_{name}": value for name, value in cad["results"].items()}},
        "peer": {"samples_per_s": round(statistics.median(rates["sequential"]), 3),
                 **{f"cad_{name}": value for name, value in cad["peer"].items()}},
    }
