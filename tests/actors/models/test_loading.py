"""Checkpoints: our safetensors folders round-trip, load in transformers, and bad input is named."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from postrain.actors.models.loading import (
    CheckpointError, checkpoint_policy_version, load_model, save_checkpoint,
)
from postrain.actors.models.tokenizer import byte_tokenizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, tokenizer = load_model("tiny", seed=4)
    folder = save_checkpoint(model, tokenizer, tmp_path_factory.mktemp("ckpt"), policy_version=7)
    return model, tokenizer, folder


def test_round_trip_equal_logits_tokenizer_and_version(saved):
    model, tokenizer, folder = saved
    loaded, loaded_tok = load_model(folder)
    ids = torch.tensor([tokenizer.encode("def f(x): return x*2")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), atol=0, rtol=0)
    assert loaded.config.tie_word_embeddings and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert checkpoint_policy_version(folder) == 7
    for field in ("initializer_range", "rope_theta", "num_kv_heads"):
        assert getattr(loaded.config, field) == getattr(model.config, field)
    assert json.loads((folder / "config.json").read_text())["initializer_range"] == model.config.initializer_range
    text = "x = 1 + 2  # ünïcode"
    assert loaded_tok.encode(text) == tokenizer.encode(text)
    assert loaded_tok.decode(loaded_tok.encode(text)) == text
    assert loaded_tok.eos_token_ids == tokenizer.eos_token_ids
    assert loaded_tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_from_scratch_model_draws_its_weights_at_its_configs_initializer_range():
    from postrain.actors.models.config import BUILTIN_CONFIGS
    from postrain.actors.models.llama import LlamaModel
    wide, narrow = (LlamaModel(dataclasses.replace(BUILTIN_CONFIGS["tiny"], initializer_range=std)).init_weights(3)
                    for std in (0.05, 0.02))
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight"):
        w, n = wide.state_dict()[name], narrow.state_dict()[name]
        assert abs(float(w.std()) - 0.05) < 0.005 and abs(float(n.std()) - 0.02) < 0.002
        torch.testing.assert_close(w * 0.4, n)                # the same draw, scaled
    assert float(LlamaModel(BUILTIN_CONFIGS["tiny"]).init_weights(3, std=0.1).model.norm.weight.detach().min()) == 1.0


def test_our_checkpoint_loads_in_transformers(saved):
    transformers = pytest.importorskip("transformers")
    model, tokenizer, folder = saved
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode("2+3=5")])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=1e-4)


def test_bad_paths_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no model at '/no/such/model'"):
        load_model("/no/such/model")
    stray = tmp_path / "weights.bin"
    stray.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a .gguf"):
        load_model(stray)
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_model(tmp_path)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_model(fake)


def _copy(folder, dest, edit_config=None, edit_state=None):
    dest.mkdir()
    config = json.loads((folder / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dest / "config.json").write_text(json.dumps(config))
    state = load_file(str(folder / "model.safetensors"))
    if edit_state:
        edit_state(state)
    save_file(state, str(dest / "model.safetensors"))
    byte_tokenizer().save(dest)
    return dest


def test_unknown_architecture_missing_tensor_and_shape_mismatch(saved, tmp_path):
    _, _, folder = saved
    bad = _copy(folder, tmp_path / "arch", edit_config=lambda c: c.update(model_type="gpt_neox"))
    with pytest.raises(CheckpointError, match="model_type 'gpt_neox' is not supported"):
        load_model(bad)
    missing = _copy(folder, tmp_path / "missing",
                    edit_state=lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['model.layers.1.mlp.up_proj.weight'\]"):
        load_model(missing)
    shape = _copy(folder, tmp_path / "shape", edit_config=lambda c: c.update(intermediate_size=100))
    with pytest.raises(CheckpointError, match="has shape .* the config implies"):
        load_model(shape)


def test_model_config_reads_a_models_shape_without_its_weights(saved, tmp_path):
    import sys
    from pathlib import Path

    from postrain.actors.models.config import BUILTIN_CONFIGS
    from postrain.actors.models.loading import model_config
    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_files import write_gguf      # tests/actors/models/gguf_files.py
    from hf_tiny import build_tiny

    folder = saved[2]
    assert model_config("tiny") == BUILTIN_CONFIGS["tiny"] and model_config(folder) == load_model(folder)[0].config
    assert model_config({"hidden_size": 64, "num_heads": 4, "num_kv_heads": 4}).head_dim == 16
    path = write_gguf(build_tiny("qwen3"), "qwen3", tmp_path / "q3.gguf")
    assert model_config(path) == load_model(path)[0].config          # tie_word_embeddings from its tensors
    with pytest.raises(CheckpointError, match="no model config at"):
        model_config(str(tmp_path))


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_num_params_counts_the_models_parameters(model_type):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from hf_tiny import build_tiny      # tests/actors/models/hf_tiny.py

    from postrain.actors.models.loading import config_from_hf
    hf = build_tiny(model_type)
    config = config_from_hf(hf.config.to_dict())
    assert config.num_params == pytest.approx(sum(p.numel() for p in hf.parameters()), rel=0.01)


def test_a_folders_tokenizer_read_without_weights_stops_where_the_loaded_one_does(saved, tmp_path):
    """The env and orchestrator read a folder's tokenizer without its weights (spec_tokenizer):
    where tokenizer_config.json names no end of sequence, the ids come from config.json, as
    load_model takes them, so an episode stops where the generator does."""
    import shutil
    from postrain.actors.models.spec import spec_tokenizer
    _, tokenizer, folder = saved
    copy = shutil.copytree(folder, tmp_path / "copy")
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    cfg.pop("eos_token", None)
    cfg.pop("postrain_eos_token_ids", None)
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    config = json.loads((copy / "config.json").read_text())
    config["eos_token_id"] = [tokenizer.eos_token_ids[0], 7]
    (copy / "config.json").write_text(json.dumps(config))
    loaded = load_model(copy)[1]
    assert set(loaded.eos_token_ids) == {tokenizer.eos_token_ids[0], 7}
    assert spec_tokenizer(str(copy)).eos_token_ids == loaded.eos_token_ids
