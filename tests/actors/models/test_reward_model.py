"""Reward models: a `*ForSequenceClassification` folder of each registry architecture scores as
transformers does; folders that are no reward model are refused by name, at load and at the
dry-run check (config.json and safetensors headers only)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from postrain.actors.models import ARCHITECTURES
from postrain.actors.models.hf_config import CheckpointError
from postrain.actors.models.reward_model import check_reward_model_spec, load_reward_model
from postrain.bench.architectures import BYTE_IDS, HF_CONFIGS, TEST_SHAPE, build_hf_folder

transformers = pytest.importorskip("transformers")

SHAPE = {**TEST_SHAPE, "num_hidden_layers": 2}
FIX = r"a reward model needs \*ForSequenceClassification weights with a `score` head"


def _config(arch: str, num_labels: int):
    """The transformers config of a tiny `arch` (the bench's where it has one), with num_labels."""
    if arch in HF_CONFIGS:
        config = HF_CONFIGS[arch](SHAPE, 8)
    elif arch == "llama":
        config = transformers.LlamaConfig(**SHAPE, **BYTE_IDS, tie_word_embeddings=False)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**SHAPE, **BYTE_IDS, tie_word_embeddings=False, use_sliding_window=False)
    else:
        raise AssertionError(f"no tiny config for the registry's {arch!r}: add one here")
    config.num_labels = num_labels
    return config


def save_reward_folder(arch: str, folder: Path, num_labels: int = 1, seed: int = 0):
    """A random tiny `arch` XForSequenceClassification saved by transformers; (folder, the hf model)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(_config(arch, num_labels)).eval()
    gemma_norm = arch.startswith("gemma")             # Gemma norms scale by 1 + weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in name and not gemma_norm else 0.0))
    model.save_pretrained(folder)
    return Path(folder), model


def sequences() -> list[list[int]]:
    """Lengths 1 to 21 (past the 8-token sliding window), in no order; the last ends in the pad id
    (0), which transformers' pooling skips: it is scored at the token before."""
    gen = torch.Generator().manual_seed(1)
    lengths = [13, 1, 21, 5, 9]
    seqs = [torch.randint(8, 264, (n,), generator=gen).tolist() for n in lengths]
    return seqs + [seqs[3] + [BYTE_IDS["pad_token_id"]]]


# the vision-language types have no *ForSequenceClassification in transformers, or (gemma3) one postrain's
# reward models do not read: a Gemma 3 reward model is a gemma3_text folder
@pytest.mark.parametrize("arch", sorted(set(ARCHITECTURES) - {"idefics3", "smolvlm", "qwen2_5_vl", "gemma3"}))
def test_scores_equal_transformers_for_each_registry_architecture(arch, tmp_path):
    folder, hf = save_reward_folder(arch, tmp_path / arch)
    assert json.loads((folder / "config.json").read_text())["architectures"][0].endswith("ForSequenceClassification")
    check_reward_model_spec(str(folder))
    rm = load_reward_model(str(folder))
    seqs = sequences()
    ours = rm.score(seqs)
    with torch.no_grad():
        theirs = [float(hf(torch.tensor([ids])).logits[0, 0]) for ids in seqs]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=1e-5)
    assert ours[-1] == pytest.approx(ours[3], abs=1e-5)       # the trailing pad id is not scored
    rm.max_batch_tokens = 16                                   # more, smaller batches: the same scores
    torch.testing.assert_close(torch.tensor(rm.score(seqs)), torch.tensor(ours), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def llama_rm(tmp_path_factory) -> Path:
    return save_reward_folder("llama", tmp_path_factory.mktemp("rm") / "llama")[0]


def _refused(spec, match: str) -> None:
    """Both the dry-run check and the loader refuse `spec` with `match`."""
    with pytest.raises(CheckpointError, match=match):
        check_reward_model_spec(spec)
    with pytest.raises(CheckpointError, match=match):
        load_reward_model(spec)


def test_a_folder_without_a_score_head_is_refused_naming_the_folder_and_the_fix(llama_rm, tmp_path):
    headless = tmp_path / "headless"
    headless.mkdir()
    (headless / "config.json").write_text((llama_rm / "config.json").read_text())
    state = load_file(str(llama_rm / "model.safetensors"))
    del state["score.weight"]
    save_file(state, str(headless / "model.safetensors"))
    _refused(str(headless), f"{headless}.*has no `score.weight`.*{FIX}")


def test_a_classifier_of_two_labels_is_refused(tmp_path):
    folder, _ = save_reward_folder("llama", tmp_path / "two", num_labels=2)
    _refused(str(folder), "num_labels=2.*num_labels must be 1")


def test_a_causal_lm_folder_is_refused_as_a_reward_model(tmp_path):
    folder = build_hf_folder("qwen3", tmp_path / "lm", SHAPE)
    _refused(str(folder), f"{folder}.*Qwen3ForCausalLM.*name no \\*ForSequenceClassification.*{FIX}")


def test_other_non_reward_models_are_refused_by_name(llama_rm, tmp_path):
    _refused("tiny", f"built-in name.*{FIX}")
    _refused(str(tmp_path / "missing"), f"no such folder.*{FIX}")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((llama_rm / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\xff" * 8 + b"not a header")
    _refused(str(broken), "model.safetensors: not a readable safetensors file")


def test_bad_sequences_are_named(llama_rm):
    rm = load_reward_model(str(llama_rm))
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        rm.score([[5, 6], []])
    with pytest.raises(ValueError, match="sequence 0 holds token id 264, outside"):
        rm.score([[5, 264]])
    with pytest.raises(ValueError, match="past .* context length"):
        rm.score([[5] * (SHAPE["max_position_embeddings"] + 1)])
    assert rm.score([]) == []
