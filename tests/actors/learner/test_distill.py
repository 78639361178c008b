"""On-policy distillation in the learner: loss = "opd" moves the student toward the teacher, from
the batch's top-k rows and from a teacher model (full vocabulary); distill_coef beside GRPO;
micro-batches, shared prefixes and data-parallel shards sum to one process's step; the teacher
rows travel on the wire; and the errors that name a batch or config distillation cannot use.

Tiny random Llamas of the byte tokenizer's vocabulary; the teacher is another random model."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from postrain.actors.learner.batch import LearnerError
from postrain.actors.learner.group import shard_batch
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.models.loading import build_policy
from postrain.actors.records import TrainBatch
from postrain.core import wire
from postrain.core.record import RecordError

TINY = dict(vocab_size=264, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
            max_position_embeddings=128, tie_word_embeddings=True)
# A teacher of another shape (so other weights from the same seed), on the same vocabulary; the
# fixture sharpens its head (a random model's next-token distribution is nearly uniform).
TEACHER = dict(TINY, hidden_size=48, intermediate_size=96, num_layers=2, tie_word_embeddings=False)
TAIL_FLOOR = math.log(1e-20)


def learner(**kw) -> Learner:
    kw.setdefault("model", TINY)
    kw.setdefault("micro_batch_size", 2)
    kw.setdefault("lr", 3e-3)
    return Learner(LearnerConfig(**kw))


def samples(seed: int = 0, num: int = 4, prompt_len: int = 4, shared_prompt: bool = False):
    """(token_ids, loss_mask): `num` samples of a few lengths; with `shared_prompt` one prompt each pair."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(8, 264, (prompt_len,), generator=g) for _ in range(num)]
    if shared_prompt:
        prompts = [prompts[i // 2] for i in range(num)]
    ids = [torch.cat([prompts[i], torch.randint(8, 264, (5 + 2 * i,), generator=g)]) for i in range(num)]
    return ids, [[0] * prompt_len + [1] * (len(x) - prompt_len) for x in ids]


@torch.no_grad()
def full_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """(T, V) float64: row t the model's log-softmax that predicts ids[t] (row 0 zeros)."""
    logits = model(ids[None])[0].double()
    rows = torch.zeros(len(ids), logits.shape[-1], dtype=torch.float64)
    rows[1:] = torch.log_softmax(logits[:-1], dim=-1)
    return rows


def teacher_rows(teacher, ids: list[torch.Tensor], k: int):
    """The scorer's rows (docs/scorers.md conventions) of each sample, as numpy arrays."""
    out: dict[str, list] = {"teacher_topk_ids": [], "teacher_topk_logprobs": [], "teacher_tail_logmass": []}
    for x in ids:
        full = full_logprobs(teacher, x)
        top, top_ids = full.topk(k, dim=-1)
        tail = torch.logsumexp(full.scatter(-1, top_ids, float("-inf")), dim=-1).clamp(min=TAIL_FLOOR)
        top_ids[0], top[0], tail[0] = 0, 0.0, 0.0
        out["teacher_topk_ids"].append(top_ids.numpy().astype(np.int32))
        out["teacher_topk_logprobs"].append(top.numpy().astype(np.float32))
        out["teacher_tail_logmass"].append(tail.numpy().astype(np.float32))
    return out


def full_kl(student, teacher, ids, masks, divergence="reverse") -> float:
    """The token mean of the exact KL(student || teacher) (or KL(teacher || student), forward)
    over the trained tokens (float64)."""
    total, count = 0.0, 0
    for x, m in zip(ids, masks):
        s, t = full_logprobs(student, x), full_logprobs(teacher, x)
        if divergence == "forward":
            s, t = t, s
        kl = (s.exp() * (s - t)).sum(-1)
        sel = torch.tensor(m, dtype=torch.bool)
        total, count = total + float(kl[sel].sum()), count + int(sel.sum())
    return total / count


@pytest.fixture(scope="module")
def teacher():
    model, _ = build_policy(TEACHER, 1, torch.float32, "cpu")
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model.eval()


def distill_batch(teacher, k: int = 8, seed: int = 0, rewards=None, **kw) -> TrainBatch:
    ids, masks = samples(seed, **kw)
    extra = {} if rewards is None else {"rewards": rewards, "group_ids": [i // 2 for i in range(len(ids))]}
    return TrainBatch(token_ids=ids, loss_mask=masks, behavior_logprobs=[np.zeros(len(x), np.float32) for x in ids],
                      **teacher_rows(teacher, ids, k), **extra)


# ------------------------------------------------------------------ learning toward the teacher

@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_opd_from_top_k_rows_moves_the_student_toward_the_teacher(teacher, divergence):
    lrn = learner(loss="opd", lr=1e-2, distill_divergence=divergence)
    batch = distill_batch(teacher, k=16)
    before = full_kl(lrn.model, teacher, batch.token_ids, batch.loss_mask, divergence)
    metrics = [lrn.train_step(batch) for _ in range(4)]
    after = full_kl(lrn.model, teacher, batch.token_ids, batch.loss_mask, divergence)
    kls = [m["distill_kl"] for m in metrics]
    assert kls == sorted(kls, reverse=True) and kls[-1] < 0.9 * kls[0], kls
    assert after < 0.95 * before
    assert 0 < metrics[0]["distill_kl"] <= before + 1e-4          # top-k KL <= the full KL (the bound)
    assert metrics[0]["loss"] == pytest.approx(metrics[0]["distill_kl"], rel=1e-5)   # the KL alone, token mean
    assert metrics[0]["pg_loss"] == 0.0 and "reward_mean" not in metrics


@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_opd_with_a_teacher_model_takes_the_exact_full_vocabulary_kl(teacher, tmp_path, divergence):
    lrn = learner(loss="opd", teacher_model=TEACHER, seed=0, lr=1e-2, distill_divergence=divergence)
    lrn.distill.teacher.load_state_dict(teacher.state_dict())      # the module fixture's teacher (seed 1)
    ids, masks = samples(1)
    batch = TrainBatch(token_ids=ids, loss_mask=masks, behavior_logprobs=[np.zeros(len(x)) for x in ids],
                       rewards=[1.0, 0.0, 0.0, 1.0])               # the loss ignores them; metrics only
    before = full_kl(lrn.model, teacher, ids, masks, divergence)
    first = lrn.train_step(batch)
    assert first["distill_kl"] == pytest.approx(before, rel=1e-4)   # exact, not a bound
    assert first["reward_mean"] == 0.5
    for _ in range(3):
        last = lrn.train_step(batch)
    assert last["distill_kl"] < 0.9 * first["distill_kl"]
    assert all(p.grad is None for p in lrn.distill.teacher.parameters())


def test_distill_coef_adds_the_kl_to_grpo(teacher):
    batch = distill_batch(teacher, rewards=[1.0, 0.0, 0.0, 1.0])
    plain = learner(seed=3).train_step(TrainBatch(token_ids=batch.token_ids, loss_mask=batch.loss_mask,
                                                  behavior_logprobs=batch.behavior_logprobs,
                                                  rewards=batch.rewards, group_ids=batch.group_ids))
    mixed = learner(seed=3, distill_coef=0.5).train_step(batch)
    assert "distill_kl" not in plain and mixed["distill_kl"] > 0
    assert mixed["pg_loss"] == pytest.approx(plain["pg_loss"], abs=1e-6)
    assert mixed["loss"] == pytest.approx(plain["loss"] + 0.5 * mixed["distill_kl"], rel=1e-5, abs=1e-6)
    assert mixed["reward_mean"] == plain["reward_mean"] == 0.5


# ------------------------------------------------------------------ one step, however it is cut

def captured_step(batch: TrainBatch, other_rank_counts: list[float] | None = None, **kw):
    """(metrics, the summed gradient) of one train step; `other_rank_counts` stands in for a second
    data-parallel rank: its (trained tokens, sequences) are added where the learner all-reduces
    the batch's counts, so this rank's loss uses the whole batch's normalisers (step.py)."""
    lrn = learner(loss="opd", **kw)
    grads = []
    lrn.comm.sum_gradients = lambda params: grads.append(torch.cat([p.grad.flatten() for p in params]))
    if other_rank_counts is not None:
        calls = []

        def all_reduce(tensor, op=None):
            if not calls:
                tensor += torch.tensor(other_rank_counts, dtype=tensor.dtype)
            calls.append(tensor)
        lrn.comm.all_reduce = all_reduce
    return lrn.train_step(batch), grads[0]


def counts(batch: TrainBatch) -> list[float]:
    masks = [np.asarray(m) for m in batch.loss_mask]
    return [float(sum(m.sum() for m in masks)), float(sum(m.sum() > 0 for m in masks))]


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_shared_prefixes_and_shards_give_one_process_gradient(teacher, agg_mode):
    """Micro-batches and the shared-prefix path against one plain micro-batch; two data-parallel
    shards (group.py cuts the teacher rows per sample) whose gradients, with the whole batch's
    counts, sum to the whole batch's (the sum rule in step.py's docstring)."""
    batch = distill_batch(teacher, k=5, num=4, shared_prompt=True, prompt_len=6)
    from postrain.actors.learner.batch import pack_batch
    lrn = learner(loss="opd", micro_batch_size=2)
    _, planned = lrn.forward.micro_batches(pack_batch(batch, advantages=torch.zeros(4)))
    assert any(mb.shared is not None for mb in planned)       # the shared-prefix path is taken below
    whole, grad = captured_step(batch, agg_mode=agg_mode, micro_batch_size=4, shared_prefix=False)
    for micro, shared in ((1, False), (2, True)):
        metrics, other = captured_step(batch, agg_mode=agg_mode, micro_batch_size=micro, shared_prefix=shared)
        torch.testing.assert_close(other, grad, atol=1e-6, rtol=1e-4)
        assert metrics["distill_kl"] == pytest.approx(whole["distill_kl"], rel=1e-4)
    shards = shard_batch(batch, 2)
    assert [len(s.teacher_topk_ids) for s in shards] == [2, 2]
    assert all(np.array_equal(a, b) for a, b in zip(shards[1].teacher_topk_ids, batch.teacher_topk_ids[2:]))
    parts = [captured_step(s, other_rank_counts=counts(shards[1 - r]), agg_mode=agg_mode)
             for r, s in enumerate(shards)]
    torch.testing.assert_close(parts[0][1] + parts[1][1], grad, atol=1e-6, rtol=1e-4)
    tokens = [m["num_tokens"] for m, _ in parts]
    assert sum(m["distill_kl"] * n for (m, _), n in zip(parts, tokens)) / sum(tokens) == pytest.approx(
        whole["distill_kl"], rel=1e-4)


# ------------------------------------------------------------------ the wire

def test_a_batch_with_teacher_rows_travels_and_comes_back_equal(teacher):
    batch = distill_batch(teacher, k=3)
    frames = wire.encode(wire.Message("call", 1, 1, "learner", None, batch.to_wire()))
    back = TrainBatch.from_wire(wire.decode(frames).body)
    for name in ("teacher_topk_ids", "teacher_topk_logprobs", "teacher_tail_logmass"):
        for a, b in zip(getattr(batch, name), getattr(back, name)):
            assert np.asarray(b).dtype == a.dtype and np.array_equal(np.asarray(b), a), name
    assert back.advantages is None and back.rewards is None


# ------------------------------------------------------------------ errors

def test_teacher_rows_of_the_wrong_shape_are_refused_by_name(teacher):
    batch = distill_batch(teacher, k=3)
    rows = {name: getattr(batch, name) for name in ("teacher_topk_ids", "teacher_topk_logprobs",
                                                    "teacher_tail_logmass")}
    common = dict(token_ids=batch.token_ids, loss_mask=batch.loss_mask, behavior_logprobs=batch.behavior_logprobs)
    short = dict(rows, teacher_topk_ids=[rows["teacher_topk_ids"][0][:-1]] + rows["teacher_topk_ids"][1:])
    with pytest.raises(RecordError, match=r"teacher_topk_ids\[0\] must be \(T, k\) with T = len\(token_ids\[0\]\)"):
        TrainBatch(**common, **short)
    other_k = dict(rows, teacher_topk_logprobs=[x[:, :2] for x in rows["teacher_topk_logprobs"]])
    with pytest.raises(RecordError, match=r"teacher_topk_logprobs\[0\] must be the shape of teacher_topk_ids\[0\]"):
        TrainBatch(**common, **other_k)
    with pytest.raises(RecordError, match=r"teacher_tail_logmass must be given with"):
        TrainBatch(**common, teacher_topk_ids=rows["teacher_topk_ids"],
                   teacher_topk_logprobs=rows["teacher_topk_logprobs"])
    with pytest.raises(RecordError, match="or the teacher_\\* rows of a distillation batch"):
        TrainBatch(**common)
    lrn = learner(loss="opd")
    dup = [x.copy() for x in rows["teacher_topk_ids"]]
    dup[1][6, 1] = dup[1][6, 0]
    with pytest.raises(LearnerError, match=r"teacher_topk_ids\[1\]\[6\] repeats an id"):
        lrn.train_step(TrainBatch(**common, **dict(rows, teacher_topk_ids=dup)))
    wide = [x.copy() for x in rows["teacher_topk_ids"]]
    wide[2][5, 0] = 300
    with pytest.raises(LearnerError, match=r"outside the policy's vocabulary \[0, 264\)"):
        lrn.train_step(TrainBatch(**common, **dict(rows, teacher_topk_ids=wide)))
    assert lrn.step == 0


def test_distillation_without_a_teacher_and_a_teacher_of_another_vocabulary_are_refused(teacher):
    batch = distill_batch(teacher, rewards=[1.0, 0.0, 0.0, 1.0])
    plain = TrainBatch(token_ids=batch.token_ids, loss_mask=batch.loss_mask,
                       behavior_logprobs=batch.behavior_logprobs, rewards=batch.rewards, group_ids=batch.group_ids)
    with pytest.raises(LearnerError, match=r"learner.distill_coef = 0.1 needs the teacher's rows in every batch"):
        learner(distill_coef=0.1).train_step(plain)
    with pytest.raises(LearnerError, match="the learner does not distill"):
        learner().train_step(batch)
    unrewarded = TrainBatch(**{name: getattr(batch, name) for name in (
        "token_ids", "loss_mask", "behavior_logprobs", "teacher_topk_ids", "teacher_topk_logprobs",
        "teacher_tail_logmass")})
    with pytest.raises(LearnerError, match=r"neither 'advantages' nor 'rewards'.*only learner.loss = \"opd\""):
        learner(distill_coef=0.1).train_step(unrewarded)
    with pytest.raises(LearnerError, match=r"teacher_model .* has a vocabulary of 300 tokens, the policy 264"):
        learner(loss="opd", teacher_model=dict(TEACHER, vocab_size=300))
    with pytest.raises(LearnerError, match="trains on the distillation KL alone"):
        LearnerConfig(model=TINY, loss="opd", distill_coef=0.5)
    with pytest.raises(LearnerError, match="teacher_model is the teacher of on-policy distillation"):
        LearnerConfig(model=TINY, teacher_model=TEACHER)
    with pytest.raises(LearnerError, match="does not run on context-parallel rings"):
        LearnerConfig(model=TINY, loss="opd", context_parallel=2)
    with pytest.raises(LearnerError, match=r"distill_divergence must be one of \('reverse', 'forward'\), got 'js'"):
        LearnerConfig(model=TINY, loss="opd", distill_divergence="js")
    with pytest.raises(LearnerError, match=r"unknown loss preset 'opt'.*or 'opd'"):
        LearnerConfig(model=TINY, loss="opt")
