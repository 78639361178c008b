"""Learning-health warnings (actors/orchestrator/health.py) from scripted metrics sequences: each
fires once, at the step it should, into metrics.jsonl (a real MetricsWriter) and the output."""
from __future__ import annotations

import json

from postrain.actors.orchestrator.health import HealthWatch, report_warnings
from postrain.core.metrics import MetricsWriter


def feed(watch: HealthWatch, rows: list[dict]) -> list[tuple[int, str]]:
    """(step, code) of every warning over the rows, steps 1-based."""
    out = []
    for step, row in enumerate(rows, start=1):
        out += [(step, w["row"]["code"]) for w in watch.check_step(step, row)]
    return out


def test_reward_collapse_fires_once_when_the_k_step_mean_halves():
    rewards = [0.4, 0.45, 0.5, 0.5, 0.5, 0.45, 0.3, 0.2, 0.1, 0.1, 0.05, 0.0, 0.0]
    # 5-step means: best 0.48 (steps 1-5 .. 2-6); steps 5-9 mean 0.31, 6-10 0.23 <= 0.24 -> step 10
    assert feed(HealthWatch(window_steps=5), [{"reward_mean": r} for r in rewards]) == [(10, "reward_collapse")]


def test_a_steady_or_noisy_low_reward_is_not_a_collapse():
    assert feed(HealthWatch(5), [{"reward_mean": r} for r in [0.5, 0.4, 0.6, 0.45, 0.5] * 4]) == []
    assert feed(HealthWatch(5), [{"reward_mean": r} for r in [0.04, 0.0, 0.02, 0.0, 0.0] * 4]) == []


def test_entropy_collapse_against_the_first_k_steps():
    entropies = [1.2, 1.1, 1.0, 1.0, 0.9, 0.5, 0.2, 0.05, 0.02, 0.01, 0.01]
    # first 5: mean 1.04; last 5 at step 10: (0.5+0.2+0.05+0.02+0.01)/5 = 0.156 >= 0.104; step 11: 0.058
    assert feed(HealthWatch(5), [{"entropy": e} for e in entropies]) == [(11, "entropy_collapse")]


def test_accuracy_collapse_and_an_all_zero_evaluation_each_once():
    watch = HealthWatch()
    evals = {"before": 0.0}
    assert watch.check_eval("before", evals) == []           # a model from scratch scores 0 before training
    evals.update(after_sft=0.36, sampled_after_sft=0.2)
    assert watch.check_eval("after_sft", evals) == []
    evals.update(step_10=0.30)
    assert watch.check_eval("step_10", evals) == []
    evals.update(step_20=0.0, sampled_step_20=0.0)
    codes = [w["row"]["code"] for w in watch.check_eval("step_20", evals)]
    assert codes == ["eval_all_zero", "accuracy_collapse"]
    evals.update(after=0.0, sampled_after=0.0)
    assert watch.check_eval("after", evals) == []           # once each


def test_warnings_go_to_metrics_jsonl_and_the_output(tmp_path):
    metrics = MetricsWriter(tmp_path, tensorboard=False)
    lines = []
    watch = HealthWatch(window_steps=2)
    for step, reward in enumerate([0.6, 0.6, 0.2, 0.1], start=1):
        report_warnings(watch.check_step(step, {"reward_mean": reward}), metrics, lines.append)
    metrics.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["code"], r["step"]) for r in rows] == [("warning", "reward_collapse", 4)]
    assert len(lines) == 1 and lines[0].startswith("warning: step 4: reward collapse")
