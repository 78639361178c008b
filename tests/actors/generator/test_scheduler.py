"""The scheduler's step plans: what it admits, what it reserves, whom it preempts.

No model runs here: plans are checked against the allocator the KV manager holds.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from postrain.actors.generator.engine import Engine, EngineError
from postrain.actors.generator.kv_manager import KVManager, new_kv_caches
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.generator.scheduler import Scheduler, StepPlan
from postrain.actors.generator.sequence import EngineCounters, Request, RequestOutput, Sequence
from postrain.actors.models.llama import ModelConfig
from postrain.ext import KVBlockPool

CONFIG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_layers=1, num_heads=2,
                     num_kv_heads=1, max_position_embeddings=256)


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, caching=False):
    pool = KVBlockPool(num_blocks, block_size, caching)
    kv = KVManager(pool, new_kv_caches(CONFIG, num_blocks, block_size, torch.float32))
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     counters=EngineCounters())


_ids = iter(range(10**6))


def request(prompt, n=1):
    req = Request(RequestOutput("r", list(prompt), []), SamplingParams(n=n), set())
    req.sequences = [Sequence(next(_ids), req, i, None) for i in range(n)]
    return req


def run_plan(scheduler: Scheduler, plan: StepPlan, requests, next_token=7) -> None:
    """What the engine does after the forwards: start prefills, append one sampled token."""
    by_id = {s.seq_id: s for r in requests for s in r.sequences}
    for entry in plan.prefills:
        scheduler.start_running(entry, [by_id[entry.seq_id]] + [by_id[i] for i in entry.fork_seq_ids])
    for entry in plan.decodes + plan.prefills:
        for seq_id in (entry.seq_id, *entry.fork_seq_ids):
            by_id[seq_id].token_ids.append(next_token)


def assert_plan_matches_allocator(scheduler: Scheduler, plan: StepPlan) -> None:
    for entry in plan.decodes + plan.prefills:
        assert list(entry.block_table) == scheduler.kv.block_table(entry.seq_id)
        assert scheduler.kv.num_tokens(entry.seq_id) == entry.positions.stop
        assert len(entry.block_table) * scheduler.kv.block_size_tokens >= entry.positions.stop


def test_a_plan_is_typed_frozen_and_its_blocks_are_the_allocators():
    scheduler = make_scheduler()
    reqs = [request(range(1, 11)), request(range(20, 25), n=3)]
    for r in reqs:
        scheduler.add(r.sequences)
    plan = scheduler.schedule()
    assert plan.decodes == () and [e.num_new_tokens for e in plan.prefills] == [10, 5]
    assert plan.prefills[0].positions == range(0, 10) and plan.prefills[0].input_ids == tuple(range(1, 11))
    assert plan.prefills[1].fork_seq_ids == tuple(s.seq_id for s in reqs[1].sequences[1:])
    assert_plan_matches_allocator(scheduler, plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.prefills[0].seq_id = 99
    run_plan(scheduler, plan, reqs)
    plan = scheduler.schedule()                                  # every sample decodes one token
    assert plan.prefills == () and len(plan.decodes) == 4
    assert all(e.num_new_tokens == 1 and e.drafts == () for e in plan.decodes)
    assert [e.start_position for e in plan.decodes] == [10, 5, 5, 5]
    assert_plan_matches_allocator(scheduler, plan)


def test_drafts_ride_in_the_plan_and_are_dropped_before_preempting():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    reqs = [request(range(1, 8))]                                # 7 tokens: 2 blocks
    scheduler.add(reqs[0].sequences)
    run_plan(scheduler, scheduler.schedule(), reqs)
    seq = reqs[0].sequences[0]
    seq.drafts = [1, 2, 3]
    plan = scheduler.schedule()
    assert plan.has_drafts and plan.decodes[0].input_ids == (7, 1, 2, 3)
    assert plan.decodes[0].positions == range(7, 11)
    assert_plan_matches_allocator(scheduler, plan)
    scheduler.kv.truncate(seq.seq_id, seq.token_ids[:-1] + [seq.token_ids[-1]])  # roll the drafts back
    seq.drafts = [1] * 12                                        # more than the cache holds
    plan = scheduler.schedule()
    assert not plan.has_drafts and len(plan.decodes) == 1 and scheduler.counters.num_preemptions == 0


def test_preemption_frees_the_newest_and_readmits_it_first():
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    reqs = [request(range(1, 9)), request(range(10, 18)), request(range(20, 24))]   # 2 + 2 + 1 blocks
    for r in reqs:
        scheduler.add(r.sequences)
    plan = scheduler.schedule()
    assert len(plan.prefills) == 3 and scheduler.kv.num_free_blocks == 1
    run_plan(scheduler, plan, reqs)
    # Next step: seqs 0 and 1 each need a third block; one is free, the newest gives up its one.
    newest = reqs[2].sequences[0]
    plan = scheduler.schedule()
    assert scheduler.counters.num_preemptions == 1
    assert newest not in scheduler.running and scheduler.waiting[0].seqs == [newest]
    assert [e.seq_id for e in plan.decodes] == [s.sequences[0].seq_id for s in reqs[:2]]
    assert newest.seq_id not in {e.seq_id for e in plan.decodes + plan.prefills}
    assert_plan_matches_allocator(scheduler, plan)
    # Once blocks are free again, the preempted sequence is recomputed with what it generated.
    for r in reqs[:2]:
        scheduler.finish(r.sequences[0])
    plan = scheduler.schedule()
    assert [e.seq_id for e in plan.prefills] == [newest.seq_id]
    assert plan.prefills[0].input_ids == tuple(newest.token_ids) and plan.prefills[0].start_position == 0
    assert_plan_matches_allocator(scheduler, plan)


def test_admission_respects_the_sequence_and_token_budgets():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=12)
    reqs = [request(range(1, 6), n=3), request(range(1, 3), n=2), request(range(30, 40)), request([5] * 20)]
    for r in reqs:
        scheduler.add(r.sequences)
    assert [e.seq_id for e in scheduler.schedule().prefills] == [reqs[0].sequences[0].seq_id]  # 3 + 2 > 4
    scheduler.running.clear()                                  # (as if they finished)
    plan = scheduler.schedule()
    assert [e.num_new_tokens for e in plan.prefills] == [2, 10]  # 2 + 10 <= 12; then 20 more: no
    scheduler.running.clear()
    assert [e.num_new_tokens for e in scheduler.schedule().prefills] == [20]   # over budget, but alone


def test_a_request_larger_than_the_cache_is_refused():
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    scheduler.add(request(range(1, 12)).sequences)
    with pytest.raises(EngineError, match="needs 3 KV blocks but the cache has only 2"):
        scheduler.schedule()


def test_the_engine_steps_through_the_scheduler_and_frees_everything():
    from postrain.actors.models.llama import build_model

    model = build_model(CONFIG, seed=0).eval()
    engine = Engine(model, None, num_blocks=10, block_size_tokens=4)
    prompts = [[1 + i, 2 + i, 3 + i, 4 + i, 5 + i] for i in range(4)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 9 for o in outs)
    assert engine.counters.num_preemptions > 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
