"""reasoning-gym tasks: procedurally generated reasoning problems, each scored by its own verifier.

    task = "reasoning_gym:chain_sum"                        # one family; its generator's options
    task_options = { min_terms = 2, max_terms = 3, num_eval = 50 }

    task = "reasoning_gym"                                  # a mixture of families, by weight
    task_options = { families = { chain_sum = 2.0, count_bits = 1.0 },
                     configs = { chain_sum = { max_digits = 2 } } }

Every family of the installed `reasoning-gym` package (`reasoning_gym.factory.DATASETS`) works,
offline. Its generator makes the problem and its `score_answer` is the reward: the component
`correct`, in [0, 1]. Some families give part marks to a wrong answer that contains the right
one (chain_sum: `1-5` earns 1/3 and `-5` earns 1/2 when the answer is 5), which RL reinforces;
`partial_credit = false` makes the reward 1 for full marks and 0 otherwise. The model is asked
to put its final answer between <answer> and </answer> (`rewards.final_answer` takes it out).

Held out by seed: a family's held-out set is its first `num_eval` problems generated with
`eval_seed`; training problems come from seeds derived from the run's seed, and a training
problem whose question is in the held-out set is skipped, so the two never share a question.
The mixture draws each training problem's family with probability weight / sum(weights), seeded.

Demonstrations (for a supervised warm start, `sft_steps`): training problems answered with the
generator's own answer between <answer> tags, so a small model learns the format before RL.

A task dict names the problem (family, config, seed, index) rather than carrying it: the
environment regenerates it (reasoning-gym's generators are deterministic per seed and index), so
nothing but plain data crosses the wire. An unknown family is a `TaskOptionsError` listing the
names closest to it.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import itertools
import json
import random
from typing import Any, Iterator, cast

from pydantic import Field, create_model, field_validator, model_validator

from postrain.core import Options

from ..env.api import Environment, StepResult, TaskOptionsError, check_options
from .registry import TaskError, TaskSpec
from .rewards import RewardFunction, final_answer

PREFIX = "reasoning_gym:"
EVAL_SEED = 20261201
TRAIN_SIZE = 1_000_000     # a training dataset's index space (problems are made on demand)
_RESERVED = ("seed", "size")   # generator fields postrain sets itself
SYSTEM_PROMPT = ("Answer the question. Put only the final answer between <answer> and </answer>, "
                 "for example <answer>42</answer>.")


def family_names() -> list[str]:
    from reasoning_gym.factory import DATASETS
    return sorted(DATASETS)


def check_family(name: str) -> str:
    """`name`, if reasoning-gym has such a family; else TaskOptionsError with the closest names."""
    names = family_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=5, cutoff=0.5) or \
            [n for n in names if name.split("_")[0] in n][:5]
        raise TaskOptionsError(f"reasoning-gym has no task family {name!r}; closest: {close}; fix: use one "
                               f"of the {len(names)} names of reasoning_gym.factory.DATASETS")
    return name


def check_config(family: str, config: dict) -> dict:
    """`config`, once the family's generator config accepts it (its own checks included)."""
    from reasoning_gym.factory import DATASETS
    config_class = DATASETS[family][1]
    bad = sorted(set(config) & set(_RESERVED))
    if bad:
        raise TaskOptionsError(f"reasoning-gym option(s) {bad} of {family!r} are set by postrain (from the "
                               f"run's seed and num_eval); fix: remove them")
    try:
        config_class(**config, seed=0, size=1).validate()
    except (TypeError, AssertionError, ValueError) as exc:
        raise TaskOptionsError(f"bad options for reasoning-gym family {family!r}: {exc}; its options: "
                               f"{generator_fields(family)}") from None
    return config


def generator_fields(family: str) -> list[str]:
    from reasoning_gym.factory import DATASETS
    return [f.name for f in dataclasses.fields(DATASETS[family][1]) if f.name not in _RESERVED]


class MixtureOptions(Options):
    """The task options of `reasoning_gym` (a mixture of families)."""

    families: dict[str, float] = Field(description="family name -> weight (> 0): how often training "
                                       "draws it", min_length=1)
    configs: dict[str, dict[str, Any]] = Field(default_factory=dict, description="family name -> its "
                                               "generator's options (difficulty knobs)")
    num_eval: int = Field(20, ge=0, description="held-out problems per family")
    eval_seed: int = Field(EVAL_SEED, description="the seed of the held-out problems")
    system_prompt: str = Field(SYSTEM_PROMPT, description="the system message (asks for <answer> tags)")
    score_timeout_s: float = Field(30.0, gt=0, description="a scorer call past this fails its sample, seconds")
    partial_credit: bool = Field(True, description="true: the family's score as it is, part marks included; "
                                 "false: 1 for full marks, else 0 (nothing to farm)")
    max_turns: int = Field(1, ge=1, le=1, description="single-turn: one assistant turn per episode")

    @field_validator("families")
    @classmethod
    def _families(cls, value: dict) -> dict:
        for name, weight in value.items():
            check_family(name)
            if not weight > 0:
                raise ValueError(f"the weight of {name!r} must be > 0, got {weight}")
        return value

    @model_validator(mode="after")
    def _configs(self):
        for name, config in self.configs.items():
            if name not in self.families:
                raise ValueError(f"configs names {name!r}, which is not in families {sorted(self.families)}")
            check_config(name, config)
        return self


def mixture_options(options: dict | MixtureOptions | None) -> MixtureOptions:
    """`options` checked (a dict, None or a `MixtureOptions`); TaskOptionsError names a bad one."""
    return check_options(MixtureOptions, options, "task 'reasoning_gym'")


@functools.lru_cache(maxsize=64)
def _dataset(family: str, config_json: str, seed: int, size: int):
    import reasoning_gym
    return reasoning_gym.create_dataset(family, seed=seed, size=size, **json.loads(config_json))


def _problem(family: str, config: dict, seed: int, size: int, index: int) -> dict:
    """A task dict naming one problem (the environment regenerates it)."""
    config_json = json.dumps(config, sort_keys=True)
    question = _dataset(family, config_json, seed, size)[index]["question"]
    return {"family": family, "config": config_json, "seed": seed, "size": size, "index": index,
            "question": question}


def _held_out(family: str, options: MixtureOptions) -> list[dict]:
    num, config = options.num_eval, options.configs.get(family, {})
    return [_problem(family, config, options.eval_seed, max(num, 1), i) for i in range(num)]


def mixture_train_tasks(seed: int = 0, options: dict | MixtureOptions | None = None) -> Iterator[dict]:
    """An endless, deterministic stream of training problems, families drawn by weight."""
    options = mixture_options(options)
    families = sorted(options.families)
    weights = [options.families[f] for f in families]
    held_out = {f: {p["question"] for p in _held_out(f, options)} for f in families}
    rng = random.Random(f"reasoning-gym-{seed}")
    next_index = dict.fromkeys(families, 0)
    for i in itertools.count():
        family = rng.choices(families, weights)[0]
        while True:   # skip problems whose question is held out
            index = next_index[family]
            next_index[family] += 1
            problem = _problem(family, options.configs.get(family, {}),
                               _train_seed(seed, family), TRAIN_SIZE, index % TRAIN_SIZE)
            if problem["question"] not in held_out[family]:
                break
        yield {"id": f"rg-train-{seed}-{i}", **problem}


def _train_seed(seed: int, family: str) -> int:
    return random.Random(f"reasoning-gym-train-{seed}-{family}").randrange(2 ** 31)


def mixture_eval_tasks(options: dict | MixtureOptions | None = None) -> list[dict]:
    """The held-out problems: `num_eval` per family, families in name order."""
    options = mixture_options(options)
    return [{"id": f"rg-eval-{family}-{p['index']}", **p}
            for family in sorted(options.families) for p in _held_out(family, options)]


def _entry(task: dict) -> tuple[Any, dict]:
    """(the family's dataset, the problem's entry) of a task dict, regenerated."""
    dataset = _dataset(task["family"], task["config"], task["seed"], task["size"])
    return dataset, dataset[task["index"]]


def score(completion: str, task: dict) -> dict[str, float]:
    """The family's own verdict on the completion's final answer: {"correct": score in [0, 1]}."""
    dataset, entry = _entry(task)
    return {"correct": float(dataset.score_answer(answer=final_answer(completion), entry=entry))}


def prompt_messages(task: dict, options: MixtureOptions) -> list[dict]:
    """The first messages of an episode (demonstrations begin with the same); `options`: a
    mixture's or one family's (both have `system_prompt`)."""
    return [{"role": "system", "content": options.system_prompt},
            {"role": "user", "content": task["question"]}]


def mixture_demonstrations(num: int, seed: int = 0, options: dict | MixtureOptions | None = None) -> list[dict]:
    """`num` chat demonstrations for a supervised warm start: training problems (never held-out
    ones), each answered with the generator's own answer between <answer> tags."""
    options = mixture_options(options)
    return [{"messages": [*prompt_messages(task, options),
                          {"role": "assistant", "content": f"<answer>{_entry(task)[1]['answer']}</answer>"}]}
            for task in itertools.islice(mixture_train_tasks(seed, options), num)]


class ReasoningGymEnv(Environment):
    """A reasoning-gym problem, one answer, scored by the family's verifier. Options:
    `MixtureOptions`, or a family's model (`family_options_model`); both hold the knobs it reads
    (`system_prompt`, `score_timeout_s`, `partial_credit`, `max_turns` = 1)."""

    options_model = MixtureOptions
    options: MixtureOptions
    scorer = RewardFunction("reasoning_gym", score)

    async def reset(self, task: dict) -> list[dict]:
        """The question. Does not wait (cancel-safe)."""
        self.task = task
        return prompt_messages(task, self.options)

    async def step(self, action: str) -> StepResult:
        """Score the answer (in a worker thread, within score_timeout_s). Raises RewardFailure (the
        sample is dropped). Cancellation: no reward; the scorer's thread runs on to its end."""
        reward = await self.scorer.score(action, self.task, answer_field="",
                                         timeout_s=self.options.score_timeout_s)
        if not self.options.partial_credit:
            reward.components["correct"] = float(reward.components["correct"] == 1.0)
        return StepResult(None, True, reward)


# --------------------------------------------------------------------------- one family
_KNOBS = ("num_eval", "eval_seed", "system_prompt", "score_timeout_s", "partial_credit", "max_turns")


@functools.cache
def family_options_model(family: str) -> type[Options]:
    """The task options of `reasoning_gym:FAMILY`: the generator's options and the mixture's knobs."""
    fields: dict[str, Any] = {name: (Any, None) for name in generator_fields(family)}
    knobs: dict[str, Any] = {name: (info.annotation, info)
                             for name, info in MixtureOptions.model_fields.items() if name in _KNOBS}

    def check(self):
        check_config(family, {k: getattr(self, k) for k in self.model_fields_set if k not in _KNOBS})
        return self
    # type ignore: pydantic's stub takes plain callables as validators, its code decorated ones too
    return create_model(f"ReasoningGym_{family}_Options", __base__=Options, **fields, **knobs,
                        __validators__={"_config": model_validator(mode="after")(check)})  # type: ignore[dict-item]


def _as_mixture(family: str, options: Options) -> MixtureOptions:
    """A family's checked options (`family_options_model`) as the one-family mixture: the
    generator's options given become its `configs` entry, the knobs carry over (given or not)."""
    given = options.model_dump(include=options.model_fields_set)
    return mixture_options({"families": {family: 1.0}, "configs": {family: {
        k: v for k, v in given.items() if k not in _KNOBS}}, **{k: getattr(options, k) for k in _KNOBS}})


@functools.cache
def family_task(family: str):
    """The TaskSpec of `reasoning_gym:FAMILY` (TaskError listing the closest names when reasoning-gym
    has no such family)."""
    try:
        check_family(family)
    except TaskOptionsError as exc:
        raise TaskError(str(exc)) from None
    env_class = cast(type[ReasoningGymEnv], type(  # a subclass made at run time
        f"ReasoningGymEnv_{family}", (ReasoningGymEnv,),
        {"options_model": family_options_model(family), "__module__": __name__}))
    return TaskSpec(PREFIX + family, env_class,
                    train=lambda seed, options: mixture_train_tasks(seed, _as_mixture(family, options)),
                    eval=lambda options: mixture_eval_tasks(_as_mixture(family, options)),
                    demos=lambda num, seed=0, options=None: mixture_demonstrations(
                        num, seed, _as_mixture(family, options)),
                    description=f"reasoning-gym's {family} problems, scored by its verifier")
