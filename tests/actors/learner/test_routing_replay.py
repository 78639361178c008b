"""Routing replay (R3, actors/learner/routing.py): the learner routes the rollout's tokens to the
experts the generator recorded, so their logprobs agree even after the learner's router moved;
the per-step routing metrics; the router's load-balancing loss in a train step."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from hf_tiny import PROMPT, build_tiny  # noqa: E402  (tests/actors/models/hf_tiny.py)

NUM_EXPERTS = 16


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """(model folder, TrainBatch of 2 sampled continuations with their routing records, the experts
    of each MoE layer that no token of the rollout went to)."""
    from postrain.actors.generator.engine import Engine
    from postrain.actors.generator.sampling import SamplingParams
    from postrain.actors.models.loading import load_model
    from postrain.actors.models.moe import decode_routing
    from postrain.actors.records import TrainBatch

    folder = tmp_path_factory.mktemp("moe")
    build_tiny("qwen3_moe", num_experts=NUM_EXPERTS).save_pretrained(folder)
    model, tokenizer = load_model(folder)
    out = Engine(model, tokenizer, enable_prefix_caching=False).generate(
        [PROMPT], SamplingParams(n=2, temperature=1.0, seed=5, max_new_tokens=16, ignore_eos=True))[0]
    prompt, samples = out.prompt_token_ids, out.outputs
    batch = TrainBatch(token_ids=[prompt + s.token_ids for s in samples],
                       loss_mask=[[0] * len(prompt) + [1] * len(s.token_ids) for s in samples],
                       behavior_logprobs=[[0.0] * len(prompt) + s.logprobs for s in samples],
                       policy_versions=[[-1] * len(prompt) + s.policy_versions for s in samples],
                       advantages=[0.0, 0.0], routed_experts=[s.routed_experts for s in samples])
    used = torch.cat([decode_routing(data, len(ids), 2, 2, NUM_EXPERTS)
                      for ids, data in zip(batch.token_ids, batch.routed_experts)])        # (tokens, L, k)
    unused = [sorted(set(range(NUM_EXPERTS)) - set(used[:, layer].reshape(-1).tolist()))
              for layer in range(2)]
    assert all(unused), "every expert of a layer was used: pick another seed"
    return folder, batch, unused


def moved_learner(folder, unused, **options):
    """A learner whose router sends many tokens to experts the rollout never used (so the gate
    weights of the experts it did use, renormalised over each token's top-k, stay as they were)."""
    from postrain.actors.learner.learner import Learner

    learner = Learner({"model": str(folder), "lr": 1e-3, **options})
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for moe_index, layer_idx in enumerate(learner.model.config.moe_layers):
            gate = learner.model.model.layers[layer_idx].mlp.gate.weight
            for expert in unused[moe_index]:
                gate[expert] = torch.randn(gate.shape[1], generator=gen) * 3.0
    return learner


def generated_gap(learner, batch) -> float:
    scored = learner.compute_logprobs(batch)
    gaps = [(row - torch.tensor(lp))[torch.tensor(mask).bool()].abs().max()
            for row, lp, mask in zip(scored, batch.behavior_logprobs, batch.loss_mask)]
    return float(max(gaps))


def test_replayed_logprobs_equal_the_generators_after_the_router_moved(rollout):
    folder, batch, unused = rollout
    assert generated_gap(moved_learner(folder, unused, routing_replay=True), batch) < 1e-4
    assert generated_gap(moved_learner(folder, unused, routing_replay=False), batch) > 1e-2


@pytest.mark.parametrize("replay", [True, False])
def test_train_step_reports_routing_mismatch_and_both_gaps(rollout, replay):
    folder, batch, unused = rollout
    metrics = moved_learner(folder, unused, routing_replay=replay).train_step(batch)
    assert metrics["routing_mismatch_frac"] > 0.2          # the moved router disagrees with the rollout
    assert metrics["routing_recorded_tokens"] == sum(len(ids) - 1 for ids in batch.token_ids)
    assert metrics["logprob_gap_mean_replay"] < 1e-5
    assert metrics["logprob_gap_mean_no_replay"] > 1e-3
    expected = metrics["logprob_gap_mean_replay" if replay else "logprob_gap_mean_no_replay"]
    assert metrics["logprob_gap_mean"] == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_aux_loss_trains_the_router_alone_when_advantages_are_zero(rollout):
    from postrain.actors.learner.learner import Learner

    folder, batch, _ = rollout
    learner = Learner({"model": str(folder), "lr": 1e-2, "router_aux_loss_coef": 0.1})
    gate = learner.model.model.layers[2].mlp.gate.weight
    before_gate, before_head = gate.detach().clone(), learner.model.lm_head.weight.detach().clone()
    learner.train_step(batch)                               # advantages 0: no policy gradient
    assert not torch.equal(gate.detach(), before_gate)
    assert torch.equal(learner.model.lm_head.weight.detach(), before_head)


def test_replay_on_a_dense_model_is_refused():
    from postrain.actors.learner.batch import LearnerError
    from postrain.actors.learner.learner import Learner

    with pytest.raises(LearnerError, match="routing_replay .* need a mixture-of-experts policy"):
        Learner({"model": "tiny", "routing_replay": True})


def test_a_rollout_pads_the_last_actions_record_over_the_observation_after_it():
    import numpy as np

    from postrain.actors.env.actor import TokenPolicy
    from postrain.actors.models.moe import decode_routing, encode_routing

    table = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 0], [-1, -1]]])      # 3 tokens, 2 layers, top-2
    policy = TokenPolicy(None, None, None, max_total_tokens=100, timeline=None)
    policy.token_ids = [5, 6, 7, 8, 9]                   # 3 tokens when the action ended, then 2 observed
    policy.routed_experts, policy._routed_len = encode_routing(table, 3, 8), 3
    rows = decode_routing(policy._routing_record(), 5, 2, 2, 8)
    assert rows[:3].tolist() == table.tolist() and (rows[3:] == -1).all()
