"""The distillation KL (postrain.ext.distill) against a float64 reference written out here: top-k
with its tail bucket, the full vocabulary (torch's exact KL), the bound between them, and the
chunked LM-head pass against the plain one."""
from __future__ import annotations

import pytest
import torch

from postrain.ext import rl_ops
from postrain.ext.rl_ops import RLOpsError


def reference_topk_kl(student_logits, teacher_logits, ids, divergence="reverse"):
    """KL over the partition {each id of ids} u {tail}, one token at a time, from the definitions:
    KL(student || teacher), or KL(teacher || student) for the forward divergence."""
    out = []
    for z, zt, row in zip(student_logits, teacher_logits, ids):
        p, q = torch.softmax(z, -1), torch.softmax(zt, -1)
        if divergence == "forward":
            p, q = q, p
        kl = sum(p[v] * (torch.log(p[v]) - torch.log(q[v])) for v in row.tolist())
        p_tail = 1 - sum(p[v] for v in row.tolist())
        q_tail = 1 - sum(q[v] for v in row.tolist())
        if len(row) < len(z):
            kl = kl + p_tail * (torch.log(p_tail) - torch.log(q_tail))
        out.append(kl)
    return torch.stack(out)


def reference_full_kl(student_logits, teacher_logits, divergence="reverse"):
    p, q = torch.softmax(student_logits, -1), torch.softmax(teacher_logits, -1)
    if divergence == "forward":
        p, q = q, p
    return (p * (p.log() - q.log())).sum(-1)


def case(seed: int, n: int = 6, vocab: int = 12, k: int = 4, sharp: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(n, vocab, generator=g, dtype=torch.float64) * sharp).requires_grad_(True)
    teacher = torch.randn(n, vocab, generator=g, dtype=torch.float64) * sharp
    ids = teacher.topk(k, dim=-1).indices
    return student, teacher, ids


def rows(student, teacher, ids):
    """(student top-k log-probs, its exact tail log-mass, the teacher's top-k log-probs and tail):
    what the learner's head and a scorer give."""
    s_all, t_all = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    outside = torch.ones_like(s_all, dtype=torch.bool).scatter(-1, ids, False)
    tail = lambda lp: torch.logsumexp(lp.masked_fill(~outside, float("-inf")), -1)  # noqa: E731
    return s_all.gather(-1, ids), tail(s_all), t_all.gather(-1, ids), tail(t_all)


@pytest.mark.parametrize("divergence", ["reverse", "forward"])
@pytest.mark.parametrize("exact_tail", [True, False])
def test_topk_kl_and_its_gradient_match_the_reference(exact_tail, divergence):
    student, teacher, ids = case(0)
    s_top, s_tail, t_top, t_tail = rows(student, teacher, ids)
    kl = rl_ops.topk_kl_per_token(s_top, t_top, t_tail, student_tail_logmass=s_tail if exact_tail else None,
                                  divergence=divergence)
    ref = reference_topk_kl(student, teacher, ids, divergence)
    torch.testing.assert_close(kl, ref, rtol=1e-10, atol=1e-12)
    weights = torch.linspace(0.5, 2.0, len(kl), dtype=torch.float64)
    (grad,) = torch.autograd.grad((kl * weights).sum(), student)
    (grad_ref,) = torch.autograd.grad((ref * weights).sum(), student)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-8, atol=1e-10)


def test_with_every_id_in_the_top_k_it_is_torchs_exact_kl():
    student, teacher, ids = case(1, k=12)
    s_top, s_tail, t_top, _ = rows(student, teacher, ids)
    assert bool(torch.isneginf(s_tail).all())                               # no tail at k = V
    floor = torch.full((len(ids),), rl_ops.TAIL_LOGMASS_FLOOR, dtype=torch.float64)   # a scorer's clamp
    kl = rl_ops.topk_kl_per_token(s_top, t_top, floor, student_tail_logmass=s_tail)
    exact = torch.nn.functional.kl_div(torch.log_softmax(teacher, -1), torch.log_softmax(student, -1),
                                       reduction="none", log_target=True).sum(-1)   # KL(student || teacher)
    torch.testing.assert_close(kl, exact, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kl, reference_full_kl(student, teacher), rtol=1e-10, atol=1e-12)
    (grad,) = torch.autograd.grad(kl.sum(), student)
    (grad_exact,) = torch.autograd.grad(exact.sum(), student)
    torch.testing.assert_close(grad, grad_exact, rtol=1e-8, atol=1e-10)
    full = rl_ops.full_kl_per_token(student, teacher)
    torch.testing.assert_close(full, exact, rtol=1e-10, atol=1e-12)
    # the forward KL(teacher || student): the scorer's floor on a tail that has no ids adds nothing
    s_top, s_tail, t_top, _ = rows(student, teacher, ids)
    forward = rl_ops.topk_kl_per_token(s_top, t_top, floor, student_tail_logmass=s_tail, divergence="forward")
    exact_forward = torch.nn.functional.kl_div(torch.log_softmax(student, -1), torch.log_softmax(teacher, -1),
                                               reduction="none", log_target=True).sum(-1)
    torch.testing.assert_close(forward, exact_forward, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(rl_ops.full_kl_per_token(student, teacher, "forward"), exact_forward,
                               rtol=1e-10, atol=1e-12)
    (grad,) = torch.autograd.grad(forward.sum(), student)     # d KL(t || s) / d z = p_s - p_t
    expected = torch.softmax(student, -1) - torch.softmax(teacher, -1)
    torch.testing.assert_close(grad, expected.detach(), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("seed", range(20))
def test_top_k_is_a_lower_bound_of_the_full_kl_with_the_tail_gap(seed):
    g = torch.Generator().manual_seed(100 + seed)
    k = int(torch.randint(1, 11, (1,), generator=g))
    student, teacher, ids = case(seed, n=8, vocab=12, k=k, sharp=float(torch.rand(1, generator=g)) * 4 + 0.1)
    if seed % 2:       # the top k of the student, not of the teacher: the bound holds for any S
        ids = torch.stack([torch.randperm(12, generator=g)[:k] for _ in range(8)])
    with torch.no_grad():
        s_top, s_tail, t_top, t_tail = rows(student, teacher, ids)
        topk = rl_ops.topk_kl_per_token(s_top, t_top, t_tail, student_tail_logmass=s_tail)
        full = reference_full_kl(student, teacher)
        assert bool((topk <= full + 1e-12).all())
        # gap = p_s(tail) * KL(student | tail || teacher | tail)
        s_all, t_all = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
        outside = torch.ones_like(s_all, dtype=torch.bool).scatter(-1, ids, False)
        s_cond, t_cond = s_all - s_tail[:, None], t_all - t_tail[:, None]
        cond = torch.where(outside, s_cond.exp() * (s_cond - t_cond), torch.zeros_like(s_cond)).sum(-1)
        torch.testing.assert_close(full - topk, s_tail.exp() * cond, rtol=1e-9, atol=1e-12)
        # the forward KL's bound, the same inequality with the distributions swapped
        forward = rl_ops.topk_kl_per_token(s_top, t_top, t_tail, student_tail_logmass=s_tail, divergence="forward")
        assert bool((forward <= reference_full_kl(student, teacher, "forward") + 1e-12).all())


def test_distill_kl_aggregates_like_the_policy_loss():
    student, teacher, ids = case(2, n=6)
    s_top, s_tail, t_top, t_tail = rows(student, teacher, ids)
    shape = (2, 3)
    mask = torch.tensor([[0, 1, 1], [0, 0, 1]], dtype=torch.bool)
    args = [x.reshape(*shape, -1) for x in (s_top, t_top)]
    loss, kl = rl_ops.distill_kl(args[0], args[1], t_tail.reshape(shape), mask, student_tail_logmass=s_tail.reshape(shape),
                                 agg_mode="seq-mean-token-mean", global_num_seqs=4.0)
    per_token = reference_topk_kl(student, teacher, ids).reshape(shape)
    torch.testing.assert_close(kl, per_token * mask, rtol=1e-10, atol=1e-12)
    expected = ((per_token[0, 1] + per_token[0, 2]) / 2 + per_token[1, 2]) / 4.0
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(RLOpsError, match=r"mask must be \(2, 3\)"):
        rl_ops.distill_kl(args[0], args[1], t_tail.reshape(shape), mask[:, :2])
    with pytest.raises(RLOpsError, match="teacher_tail_logmass must be"):
        rl_ops.topk_kl_per_token(args[0], args[1], t_tail)


@pytest.mark.parametrize("mode", ["topk", "full", "full-forward", "every-id"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_chunked_head_equals_the_plain_one(mode, temperature):
    """distill_head_from_hidden (chunks of 3 rows, float32 inside) against distill_head_naive on the
    full logits: values and gradients in the student's hidden rows and LM head."""
    g = torch.Generator().manual_seed(3)
    n, hidden, vocab = 7, 5, 11
    divergence = "forward" if mode == "full-forward" else "reverse"
    mode = "full" if mode == "full-forward" else mode
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    th, tw = torch.randn(n, 4, generator=g), torch.randn(vocab, 4, generator=g)
    k = vocab if mode == "every-id" else 3
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)])
    weights = [torch.randn(n, generator=g), torch.randn(n, generator=g),
               torch.randn(n, generator=g) if mode == "full" else torch.randn(n, k + 1, generator=g)]
    if mode == "every-id":
        weights[2][:, -1] = 0.0       # the tail is -inf: it takes no weight
    results = []
    for fused in (True, False):
        if fused:
            kw = {"topk_ids": ids} if mode != "full" else {"teacher_hidden": th, "teacher_weight": tw}
            out = rl_ops.distill_head_from_hidden(h, w, targets, temperature=temperature, chunk_size_tokens=3,
                                                  divergence=divergence, **kw)
        else:
            kw = {"topk_ids": ids} if mode != "full" else {"teacher_logits": th @ tw.t()}
            out = rl_ops.distill_head_naive(h @ w.t(), targets, temperature=temperature, divergence=divergence, **kw)
        total = sum((torch.nan_to_num(o, neginf=0.0) * wt).sum() for o, wt in zip(out, weights))
        grads = torch.autograd.grad(total, (h, w))
        results.append([o.detach() for o in out] + list(grads))
    for fused, plain in zip(*results):
        torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-5)
    plain_logp = rl_ops.naive_token_logprobs(h.detach() @ w.detach().t(), targets, temperature)
    torch.testing.assert_close(results[0][0], plain_logp, rtol=1e-5, atol=1e-5)
    if mode == "full":
        reference = reference_full_kl((h.detach() @ w.detach().t()).double(), (th @ tw.t()).double(), divergence)
        torch.testing.assert_close(results[0][2], reference.float(), rtol=1e-4, atol=1e-5)


def test_the_chunked_heads_tail_gradient_holds_when_the_top_k_hold_almost_all_the_mass():
    """A peaked student (the tail's mass ~1e-9): the tail's gradient is exact in float32 against a
    float64 reference, not lost to cancellation with the top k's."""
    g = torch.Generator().manual_seed(5)
    n, hidden, vocab, k = 6, 4, 40, 4
    h = (1.0 + 0.1 * torch.randn(n, hidden, generator=g, dtype=torch.float64)).requires_grad_(True)
    w = 0.3 * torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    w[:k] += 6.0                            # ids 0..k-1: logits ~24 against ~0, so the tail is ~1e-9
    w.requires_grad_(True)
    targets = torch.zeros(n, dtype=torch.int64)
    ids = torch.arange(k).repeat(n, 1)
    weights = torch.randn(n, k + 1, generator=g, dtype=torch.float64)
    grads = []
    for fused in (True, False):
        hh, ww = (h.float(), w.float()) if fused else (h, w)
        out = (rl_ops.distill_head_from_hidden(hh, ww, targets, topk_ids=ids, chunk_size_tokens=4) if fused
               else rl_ops.distill_head_naive(hh @ ww.t(), targets, topk_ids=ids))
        assert bool((out[2][:, -1] < -15).all())                             # a tail of < 3e-7
        grads.append(torch.autograd.grad((out[2].double() * weights).sum(), (h, w)))
    for fused, reference in zip(*grads):
        torch.testing.assert_close(fused, reference, rtol=1e-3, atol=1e-6)


def test_the_head_refuses_a_teacher_of_another_vocabulary():
    h, w = torch.randn(2, 3), torch.randn(5, 3)
    with pytest.raises(RLOpsError, match=r"the teacher's vocabulary \(6\) differs from the student's \(5\)"):
        rl_ops.distill_head_from_hidden(h, w, torch.zeros(2, dtype=torch.int64), teacher_hidden=torch.randn(2, 4),
                                        teacher_weight=torch.randn(6, 4))
    with pytest.raises(RLOpsError, match="one of the two"):
        rl_ops.distill_head_from_hidden(h, w, torch.zeros(2, dtype=torch.int64))
