"""The run-level check of a mixture's KL targets, at config load (`postrain up` and `--dry-run`).

A task's `kl_target` ([[tasks]], actors/tasks/mixture.py) gives its samples an adaptive KL
coefficient of their own in the learner (actors/learner/task_kl.py), which needs that learner
to have a KL reference (`reference_model`) and a starting coefficient (`kl_coef` > 0: an
adaptive coefficient never leaves 0). Each orchestrator's learner is checked here, so a run
that would fail at its first RL step is refused before a process starts, with the fix.
"""
from __future__ import annotations

import sys

from postrain.core.actor import import_actor_class
from postrain.core.config import RunConfig
from postrain.core.errors import ConfigError


def check_task_kl(config: RunConfig) -> None:
    """ConfigError naming each learner that cannot take its orchestrator's KL targets per task."""
    options = {spec.name: dict(spec.options) for spec in config.actors}
    # the options check imported every actor's class: an orchestrator's module is loaded if any is one
    role = getattr(sys.modules.get("postrain.actors.orchestrator.actor"), "OrchestratorActor", None)
    orchestrators = [spec.name for spec in config.actors
                     if role is not None and issubclass(import_actor_class(spec.cls), role)]
    problems = []
    for name in orchestrators:
        opts = options[name]
        targets = [t for t in opts.get("tasks") or [] if t.get("kl_target") is not None]
        if not targets:
            continue
        learner = opts.get("learner", "learner")
        from ..learner.config import LearnerConfig   # here: a run without KL targets imports no learner (torch)
        settings = LearnerConfig(**(options.get(learner, {}).get("learner") or {}))
        missing = [what for what, ok in (("reference_model", settings.reference_model is not None),
                                         ("kl_coef > 0", settings.kl_coef > 0)) if not ok]
        if missing:
            tasks = [t.get("name") or t["task"] for t in targets]
            problems.append(f"tasks {tasks} set kl_target, but learner {learner!r} has no {' and no '.join(missing)}; "
                            f"fix: in its options, learner = {{ reference_model = \"initial\", kl_coef = 0.01, ... }} "
                            "(each task's coefficient starts at kl_coef), or remove the kl_target")
    if problems:
        raise ConfigError("KL targets per task:\n  " + "\n  ".join(problems))
