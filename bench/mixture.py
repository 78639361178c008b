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

Arm "mixture": one run of the four as `[[tasks]]` (equal weights) for `num_steps` steps. Arm
"sequential" (the peer): four runs, one task each, `num_steps / 4` steps each, one after the
other: the same samples, as a user without mixtures would train them. Figures: trained samples
per second of the RL phase (summary `rl_wall_s`: from the first admission to the last publish;
start-up, evaluation and export excluded; the sequential arm sums its four), so
`ratio` of `samples_per_s` is `mixture_throughput_ratio`. The arms alternate over repeats. Beside
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
FULL = {"num_steps": 8, "repeats": 2, "cad_samples": 6}
QUICK = {"num_steps": 4, "repeats": 1, "cad_samples": 2}


def arm_specs(config, tasks: list[dict], num_steps: int) -> list:
    """The default run's actors with `tasks` as the run's tasks (a mixture, or one of them), the
    driver sized for one arm: no warm start, no evaluation."""
    specs = []
    for spec in config.actors:
        options = {k: v for k, v in spec.options.items() if k not in ("task", "task_options", "tasks")}
        if "tasks" in spec.options or "task" in spec.options:   # the roles that read the run's tasks
            options["tasks"] = tasks
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
    steps_alone = sizes["num_steps"] // len(TASKS)
    rates: dict[str, list[float]] = {"mixture": [], "sequential": []}
    seconds: dict[str, list[float]] = {"mixture": [], "sequential": []}
    with bench_folder(os.environ.get("POSTRAIN_BENCH_DIR")) as tmp:
        for repeat in range(sizes["repeats"]):
            summary = anyio.run(run_arm, config, arm_specs(config, TASKS, sizes["num_steps"]),
                                Path(tmp) / f"mixture-r{repeat}", backend="trio")
            rates["mixture"].append(summary["samples"] / summary["rl_wall_s"])
            seconds["mixture"].append(summary["rl_wall_s"])
            samples = rl_s = 0.0
            for task in TASKS:
                alone = anyio.run(run_arm, config, arm_specs(config, [task], steps_alone),
                                  Path(tmp) / f"{task['name']}-r{repeat}", backend="trio")
                samples += alone["samples"]
                rl_s += alone["rl_wall_s"]
            rates["sequential"].append(samples / rl_s)
            seconds["sequential"].append(rl_s)
    cad = grading_figures(sizes["cad_samples"], num_warm_runs=10)
    return {
        "config": {**sizes, "tasks": [t["name"] for t in TASKS], "steps_alone": steps_alone,
                   "prompts_per_step": options["prompts_per_step"],
                   "samples_per_prompt": options["samples_per_prompt"], "model": "tiny, initial weights",
                   "rl_wall_s": {arm: [round(s, 1) for s in values] for arm, values in seconds.items()},
                   "arms": "one mixture run (ours) vs the four tasks run one after another (peer), alternating"},
        "results": {"samples_per_s": round(statistics.median(rates["mixture"]), 3),
                    **{f"cad_{name}": value for name, value in cad["results"].items()}},
        "peer": {"samples_per_s": round(statistics.median(rates["sequential"]), 3),
                 **{f"cad_{name}": value for name, value in cad["peer"].items()}},
    }
