"""Gemma 3 (actors/models/gemma3.py) against transformers' own Gemma3ForCausalLM on a tiny random model
(local and global layers alternating, an 8-token window, its own rope per kind, a final logit soft
cap) and prompts longer than the window: greedy tokens through `postrain
generate`, engine-vs-learner logprobs, prefix caching / preemption / weight swap, export round trip.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import arch_checks  # noqa: E402  (tests/actors/models/arch_checks.py)

from postrain.bench.architectures import build_hf_folder  # noqa: E402

ARCH = "gemma3_text"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp(ARCH)
    return [build_hf_folder(ARCH, root / f"seed{seed}", window=arch_checks.WINDOW, seed=seed) for seed in (0, 1)]


def test_loads_as_gemma3_with_local_and_global_layers(folders):
    from postrain.actors.models.gemma3 import Gemma3Model
    from postrain.actors.models.loading import load_model

    model, _ = load_model(folders[0])
    assert isinstance(model, Gemma3Model)
    assert [layer.self_attn.window for layer in model.model.layers] == [arch_checks.WINDOW, None] * 2
    assert model.config.final_logit_softcapping == 5.0 and model.config.rope_local_base_freq == 1000.0


def test_generate_cli_greedy_equals_transformers(folders, capsys):
    arch_checks.check_cli_greedy_equals_transformers(folders[0], capsys)


def test_engine_logprobs_equal_learner_logprobs(folders):
    arch_checks.check_engine_logprobs_equal_learner(folders[0])


def test_prefix_cache_preemption_and_weight_swap_keep_greedy_output(folders):
    arch_checks.check_engine_paths_keep_greedy(*folders)


def test_export_round_trip_gives_transformers_the_same_logits(folders, tmp_path):
    arch_checks.check_export_round_trip(folders[0], tmp_path)


@pytest.mark.parametrize("field, value, message", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0, which transformers' Gemma 3 ignores"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=true"),
    ("hidden_activation", "gelu", "hidden_act='gelu' is not supported for gemma3_text"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
     "rope_scaling type 'yarn' is not supported"),
    ("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     r"sliding layers' rope type 'linear' \(rope_parameters.sliding_attention\)"),
])
def test_unhonoured_config_fields_are_refused_by_name(folders, field, value, message):
    import json

    from postrain.actors.models.loading import CheckpointError, config_from_hf

    hf = json.loads((folders[0] / "config.json").read_text())
    hf.pop("hidden_act", None)
    with pytest.raises(CheckpointError, match=message):
        config_from_hf({**hf, field: value})


def test_transformers_4_layout_gives_the_same_config(folders):
    """Older config.json files: sliding_window_pattern, rope_theta + rope_scaling, rope_local_base_freq."""
    import json

    from postrain.actors.models.loading import config_from_hf

    hf = json.loads((folders[0] / "config.json").read_text())
    new = config_from_hf(hf)
    old = {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters")}
    old.update(sliding_window_pattern=2, rope_theta=100_000.0, rope_local_base_freq=1_000.0,
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert config_from_hf(old) == new
