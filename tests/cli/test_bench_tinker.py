"""`postrain bench tinker` (bench/tinker.py), quick: the Tinker server's figures through the real SDK
are present, positive and finite, each ratio is its raw figures' quotient, and the API's step did the
learner's work (the adapters agree). No wall-clock asserts."""
import math

import pytest
from postrain.bench import BENCHMARKS, run_benchmark

pytest.importorskip("tinker")

RAW = ("step_s", "sample_tokens_per_s", "sample_group_tokens_per_s", "tenants_1_samples_per_s",
       "tenants_4_samples_per_s", "tenants_4_min_tenant_samples_per_s", "tenants_4_max_tenant_samples_per_s",
       *(f"tenants_{n}{tag}_samples_per_s" for tag in ("_unbatched", "_1datum", "_1datum_unbatched") for n in (1, 4)))
RATIOS = {"tinker_step_overhead_ratio": ("step_s", "peer step_s"),
          "tinker_sample_ratio": ("sample_tokens_per_s", "peer sample_tokens_per_s"),
          "tinker_sample_group_ratio": ("sample_group_tokens_per_s", "peer sample_group_tokens_per_s"),
          "tinker_4_tenants_total_ratio": ("tenants_4_samples_per_s", "tenants_1_samples_per_s"),
          **{f"tinker_4_tenants{tag}_total_ratio": (f"tenants_4{tag}_samples_per_s", f"tenants_1{tag}_samples_per_s")
             for tag in ("_unbatched", "_1datum", "_1datum_unbatched")},
          **{f"tinker_4_tenants{tag}_batching_gain": (f"tenants_4{tag}_samples_per_s",
                                                      f"tenants_4{tag}_unbatched_samples_per_s")
             for tag in ("", "_1datum")}}


@pytest.mark.slow
def test_a_quick_run_reports_the_apis_step_sampling_and_tenants_against_the_same_work_in_process():
    assert BENCHMARKS["tinker"] == "postrain.bench.tinker"
    report = run_benchmark("tinker", quick=True)
    results, peer = report["results"], report["peer"]
    assert report["config"]["model"].startswith("tiny")
    figures = {**results, **{f"peer {k}": v for k, v in peer.items()}}
    for name in (*RAW, *(f"peer {k}" for k in ("step_s", "sample_tokens_per_s", "sample_group_tokens_per_s")),
                 *RATIOS):
        assert isinstance(figures[name], float) and math.isfinite(figures[name]) and figures[name] > 0, name
    for name, (ours, theirs) in RATIOS.items():     # the ratio is rounded to 3 decimals
        assert abs(results[name] - figures[ours] / figures[theirs]) <= 5e-4 + 1e-9, name
    assert results["tenants_4_min_tenant_samples_per_s"] <= results["tenants_4_max_tenant_samples_per_s"]
    assert results["step_weights_max_abs_diff"] < 1e-5      # both sides trained the same adapter alike
    assert isinstance(results["tenants_4_batched_forwards"], int) and results["tenants_4_batched_forwards"] >= 0
