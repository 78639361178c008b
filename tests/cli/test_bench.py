"""`postrain bench`: `all` selects every registered benchmark and prints one table.

Only the cheap kvpool benchmark actually runs here (quick mode); the heavy ones are skipped."""
import subprocess
import sys

import pytest

from postrain.bench import BENCHMARKS, format_table
from postrain.cli.bench import select


def test_all_selects_every_registered_benchmark_in_order_minus_the_skipped():
    assert select("all", "", BENCHMARKS) == list(BENCHMARKS)
    assert select("all", "generate,learner", BENCHMARKS) == [n for n in BENCHMARKS if n not in ("generate", "learner")]
    assert select("kvpool,sandbox", "", BENCHMARKS) == ["kvpool", "sandbox"]
    with pytest.raises(SystemExit, match="unknown benchmark 'nope'; choose from: messaging"):
        select("all", "nope", BENCHMARKS)


def test_a_quick_run_of_all_prints_one_table_of_bench_figure_ours_peer_ratio():
    heavy = ",".join(name for name in BENCHMARKS if name != "kvpool")
    result = subprocess.run([sys.executable, "-m", "postrain.cli", "bench", "all", "--quick", "--skip", heavy],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    header, *rows = result.stdout.strip().splitlines()
    assert header.split() == ["bench", "figure", "ours", "peer", "ratio"]
    figures = {row.split()[1]: row.split() for row in rows}
    assert {"alloc_free_ops_per_s", "append_batch_ops_per_s", "prefix_lookup_4096_us"} <= set(figures)
    for cells in figures.values():
        assert cells[0] == "kvpool" and len(cells) == 5
        ours, peer, ratio = (float(cell.replace(",", "")) for cell in cells[2:])
        assert ours > 0 and peer > 0 and ratio == pytest.approx(ours / peer, rel=0.02, abs=0.002)


def test_a_failed_benchmark_is_an_error_row_in_the_table():
    table = format_table([{"bench": "kvpool", "results": {"ops_per_s": 2000.0}, "peer": {"ops_per_s": 1000.0},
                           "ratio": {"ops_per_s": 2.0}},
                          {"bench": "generate", "error": "FileNotFoundError: no model"}])
    lines = table.splitlines()
    assert lines[1].split() == ["kvpool", "ops_per_s", "2,000", "1,000", "2"]
    assert lines[2].split()[:3] == ["generate", "error:", "FileNotFoundError:"]


def test_the_default_run_bench_compares_the_shipped_config_with_its_elastic_actors_pinned():
    import re

    from postrain.bench.default_run import arm_config
    from postrain.cli.up import default_config_path
    shipped = default_config_path().read_text()
    assert arm_config(True, quick=False) == shipped, "ours is the default run as shipped"
    pinned = arm_config(False, quick=True)
    assert re.findall(r"^elastic = (\w+)", pinned, re.M) == ["false", "false"]
    assert "sft_steps = 20" in pinned and "num_steps = 2," in pinned and "num_eval_tasks = 10" in pinned


def test_the_scorers_bench_counts_top_k_rows_on_the_wire_against_full_vocabulary_rows():
    from postrain.bench.scorers import judged_group, topk_and_full_bytes
    assert BENCHMARKS["scorers"] == "postrain.bench.scorers"
    rows = 100 + 120
    topk, full = topk_and_full_bytes([100, 120], 49152, 32)
    assert rows * (32 * 8 + 2 * 4) <= topk < rows * (32 * 8 + 2 * 4) + 2048     # ids int32, log-probs float32
    assert rows * 49152 * 4 <= full < rows * 49152 * 4 + 1024 and topk / full <= 0.02
    group = judged_group()
    assert len(group) == 16 and len(set(group)) == 4


def test_the_mixture_bench_runs_the_four_tasks_together_and_each_alone_on_the_default_actors():
    from postrain.actors.env.actor import EnvironmentOptions
    from postrain.actors.orchestrator.options import OrchestratorOptions
    from postrain.bench.e2e import default_run_config
    from postrain.bench.mixture import TASKS, arm_specs
    config = default_run_config()
    together = {spec.name: spec.options for spec in arm_specs(config, TASKS, 3, seed=2)}
    alone = {spec.name: spec.options for spec in arm_specs(config, TASKS[2:3], 3)}
    assert [t["name"] for t in together["env"]["tasks"]] == [t["name"] for t in together["orchestrator"]["tasks"]] \
        == ["arithmetic", "mental", "chain_sum", "code"] and alone["env"]["tasks"] == [TASKS[2]]
    for options in (together, alone):   # what the actors will check when they start
        EnvironmentOptions(**options["env"])
        driver = OrchestratorOptions(**options["orchestrator"])
        assert driver.sft_steps == 0 and driver.num_eval_tasks == 0
    assert {together[name]["seed"] for name in ("generator", "learner", "orchestrator")} == {2}   # the draws differ
    assert OrchestratorOptions(**together["orchestrator"]).num_steps == OrchestratorOptions(
        **alone["orchestrator"]).num_steps == 3
