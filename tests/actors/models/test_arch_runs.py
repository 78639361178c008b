"""A short real run (`postrain up`: every role a real process, one GRPO step on the built-in
arithmetic task) with each new architecture as `[shared] model`: the ledger balances and the
exported policy loads in transformers with postrain's logits."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import arch_checks  # noqa: E402  (tests/actors/models/arch_checks.py)

from postrain.bench.architectures import build_hf_folder  # noqa: E402
from postrain.core.testing import to_toml  # noqa: E402


def run_config(run_dir: Path, model: Path) -> dict:
    """One GRPO step of 2 prompts x 2 samples on 1-digit arithmetic, no warm start, 2 eval tasks."""
    actor = {"cpus": 0.5, "memory_mb": 0}
    return {
        "run": {"name": "arch", "run_dir": str(run_dir), "driver": "orchestrator"},
        "shared": {"model": str(model), "task": "arithmetic",
                   "task_options": {"include_instructions": False, "max_digits": 1}},
        "head": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 120},
        "balancer": {"enabled": False},
        "actors": [
            {"name": "sandbox", "cls": "postrain.actors.sandbox:SandboxActor", **actor, "cpus": 0.2,
             "options": {"mode": "warm", "num_workers": 1}},
            {"name": "generator", "cls": "postrain.actors.generator:GeneratorActor", **actor,
             "options": {"kv_cache_mb": 16}},
            {"name": "learner", "cls": "postrain.actors.learner:LearnerActor", **actor,
             "options": {"learner": {"lr": 1e-3}}},
            {"name": "env", "cls": "postrain.actors.env:EnvironmentActor", **actor, "cpus": 0.1},
            {"name": "orchestrator", "cls": "postrain.actors.orchestrator:OrchestratorActor", **actor,
             "cpus": 0.1, "options": {"num_steps": 1, "prompts_per_step": 2, "samples_per_prompt": 2,
                                      "num_eval_tasks": 2, "sampling": {"max_new_tokens": 8}}},
        ],
    }




@pytest.mark.slow
@pytest.mark.arch_matrix      # with test_moe.py's: `pytest -m arch_matrix tests/actors/models`
@pytest.mark.parametrize("arch", ["mistral", "gemma3_text"])
def test_a_grpo_run_on_the_architecture_balances_its_ledger_and_exports_for_transformers(arch, tmp_path):
    import transformers

    from postrain.actors.models.loading import load_model

    config = tmp_path / "run.toml"
    config.write_text(to_toml(run_config(tmp_path / "runs", build_hf_folder(arch, tmp_path / arch))))
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "up", "--config", str(config), "--quiet"],
                            capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "runs" / "arch"
    summary = json.loads((run / "summary.json").read_text())
    ledger = summary["ledger"]
    assert summary["steps"] == 1 and ledger["created"] == 2 * 2
    assert ledger["created"] == ledger["in_flight"] + ledger["trained"] + ledger["dropped"]
    assert ledger["in_flight"] == 0 and summary["samples"] == ledger["trained"] > 0
    policy = run / "policy"
    ours, tokenizer = load_model(policy)
    assert ours.config.architecture == arch
    hf = transformers.AutoModelForCausalLM.from_pretrained(policy).eval()
    ids = torch.tensor([tokenizer.encode(arch_checks.PROMPT)])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=0, atol=2e-5)
