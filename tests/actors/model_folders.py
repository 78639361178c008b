"""Model folders for the scorer and distillation tests, written by the code's own `save_checkpoint`
(no transformers, no download; well under a second each):

    teacher = tiny_policy_folder(tmp_path / "teacher", seed=1)   # a tiny policy, as a run exports one
    other = other_tokenizer_folder(teacher, tmp_path / "other")   # two tokens' ids swapped
    rm = reward_folder(teacher, tmp_path / "rm")                  # *ForSequenceClassification + score head
    no_head = reward_folder(teacher, tmp_path / "nohead", head=False)

A reward folder here is for the checks and the sizing (config.json and safetensors headers): its
decoder still holds the LM head, which load_reward_model would refuse to read as a reward model's.
"""
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from postrain.actors.models.loading import load_model, model_config, save_checkpoint


def tiny_policy_folder(folder: Path, seed: int = 1) -> Path:
    """The built-in tiny model of `seed` (random weights) as a Hugging Face folder with the byte
    tokenizer: a teacher of the tiny policy's vocabulary."""
    model, tokenizer = load_model("tiny", seed=seed)
    return save_checkpoint(model, tokenizer, folder)


def other_tokenizer_folder(source: Path, folder: Path) -> Path:
    """`source` with the ids of tokens 'a' and 'b' swapped in tokenizer.json: the same vocabulary
    size, another tokenizer."""
    folder = Path(shutil.copytree(source, folder))
    doc = json.loads((folder / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (folder / "tokenizer.json").write_text(json.dumps(doc))
    return folder


def reward_folder(source: Path, folder: Path, head: bool = True) -> Path:
    """`source` declared a LlamaForSequenceClassification of one label, with a `score.weight` head
    in a second safetensors file (or, `head=False`, none)."""
    folder = Path(shutil.copytree(source, folder))
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["LlamaForSequenceClassification"], id2label={"0": "LABEL_0"},
                  label2id={"LABEL_0": 0})
    (folder / "config.json").write_text(json.dumps(config))
    if head:
        hidden = model_config(str(source)).hidden_size
        save_file({"score.weight": torch.zeros(1, hidden)}, str(folder / "score.safetensors"))
    return folder
