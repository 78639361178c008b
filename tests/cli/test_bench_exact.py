"""`postrain bench exact` (bench/exact.py), quick: the tiny model's exact rollouts are scored at a gap
of exactly 0 where the plain ones are not, and both cost ratios come from the same run."""
import math

import pytest

from postrain.bench import run_benchmark


@pytest.mark.slow
def test_a_quick_run_measures_the_gap_exact_removes_and_what_it_costs():
    report = run_benchmark("exact", quick=True)
    results, peer = report["results"], report["peer"]
    assert results["exact_logprob_max_abs_diff"] == 0.0
    assert results["plain_logprob_max_abs_diff"] > 0.0       # the mismatch exact removes
    for name in ("exact_engine_tok_per_s_ratio_tiny", "exact_learner_step_ratio_tiny"):
        assert math.isfinite(results[name]) and results[name] > 0, name
    assert results["exact_engine_tok_per_s_ratio_tiny"] == pytest.approx(
        results["engine_tok_per_s_tiny"] / peer["engine_tok_per_s_tiny"], rel=0.01)
