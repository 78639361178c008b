"""StepCounter: the learner's optimizer-step count and policy version, with one writer.

    counter = StepCounter()
    counter.advance()                     # the step loop, after each optimizer step
    counter.restore(step=10, policy_version=10)   # checkpoint IO, on a load

Invariant: only `advance` and `restore` change the counts; between them `policy_version -
step` is constant (a resumed run continues its version count from the checkpoint's). Weights
published after optimizer step k carry version k.
"""
from __future__ import annotations


class StepCounter:
    """The step and the policy version (read-only outside this class)."""

    def __init__(self) -> None:
        self._step = 0
        self._policy_version = 0

    @property
    def step(self) -> int:
        """Optimizer steps taken (a resumed run's included)."""
        return self._step

    @property
    def policy_version(self) -> int:
        """The version of the weights the policy holds now."""
        return self._policy_version

    def advance(self) -> None:
        """One optimizer step was taken: both counts move by one."""
        self._step += 1
        self._policy_version += 1

    def restore(self, step: int, policy_version: int) -> None:
        """A checkpoint's counts (a load): the only other writer."""
        if step < 0 or policy_version < 0:
            raise ValueError(f"a checkpoint's step and policy_version must be >= 0, got {step}, {policy_version}")
        self._step, self._policy_version = int(step), int(policy_version)
