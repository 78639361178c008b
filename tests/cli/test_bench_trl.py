"""`postrain bench trl`: without trl it says how to install it and exits 0; with trl, TRL's side
gets the run's own GRPO settings, sizes and reward. The timed run itself is a benchmark, not a test."""
import importlib.util

import pytest

from postrain import cli
from postrain.bench import run_benchmark
from postrain.bench import trl as bench_trl


def test_without_trl_the_bench_says_how_to_install_it_and_exits_0(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else find_spec(name, *a))
    assert run_benchmark("trl") == {"bench": "trl", "skipped": bench_trl.INSTALL}
    assert cli.main(["bench", "trl"]) == 0
    assert capsys.readouterr().out.strip() == bench_trl.INSTALL
    assert "pip install -e '.[bench-trl]'" in bench_trl.INSTALL


def test_seconds_per_step_run_from_the_warm_up_steps_end_to_the_last():
    assert bench_trl.step_figures([100.0, 150.0, 210.0, 250.0], 64) == {"s_per_step": 50.0, "samples_per_s": 1.28}
    with pytest.raises(AssertionError, match="at least one measured step"):
        bench_trl.step_figures([100.0], 64)


def test_trl_is_rewarded_by_the_environments_own_rule():
    completions = [[{"role": "assistant", "content": text}] for text in
                   ("37 + 58 = 95", "The answer is 95.", "To add 37 and 58, we", "95")]
    assert bench_trl.plain_answer_reward(completions, [95, 95, 95, 96]) == [1.0, 1.0, 0.0, 0.0]


def test_trl_gets_the_addition_runs_sizes_and_learner_settings(tmp_path):
    pytest.importorskip("trl")
    config = bench_trl.addition_config()
    args = bench_trl.trl_arguments(config, str(tmp_path), num_steps=3)
    assert (args.max_steps, args.num_generations, args.max_completion_length) == (4, 8, 16)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 64 == args.generation_batch_size
    assert (args.learning_rate, args.lr_scheduler_type, args.beta) == (1e-5, "constant", 0.0)
    assert (args.epsilon, args.epsilon_high, args.loss_type, args.scale_rewards) == (0.2, 0.28, "grpo", "group")
    assert args.temperature == 1.0 and args.num_iterations == 1 and args.use_cpu
    # TRL's own default recomputes activations; the headline side turns that off
    assert args.gradient_checkpointing
    assert not bench_trl.trl_arguments(config, str(tmp_path), 3, gradient_checkpointing=False).gradient_checkpointing
    data = bench_trl.trl_dataset(config, 16)
    assert len(data) == 16 and data[0]["prompt"][0]["role"] == "user"
    assert all(" + " in row["prompt"][0]["content"] for row in data)
