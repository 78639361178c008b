"""Qwen3-MoE and the MoE block (actors/models/moe.py, qwen3_moe.py): transformers' greedy tokens,
engine-vs-learner logprobs, export round trip, the grouped expert path against the per-token
reference, the load-balancing loss against transformers' formula, the engine's routing record."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import arch_checks  # noqa: E402  (tests/actors/models/arch_checks.py)
from hf_tiny import (  # noqa: E402  (tests/actors/models/hf_tiny.py)
    PROMPT, build_tiny, engine_vs_learner_logprobs, save_tiny,
)

from postrain.actors.models.moe import (  # noqa: E402
    decode_routing, grouped_expert_mlp, load_balancing_loss, naive_expert_mlp, route, routing_trace,
)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


def test_greedy_tokens_equal_transformers(moe_folder, capsys):
    arch_checks.check_cli_greedy_equals_transformers(moe_folder, capsys)


def test_layers_follow_decoder_sparse_step_and_mlp_only_layers(moe_folder):
    from postrain.actors.models.loading import load_model
    from postrain.actors.models.moe import SparseMoeBlock

    model, _ = load_model(moe_folder)
    assert model.config.moe_layers == (0, 2)              # mlp_only_layers = [1]
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert kinds == [True, False, True]


def test_engine_logprobs_equal_learner_logprobs(moe_folder):
    engine, learner = engine_vs_learner_logprobs(moe_folder)
    assert torch.allclose(engine, learner, atol=1e-4), (engine - learner).abs().max()


def test_prefix_cache_preemption_and_weight_swap_keep_greedy_output(moe_folder, tmp_path):
    arch_checks.check_engine_paths_keep_greedy(moe_folder, save_tiny(tmp_path / "other", "qwen3_moe", seed=1))


def test_export_round_trip_gives_transformers_equal_logits(moe_folder, tmp_path):
    import transformers

    from postrain.actors.learner.learner import Learner

    learner = Learner({"model": str(moe_folder)})
    with torch.no_grad():                     # move an expert and the router away from the folder's weights
        learner.model.model.layers[0].mlp.experts.down_proj[3].mul_(-2.0)
        learner.model.model.layers[2].mlp.gate.weight.add_(0.3)
    learner.export_hf(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.randint(0, 264, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, learner.model.eval()(ids), atol=1e-5)


@pytest.mark.parametrize("num_tokens", [3, 64])      # 3: one matmul per hit expert; 64: one padded bmm
def test_grouped_expert_path_equals_per_token_reference(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    experts_, hidden, inner, top_k = 8, 16, 12, 2
    x = torch.randn(num_tokens, hidden, generator=gen, requires_grad=True)
    gate_up = (torch.randn(experts_, 2 * inner, hidden, generator=gen) * 0.3).requires_grad_()
    down = (torch.randn(experts_, hidden, inner, generator=gen) * 0.3).requires_grad_()
    logits = torch.randn(num_tokens, experts_, generator=gen)
    chosen, weights, _ = route(logits, top_k, norm_topk_prob=True)
    grouped = grouped_expert_mlp(x, chosen, weights, gate_up, down)
    naive = naive_expert_mlp(x, chosen, weights, gate_up, down)
    assert torch.allclose(grouped, naive, atol=1e-5)
    g_grouped = torch.autograd.grad(grouped.square().sum(), (x, gate_up, down))
    g_naive = torch.autograd.grad(naive.square().sum(), (x, gate_up, down))
    for a, b in zip(g_grouped, g_naive):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_aux_loss_matches_transformers_formula():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(2 * 7, 8, generator=gen) for _ in range(3)]     # 3 MoE layers, batch 2 x 7 tokens
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    for row_mask in (None, mask):
        theirs = load_balancing_loss_func(tuple(logits), 8, 2, row_mask)
        ours = load_balancing_loss(logits, 8, 2, row_mask)
        assert torch.allclose(ours, theirs, atol=1e-6)


@pytest.mark.parametrize("prefill_chunk_tokens", [0, 5])      # 5: the prompt read over several steps
def test_engine_records_every_computed_tokens_experts(moe_folder, prefill_chunk_tokens):
    from postrain.actors.generator.engine import Engine
    from postrain.actors.generator.sampling import SamplingParams
    from postrain.actors.models.loading import load_model

    model, tokenizer = load_model(moe_folder)
    engine = Engine(model, tokenizer, enable_prefix_caching=False, prefill_chunk_tokens=prefill_chunk_tokens)
    out = engine.generate(
        [PROMPT], SamplingParams(n=2, temperature=1.0, seed=1, max_new_tokens=10, ignore_eos=True))[0]
    for sample in out.outputs:
        tokens = out.prompt_token_ids + sample.token_ids
        recorded = decode_routing(sample.routed_experts, len(tokens), 2, 2, 8)       # (T, L, k)
        assert (recorded[:-1] >= 0).all() and (recorded[-1] == -1).all()          # the last token never ran
        with torch.no_grad(), routing_trace(model, record=True) as trace:
            model(torch.tensor([tokens]))
        own = trace.chosen_experts()[:-1]                                          # the same tokens, one pass
        assert torch.equal(own.sort(-1).values, recorded[:-1].sort(-1).values)


def test_a_moe_config_without_experts_is_refused():
    from postrain.actors.models.config import ModelConfig, ModelConfigError

    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        ModelConfig(num_experts=8, num_experts_per_tok=0, moe_intermediate_size=4)
    assert build_tiny("qwen3_moe").config.num_experts == 8


@pytest.mark.slow
@pytest.mark.arch_matrix   # routing replay's parts: tests/actors/learner/test_routing_replay.py, above
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_postrain_up_trains_a_qwen3_policy_with_a_balanced_ledger(model_type, tmp_path):
    """Two GRPO steps of the arithmetic task (plain answers) with a Qwen3 / Qwen3-MoE folder as the
    policy; the MoE run replays the generator's routing and reports the routing metrics."""
    import json
    import os
    import subprocess

    import transformers

    from postrain.actors.models.loading import load_model
    from postrain.core.testing import to_toml

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from task_runs import run_config  # tests/actors/task_runs.py

    folder = save_tiny(tmp_path / model_type, model_type)
    config = run_config(tmp_path, "arithmetic", {"answer_format": "plain"})
    config["shared"]["model"] = str(folder)
    actors = {a["name"]: a for a in config["actors"]}
    actors["orchestrator"]["options"].update(num_steps=2, num_eval_tasks=1)
    if model_type == "qwen3_moe":
        actors["learner"]["options"]["learner"]["routing_replay"] = True
    (tmp_path / "run.toml").write_text(to_toml(config))
    command = [sys.executable, "-m", "postrain.cli", "up", "--config", str(tmp_path / "run.toml"), "--quiet"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "runs" / "task"
    summary = json.loads((run / "summary.json").read_text())
    ledger = summary["ledger"]
    assert summary["steps"] == 2 and ledger["in_flight"] == 0
    assert ledger["created"] == ledger["trained"] + ledger["dropped"] and ledger["trained"] > 0
    if model_type == "qwen3_moe":
        text = "\n".join(p.read_text() for p in run.rglob("*.jsonl"))
        assert "routing_mismatch_frac" in text and "logprob_gap_mean_replay" in text
    ours, tokenizer = load_model(run / "policy")           # the exported policy, in transformers too
    assert ours.config.architecture == model_type
    hf = transformers.AutoModelForCausalLM.from_pretrained(run / "policy").eval()
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=0, atol=2e-5)
