"""Infrastructure failures are not zero rewards: a sample whose reward function raised (or whose
actor died past the retries) is dropped in the ledger with the reason, left out of its group,
and the group's other samples get exactly the advantages they would have had if it had never
been sampled; the learner trains the uneven groups (actors/orchestrator/train_step.py,
ext/advantages.py). Real parts: the rollout pool's sample path, a user's reward function that
raises, the ledger, a tiny Llama learner."""
from __future__ import annotations

import torch
import trio

from postrain.actors.env.api import Reward
from postrain.actors.env.user_errors import EnvironmentErrors
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.orchestrator.ledger import SampleLedger, read_events
from postrain.actors.orchestrator.rollout_pool import RolloutPool
from postrain.actors.orchestrator.train_step import GROUP_INCOMPLETE, surviving_groups, train_batch
from postrain.actors.records import Rollout
from postrain.actors.tasks.rewards import RewardFunction
from postrain.ext.advantages import group_advantages

TINY = dict(vocab_size=264, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
            num_kv_heads=1, max_position_embeddings=64, tie_word_embeddings=True)


def rollout(seed: int, reward: float) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, 264, (10,), generator=g).tolist()
    mask = [0] * 4 + [1] * 6
    return Rollout(token_ids=ids, loss_mask=mask, behavior_logprobs=[-5.5] * 10,
                   policy_versions=[0 if m else -1 for m in mask], reward=Reward({"correct": reward}),
                   num_turns=1, num_policy_tokens=6)


def broken_reward(completion, example):
    raise ConnectionError("the grader's service is down")


def pool_sample(ledger: SampleLedger, sample_id: str, outcome: Rollout | None, group: list) -> None:
    """The rollout pool's per-sample path (`RolloutPool._sample`), whose episode returns `outcome`
    or, for None, whose reward function raises as a user's may."""
    pool = RolloutPool.__new__(RolloutPool)   # only its ledger, errors, teacher and `rollout` take part here
    pool.ledger = ledger
    pool.errors = EnvironmentErrors(1.0, show=lambda line: None)
    pool.teacher = None

    async def episode(task, sampling, sample_id=None, min_version=None, task_name=""):
        if outcome is None:
            await RewardFunction("grader", broken_reward).score("42", {"answer": "42"}, answer_field="answer")
        return outcome

    pool.rollout = episode
    trio.run(pool._sample, sample_id, "", {}, None, group, 0)


def test_a_failed_sample_is_left_out_of_its_groups_baseline_and_never_trained_as_zero(tmp_path):
    ledger = SampleLedger(tmp_path / "ledger.jsonl")
    rewards = [[1.0, 0.0, None, 1.0], [0.0, 1.0, 0.5, 0.0], [None, None, None, 1.0]]
    groups = []
    for g, group_rewards in enumerate(rewards):
        group = []
        for s, reward in enumerate(group_rewards):
            sample_id = f"b0-g{g}-s{s}"
            ledger.create(sample_id)
            pool_sample(ledger, sample_id, None if reward is None else rollout(10 * g + s, reward), group)
        groups.append(group)

    kept = surviving_groups(groups, ledger)
    batch = train_batch(kept)
    # the failed samples are in the ledger as dropped, with the reason; none is in the batch as a 0
    for sample_id in ("b0-g0-s2", "b0-g2-s0", "b0-g2-s1", "b0-g2-s2"):
        assert ledger.state(sample_id) == "dropped"
        dropped = [e for e in read_events(tmp_path / "ledger.jsonl", sample_id) if e["event"] == "dropped"]
        assert dropped[-1]["reason"].startswith("rollout failed: ")
        assert "reward function 'grader' raised ConnectionError" in dropped[-1]["reason"]
    assert ledger.state("b0-g2-s3") == "dropped" and ledger.drop_reasons[GROUP_INCOMPLETE] == 1
    assert batch.rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 0.5, 0.0] and batch.group_ids == [0, 0, 0, 1, 1, 1, 1]

    learner = Learner(LearnerConfig(model=TINY, micro_batch_size=4))
    _, advantages = learner.batch_advantages(batch)
    # group 0's advantages are those of the three that came back, as if the fourth never existed
    alone = group_advantages(torch.tensor([1.0, 0.0, 1.0]), 3)
    torch.testing.assert_close(advantages[:3], alone)
    torch.testing.assert_close(advantages[3:], group_advantages(torch.tensor([0.0, 1.0, 0.5, 0.0]), 4))
    # had the failure been trained as a 0, group 0's baseline would differ
    as_zero = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)[[0, 1, 3]]
    assert not torch.allclose(advantages[:3], as_zero)

    metrics = learner.train_step(batch)                # uneven groups train end to end
    assert metrics["num_tokens"] == 7 * 6
    for group in kept:
        for sample in group:
            ledger.advance(sample.sample_id, "trained", step=1)
    counts = ledger.counts()
    assert counts["created"] == 12 and counts["trained"] == 7 and counts["dropped"] == 5
    ledger.check()   # created = in flight + trained + dropped


class FailingSandbox:
    """A sandbox handle whose jail cannot start a run (no warm worker): the sandbox's own
    not-started error, which no code can produce (a run that started and then failed could
    be the code's doing, and scores 0: tests/actors/tasks/test_rewards.py)."""

    async def exec(self, code, *, files=None, stdin=None, timeout_s=None):
        from postrain.sandbox import NOT_STARTED
        from postrain.sandbox.result import ExecResult, Status
        return ExecResult(Status.SANDBOX_ERROR, error=f"{NOT_STARTED}no warm worker")


def test_a_sandbox_that_fails_under_a_code_reward_is_a_failure_not_a_zero():
    import pytest
    from postrain.actors.tasks.rewards import RewardFailure, load_reward

    tests = "assert f(1) == 2\n"
    with pytest.raises(RewardFailure, match=r"could not start the run .*no warm worker.*the sample is dropped"):
        trio.run(lambda: load_reward("code_tests").score("def f(x): return x + 1", {"tests": tests},
                                                          answer_field="tests", sandbox=FailingSandbox()))


def test_a_lone_sample_trains_when_the_run_distils_and_is_dropped_when_it_does_not(tmp_path):
    """samples_per_prompt = 1: a group of one has no GRPO baseline and is dropped, unless its
    sample carries the teacher's rows (on-policy distillation needs no baseline)."""
    import numpy as np

    from postrain.actors.orchestrator.scored_sample import ScoredSample
    from postrain.actors.records import SequenceScores

    def rows(seed: int, k: int = 4) -> SequenceScores:
        g = np.random.default_rng(seed)
        ids = np.stack([g.choice(np.arange(8, 264), k, replace=False) for _ in range(10)]).astype(np.int32)
        probs = g.dirichlet(np.ones(k + 1), size=10)          # k ids and the tail
        return SequenceScores(topk_ids=ids, topk_logprobs=np.log(probs[:, :k]).astype(np.float32),
                              tail_logmass=np.log(probs[:, k]).astype(np.float32),
                              token_logprobs=np.full(10, -1.0, np.float32))

    ledger = SampleLedger(tmp_path / "ledger.jsonl")
    for g in range(4):
        ledger.create(f"b0-g{g}-s0")
    plain = [[ScoredSample(f"b0-g{g}-s0", rollout(g, 0.0))] for g in range(2)]
    distilled = [[ScoredSample(f"b0-g{g}-s0", rollout(g, 0.0), (rows(g),))] for g in range(2, 4)]

    assert surviving_groups(plain, ledger) == []
    assert ledger.drop_reasons[GROUP_INCOMPLETE] == 2
    kept = surviving_groups(distilled, ledger)
    assert [[s.sample_id for s in group] for group in kept] == [["b0-g2-s0"], ["b0-g3-s0"]]

    batch = train_batch(kept)
    assert batch.group_ids == [0, 1] and batch.teacher_topk_ids is not None
    metrics = Learner(LearnerConfig(model=TINY, micro_batch_size=4, loss="opd", lr=1e-3)).train_step(batch)
    assert metrics["num_tokens"] == 2 * 6 and metrics["distill_kl"] > 0


def test_a_run_of_groups_of_one_without_a_teacher_is_refused_when_the_config_loads():
    import pytest
    from pydantic import ValidationError

    from postrain.actors.orchestrator.options import OrchestratorOptions
    with pytest.raises(ValidationError, match=r"samples_per_prompt = 1 gives every group one sample, which has no "
                                              r"baseline .*fix: samples_per_prompt >= 2, or distil"):
        OrchestratorOptions(samples_per_prompt=1)
    assert OrchestratorOptions(samples_per_prompt=1, teacher="teacher").batch_size == 8   # distils: trains
