"""A short real run (`postrain up`, every role a real process, the tiny model) on any task, for the
tests of the task kinds: no sandbox actor, one GRPO step of 3 prompts x 2 samples, a held-out
evaluation (2 tasks) before and after. Returns the run's summary and its folder.

`killable_run_specs`: the actors of a short arithmetic run under a test's own Supervisor, each
restarted at once when killed (the recovery and teacher-kill tests)."""
import json
import os
import subprocess
import sys

from postrain.core import ActorSpec
from postrain.core.testing import to_toml


def run_config(tmp_path, task: str, task_options: dict, *, extra: dict | None = None,
               orchestrator: dict | None = None) -> dict:
    """The run's config; `orchestrator`: options that replace the orchestrator's own."""
    actor = {"cpus": 0.5, "memory_mb": 0}
    return {
        "run": {"name": "task", "run_dir": str(tmp_path / "runs"), "driver": "orchestrator"},
        "shared": {"model": "tiny", "task": task, "task_options": task_options},
        "head": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 120},
        "actors": [
            {"name": "generator", "cls": "postrain.actors.generator:GeneratorActor", **actor,
             "options": {"kv_cache_mb": 16}},
            {"name": "learner", "cls": "postrain.actors.learner:LearnerActor", **actor,
             "options": {"learner": {"lr": 1e-3}}},
            {"name": "env", "cls": "postrain.actors.env:EnvironmentActor", **actor, "cpus": 0.1},
            {"name": "orchestrator", "cls": "postrain.actors.orchestrator:OrchestratorActor", **actor,
             "cpus": 0.1, "options": {"num_steps": 1, "prompts_per_step": 3, "samples_per_prompt": 2,
                                      "num_eval_tasks": 2,
                                      "sampling": {"max_new_tokens": 12}, **(orchestrator or {})}},
        ],
        **(extra or {}),
    }


def run_task(tmp_path, task: str, task_options: dict, *, extra: dict | None = None,
             orchestrator: dict | None = None):
    """`postrain up` on `task`; the summary and the run folder. `tmp_path` is on PYTHONPATH (for the
    user modules a test writes there)."""
    config = tmp_path / "run.toml"
    config.write_text(to_toml(run_config(tmp_path, task, task_options, extra=extra, orchestrator=orchestrator)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "up", "--config", str(config), "--quiet"],
                            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    folder = tmp_path / "runs" / "task"
    return json.loads((folder / "summary.json").read_text()), folder


def killable_run_specs(orchestrator: dict, learner: dict, task_options: dict,
                       extra: tuple[ActorSpec, ...] = ()) -> list[ActorSpec]:
    """Sandbox, generator, `extra` (e.g. a teacher), learner, environment and orchestrator, each
    restarted at once when it dies (max_restarts 10, backoff 0.05 s), on the tiny model."""
    common = {"memory_mb": 0, "max_restarts": 10, "restart_backoff_s": 0.05}
    return [
        ActorSpec(name="sandbox", cls="postrain.actors.sandbox:SandboxActor", cpus=0.2,
                  options={"mode": "warm", "num_workers": 1}, **common),
        ActorSpec(name="generator", cls="postrain.actors.generator:GeneratorActor", cpus=0.5,
                  options={"model": "tiny", "kv_cache_mb": 16}, **common),
        *(spec.model_copy(update=common) for spec in extra),
        ActorSpec(name="learner", cls="postrain.actors.learner:LearnerActor", cpus=0.5,
                  options={"model": "tiny", "learner": learner}, **common),
        ActorSpec(name="env", cls="postrain.actors.env:EnvironmentActor", cpus=0.1,
                  options={"task": "arithmetic", "task_options": task_options}, **common),
        ActorSpec(name="orchestrator", cls="postrain.actors.orchestrator:OrchestratorActor", cpus=0.1,
                  options=orchestrator, **common)]
