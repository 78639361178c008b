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
  token id (docs/scorers.md says why distillation across tokenizers is refused, not aligned);
  that holds for the learner's own `teacher_model` too (its vocabulary size as well), which the
  learner would otherwise refuse only once it is built;
- a learner has one teacher: the orchestrator's scorer (top-k rows in the batch) or its own
  `teacher_model` (the full vocabulary), not both (the learner refuses rows beside a teacher
  model at its first step); the orchestrator's `teacher_top_k` is at most the teacher's
  vocabulary (the scorer would refuse every sample).
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
        if name in classes:
            what = (f"actor {name!r} is a {classes[name].__name__}, not a scorer; fix: name a scorer actor "
                    f"(this run's: {sorted(scorers) or 'none'}), or add one")
        else:
            what = (f"no actor of the run is named {name!r}; fix: correct the name (this run's scorers: "
                    f"{sorted(scorers) or 'none'}), or add an [[actors]] entry named {name!r}")
        problems.append(f"{where} = {name!r}: {what} with cls = \"postrain.actors.scorer:ScorerActor\" "
                        "(docs/scorers.md)")
        return None

    learner_options = {name: options[name].get("learner") or {} for name in learners}
    distilling = [name for name in learners if _distils(learner_options[name])]
    named_teacher = False        # an orchestrator names a teacher (a scorer or not: that is its own problem)
    teachers = []
    for name in classes:
        if name in environments:
            for scorer in options[name].get("scorers") or []:
                named_scorer(f"{name}.scorers", scorer)
        if name in orchestrators and options[name].get("teacher"):
            named_teacher = True
            teacher = named_scorer(f"{name}.teacher", options[name]["teacher"])
            if teacher is not None:
                teachers.append((name, options[name]["teacher"], teacher))
    for orchestrator, scorer, teacher in teachers:
        where = f"{orchestrator}.teacher = {scorer!r}"
        if teacher.get("serves", "logprobs") != "logprobs":
            problems.append(f"{where}: that scorer serves {teacher.get('serves')!r}; a teacher serves "
                            f"\"logprobs\"; fix: set {scorer}.serves = \"logprobs\" (or name another scorer)")
        if not distilling:
            problems.append(f"{where}, but no learner distils: its rows would be thrown away; "
                            "fix: set the learner's loss = \"opd\" or distill_coef > 0, or remove the teacher")
        top_k = options[orchestrator].get("teacher_top_k")
        if top_k is not None and teacher.get("serves", "logprobs") == "logprobs":
            vocab = _vocab_size(teacher.get("model", "tiny"))
            if top_k > vocab:
                problems.append(f"{orchestrator}.teacher_top_k = {top_k}: more than the teacher's vocabulary "
                                f"({vocab}); fix: set teacher_top_k to at most {vocab}, or leave it unset")
    for name in distilling:
        local = learner_options[name].get("teacher_model")
        if not named_teacher and not local:
            problems.append(f"{name}.learner distils (loss \"opd\" or distill_coef > 0) but has no teacher; "
                            "fix: name a scorer that serves \"logprobs\" as the orchestrator's teacher, or "
                            "set the learner's teacher_model")
        if local and named_teacher:
            problems.append(f"{name}.learner.teacher_model = {local!r} and the orchestrator's teacher both "
                            "score the samples; the learner takes one or the other; fix: remove the "
                            "orchestrator's teacher (the full vocabulary, in the learner) or the learner's "
                            "teacher_model (top-k rows from the scorer)")
        if local:
            difference = _vocabulary_difference(options[name], local, sizes=True)
            if difference is not None:
                problems.append(f"{name}.learner.teacher_model = {local!r}: its tokenizer is not the policy's "
                                f"({difference}); {_ONE_VOCABULARY}")
    for orchestrator, scorer, teacher in teachers:
        for name in distilling:
            difference = _vocabulary_difference(options[name], teacher.get("model", "tiny"))
            if difference is not None:
                problems.append(f"{orchestrator}.teacher = {scorer!r}: its tokenizer is not the policy's "
                                f"({difference}); {_ONE_VOCABULARY}")
    if problems:
        raise ConfigError(f"{len(problems)} scorer problem(s):\n  " + "\n  ".join(problems))


_ONE_VOCABULARY = ("on-policy distillation compares logprobs token id by token id, so teacher and student must "
                   "share one vocabulary; fix: a teacher of the policy's tokenizer (its family), or a "
                   "policy of the teacher's (docs/scorers.md)")


def _distils(learner: dict[str, Any]) -> bool:
    return learner.get("loss") == "opd" or float(learner.get("distill_coef") or 0.0) > 0


def _vocab_size(spec: str | dict) -> int:
    from ..models.spec import model_config
    return model_config(spec).vocab_size


def _vocabulary_difference(learner_options: dict[str, Any], teacher: str | dict, sizes: bool = False) -> str | None:
    """None when the teacher's tokenizer maps every token to the policy's id; else the first
    difference, naming both models. With `sizes`, the models' vocabulary sizes must agree too
    (the learner's own teacher: its full distribution is compared with the policy's)."""
    from ..models.spec import spec_tokenizer
    policy = learner_options.get("model", "tiny")
    if policy == teacher:
        return None
    if sizes and _vocab_size(policy) != _vocab_size(teacher):
        return (f"a vocabulary of {_vocab_size(teacher)} tokens, the policy {_label(policy)} "
                f"{_vocab_size(policy)}")
    difference = spec_tokenizer(policy).vocabulary_difference(spec_tokenizer(teacher))
    return None if difference is None else f"policy {_label(policy)}, teacher {_label(teacher)}: {difference}"


def _label(spec: str | dict) -> str:
    return repr(spec) if isinstance(spec, str) else "of ModelConfig fields"
