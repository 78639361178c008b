"""The run-level checks of scorers, at config load (`postrain up` and `--dry-run`).

Each actor's options are checked alone by its class's model (core/run_options.py); what spans
actors is checked here, after that, so a run that cannot distil or judge is refused before a
process starts, with the fix:

- every scorer an option names (the orchestrator's `teacher`, an environment actor's `scorers`)
  is an actor of the run whose class is a ScorerActor; the teacher serves "logprobs";
- a learner that distils (`loss = "opd"` or `distill_coef` > 0) has a teacher: the
  orchestrator's `teacher`, or its own `teacher_model`; a teacher no learner uses is refused
  too (its rows would be computed and thrown away);
- a teacher and the policy share one vocabulary, token for token: logprobs are compared per
  token id (docs/scorers.md says why distillation across tokenizers is refused, not aligned).
"""
from __future__ import annotations

import sys
from typing import Any

from postrain.core.actor import import_actor_class
from postrain.core.config import RunConfig
from postrain.core.errors import ConfigError


def check_scorers(config: RunConfig) -> None:
    """ConfigError listing every problem above; nothing when the run names no scorer and distils not."""
    classes = {spec.name: import_actor_class(spec.cls) for spec in config.actors}
    options = {spec.name: dict(spec.options) for spec in config.actors}

    def of_role(module: str, name: str) -> set[str]:
        """The actors whose class is (or derives) a role's actor class. The options check imported
        every actor's class, so a role none of them derives is not loaded: none is of it (and a
        run of other classes imports no role, nor torch, here)."""
        role = getattr(sys.modules.get(module), name, None)
        return {actor for actor, cls in classes.items() if role is not None and issubclass(cls, role)}

    scorers = {name: options[name] for name in of_role("postrain.actors.scorer.actor", "ScorerActor")}
    environments = of_role("postrain.actors.env.actor", "EnvironmentActor")
    orchestrators = of_role("postrain.actors.orchestrator.actor", "OrchestratorActor")
    learners = sorted(of_role("postrain.actors.learner.actor", "LearnerActor"))
    problems: list[str] = []

    def named_scorer(where: str, name: str) -> dict[str, Any] | None:
        if name in scorers:
            return scorers[name]
        what = "no actor" if name not in classes else f"actor {name!r} is a {classes[name].__name__}"
        problems.append(f"{where} = {name!r}: {what}, not a scorer; fix: add an [[actors]] entry named "
                        f"{name!r} with cls = \"postrain.actors.scorer:ScorerActor\" (docs/scorers.md)")
        return None

    distilling = [name for name in learners if _distils(options[name].get("learner") or {})]
    local_teacher = any((options[name].get("learner") or {}).get("teacher_model") for name in learners)
    teachers = []
    for name in classes:
        if name in environments:
            for scorer in options[name].get("scorers") or []:
                named_scorer(f"{name}.scorers", scorer)
        if name in orchestrators and options[name].get("teacher"):
            teacher = named_scorer(f"{name}.teacher", options[name]["teacher"])
            if teacher is not None:
                teachers.append((f"{name}.teacher", options[name]["teacher"], teacher))
    for where, scorer, teacher in teachers:
        if teacher.get("serves", "logprobs") != "logprobs":
            problems.append(f"{where} = {scorer!r}: that scorer serves {teacher.get('serves')!r}; a teacher "
                            "serves \"logprobs\"; fix: set its serves = \"logprobs\"")
        if not distilling:
            problems.append(f"{where} = {scorer!r}, but no learner distils: its rows would be thrown away; "
                            "fix: set the learner's loss = \"opd\" or distill_coef > 0, or remove the teacher")
    for name in distilling:
        if not teachers and not local_teacher:
            problems.append(f"{name}.learner distils (loss \"opd\" or distill_coef > 0) but has no teacher; "
                            "fix: name a scorer that serves \"logprobs\" as the orchestrator's teacher, or "
                            "set the learner's teacher_model")
    for where, scorer, teacher in teachers:
        for name in distilling:
            difference = _vocabulary_difference(options[name], teacher)
            if difference is not None:
                problems.append(f"{where} = {scorer!r}: its tokenizer is not the policy's ({difference}); "
                                "on-policy distillation compares logprobs token id by token id, so teacher "
                                "and student must share one vocabulary; fix: a teacher of the policy's "
                                "family (docs/scorers.md)")
    if problems:
        raise ConfigError(f"{len(problems)} scorer problem(s):\n  " + "\n  ".join(problems))


def _distils(learner: dict[str, Any]) -> bool:
    return learner.get("loss") == "opd" or float(learner.get("distill_coef") or 0.0) > 0


def _vocabulary_difference(learner_options: dict[str, Any], scorer_options: dict[str, Any]) -> str | None:
    from ..models.loading import spec_tokenizer
    policy = learner_options.get("model", "tiny")
    teacher = scorer_options.get("model", "tiny")
    if policy == teacher:
        return None
    return spec_tokenizer(policy).vocabulary_difference(spec_tokenizer(teacher))
