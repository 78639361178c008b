"""Mistral (actors/models/mistral.py) against transformers' own Mistral on a tiny random model
with an 8-token sliding window and prompts longer than it: greedy tokens through `postrain
generate`, engine-vs-learner logprobs, prefix caching / preemption / weight swap, export round trip.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import arch_checks  # noqa: E402  (tests/actors/models/arch_checks.py)

from postrain.bench.architectures import build_hf_folder  # noqa: E402

ARCH = "mistral"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp(ARCH)
    return [build_hf_folder(ARCH, root / f"seed{seed}", window=arch_checks.WINDOW, seed=seed) for seed in (0, 1)]


def test_loads_as_mistral_with_its_window(folders):
    from postrain.actors.models.loading import load_model
    from postrain.actors.models.mistral import MistralModel

    model, _ = load_model(folders[0])
    assert isinstance(model, MistralModel) and model.config.sliding_window == arch_checks.WINDOW
    assert all(layer.self_attn.window == arch_checks.WINDOW for layer in model.model.layers)


def test_generate_cli_greedy_equals_transformers(folders, capsys):
    arch_checks.check_cli_greedy_equals_transformers(folders[0], capsys)


def test_engine_logprobs_equal_learner_logprobs(folders):
    arch_checks.check_engine_logprobs_equal_learner(folders[0])


def test_prefix_cache_preemption_and_weight_swap_keep_greedy_output(folders):
    arch_checks.check_engine_paths_keep_greedy(*folders)


def test_export_round_trip_gives_transformers_the_same_logits(folders, tmp_path):
    arch_checks.check_export_round_trip(folders[0], tmp_path)


def test_unsupported_model_type_and_unhonoured_fields_are_refused_by_name(folders, tmp_path, capsys):
    import json
    import shutil

    from postrain.actors.models.loading import CheckpointError, config_from_hf
    from postrain.cli import main

    hf = json.loads((folders[0] / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"model_type 'falcon' is not supported; supported: .*mistral.*"
                                              r"add one line to ARCHITECTURES"):
        config_from_hf({**hf, "model_type": "falcon"})
    with pytest.raises(CheckpointError, match="use_sliding_window=true is not supported for qwen2"):
        config_from_hf({**hf, "model_type": "qwen2", "use_sliding_window": True})
    with pytest.raises(CheckpointError, match="hidden_act='gelu'"):
        config_from_hf({**hf, "hidden_act": "gelu"})
    with pytest.raises(CheckpointError, match="rope_scaling type 'yarn' is not supported"):
        config_from_hf({**hf, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})
    bad = shutil.copytree(folders[0], tmp_path / "bad")
    (bad / "config.json").write_text(json.dumps({**hf, "sliding_window": -4}))
    assert main(["generate", "--model", str(bad), "--prompt", "x"]) == 2
    assert "sliding_window must be > 0" in capsys.readouterr().err
