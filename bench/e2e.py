"""Benchmark `e2e`: the whole RL loop, asynchronous (max_staleness 1 and 2) against synchronous (0).

    postrain bench e2e --json [--quick]

The built-in default run (actors/configs/default.toml: the tiny model, arithmetic with a Python
tool in the warm nsjail sandbox, 8 prompts x 8 samples per step, every role its own process),
reduced to fit a 2-core machine: one supervised warm start, shared by every arm (the default's
`sft_steps` x `sft_batch_size` demonstrations, trained in this process and saved as a learner
checkpoint: weights and optimizer state, as the default run's RL continues them), then for each
`max_staleness` in (0, 1, 2) a fresh set of actors whose learner starts from that checkpoint
(`resume_from`) runs `num_steps` GRPO steps with the same seed, then evaluates greedily on the
held-out set. Arms run
interleaved over repeats (0, 1, 2, 0, 1, 2, ...), so machine load hits them alike.

Figures (medians over repeats; K = max_staleness):
- `samples_per_s_sK`: trained samples per second of the RL phase (the summary's `rl_wall_s`: from
  the first admission to the last weight publish; evaluations and checkpoints at the end excluded)
- `steps_per_hour_sK`: learner steps per hour of the same phase
- `accuracy_sK`: held-out accuracy after RL (its noise: one problem of `num_eval_tasks`)
- `learner_idle_frac_sK`: share of the RL phase the learner waited for rollouts
Peer: the same figure of the synchronous loop (max_staleness 0, the same code), so `ratio` is
async over sync. `config` holds the sizes, the warm start's own held-out accuracy and each arm's
RL seconds. Set POSTRAIN_BENCH_DIR to keep the arms' run folders (logs, metrics, ledgers).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

STALENESS_ARMS = (0, 1, 2)
FULL = {"sft_steps": None, "num_steps": 10, "num_eval_tasks": 100, "repeats": 1}  # None: the default's
QUICK = {"sft_steps": 40, "num_steps": 3, "num_eval_tasks": 10, "repeats": 1}


def default_run_config():
    """The built-in run's config, every actor's options resolved ([shared] filled in)."""
    from postrain.actors.configs.run_config import default_config_path, load_up_config

    return load_up_config(default_config_path())


def orchestrator_options(config) -> dict:
    return next(spec.options for spec in config.actors if spec.name == config.run.driver)


def learner_config(config):
    """The LearnerConfig of the run's learner actor."""
    from postrain.actors.learner.actor import LearnerOptions
    return next(LearnerOptions(**spec.options).learner_config() for spec in config.actors
                if "learner" in spec.options)


def warm_start(config, folder: Path, sft_steps: int, sft_batch_size: int) -> float:
    """Supervised warm start of the default run's learner on demonstrations, saved as a learner
    checkpoint in `folder`. Returns the seconds it took."""
    from postrain.actors.learner.learner import Learner
    from postrain.actors.orchestrator import chat_to_tokens
    from postrain.actors.records import SftBatch
    from postrain.actors.tasks import get_task

    import torch

    torch.set_num_threads(1)  # as the learner actor runs (the scheduler gives it one core)
    start = time.perf_counter()
    options = orchestrator_options(config)
    learner = Learner(learner_config(config))
    task = get_task(options["task"])
    demos = task.demonstrations(sft_steps * sft_batch_size, seed=options["seed"],
                                options=options["task_options"])
    for step in range(sft_steps):
        batch = [chat_to_tokens(learner.tokenizer, d["messages"])
                 for d in demos[step * sft_batch_size:(step + 1) * sft_batch_size]]
        learner.sft_step(SftBatch(token_ids=[ids for ids, _ in batch], loss_mask=[mask for _, mask in batch]))
    learner.save_checkpoint(folder)
    return time.perf_counter() - start


def arm_specs(config, checkpoint: str, max_staleness: int, num_steps: int, num_eval_tasks: int) -> list:
    """The default run's actors, the learner starting from the warm-start checkpoint (it publishes
    those weights to the generators first), the driver sized for one arm."""
    specs = []
    for spec in config.actors:
        options = dict(spec.options)
        if "learner" in options:
            options["resume_from"] = checkpoint
        if spec.name == config.run.driver:
            options.update(max_staleness=max_staleness, num_steps=num_steps, sft_steps=0,
                           num_eval_tasks=num_eval_tasks, eval_samples_per_task=0,
                           checkpoint_every=num_steps)
        specs.append(spec.model_copy(update={"options": options}))
    return specs


async def run_arm(config, specs: list, folder: Path) -> dict:
    """Start the actors, follow the driver's `run` stream to its summary, stop them. Cancelled:
    leaving the supervisor stops every actor (shielded); the arm's folder keeps what was written."""
    from postrain.actors.records import RUN, RunRequest
    from postrain.core import Supervisor

    (folder / "logs").mkdir(parents=True, exist_ok=True)
    async with Supervisor.open(heartbeat_interval_s=config.head.heartbeat_interval_s,
                               heartbeat_timeout_s=config.head.heartbeat_timeout_s,
                               log_dir=str(folder / "logs")) as supervisor:
        for spec in specs:
            await supervisor.start(spec)
        summary = None
        request = RunRequest(run_folder=str(folder))
        async for update in supervisor.ref(config.run.driver).call_stream(RUN, request, timeout_s=3600):
            summary = update.summary or summary
    if summary is None:
        raise RuntimeError(f"the {config.run.driver} ended without a summary; see {folder / 'logs'}")
    return summary


def arm_figures(summary: dict) -> dict:
    rl_s = summary["rl_wall_s"]
    return {"samples_per_s": summary["samples"] / rl_s, "steps_per_hour": summary["steps"] / rl_s * 3600,
            "accuracy": summary["eval_after"], "learner_idle_frac": summary["learner_idle_s"] / rl_s,
            "eval_before": summary["eval_before"], "rl_wall_s": rl_s}


@contextlib.contextmanager
def bench_folder(keep_in: str | None):
    """A fresh folder for the arms: kept inside `keep_in` when given, else removed afterwards."""
    if keep_in:
        yield tempfile.mkdtemp(prefix="postrain-bench-e2e-", dir=keep_in)
        return
    with tempfile.TemporaryDirectory(prefix="postrain-bench-e2e-") as tmp:
        yield tmp


def run(quick: bool) -> dict:
    import anyio

    config = default_run_config()
    options = orchestrator_options(config)
    sizes: dict[str, Any] = QUICK if quick else FULL   # FULL's sft_steps None: resolved just below
    sizes = {**sizes, "sft_steps": sizes["sft_steps"] or options["sft_steps"],
             "sft_batch_size": options["sft_batch_size"]}
    runs: dict[int, list[dict]] = {k: [] for k in STALENESS_ARMS}
    keep_in = os.environ.get("POSTRAIN_BENCH_DIR")  # set: the arms' run folders stay there
    with bench_folder(keep_in) as tmp:
        checkpoint = Path(tmp) / "warm_start"
        warm_start_s = warm_start(config, checkpoint, sizes["sft_steps"], sizes["sft_batch_size"])
        for repeat in range(sizes["repeats"]):
            for staleness in STALENESS_ARMS:
                specs = arm_specs(config, str(checkpoint), staleness, sizes["num_steps"],
                                  sizes["num_eval_tasks"])
                summary = anyio.run(run_arm, config, specs, Path(tmp) / f"s{staleness}-r{repeat}",
                                    backend="trio")
                runs[staleness].append(arm_figures(summary))
    median = {k: {name: statistics.median(r[name] for r in rows) for name in rows[0]}
              for k, rows in runs.items()}
    results, peer = {}, {}
    for staleness in STALENESS_ARMS[1:]:
        for name in ("samples_per_s", "steps_per_hour", "accuracy", "learner_idle_frac"):
            results[f"{name}_s{staleness}"] = round(median[staleness][name], 4)
            peer[f"{name}_s{staleness}"] = round(median[0][name], 4)
    return {
        "config": {**sizes, "task": options["task"], "model": "tiny (warm start shared by every arm)",
                   "prompts_per_step": options["prompts_per_step"],
                   "samples_per_prompt": options["samples_per_prompt"], "seed": options["seed"],
                   "warm_start_s": round(warm_start_s, 1),
                   "warm_start_accuracy": median[0]["eval_before"],
                   "rl_wall_s": {f"s{k}": round(median[k]["rl_wall_s"], 1) for k in STALENESS_ARMS},
                   "arms": "max_staleness 1 and 2 (ours) vs 0 (peer), interleaved"},
        "results": results,
        "peer": peer,
    }
