"""`ScoredSample`: one RL sample whose rollout came back, as it goes from the rollout pool
(rollout_pool.py) through the admission's buffer (admission.py) to the train step
(train_step.py). Its own module, so that those three import it and not each other."""
from __future__ import annotations

import dataclasses

from ..env.api import Reward
from ..records import Rollout


@dataclasses.dataclass(frozen=True, slots=True)
class ScoredSample:
    """A sample whose rollout came back: its ledger id and the rollout (with its reward)."""

    sample_id: str
    rollout: Rollout

    @property
    def reward(self) -> Reward:
        return self.rollout.reward
