"""No learning signal: a step whose every group has rewards all equal.

GRPO learns from the differences between the samples of one prompt; a group whose rewards
are all equal has advantage 0 for every sample, and a step where every group is like that
changes nothing but the KL and entropy terms. It happens silently (the loss is 0, the run goes
on), so the train step asks `LearningSignalWatch.check` after each step: the first such step
gets a warning (a progress line, and a `warning` row of metrics.jsonl with code
`no_learning_signal`), and then at most one every `warn_every` steps while it goes on. The
line names the likely causes, the ones the run's own settings point at first, and what the
rewards are the sum of. A step where every sample is right (its `correct` component 1) is a
solved task, not a broken one: its line is a `note` and its row's code `solved`.
"""
from __future__ import annotations


def split_groups(rewards: list[float], group_size: int | list[int]) -> list[list[float]]:
    """Contiguous groups of `group_size` each, or of the listed sizes (groups that lost samples)."""
    if isinstance(group_size, int):
        return [rewards[i:i + group_size] for i in range(0, len(rewards), group_size)] if group_size else []
    starts = [sum(group_size[:g]) for g in range(len(group_size))]
    return [rewards[start:start + size] for start, size in zip(starts, group_size)]


def num_zero_variance_groups(rewards: list[float], group_size: int | list[int]) -> int:
    """Groups (contiguous, `group_size` each or of the listed sizes) whose rewards are all equal."""
    return sum(1 for group in split_groups(rewards, group_size) if group and max(group) == min(group))


def made_of(total: float, parts: dict[str, float] | None) -> str:
    """A reward as the sum it is: `1.1 (correct 1 + format 0.1)`, or `1.1` with one part or none."""
    shown = [f"{name} {value:g}" for name, value in (parts or {}).items()]
    return f"{total:g} ({' + '.join(shown)})" if len(shown) > 1 else f"{total:g}"


def likely_causes(rewards: list[float], samples_per_prompt: int, temperature: float,
                  sft_steps: int = 0, parts: dict[str, float] | None = None, solved: bool = False) -> list[str]:
    """What to look at, the ones the settings show first. `parts`: what one sample's reward is the
    sum of (weighted components, a penalty); `solved`: every sample is right (its `correct` is 1)."""
    causes = []
    if samples_per_prompt < 2:
        causes.append(f"samples_per_prompt = {samples_per_prompt}: a group of one has no baseline; use >= 2")
    if temperature == 0:
        causes.append("sampling temperature 0: every sample of a prompt is the same; use ~1.0")
    if rewards and max(rewards) == min(rewards) == 0:
        warm_start = (f"a longer warm start (sft_steps = {sft_steps})" if sft_steps
                      else "a warm start (sft_steps)")
        causes.append("every reward is 0: the model never reaches a rewarded answer (its format, or the "
                      f"task is too hard for it): {warm_start}, the instructions in the prompt "
                      "(include_instructions), an easier task, or more max_new_tokens if answers are cut "
                      "off (`postrain samples RUN --step N` shows what it wrote)")
    elif solved and rewards and max(rewards) == min(rewards):
        causes.append(f"every sample is right (each reward {made_of(rewards[0], parts)}): the task is "
                      "solved at this size; a harder one (task_options) gives the run something to learn")
    elif rewards and max(rewards) == min(rewards):
        causes.append(f"every reward is {made_of(rewards[0], parts)}: the reward function may return a "
                      "constant, or every sample fails the same way (`postrain samples RUN --step N`)")
    else:
        causes.append("each prompt's samples score alike (all right or all wrong per prompt): raise "
                      "samples_per_prompt or the temperature, or pick prompts of middling difficulty")
    return causes


class LearningSignalWatch:
    """Warns on steps without a learning signal (module docstring)."""

    def __init__(self, samples_per_prompt: int, temperature: float, warn_every: int = 10, sft_steps: int = 0):
        self.samples_per_prompt = samples_per_prompt
        self.temperature = temperature
        self.sft_steps = sft_steps
        self.warn_every = warn_every            # steps between two warnings while it goes on (>= 1)
        self.last_warned: int | None = None     # the step of the last warning
        self.num_steps_without = 0              # steps without a signal so far (all of them)

    def check(self, step: int, rewards: list[float], group_sizes: list[int] | None = None,
              parts: dict[str, float] | None = None, all_correct: bool = False) -> dict | None:
        """The warning for RL step `step` (1-based) whose samples' total rewards are `rewards`
        (contiguous groups of `group_sizes`, default samples_per_prompt each; `parts`: what a
        sample's reward is the sum of; `all_correct`: every sample's `correct` is 1), or None:
        {"line": ..., "row": {...metrics row figures}}. A solved task is a note, not a warning."""
        group_size = self.samples_per_prompt if group_sizes is None else group_sizes
        num_groups = len(split_groups(rewards, group_size))
        zero = num_zero_variance_groups(rewards, group_size)
        if not num_groups or zero < num_groups:
            return None
        self.num_steps_without += 1
        if self.last_warned is not None and step - self.last_warned < self.warn_every:
            return None
        self.last_warned = step
        solved = all_correct and max(rewards) == min(rewards)
        causes = likely_causes(rewards, self.samples_per_prompt, self.temperature, self.sft_steps, parts, solved)
        groups = "its one group has" if num_groups == 1 else f"all {num_groups} groups have"
        line = (f"{'note' if solved else 'warning'}: step {step}: no learning signal: {groups} zero reward "
                f"variance (every sample of each prompt got the same reward, so every advantage is 0; "
                f"{self.num_steps_without} such step{'s' if self.num_steps_without > 1 else ''} so far). "
                + ("Why: " if solved else "Likely: ") + "; ".join(causes))
        row = {"code": "solved" if solved else "no_learning_signal", "step": step, "num_groups": num_groups,
               "num_zero_variance_groups": zero, "reward_mean": sum(rewards) / len(rewards),
               "num_steps_without_signal": self.num_steps_without, "causes": causes}
        return {"line": line, "row": row}
