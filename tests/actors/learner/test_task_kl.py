"""KL targets per task (actors/learner/task_kl.py): with every coefficient at the learner's own the
step is the plain KL step; each task's coefficient then moves toward its own target on its own
measured KL; a checkpoint keeps the coefficients; a learner without a reference refuses."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from postrain.actors.learner.batch import LearnerError
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.records import TrainBatch

TINY = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def random_batch(seed: int, num: int = 4) -> TrainBatch:
    """`num` random 11-17-token samples (6 prompt tokens), advantages +1 / -1 in turn."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(8, 264, (11 + 3 * (i % 3),), generator=g) for i in range(num)]
    return TrainBatch(token_ids=ids, loss_mask=[[0] * 6 + [1] * (len(x) - 6) for x in ids],
                      behavior_logprobs=[torch.randn(len(x), generator=g) * 0.1 - 5.5 for x in ids],
                      policy_versions=[0] * num, advantages=[1.0 if i % 2 == 0 else -1.0 for i in range(num)])

OPTIONS = dict(model=TINY, micro_batch_size=2, lr=1e-2, reference_model="initial", kl_coef=0.1, kl_horizon=10)


def drift(learner: Learner) -> None:
    """Move the policy off its reference (a KL of zero teaches no controller anything)."""
    learner.train_step(random_batch(1))


def tagged(batch, tasks: list[str], targets: dict[str, float]):
    return dataclasses.replace(batch, row_tasks=tasks, kl_targets=targets)


def test_targets_at_the_learners_coefficient_give_the_plain_step():
    plain, per_task = Learner(LearnerConfig(**OPTIONS)), Learner(LearnerConfig(**OPTIONS))
    drift(plain), drift(per_task)
    batch = random_batch(2, num=6)
    a = plain.train_step(batch)
    b = per_task.train_step(tagged(batch, ["x", "y", "x", "y", "z", "z"], {"x": 0.5, "y": 1e-4}))
    for name, tensor in plain.model.state_dict().items():
        torch.testing.assert_close(per_task.model.state_dict()[name], tensor, rtol=1e-5, atol=1e-6)
    assert b["kl_coef_x"] == pytest.approx(0.1 * 0.98) and b["kl_coef_y"] == pytest.approx(0.1 * 1.02)
    assert set(b) - set(a) == {"kl_x", "kl_y", "kl_coef_x", "kl_coef_y"}   # "z" has no target: the learner's
    assert a["kl"] > 0 and b["kl_x"] > 0 and b["kl_y"] > 0


def test_each_tasks_coefficient_follows_its_own_target_and_a_checkpoint_keeps_it(tmp_path):
    learner = Learner(LearnerConfig(**OPTIONS))
    drift(learner)
    for seed in range(2, 6):
        metrics = learner.train_step(tagged(random_batch(seed), ["tight", "loose"] * 2, {"tight": 1e-6, "loose": 10.0}))
    assert metrics["kl_coef_tight"] == pytest.approx(0.1 * 1.02 ** 4)     # over its target: the coefficient grows
    assert metrics["kl_coef_loose"] == pytest.approx(0.1 * 0.98 ** 4)     # under it: shrinks
    assert learner.kl.coef == 0.1                                         # the learner's own is fixed
    learner.save_checkpoint(tmp_path / "ckpt")
    resumed = Learner(LearnerConfig(**OPTIONS, seed=5))
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.task_kl.state_dict() == learner.task_kl.state_dict()


def test_targets_without_a_reference_or_a_starting_coefficient_are_refused():
    no_reference = Learner(LearnerConfig(model=TINY, micro_batch_size=2))
    with pytest.raises(LearnerError, match=r"no KL reference; fix: set learner.reference_model"):
        no_reference.train_step(tagged(random_batch(1), ["x"] * 4, {"x": 0.01}))
    zero = Learner(LearnerConfig(model=TINY, micro_batch_size=2, reference_model="initial"))
    with pytest.raises(LearnerError, match=r"kl_coef, which is 0 .*fix: set learner.kl_coef > 0"):
        zero.train_step(tagged(random_batch(1), ["x"] * 4, {"x": 0.01}))
