"""The teacher's rows for on-policy distillation: each sample's tokens, scored by a scorer actor.

    teacher = Teacher(await lookup("teacher"), top_k=32)
    rows = await teacher.score(rollout)          # one SequenceScores per segment, oldest first

When the learner distils (`learner.loss = "opd"`, or `distill_coef` > 0), the orchestrator's
`teacher` option names a scorer actor that serves "logprobs" (actors/scorer/). As each rollout
comes back, its segments go to the teacher in one SCORE_TOKENS call, each scored from its first
trained token (the first 1 of its loss_mask), and the rows travel with the sample into its
TrainBatch (the `teacher_*` fields, aligned with token_ids: docs/scorers.md). Tokens the
environment wrote (tool output) are scored too where they fall after the first trained token;
the learner reads rows only where loss_mask is 1.

Failures. A teacher that died is asked again until it is back (the supervisor restarts it),
for at most `restart_timeout_s`; any other failure, or a teacher still gone then, raises
`TeacherFailed`, and the rollout pool drops the
sample with that reason: an infrastructure failure, so the sample leaves its group's baseline
(train_step.py) and is never trained without its rows, nor as a 0.
"""
from __future__ import annotations

import anyio

from postrain.core.errors import PostrainError

from ..learner.recovery import is_actor_death, short_reason
from ..records import SCORE_TOKENS, Rollout, SequenceScores, TokenScoresRequest

TEACHER_TIMEOUT_S = 600          # one scoring call, at most
RESTART_TIMEOUT_S = 300.0        # a dead teacher is waited for this long (a model load), then the sample fails
RETRY_PAUSE_S = 0.2              # between two calls to a teacher that died


class TeacherFailed(PostrainError, RuntimeError):
    """The teacher could not score a sample (the reason is the ledger's)."""


class Teacher:
    """Scores rollouts on the teacher scorer `ref` (an ActorRef); stateless between calls."""

    def __init__(self, ref, top_k: int | None, restart_timeout_s: float = RESTART_TIMEOUT_S):
        self.ref = ref
        self.top_k = top_k                     # None: the scorer's own top_k
        self.restart_timeout_s = restart_timeout_s
        self.num_retries = 0                   # calls asked again after the teacher died, in all

    async def score(self, rollout: Rollout) -> tuple[SequenceScores, ...]:
        """One SequenceScores per segment of `rollout` (oldest first). Cancelled: nothing kept."""
        segments = rollout.segments()
        request = TokenScoresRequest(token_ids=[list(s.token_ids) for s in segments],
                                     score_from=[first_trained(s.loss_mask) for s in segments],
                                     top_k=self.top_k)
        deadline = anyio.current_time() + self.restart_timeout_s
        while True:
            try:
                reply = await self.ref.call(SCORE_TOKENS, request, timeout_s=TEACHER_TIMEOUT_S)
            except Exception as exc:
                if not is_actor_death(exc) or anyio.current_time() > deadline:
                    raise TeacherFailed(f"teacher {self.ref.name} failed: {short_reason(exc)}") from exc
                self.num_retries += 1
                await anyio.sleep(RETRY_PAUSE_S)
                continue
            if len(reply.sequences) != len(segments):
                raise TeacherFailed(f"teacher {self.ref.name} scored {len(reply.sequences)} sequences of "
                                    f"{len(segments)}")
            return tuple(reply.sequences)


def first_trained(loss_mask) -> int:
    """The first position whose token is trained (loss_mask 1); at least 1 (row 0 predicts nothing)."""
    for position, flag in enumerate(loss_mask):
        if flag:
            return max(position, 1)
    return max(len(loss_mask) - 1, 1)      # nothing trained: score the last row alone (it is ignored)
