"""Qwen3 (actors/models/qwen3.py) against transformers' own Qwen3 on a tiny random model: greedy
tokens, engine-vs-learner logprobs, export round trip, refused config fields."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import arch_checks  # noqa: E402  (tests/actors/models/arch_checks.py)
from hf_tiny import engine_vs_learner_logprobs, save_tiny  # noqa: E402  (hf_tiny.py here)


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("qwen3"), "qwen3")


def test_greedy_tokens_equal_transformers(qwen3_folder, capsys):
    arch_checks.check_cli_greedy_equals_transformers(qwen3_folder, capsys)


def test_engine_logprobs_equal_learner_logprobs(qwen3_folder):
    engine, learner = engine_vs_learner_logprobs(qwen3_folder)
    assert torch.allclose(engine, learner, atol=1e-4), (engine - learner).abs().max()


def test_prefix_cache_preemption_and_weight_swap_keep_greedy_output(qwen3_folder, tmp_path):
    arch_checks.check_engine_paths_keep_greedy(qwen3_folder, save_tiny(tmp_path / "other", "qwen3", seed=1))


def test_export_round_trip_gives_transformers_equal_logits(qwen3_folder, tmp_path):
    import transformers

    from postrain.actors.learner.learner import Learner

    learner = Learner({"model": str(qwen3_folder), "lr": 1e-2})
    with torch.no_grad():                     # a policy that moved away from the folder's weights
        learner.model.model.layers[0].self_attn.q_norm.weight.mul_(1.5)
    learner.export_hf(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, 264, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, learner.model.eval()(ids), atol=1e-5)


def test_config_fields_it_does_not_implement_are_refused(tmp_path):
    from postrain.actors.models.loading import CheckpointError, load_model

    folder = save_tiny(tmp_path / "q", "qwen3", use_sliding_window=True, sliding_window=16)
    with pytest.raises(CheckpointError, match="use_sliding_window=true is not implemented"):
        load_model(folder)
