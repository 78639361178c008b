"""Hugging Face export streamed one unit (decoder layer) at a time: from a 2-rank FSDP learner (real
processes, gloo) and offline from its DCP checkpoint. The folder loads in `transformers` with the
sharded policy's logits; the offline export equals the in-run one bit for bit; several files
come with an index naming every tensor once; the safetensors writer refuses what breaks its
layout."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from postrain.actors.learner.batch import LearnerError
from postrain.actors.learner.safetensors_stream import INDEX_FILE, StreamedSafetensors
from postrain.actors.learner.streamed_export import export_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from export_ranks import IDS, VARIANTS  # noqa: E402
sys.path.insert(0, str(Path(__file__).parents[1]))

RANKS_SCRIPT = Path(__file__).with_name("export_ranks.py")


def folder_tensors(folder: Path) -> dict[str, list[str]]:
    """{tensor name: [the files that hold it]} over the folder's safetensors files."""
    held: dict[str, list[str]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                held.setdefault(name, []).append(path.name)
    return held


def folder_weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, rank_processes):
    out = tmp_path_factory.mktemp("export2")
    rank_processes([[RANKS_SCRIPT, r, 2, out / "init", out] for r in range(2)])
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_streamed_export_loads_in_transformers_with_the_policys_logits(two_ranks, variant):
    transformers = pytest.importorskip("transformers")
    folder = two_ranks / f"{variant}.hf"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(IDS).logits
    ours = torch.load(two_ranks / f"{variant}.logits.pt")
    assert float((ours - theirs).abs().max()) < 1e-4
    gathered = load_file(str(two_ranks / f"{variant}.weights.safetensors"))   # LoRA: merged
    exported = folder_weights(folder)
    assert sorted(exported) == sorted(gathered)
    assert all(torch.equal(exported[k], gathered[k]) for k in gathered)


def test_several_files_come_with_an_index_naming_every_tensor_once(two_ranks):
    folder = two_ranks / "plain.hf"
    held = folder_tensors(folder)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) > 2 and "model.safetensors" not in files
    index = json.loads((folder / INDEX_FILE).read_text())
    assert sorted(index["weight_map"]) == sorted(held)                   # every tensor, nothing else
    assert all(len(where) == 1 and index["weight_map"][name] == where[0] for name, where in held.items())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in folder_weights(folder).values())
    assert not (two_ranks / "lora.hf" / INDEX_FILE).exists()            # one file: no index
    assert sorted(p.name for p in (two_ranks / "lora.hf").glob("*.safetensors")) == ["model.safetensors"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_offline_export_of_the_dcp_checkpoint_equals_the_in_run_export(two_ranks, tmp_path, variant):
    out = export_checkpoint(two_ranks / f"{variant}.ckpt", tmp_path / "hf",
                                max_shard_bytes=VARIANTS[variant])
    in_run = two_ranks / f"{variant}.hf"
    files = sorted(str(p.relative_to(in_run)) for p in in_run.rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == files
    assert ("adapter/adapter_model.safetensors" in files) == (variant == "lora")    # LoRA: its PEFT adapter too
    for name in files:
        assert (out / name).read_bytes() == (in_run / name).read_bytes(), name    # file for file, byte for byte


def test_offline_export_refuses_a_folder_that_is_no_sharded_checkpoint(tmp_path):
    with pytest.raises(LearnerError, match="no state.json"):
        export_checkpoint(tmp_path, tmp_path / "hf")
    (tmp_path / "state.json").write_text(json.dumps({"format": "postrain-learner-0"}))
    with pytest.raises(LearnerError, match="neither the sharded learner's"):
        export_checkpoint(tmp_path, tmp_path / "hf")


def test_streamed_safetensors_round_trips_and_refuses_a_broken_layout(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(6, dtype=torch.int64), "c": torch.randn(5).bfloat16(),
               "d": torch.tensor(2.5)}
    layout = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    with StreamedSafetensors(tmp_path, layout, {"policy_version": "3"}, max_shard_bytes=60) as out:
        out.write({"a": tensors["a"]})
        out.write({"b": tensors["b"], "c": tensors["c"], "d": tensors["d"]})
    got = folder_weights(tmp_path)
    assert sorted(got) == sorted(tensors) and all(torch.equal(got[k], tensors[k]) for k in tensors)
    assert json.loads((tmp_path / INDEX_FILE).read_text())["metadata"]["policy_version"] == "3"
    one = StreamedSafetensors(tmp_path / "x", layout)
    with pytest.raises(ValueError, match="out of layout order; expected a"):
        one.write({"b": tensors["b"]})
    with pytest.raises(ValueError, match=r"the layout says torch.float32 \(3, 4\)"):
        one.write({"a": tensors["a"].double()})
    (tmp_path / "y").mkdir()
    partial = StreamedSafetensors(tmp_path / "y", layout)
    partial.write({"a": tensors["a"]})
    with pytest.raises(ValueError, match="3 tensor"):
        partial.close()


def test_postrain_export_writes_a_whole_learners_checkpoint_as_its_export_hf(tmp_path):
    """`postrain export` of a one-process learner's checkpoint (LoRA): the same tensors as the
    learner's own export_hf, in files of at most --max-shard-gb with an index."""
    from postrain.actors.learner.learner import Learner, LearnerConfig
    from postrain.cli.main import main

    from fsdp_ranks import batch, config

    learner = Learner(LearnerConfig(**{**config("lora"), "strategy": "ddp"}))
    assert not learner.sharded
    learner.train_step(batch(0))
    learner.save_checkpoint(tmp_path / "ckpt")
    learner.export_hf(tmp_path / "own")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "cli"), "--max-shard-gb", "0.00004"]) == 0
    assert (tmp_path / "cli" / INDEX_FILE).exists()
    ours, theirs = folder_weights(tmp_path / "cli"), folder_weights(tmp_path / "own")
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    with pytest.raises(SystemExit, match="postrain export: .* is not a learner checkpoint"):
        main(["export", str(tmp_path), str(tmp_path / "x")])
