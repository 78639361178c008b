"""The user's own loops in tinker-cookbook's style (examples/tinker_rl_loop.py, tinker_sl_loop.py),
run through the real tinker SDK against a server started here: two steps each on the tiny model
(the RL loop's datums built by the cookbook's advantage and datum helpers and trained with
`importance_sampling`, the SL loop's held-out loss down), and, slow, the RL loop's 20 steps on
SmolLM2-135M raising held-out accuracy on the addition task (docs/tinker.md)."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from postrain.actors.tinker import BaseModels
from tinker_server import API_KEY, tinker_served

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module        # chz reads the module of its classes while it makes them
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)    # the loops' ServiceClient reads it, as a user's would


def test_the_rl_loop_runs_two_steps_on_the_tiny_model(served, api_key, monkeypatch):
    rl = example("tinker_rl_loop")
    # The random tiny model never answers a sum: a reward that varies within a group makes the
    # loop build and send datums (the cookbook's advantages, importance_sampling) every step.
    monkeypatch.setattr(rl, "plain_answer_correct", lambda text, answer: len(text) % 2 == 0)
    url, _ = served
    config = rl.Config(base_url=url, model_name="tiny", tokenizer="tiny", batch_size=4, group_size=4,
                       max_tokens=8, max_steps=2, num_eval=8)
    out = rl.main(config)
    assert [s["step"] for s in out["steps"]] == [0, 1]
    assert all(s["datums"] > 0 for s in out["steps"])
    assert 0.0 <= out["accuracy_before"] <= 1.0 and 0.0 <= out["accuracy_after"] <= 1.0


def test_the_sl_loop_lowers_its_held_out_loss_in_two_steps_on_the_tiny_model(served, api_key):
    sl = example("tinker_sl_loop")
    url, _ = served
    config = sl.Config(base_url=url, model_name="tiny", tokenizer="tiny", batch_size=8, max_steps=2,
                       num_eval=16)
    out = sl.main(config)
    assert [s["step"] for s in out["steps"]] == [0, 1]
    assert out["eval_nll_after"] < out["eval_nll_before"]


@pytest.mark.variants
@pytest.mark.timeout(900)
def test_the_rl_loop_raises_smollm2_held_out_accuracy_in_20_steps(api_key):
    """The documented run, seed 0 (docs/tinker.md): 8 questions x 4 samples a step, 16 tokens,
    lr 5e-4, rank 16; greedy accuracy on 100 held-out sums. 3-7 minutes on the 2-core VM (0.11 -> 0.43
    measured; the bound is below the worst of seeds 0-2, +0.27)."""
    rl = example("tinker_rl_loop")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # as measured: on a shared 2-core VM two threads ran ~3x slower
    try:
        with tinker_served(BaseModels.load([f"{SMOLLM2}=smollm2"])) as (url, _):
            out = rl.main(rl.Config(base_url=url, seed=0))
    finally:
        torch.set_num_threads(threads)
    assert out["accuracy_after"] >= out["accuracy_before"] + 0.15, out
