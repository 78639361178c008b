"""A user's environment module with a typo (`self.targte`), as tests/actors/env/test_user_errors.py
and tests/cli/test_eval.py write it into a folder of their own: its text is the fixture (read with
`USER_CODE`), so the line a failure names is this file's line."""
from pathlib import Path

from postrain.actors import Environment, Reward, StepResult


class MyEnv(Environment):
    @classmethod
    def eval_tasks(cls, options):
        return [{"n": n} for n in range(4)]

    async def reset(self, task):
        return "Say hi."

    async def step(self, action):
        return StepResult(None, True, Reward({"correct": self.score(action)}))

    def score(self, action):
        return float(action == self.targte())


def judge(completion, example):
    return {"correct": 1.0 / len(completion)}


def deep(n):
    return deep(n - 1) if n else 1 / 0


USER_CODE = Path(__file__).read_text()
TYPO_LINE = 1 + USER_CODE.splitlines().index("        return float(action == self.targte())")
