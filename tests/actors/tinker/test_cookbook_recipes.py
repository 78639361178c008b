"""tinker-cookbook's own recipes, unmodified, against the server: `python -m
tinker_cookbook.recipes.sl_loop` and `... rl_loop` (tinker-cookbook 0.6.1) run as subprocesses,
two steps each, with no network.

What the recipes take from the Hugging Face Hub is an offline cache built here (offline_hub.py):
the tokenizer of "Qwen/Qwen3-4B-Instruct-2507" (the name the recipes' `model_info` maps to the
ChatML renderer `qwen3_instruct`) is SmolLM2-135M-Instruct's, and the server holds, under that
name, a tiny random Llama with that tokenizer; "openai/gsm8k" ("main") holds addition word
problems in GSM8K's format, "HuggingFaceH4/no_robots" short chats in its format. The tiny model
answers any ChatML prompt `\\boxed{3}` or `\\boxed{4}` at random (smollm2_tiny_folder's planted
chain) and every sum here is 3 or 4, so rl_loop's rewards differ within most groups and it
trains (a step whose 4 groups all have rewards alike, (1/8)^4, is skipped, as the recipe does).
"""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))   # offline_hub.py, beside this file

from offline_hub import build_offline_hub, smollm2_tiny_folder  # noqa: E402
from postrain.actors.tinker import BaseModels, TinkerOptions  # noqa: E402
from tinker_server import API_KEY, tinker_served  # noqa: E402

pytest.importorskip("tinker_cookbook")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "Qwen/Qwen3-4B-Instruct-2507"
NAMES = ("Mia", "Omar", "Lena", "Raj", "Zoe", "Ben")
THINGS = ("apples", "marbles", "stickers", "pencils")
SUMS = ((1, 2), (2, 1), (1, 3), (2, 2), (3, 1), (0, 4))    # every answer is 3 or 4
TOPICS = ("the sea", "autumn", "a cat", "coffee", "rain", "the moon", "bread", "a bicycle")


def gsm8k_rows(num: int, offset: int = 0) -> list[dict]:
    """Rows of GSM8K's "main" config: a word problem, and a worked answer ending "#### N"."""
    rows = []
    for i in range(offset, offset + num):
        name, thing = NAMES[i % len(NAMES)], THINGS[i % len(THINGS)]
        a, b = SUMS[i % len(SUMS)]
        rows.append({
            "question": f"{name} has {a} {thing}. A friend gives {name} {b} more {thing}. "
                        f"How many {thing} does {name} have now?",
            "answer": f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {thing} now.\n#### {a + b}"})
    return rows


def no_robots_rows(num: int, offset: int = 0) -> list[dict]:
    """Rows of No Robots: prompt, prompt_id, messages ([{content, role}], some with a system
    message first), category."""
    rows = []
    for i in range(offset, offset + num):
        topic = TOPICS[i % len(TOPICS)]
        prompt = f"Write one short sentence about {topic}."
        messages = [{"content": prompt, "role": "user"},
                    {"content": f"Here is a sentence about {topic}: it is {('calm', 'bright', 'quiet')[i % 3]}.",
                     "role": "assistant"}]
        if i % 3 == 0:
            messages.insert(0, {"content": "You are a concise writer.", "role": "system"})
        rows.append({"prompt": prompt, "prompt_id": f"{i:064x}", "messages": messages,
                     "category": "Generation"})
    return rows


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(the tiny model's folder, the offline environment)."""
    root = tmp_path_factory.mktemp("cookbook_recipes")
    folder = smollm2_tiny_folder(root / "model")
    env = build_offline_hub(root / "hf", models={MODEL: folder}, datasets={
        ("openai/gsm8k", "main"): {"train": gsm8k_rows(24), "test": gsm8k_rows(8, offset=24)},
        "HuggingFaceH4/no_robots": {"train": no_robots_rows(24), "test": no_robots_rows(8, offset=24)}})
    return folder, env


@pytest.fixture(scope="module")
def server(hub):
    folder, _ = hub
    with tinker_served(BaseModels.load([f"{MODEL}={folder}"]), TinkerOptions()) as (url, service):
        yield url, service


def run_recipe(recipe: str, url: str, env: dict, log_path: Path, *settings: str,
               saves: tuple[str, ...] = ("final",)) -> list[dict]:
    """Run `python -m tinker_cookbook.recipes.RECIPE` with chz settings in a fresh process with
    the offline environment, two steps; its metrics.jsonl rows, one per step. `saves`: the names
    of the checkpoints it records in checkpoints.jsonl (set with save_every, 0 unless given)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "TINKER_"))}
    args = [sys.executable, "-m", f"tinker_cookbook.recipes.{recipe}", f"base_url={url}",
            f"model_name={MODEL}", f"log_path={log_path}", "max_steps=2", "lora_rank=8", *settings]
    if not any(s.startswith("save_every=") for s in settings):
        args.append("save_every=0")
    start = time.monotonic()
    out = subprocess.run(args, env={**clean, **env, "TINKER_API_KEY": API_KEY}, cwd=log_path.parent,
                         capture_output=True, text=True, timeout=400)
    print(f"{recipe}: {time.monotonic() - start:.1f} s")
    assert out.returncode == 0, f"{recipe} exited {out.returncode}\n{out.stdout[-4000:]}\n{out.stderr[-8000:]}"
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    checkpoints = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert [c["name"] for c in checkpoints] == list(saves)
    assert all(c["state_path"].startswith("tinker://") for c in checkpoints)      # save_state
    assert checkpoints[-1]["sampler_path"].startswith("tinker://")               # save_weights_for_sampler
    return rows


def test_sl_loop_runs_two_steps(hub, server, tmp_path):
    url, _ = server
    # save_every=1: a state saved at step 1 (with the recipe's ttl_seconds), beside the final one
    rows = run_recipe("sl_loop", url, hub[1], tmp_path / "sl", "batch_size=4", "max_length=256", "save_every=1",
                      saves=("000001", "final"))
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["num_sequences"] == 4
        assert math.isfinite(row["train_mean_nll"]) and row["train_mean_nll"] > 0
        assert math.isfinite(row["grad_norm:mean"]) and row["grad_norm:mean"] > 0


def test_rl_loop_runs_two_steps_with_its_default_loss(hub, server, tmp_path):
    """rl_loop as it is, its loss included: stable_reinforce, on samples recorded with
    record_stability_info and datums carrying their provenance."""
    pytest.importorskip("pylatexenc", reason="rl_loop grades with the cookbook's math-rl extra: pip install "
                                              "pylatexenc sympy math-verify (the test extra has them)")
    url, _ = server
    rows = run_recipe("rl_loop", url, hub[1], tmp_path / "rl", "batch_size=4", "group_size=4", "max_tokens=16")
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert 0.0 < row["reward/total"] < 1.0          # \boxed{3} or \boxed{4} at random: about 0.5
    # A step trains unless all 4 of its groups have rewards alike ((1/8)^4 a step), when the recipe
    # skips forward_backward and logs no optimizer metrics.
    trained = [row for row in rows if "grad_norm:mean" in row]
    assert trained, rows
    for row in trained:
        assert math.isfinite(row["grad_norm:mean"]) and row["grad_norm:mean"] > 0
