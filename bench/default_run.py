"""Benchmark `default_run`: the built-in run (`postrain up`), elastic cores against pinned cores.

    postrain bench default_run --json [--quick]

Runs the shipped default config (actors/configs/default.toml) with `postrain up` twice, one
after the other, same seed: as shipped (the learner `elastic = true`, the generator
`elastic = "lend"`: cores follow the work) and with both pinned to their own cores
(`elastic = false`, the peer).
`--quick` shortens the run (20 warm-start steps, 2 GRPO steps, 10 held-out problems) for a
smoke run; its figures are not the default run's.

Figures (ours: elastic; peer: pinned):
- `wall_s`: the `postrain up` process, start to exit (actor starts and stops included): the
  figure a user waits for
- `run_wall_s`, `warm_start_s`, `rl_wall_s`, `eval_s`: the summary's (the driver's whole run,
  its supervised steps, its RL phase, its evaluations), to show where the time goes
- `accuracy_greedy`, `accuracy_sampled`, `accuracy_after_sft`: held-out, after RL (and after
  the warm start)
- `cores_moved`: lends and returns of cores during the run
- `sft_step_s`, `sft_step_cpu_s`: one warm-start step of the default learner, run as the
  learner actor runs it: in a process that starts pinned to one core (OpenMP reads its
  affinity when torch loads), then re-pinned to two cores with 2 torch threads (ours, the
  warm start of an elastic learner) or kept on one core with 1 thread (the peer); interleaved,
  median (wall and CPU seconds): whether a lent core helps at all on this machine, measured
  in a minute rather than two runs
`config` holds the load average (1 minute) before and after each arm: the machine may be
shared, and wall times follow its load. Set POSTRAIN_BENCH_DIR to keep the run folders.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from postrain.bench import postrain_command

QUICK_OPTIONS = {"sft_steps": 20, "num_steps": 2, "num_eval_tasks": 10}
SUMMARY_FIGURES = {"run_wall_s": "wall_s", "warm_start_s": "warm_start_s", "rl_wall_s": "rl_wall_s",
                   "eval_s": "eval_s", "accuracy_greedy": "eval_after",
                   "accuracy_sampled": "eval_sampled_after",
                   "accuracy_after_sft": "eval_after_sft", "cores_moved": "cores_moved"}


def arm_config(elastic: bool, quick: bool) -> str:
    """The default config's text: as shipped (elastic), or with `elastic = false` for every actor
    that declares it (pinned); and, quick, shorter orchestrator options."""
    from postrain.actors.configs.run_config import default_config_path

    text = default_config_path().read_text()
    if not re.search(r'^elastic = (true|"lend")', text, flags=re.M):
        raise RuntimeError("the default config declares no elastic actor; nothing to compare")
    if not elastic:
        text = re.sub(r'^elastic = (true|"lend")', "elastic = false", text, flags=re.M)
    if quick:
        for name, value in QUICK_OPTIONS.items():
            text = re.sub(rf"\b{name} = \d+", f"{name} = {value}", text)
    return text


def run_arm(folder: Path, elastic: bool, quick: bool) -> dict:
    """One `postrain up` of the default run in `folder`; its figures."""
    config = folder / f"default_elastic_{str(elastic).lower()}.toml"
    config.write_text(arm_config(elastic, quick))
    run_dir = folder / ("elastic" if elastic else "pinned")
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    result = subprocess.run(postrain_command("up", "--quiet", "--config", str(config),
                                             "--run-dir", str(run_dir)),
                            capture_output=True, text=True, timeout=3600)
    wall_s = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"the default run (elastic = {elastic}) failed:\n{result.stderr[-2000:]}")
    run_folder = run_dir / "default"
    summary = json.loads((run_folder / "summary.json").read_text())
    figures = {"wall_s": round(wall_s, 1),
               **{name: summary.get(key) for name, key in SUMMARY_FIGURES.items()}}
    figures["load_before"], figures["load_after"] = round(load_before, 2), round(os.getloadavg()[0], 2)
    return figures


def sft_step_seconds(repeats: int) -> dict[int, tuple[float, float]]:
    """Median (wall, CPU) seconds of the default learner's warm-start step on 2 cores and 2
    threads, and on 1 and 1, in a fresh process that starts pinned to one core, as the learner
    actor does (module doc)."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        raise RuntimeError("the warm-start step on 2 threads needs 2 cores")
    code = (f"import os; os.sched_setaffinity(0, {{{cores[0]}}}); os.environ['OMP_NUM_THREADS'] = '1'; "
            f"from postrain.bench.default_run import _sft_steps_here; _sft_steps_here({cores}, {repeats})")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"the warm-start step timing failed:\n{result.stderr[-2000:]}")
    return {int(n): tuple(seconds) for n, seconds in json.loads(result.stdout.splitlines()[-1]).items()}


def _sft_steps_here(cores: list[int], repeats: int) -> None:
    """`sft_step_seconds` inside its process: prints {threads: [wall, cpu]} as JSON."""
    import torch

    from postrain.actors.learner.learner import Learner
    from postrain.actors.orchestrator import chat_to_tokens
    from postrain.actors.records import SftBatch
    from postrain.actors.tasks import get_task
    from postrain.core.affinity import pin_threads

    from .e2e import default_run_config, learner_config, orchestrator_options

    config = default_run_config()
    options = orchestrator_options(config)
    learner, task = Learner(learner_config(config)), get_task(options["task"])
    size = options["sft_batch_size"]
    demos = task.demonstrations(size * 2 * (repeats + 1), seed=options["seed"],
                                options=options["task_options"])
    times: dict[int, list[tuple[float, float]]] = {2: [], 1: []}
    for i in range(2 * (repeats + 1)):
        n = 2 - i % 2
        rendered = [chat_to_tokens(learner.tokenizer, d["messages"]) for d in demos[i * size:(i + 1) * size]]
        pin_threads(cores[:n])
        torch.set_num_threads(n)
        wall, cpu = time.perf_counter(), time.process_time()
        learner.sft_step(SftBatch(token_ids=[ids for ids, _ in rendered], loss_mask=[m for _, m in rendered]))
        if i >= 2:  # the first step of each count warms up
            times[n].append((time.perf_counter() - wall, time.process_time() - cpu))
    print(json.dumps({n: [round(statistics.median(w for w, _ in t), 3),
                          round(statistics.median(c for _, c in t), 3)] for n, t in times.items()}))


def run(quick: bool = False) -> dict:
    keep = os.environ.get("POSTRAIN_BENCH_DIR")
    load_sft = os.getloadavg()[0]
    steps = sft_step_seconds(repeats=3 if quick else 5)
    with (tempfile.TemporaryDirectory(prefix="postrain-bench-default-") if not keep else _kept(keep)) as root:
        ours = run_arm(Path(root), elastic=True, quick=quick)
        peer = run_arm(Path(root), elastic=False, quick=quick)
    ours["sft_step_s"], ours["sft_step_cpu_s"] = steps[2]
    peer["sft_step_s"], peer["sft_step_cpu_s"] = steps[1]
    loads = {f"{arm}_{key}": figures.pop(key) for arm, figures in (("elastic", ours), ("pinned", peer))
             for key in ("load_before", "load_after")}
    return {"config": {"quick": quick, "cpus": len(os.sched_getaffinity(0)), **loads,
                       "sft_step_load_before": round(load_sft, 2),
                       **({"orchestrator": QUICK_OPTIONS} if quick else {})},
            "results": ours, "peer": peer}


class _kept:
    """A folder that stays (POSTRAIN_BENCH_DIR), as a context manager like TemporaryDirectory."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self) -> str:
        Path(self.path).mkdir(parents=True, exist_ok=True)
        return self.path

    def __exit__(self, *exc) -> None:
        return None
