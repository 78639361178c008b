"""Environments for tests/actors/env/test_actor.py, importable by path from actor processes
(the test prepends this folder to sys.path; spawned actors inherit it). Named as a task by
import path, `scripted_envs:CountdownEnv`, they exercise `task = "pkg.mod:EnvClass"`."""
from __future__ import annotations

import itertools

from pydantic import Field

from postrain.actors import Environment, Reward, StepResult
from postrain.core import Options


class CountdownOptions(Options):
    target: int = Field(2, ge=1, description="the turn at which the episode is done")
    max_turns: int | None = Field(None, ge=1, description="actions before truncation")


class CountdownEnv(Environment):
    """Done at turn `target`; every step pays an intermediate reward that depends on the action's
    text (`chars`), the last step `finished` (weight 2) and names the cause "counted_down"; running
    out of turns pays `truncated` = -1 and names none."""

    max_turns = 3
    options_model = CountdownOptions

    @classmethod
    def train_tasks(cls, seed, options):
        return ({"id": f"countdown-{seed}-{i}"} for i in itertools.count())

    @classmethod
    def eval_tasks(cls, options):
        return [{"id": "countdown-eval-0"}]

    async def reset(self, task):
        self.turn = 0
        return f"Count down ({task['id']})."

    async def step(self, action):
        self.turn += 1
        chars = Reward({"chars": len(action) / 100, "step": 0.25})
        if self.turn >= self.options.target:
            return StepResult(None, True, Reward({**chars.components, "finished": 1.0}, {"finished": 2.0}),
                              info={"turn": self.turn, "cause": "counted_down"})
        return StepResult(f"{self.turn} down.", False, chars, info={"turn": self.turn})

    async def truncated(self):
        return Reward({"truncated": -1.0})


class SandboxedCountdownEnv(CountdownEnv):
    """The same episode, declared as one that runs code: it needs a sandbox actor."""

    uses_sandbox = True
