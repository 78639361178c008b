"""The orchestrator's options (a config's `[[actors]] options` for `OrchestratorActor`), one line each.

`model`, `task`, `task_options` and `seed` are shared settings: state them once in a run
config's `[shared]` and every role that declares them (generator, learner, environment,
orchestrator) gets the same value.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from ..env.user_errors import DEFAULT_MAX_ERROR_FRACTION
from ..models.chat_template import OPTION_HELP as CHAT_TEMPLATE_HELP
from ..records import SamplingParams
from ..tasks import TaskOptions, get_task


def _rl_sampling() -> SamplingParams:
    """SamplingParams' defaults, with room for a tool call and an answer (96 new tokens, not 64)."""
    return SamplingParams(max_new_tokens=96)


class OrchestratorOptions(TaskOptions):
    # -- shared with the other roles ([shared]); task and task_options come from TaskOptions --
    model: str | dict = Field("tiny", description="the policy's model spec; the orchestrator reads only "
                              "its tokenizer, to render the warm start's demonstrations")
    chat_template: str | None = Field(None, description=CHAT_TEMPLATE_HELP)
    seed: int = Field(0, description="the data order (batch b's prompts are a function of (seed, b)), the "
                      "demonstrations and the evaluation's sampling seeds")
    # -- the actors it drives (names in the run config) --
    learner: str = Field("learner", description="the learner actor's name")
    generators: list[str] = Field(default_factory=lambda: ["generator"], description="generator actors that "
                                  "get every published version")
    weight_chunk_mb: float | None = Field(64.0, gt=0, description="a weight sync to a generator on another "
                                          "host (reached over tcp) goes in messages of at most this many "
                                          "MiB of whole tensors; generators on this host get one message "
                                          "through /dev/shm; none: one message to every generator")
    envs: list[str] = Field(default_factory=lambda: ["env"], min_length=1, description="environment actors; "
                            "rollouts go to them in turn")
    teacher: str | None = Field(None, description="the scorer actor (serves = \"logprobs\") that scores "
                                "every sample's tokens for on-policy distillation (learner loss \"opd\" or "
                                "distill_coef); none: samples are not scored (docs/scorers.md)")
    teacher_top_k: int | None = Field(None, ge=1, description="the teacher's most likely tokens sent per "
                                      "position; none: the teacher's own top_k")
    task_weights: Literal["fixed", "signal"] = Field("fixed", description="a mixture's shares of the groups: "
                                                     "\"fixed\" by the [[tasks]] weights, or \"signal\": "
                                                     "more groups to tasks whose groups carry a learning "
                                                     "signal (actors/orchestrator/task_weights.py)")
    min_task_share: float = Field(0.05, ge=0, lt=1, description="with task_weights = \"signal\": every "
                                  "task's share of the groups, at least")
    # -- the RL loop --
    num_steps: int = Field(10, ge=0, description="GRPO steps (one batch each)")
    prompts_per_step: int = Field(8, ge=1, description="prompts per batch (part of the data order)")
    samples_per_prompt: int = Field(8, ge=1, description="samples per prompt: the GRPO group size")
    max_staleness: int = Field(0, ge=0, description="batch b starts generating once batch b - 1 - "
                               "max_staleness is trained; 0: on-policy and synchronous")
    max_buffered_batches: int = Field(0, ge=0, description="batches admitted and not yet trained, at most; "
                                      "0: no bound beyond max_staleness")
    max_concurrent_rollouts: int = Field(64, ge=1, description="rollouts in flight at once (training and "
                                         "evaluation together)")
    max_rollout_retries: int = Field(3, ge=0, description="retries of a rollout whose actor died or whose "
                                     "tokens are older than the last publish")
    dynamic_sampling: bool = Field(False, description="DAPO's dynamic sampling: a group whose rewards are all "
                                   "equal is dropped before training (ledger: 'zero reward variance'); at most "
                                   "prompts_per_step groups train (dynamic_sampling.py)")
    dynamic_sampling_extra_prompts: int = Field(0, ge=0, description="with dynamic_sampling: prompts generated "
                                                "per batch beyond prompts_per_step, so that the groups left "
                                                "after the drop fill the batch")
    overlong_max_tokens: int | None = Field(None, gt=0, description="DAPO's overlong shaping: a sample of more "
                                            "policy tokens than this minus overlong_buffer_tokens loses up to 1 "
                                            "of its reward, linearly, all of it beyond this; none: off")
    overlong_buffer_tokens: int = Field(16, ge=1, description="the ramp of overlong shaping, tokens (at most "
                                        "overlong_max_tokens)")
    sampling: SamplingParams = Field(default_factory=_rl_sampling, description="how rollouts sample "
                                     "(SamplingParams fields; stop is set to the tools' stop strings); "
                                     "SamplingParams' defaults but max_new_tokens 96")
    max_rl_wall_s: float | None = Field(None, gt=0, description="seconds of RL at most (this start of "
                                        "the run): once spent, the step in progress finishes, then the "
                                        "final evaluation; none: num_steps alone ends RL")
    max_environment_error_fraction: float = Field(DEFAULT_MAX_ERROR_FRACTION, ge=0, le=1, description=(
        "a step (or an evaluation) in which more than this fraction of the samples failed with one and the "
        "same environment error (one reason in the ledger) stops the run, naming the error, the user's line "
        "and the count; 1: never"))
    checkpoint_every: int = Field(10, ge=1, description="RL steps between checkpoints; the last step "
                                  "always checkpoints")
    sample_text_max_chars: int = Field(4096, ge=64, description="characters kept of each text in "
                                       "samples.jsonl (a prompt, a completion, a tool output; head and "
                                       "tail, the cut marked)")
    warn_no_signal_every: int = Field(10, ge=1, description="RL steps between two warnings while every "
                                      "group of a step has zero reward variance (no learning signal); "
                                      "the first such step always warns")
    # -- warm start and evaluation --
    sft_demonstrations: str | None = Field(None, description="a JSONL file of chat demonstrations for the "
                                           "warm start, one {\"messages\": [...]} per line with an assistant "
                                           "turn (relative to the directory `postrain up` starts in); none: the "
                                           "task's own (its TaskSpec's demos)")
    sft_steps: int = Field(0, ge=0, description="supervised warm-start steps on the demonstrations "
                           "(sft_demonstrations, else the task's) before RL; 0: none")
    sft_batch_size: int = Field(16, ge=1, description="demonstrations per warm-start step")
    sft_distinct_demonstrations: int = Field(0, ge=0, description="0: every warm-start step trains on "
                                             "demonstrations not seen before (sft_steps x sft_batch_size of "
                                             "them); N: the warm start draws N distinct ones (the task's, or "
                                             "the file's first N after its seeded shuffle) and passes over them "
                                             "in the same order until its steps are done")
    sft_checkpoint_every: int = Field(50, ge=1, description="warm-start steps between checkpoints; the last "
                                      "warm-start step always checkpoints (a kill or a resume in the warm "
                                      "start loses at most the steps since)")
    eval_every: int = Field(0, ge=0, description="RL steps between evaluations during RL (greedy, and "
                            "sampled with eval_samples_per_task), each a metrics row with its step and "
                            "wall time; 0: only before and after")
    num_eval_tasks: int = Field(50, ge=0, description="held-out tasks per evaluation (greedy)")
    eval_samples_per_task: int = Field(0, ge=0, description="also sample this many episodes per held-out "
                                       "task at the run's sampling settings, seeded, and report their mean "
                                       "as sampled accuracy; 0: greedy only")
    max_eval_repeats: int = Field(2, ge=0, description="times an evaluation is redone from the start when "
                                  "an episode could not finish because actors on its path kept dying "
                                  "(after max_rollout_retries); then the run stops; an evaluation is "
                                  "never reported from part of its episodes")

    @field_validator("sft_demonstrations")
    @classmethod
    def _readable_demonstrations(cls, value: str | None) -> str | None:
        if value is not None:
            from ..tasks.demonstrations import read_jsonl
            try:
                if not read_jsonl(value):
                    raise ValueError(f"{value} holds no demonstration; fix: one {{\"messages\": [...]}} per line")
            except OSError as exc:
                raise ValueError(f"cannot read {value} ({exc.strerror}); fix: a JSONL file of chat "
                                 "demonstrations (relative paths: to the directory `postrain up` starts in)") from None
        return value

    @field_validator("sft_steps")
    @classmethod
    def _demonstrations_for_warm_start(cls, value: int, info: ValidationInfo) -> int:
        """A warm start needs demonstrations: a file, or a task that has its own (refused here,
        at `--dry-run`, not after the first evaluation)."""
        if value == 0 or "task" not in info.data or info.data.get("sft_demonstrations"):
            return value
        if "sft_demonstrations" not in info.data:   # a bad file: that is the error
            return value
        entries = info.data.get("tasks") or []
        if entries and all(get_task(entry.task).demos is None for entry in entries):
            raise ValueError(f"a warm start of {value} steps needs demonstrations, and no task of the mixture "
                             f"{[entry.label for entry in entries]} has any; fix: set sft_steps = 0 in the "
                             "orchestrator's options, or give it sft_demonstrations = \"FILE.jsonl\"")
        task = info.data["task"]
        if not entries and get_task(task).demos is None:
            raise ValueError(f"a warm start of {value} steps needs demonstrations, and task {task!r} has "
                             "none; fix: set sft_steps = 0 in the orchestrator's options (no warm start), "
                             "or give it demonstrations: sft_demonstrations = \"FILE.jsonl\" (one "
                             "{\"messages\": [...]} per line) or demos= in its TaskSpec "
                             "(a function (num, seed, options) -> list of {\"messages\": [...]})")
        return value

    @field_validator("samples_per_prompt")
    @classmethod
    def _a_baseline_or_a_teacher(cls, value: int, info: ValidationInfo) -> int:
        """A group of one sample has no GRPO baseline: it trains only on a teacher's KL (train_step.py)."""
        if value == 1 and not info.data.get("teacher"):
            raise ValueError("samples_per_prompt = 1 gives every group one sample, which has no baseline (GRPO's "
                             "advantage is a sample's reward against its group's), so every sample would be "
                             "dropped untrained; fix: samples_per_prompt >= 2, or distil: the orchestrator's "
                             "teacher = \"SCORER\" (a lone sample then trains on the teacher's KL; docs/scorers.md)")
        return value

    @field_validator("min_task_share")
    @classmethod
    def _room_for_every_floor(cls, value: float, info: ValidationInfo) -> float:
        num_tasks = len(info.data.get("tasks") or [None])
        if info.data.get("task_weights") == "signal" and value * num_tasks > 1:
            raise ValueError(f"min_task_share = {value} for {num_tasks} tasks asks for more than every group; "
                             f"fix: at most {1 / num_tasks:.3g}")
        return value

    @field_validator("overlong_buffer_tokens")
    @classmethod
    def _buffer_within_maximum(cls, value: int, info: ValidationInfo) -> int:
        maximum = info.data.get("overlong_max_tokens")
        if maximum is not None and value > maximum:
            raise ValueError(f"overlong_buffer_tokens = {value} exceeds overlong_max_tokens = {maximum}; fix: a "
                             "buffer at most the maximum (DAPO: a quarter of it)")
        return value

    @property
    def prompts_generated_per_step(self) -> int:
        """Prompts generated per RL batch: prompts_per_step, plus the extra ones of dynamic sampling."""
        return self.prompts_per_step + (self.dynamic_sampling_extra_prompts if self.dynamic_sampling else 0)

    @property
    def batch_size(self) -> int:
        """Samples per RL batch."""
        return self.prompts_per_step * self.samples_per_prompt
