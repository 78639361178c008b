"""`postrain export RUN_OR_CHECKPOINT OUT [--peft]` (cli/export.py) on a run folder laid out as a run
writes it (RUN_FOLDER/config.toml, RUN_FOLDER/checkpoint): the run folder and its checkpoint give the
same folder, the commands it suggests work on that folder, `--peft` writes the PEFT adapter that
`peft` loads over the base model with the policy's logits, and a wrong folder or a checkpoint
without LoRA is refused in one line. (A real run exported: tests/cli/test_init.py.)"""
from __future__ import annotations

import json
import shlex

import pytest
import torch
from safetensors.torch import load_file

from postrain.actors.learner import Learner, LearnerConfig
from postrain.actors.models.loading import save_checkpoint
from postrain.actors.records import TrainBatch
from postrain.cli.export import RUN_CHECKPOINT, RUN_CONFIG
from postrain.cli.main import build_parser, main

TINY = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(8, 264, (12,), generator=g) for _ in range(4)]
    return TrainBatch(token_ids=ids, loss_mask=[[0] * 4 + [1] * 8] * 4,
                      behavior_logprobs=[torch.full((12,), -5.5) for _ in range(4)],
                      policy_versions=[0] * 4, rewards=[1.0, 0.0, 0.0, 1.0], group_ids=[0, 0, 1, 1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two run folders with one trained step each: lora_run (rank 4 on q_proj, v_proj) and full_run;
    the LoRA learner's base model as a Hugging Face folder (base/); the LoRA learner."""
    root = tmp_path_factory.mktemp("runs")
    learners = {}
    for name, lora in (("lora_run", {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}), ("full_run", None)):
        learner = Learner(LearnerConfig(model=TINY, lr=1e-2, micro_batch_size=2, lora=lora))
        learner.train_step(batch())
        (root / name).mkdir()
        (root / name / RUN_CONFIG).write_text("# the config `postrain up` ran\n")
        learner.save_checkpoint(root / name / RUN_CHECKPOINT)
        learners[name] = learner
    save_checkpoint(learners["lora_run"].model, learners["lora_run"].tokenizer, root / "base")   # holds the base
    return root, learners["lora_run"]


def suggested(printed: str) -> list[str]:
    return [line.strip() for line in printed.splitlines() if line.startswith("  postrain ")]


def test_a_run_folder_exports_its_checkpoint_and_the_suggested_commands_work(runs, tmp_path, capsys):
    root, _ = runs
    assert main(["export", str(root / "lora_run"), str(tmp_path / "hf")]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {tmp_path / 'hf'}" in printed and f"its PEFT adapter in {tmp_path / 'hf' / 'adapter'}" in printed
    assert main(["export", str(root / "lora_run" / RUN_CHECKPOINT), str(tmp_path / "same")]) == 0
    files = sorted(str(p.relative_to(tmp_path / "hf")) for p in (tmp_path / "hf").rglob("*") if p.is_file())
    assert "adapter/adapter_config.json" in files and "model.safetensors" in files
    assert all((tmp_path / "hf" / f).read_bytes() == (tmp_path / "same" / f).read_bytes() for f in files)
    lines = suggested(printed)
    assert [line.split()[1] for line in lines] == ["generate", "serve", "eval"]
    assert lines[2].startswith(f"postrain eval {root / 'lora_run'} --model {tmp_path / 'hf'}")
    for line in lines:      # as printed: every one parses, and generate runs on the folder
        build_parser().parse_args(shlex.split(line, comments=True)[1:])
    capsys.readouterr()
    assert main(shlex.split(lines[0])[1:] + ["--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()


def test_peft_writes_the_adapter_folder_that_peft_loads_with_the_policys_logits(runs, tmp_path, capsys):
    root, learner = runs
    assert main(["export", "--peft", str(root / "lora_run"), str(tmp_path / "adapter")]) == 0
    assert "a PEFT adapter folder" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (settings["peft_type"], settings["r"], settings["lora_alpha"]) == ("LORA", 4, 8.0)
    assert settings["target_modules"] == ["q_proj", "v_proj"]
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 2 * 2           # 2 layers x (q_proj, v_proj) x (A, B)
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    try:
        import peft
        import transformers
    except ImportError:     # the files' structure above is what peft reads
        return
    ids = torch.randint(8, 264, (2, 10), generator=torch.Generator().manual_seed(5))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(root / "base"), dtype=torch.float32)
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()(ids).logits
        ours = learner.model(ids)
    assert float((ours - theirs).abs().max()) < 1e-4


def test_peft_of_a_run_without_lora_and_a_folder_that_is_no_checkpoint_are_refused_in_one_line(runs, tmp_path):
    root, _ = runs
    with pytest.raises(SystemExit, match=r"^postrain export: .*full_run/checkpoint holds no LoRA adapters \(its "
                                         r"learner had no lora option\); export its whole policy without --peft$"):
        main(["export", "--peft", str(root / "full_run"), str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=r"^postrain export: .*checkpoints/40 is not a learner checkpoint \(no "
                                         r"such folder\); .* \(a run's is RUN_FOLDER/checkpoint\)$"):
        main(["export", str(root / "full_run" / "checkpoints" / "40"), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
