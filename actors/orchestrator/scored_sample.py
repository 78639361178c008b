"""`ScoredSample`: one RL sample whose rollout came back, as it goes from the rollout pool
(rollout_pool.py) through the admission's buffer (admission.py) to the train step
(train_step.py). Its own module, so that those three import it and not each other."""
from __future__ import annotations

import dataclasses

from ..records import Reward, Rollout, SequenceScores
from .ledger import segment_id


@dataclasses.dataclass(frozen=True, slots=True)
class ScoredSample:
    """A sample whose rollout came back: its ledger id and the rollout (with its reward). An
    episode of several segments (records/rollout.py) trains one row per segment, each its own
    ledger sample (`segment_ids`, oldest first; the first is `sample_id`). When the run
    distils, `teacher` holds the teacher's rows of each segment, oldest first (teacher.py). `task`:
    the name of the mixture's task it is of (actors/tasks/mixture.py)."""

    sample_id: str
    rollout: Rollout
    teacher: tuple[SequenceScores, ...] | None = None
    task: str = ""

    @property
    def reward(self) -> Reward:
        return self.rollout.reward

    @property
    def segment_ids(self) -> list[str]:
        return [segment_id(self.sample_id, k) for k in range(self.rollout.num_segments)]
