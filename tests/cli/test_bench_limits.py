"""`postrain bench limits` (bench/limits.py): every path's share is a positive finite fraction of
a ceiling measured in the same run, its raw figures beside it, and the ceilings are measured (the
timed torch calls at the asked size and thread count), never constants. No wall-clock asserts."""
import math

import pytest
import torch

from postrain.actors.configs.step_time import forward_flops
from postrain.actors.models.config import BUILTIN_CONFIGS
from postrain.bench import BENCHMARKS, limits, run_benchmark
from postrain.bench.learner import rollout_batch

FRACTIONS = ("learner_peak_frac", "prefill_peak_frac", "decode_b1_bandwidth_frac", "decode_b32_ceiling_frac",
             "sandbox_warm_fork_exec_frac")
RAW = ("matmul_peak_gflops", "mem_bandwidth_gb_per_s", "learner_step_s", "learner_step_gflop", "learner_gflops",
       "prefill_tok_per_s", "prefill_gflops", "decode_b1_tok_per_s", "decode_b1_mb_per_token",
       "decode_b1_gb_per_s", "decode_b32_tok_per_s", "decode_b32_ceiling_tok_per_s")


@pytest.mark.slow
def test_a_quick_run_reports_each_paths_share_of_the_ceilings_it_measured():
    assert BENCHMARKS["limits"] == "postrain.bench.limits"
    report = run_benchmark("limits", quick=True)
    results, skipped = report["results"], report["config"]["skipped"]
    assert results["threads"] == report["config"]["torch_threads"] >= 1
    for name in FRACTIONS:
        if name in skipped:     # only the sandbox's, where nsjail cannot run, and then with its reason
            assert name == "sandbox_warm_fork_exec_frac" and "nsjail" in skipped[name] and name not in results
            continue
        assert isinstance(results[name], float) and math.isfinite(results[name]) and results[name] > 0, name
    for name in RAW:
        assert math.isfinite(results[name]) and results[name] > 0, name
    approx = lambda value: pytest.approx(value, rel=0.02)     # the figures are rounded
    assert results["learner_peak_frac"] == approx(
        results["learner_step_gflop"] / results["learner_step_s"] / results["matmul_peak_gflops"])
    assert results["prefill_peak_frac"] == approx(results["prefill_gflops"] / results["matmul_peak_gflops"])
    assert results["decode_b1_bandwidth_frac"] == approx(
        results["decode_b1_mb_per_token"] * results["decode_b1_tok_per_s"] / 1e3 / results["mem_bandwidth_gb_per_s"])
    assert results["decode_b32_ceiling_frac"] == approx(
        results["decode_b32_tok_per_s"] / results["decode_b32_ceiling_tok_per_s"])
    if "sandbox_warm_fork_exec_frac" in results:
        assert results["sandbox_warm_fork_exec_frac"] == approx(
            results["bare_fork_exec_ms"] / results["sandbox_warm_run_ms"])


def test_the_matmul_peak_times_torch_matmul_at_the_size_and_thread_count_asked(monkeypatch):
    calls = []
    matmul = torch.matmul

    def spy(a, b, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape), torch.get_num_threads()))
        return matmul(a, b, **kwargs)

    monkeypatch.setattr(torch, "matmul", spy)
    threads = torch.get_num_threads()
    peaks = []
    for num_threads in (1, 2):
        calls.clear()
        peaks.append(limits.matmul_peak_gflops(96, num_threads, repeats=3))
        assert calls == [((96, 96), (96, 96), num_threads)] * 4      # one untimed, then the three timed
        assert torch.get_num_threads() == threads
    assert all(math.isfinite(p) and p > 0 for p in peaks) and peaks[0] != peaks[1]   # two timings, no constant


def test_the_bandwidth_times_copies_of_the_bytes_asked_on_the_threads_asked(monkeypatch):
    calls = []
    copy = torch.Tensor.copy_

    def spy(self, src, *args):
        calls.append((src.nbytes, self.nbytes, torch.get_num_threads()))
        return copy(self, src, *args)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    rates = []
    for num_threads in (1, 2):
        calls.clear()
        rates.append(limits.mem_bandwidth_gb_per_s(2, num_threads, repeats=2))
        assert calls == [(2 * 2**20, 2 * 2**20, num_threads)] * 3
    assert all(math.isfinite(r) and r > 0 for r in rates) and rates[0] != rates[1]


def test_a_steps_flops_are_palms_6n_plus_attention_per_token_with_the_lm_head_on_trained_tokens():
    config = BUILTIN_CONFIGS["tiny"]
    batch = rollout_batch(2, 64, config.vocab_size)      # 8 prompt tokens, 56 trained, per sample
    layers, head = config.num_layer_params(active=True), config.vocab_size * config.hidden_size
    attention = 12 * config.num_layers * config.num_heads * config.head_dim * 64 / 2     # per token
    expected = 2 * (6 * (64 * layers + 56 * head) + 64 * attention)
    assert limits.learner_step_flops(config, batch) == pytest.approx(expected)
    assert limits.prefill_flops(config, 1, 1) == forward_flops(config, 0.5)
