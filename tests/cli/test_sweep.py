"""`postrain sweep` as a user runs it: real `postrain up` runs (a head, an echo actor and a driver
that writes a summary.json whose accuracies depend on its seed and options), the table and the
plot, and `--resume` after a SIGTERM (`kill`; Ctrl-C's SIGINT takes the same path). The driver
module sits beside the config, as a user's would."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from postrain.cli.overrides import OverrideError, set_path
from postrain.cli.sweep import SweepError, parse_seeds, parse_sets

DRIVER = '''
import json
from pathlib import Path

import anyio
from pydantic import Field

from postrain.core.actor import Actor, handler
from postrain.core.testing import RUN, STOP_RUN
from postrain.core.options import Options


class SummaryDriverOptions(Options):
    seed: int = Field(0, description="the run's seed ([shared])")
    gain: float = Field(0.1, description="RL's gain this run reports")
    hold_seed: int = Field(-1, description="the seed whose run waits, while hold_file exists, until stopped")
    hold_file: str = Field("", description="see hold_seed")


class SummaryDriver(Actor):
    """Streams two steps, then writes summary.json: after the warm start 0.3 + 0.01 * seed, after RL
    that plus `gain`. The run of `hold_seed` waits after its first step while `hold_file` exists;
    stopped there, its summary says `"complete": false`."""

    Options = SummaryDriverOptions

    async def setup(self):
        self.stopping = False

    @handler(RUN, concurrent=True)
    async def run(self, body):
        o = self.options
        yield {"line": "step 1"}
        while o.seed == o.hold_seed and Path(o.hold_file).exists() and not self.stopping:
            await anyio.sleep(0.05)
        start = 0.3 + 0.01 * o.seed
        summary = {"eval_before": 0.0, "eval_after_sft": start, "eval_after": start + o.gain,
                   "wall_s": 1.0 + o.seed, "complete": not self.stopping}
        # as the real driver: a run stopped during RL writes the summary of its steps so far
        Path(body["run_folder"], "summary.json").write_text(json.dumps(summary))
        yield {"summary": summary}

    @handler(STOP_RUN)
    async def stop(self, body):
        self.stopping = True
'''


def write_config(tmp_path, hold_seed: int = -1):
    (tmp_path / "sweep_driver.py").write_text(DRIVER)
    config = tmp_path / "run.toml"
    config.write_text(f"""
[run]
name = "x"
run_dir = "{tmp_path / 'ignored'}"
driver = "driver"
[[actors]]
name = "echo"
cls = "postrain.core.testing:EchoActor"
cpus = 0.25
memory_mb = 0
[[actors]]
name = "driver"
cls = "sweep_driver:SummaryDriver"
cpus = 0.25
memory_mb = 0
options = {{ hold_seed = {hold_seed}, hold_file = "{tmp_path / 'hold'}" }}
""")
    return config


def sweep(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "postrain.cli", "sweep", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def test_arguments_are_parsed_and_bad_ones_named():
    assert parse_seeds("0-3,7") == [0, 1, 2, 3, 7]
    assert parse_sets(["learner.rl_lr=1e-4,3e-4"]) == [("learner.rl_lr", [1e-4, 3e-4])]
    assert parse_sets(["learner.loss_preset=gspo,cispo"]) == [("learner.loss_preset", ["gspo", "cispo"])]
    # a comma inside a table or an array is the value's own
    assert parse_sets(["shared.task_options={ max_digits = 2, min_operands = 3 },{ max_digits = 3 }"]) == [
        ("shared.task_options", [{"max_digits": 2, "min_operands": 3}, {"max_digits": 3}])]
    assert parse_sets(["learner.betas=[0.9, 0.95]"]) == [("learner.betas", [[0.9, 0.95]])]
    doc = {"actors": [{"name": "learner", "options": {"learner": {"lr": 1.0}}}], "shared": {}}
    set_path(doc, "learner.rl_lr", 1e-4)
    set_path(doc, "shared.seed", 3)
    assert doc["actors"][0]["options"]["learner"] == {"lr": 1.0, "rl_lr": 1e-4} and doc["shared"]["seed"] == 3
    with pytest.raises(SweepError, match=r"--seeds: '5-2' is not a seed or a range"):
        parse_seeds("5-2")
    with pytest.raises(SweepError, match="write KEY=V1,V2"):
        parse_sets(["learner.rl_lr"])
    with pytest.raises(OverrideError, match="neither a section of the config"):
        set_path(doc, "actors.x", 1)


@pytest.mark.parametrize("argv, expected", [
    (["--seeds", "x"], "postrain sweep: --seeds: 'x' is not a seed or a range"),
    (["--set", "learner.rl_lr=-1", "--seeds", "0"], "rl_lr must be > 0 or unset, got -1.0"),
    (["--set", "nobody.x=1", "--seeds", "0"], "nobody: unknown field"),
    (["--parallel", "0"], "--parallel must be >= 1, got 0"),
    (["--config", "nope.toml"], "--config nope.toml: no such file"),
])
def test_bad_inputs_are_one_line_naming_the_fix(tmp_path, argv, expected):
    from postrain.cli.main import main
    with pytest.raises(SystemExit) as exc:
        main(["sweep", "--sweep-dir", str(tmp_path / "sw"), *argv])
    assert isinstance(exc.value.code, str) and "\n" not in exc.value.code and expected in exc.value.code
    assert not (tmp_path / "sw").exists()           # nothing started


def test_a_run_collapsed_when_its_reward_or_accuracy_fell_by_half_not_when_only_its_entropy_did(tmp_path):
    from postrain.cli.sweep_table import collapsed
    from postrain.core.metrics import MetricsWriter

    def run(accuracy_after: float, *warnings: str) -> bool:
        folder = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        metrics = MetricsWriter(folder, tensorboard=False)
        for code in warnings:
            metrics.log("warning", code=code, step=40)
        metrics.close()
        return collapsed({"eval_after_sft": 0.64, "eval_after": accuracy_after}, folder)

    assert not run(1.0, "entropy_collapse")      # a solved task samples one answer per prompt too
    assert run(1.0, "reward_collapse") and run(1.0, "accuracy_collapse")
    assert run(0.3) and not run(0.33)


def test_target_counts_the_runs_that_reached_it_and_times_the_first_evaluation_at_it(tmp_path):
    from postrain.cli.sweep_table import build_table, format_table, target_figures
    from postrain.core.metrics import MetricsWriter

    def run(seed: int, *evals: tuple[int, float, float]) -> dict:
        folder = tmp_path / f"seed{seed}"
        folder.mkdir()
        metrics = MetricsWriter(folder, tensorboard=False)
        metrics.log("eval", phase="before", accuracy=0.1, eval_s=1.0)
        for step, rl_wall_s, accuracy in evals:
            metrics.log("eval", phase=f"step_{step}", step=step, rl_wall_s=rl_wall_s, accuracy=accuracy)
        metrics.close()
        return {"seed": seed, "overrides": {}, "summary": {"eval_before": 0.1, "eval_after": evals[-1][2]},
                "target_figures": target_figures(folder, 0.6)}

    runs = [run(0, (10, 100.0, 0.5), (20, 210.0, 0.6), (30, 320.0, 0.7)),    # equal to the target counts
            run(1, (10, 90.0, 0.61), (20, 200.0, 0.4)),                       # the first reach, not the last
            run(2, (10, 95.0, 0.3), (20, 190.0, 0.59))]                       # never reached
    assert runs[2]["target_figures"] == {}
    row, = build_table(runs, target=0.6)
    assert row["reached_target"] == 2
    assert row["figures"]["steps_to_target"] == {"min": 10.0, "median": 15.0, "max": 20.0, "n": 2}
    assert row["figures"]["rl_s_to_target"]["max"] == 210.0
    assert "3/3 runs finished, 0 collapsed, 2/3 reached 0.6" in format_table([row])[0]
    assert "reached_target" not in build_table(runs)[0]    # without --target, no such figures


@pytest.mark.slow
def test_a_sweep_tables_and_plots_the_spread_over_seeds_and_overrides(tmp_path):
    out = tmp_path / "sw"
    proc = sweep("--config", str(write_config(tmp_path)), "--seeds", "0-1", "--set", "driver.gain=0.1,0.3",
                 "--parallel", "2", "--sweep-dir", str(out))
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, text
    doc = json.loads((out / "sweep.json").read_text())
    assert [r["status"] for r in doc["runs"]] == ["finished"] * 4
    low, high = doc["table"]
    assert low["overrides"] == {"driver.gain": 0.1} and low["seeds"] == [0, 1]
    assert low["figures"]["eval_after_sft"] == {"min": 0.3, "median": 0.305, "max": 0.31, "n": 2}
    assert low["figures"]["rl_gain"]["median"] == pytest.approx(0.1)
    assert high["figures"]["rl_gain"]["min"] == pytest.approx(0.3) and high["figures"]["wall_s"]["max"] == 2.0
    assert low["collapses"] == 0
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "driver.gain=0.3: 2/2 runs finished, 0 collapsed" in text and "rl_gain" in text


@pytest.mark.faults   # a SIGTERM mid-sweep: the fault matrix, pytest -m faults (CI time)
def test_resume_after_a_sigterm_keeps_finished_runs_and_runs_the_rest(tmp_path):
    out = tmp_path / "sw"
    (tmp_path / "hold").write_text("")
    config = write_config(tmp_path, hold_seed=1)
    proc = sweep("--config", str(config), "--seeds", "0-1", "--parallel", "2", "--sweep-dir", str(out))
    log = out / "_logs" / "seed1.log"
    deadline = time.monotonic() + 600    # hang guards: a loaded machine is slow, not wrong
    while not ((out / "seed0" / "summary.json").exists() and log.exists() and "step 1" in log.read_text()):
        # until seed 0's run has finished and seed 1's waits inside its hold
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130, text
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["interrupted"] and [r["status"] for r in doc["runs"]] == ["finished", "interrupted"]
    assert not json.loads((out / "seed1" / "summary.json").read_text())["complete"]
    assert doc["table"][0]["figures"]["eval_after_sft"]["n"] == 1    # the stopped run is not counted
    first_summary = (out / "seed0" / "summary.json").stat().st_mtime_ns

    (tmp_path / "hold").unlink()
    proc = sweep("--config", str(config), "--seeds", "0-1", "--sweep-dir", str(out), "--resume")
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, text
    doc = json.loads((out / "sweep.json").read_text())
    assert [r["status"] for r in doc["runs"]] == ["finished"] * 2 and not doc["interrupted"]
    assert (out / "seed0" / "summary.json").stat().st_mtime_ns == first_summary     # not run again
    assert "seed0: started" not in text and doc["table"][0]["figures"]["eval_after_sft"]["n"] == 2
    # a sweep folder is not reused without --resume
    again = sweep("--config", str(config), "--seeds", "0", "--sweep-dir", str(out))
    assert again.wait(timeout=300) != 0 and "pass --resume to continue it" in again.stdout.read()


WAITS_FOR_SIGINTS = '''
import pathlib, signal, sys, time
folder, wanted, got = pathlib.Path(sys.argv[1]), int(sys.argv[2]), []
signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
(folder / "ready").write_text("")
deadline = time.monotonic() + 300
while len(got) < wanted and time.monotonic() < deadline:
    if got:
        (folder / "first_sigint").write_text("")
    time.sleep(0.01)
(folder / "sigints").write_text(str(len(got)))
sys.exit(130)
'''


@pytest.mark.parametrize("num_signals", [1, 2])
def test_a_signal_as_a_run_starts_stops_it_and_each_signal_reaches_the_runs(tmp_path, monkeypatch, num_signals):
    """A SIGTERM that comes while a run is being started (here: just after its process began):
    the run is tracked and gets a SIGINT, and a second SIGTERM a second one; no later run starts,
    and the sweep returns only after the run has exited."""
    from postrain.cli import sweep as sweep_module

    script = tmp_path / "waits.py"
    script.write_text(WAITS_FOR_SIGINTS)
    monkeypatch.setattr(sweep_module, "_command",
                        lambda run, config_file: [sys.executable, str(script), run["folder"], str(num_signals)])
    start = sweep_module._start

    def second_signal(folder: Path):     # once the first has reached the run (signals do not queue)
        deadline = time.monotonic() + 300
        while not (folder / "first_sigint").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    def start_then_signal(run, sweep_dir, import_dir):
        proc = start(run, sweep_dir, import_dir)
        folder = Path(run["folder"])
        while not (folder / "ready").exists():   # its SIGINT handler is in place
            assert proc.poll() is None
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        if num_signals == 2:
            threading.Thread(target=second_signal, args=(folder,), daemon=True).start()
        return proc

    monkeypatch.setattr(sweep_module, "_start", start_then_signal)
    runs = []
    for seed in range(2):
        folder = tmp_path / f"seed{seed}"
        folder.mkdir()
        runs.append({"name": f"seed{seed}", "folder": str(folder), "doc": {"shared": {"seed": seed}},
                     "status": "pending"})
    assert threading.current_thread() is threading.main_thread()     # where Python runs signal handlers
    assert sweep_module.execute(runs, 1, tmp_path, tmp_path) is False
    assert (tmp_path / "seed0" / "sigints").read_text() == str(num_signals)
    assert [r["status"] for r in runs] == ["interrupted", "pending"]
    assert not (tmp_path / "seed1" / "ready").exists()
