"""`postrain up` under faults, as an operator meets them: an actor killed while it loads, Ctrl-C,
SIGTERM and `postrain down` in start-up and while the driver runs. Every stop leaves no process,
no shared memory and no head.json, and a run folder that `--resume` accepts."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from postrain.cli.control import ask_head
from postrain.core.control import SHUTDOWN, STATUS
from postrain.cli.run_folder import resume_config
from postrain.core.supervisor import run_tag_for
from postrain.core.testing import assert_nothing_left, counting_run_config

ECHO_CLS = 'cls = "postrain.core.testing:EchoActor"\n'


def write_config(tmp_path, *, setup_s=0.0, steps=3, step_s=0.0) -> Path:
    text = counting_run_config(tmp_path / "runs", steps=steps, step_s=step_s, heartbeat_interval_s=0.2)
    text = text.replace(ECHO_CLS, ECHO_CLS + f"options = {{ setup_s = {setup_s} }}\n")
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def start_head(path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "postrain.cli", "up", "--quiet", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # lines as they are printed


def echo_pid_in_setup(folder: Path, timeout_s: float = 30.0) -> int:
    """The echo actor's pid once its heartbeats say its slow setup runs (asked of the head)."""
    async def poll():
        with anyio.fail_after(timeout_s):
            while True:
                if (folder / "head.json").exists():
                    actors = {a.name: a for a in (await ask_head(str(folder), STATUS)).actors}
                    if "echo" in actors and actors["echo"].note.startswith("loading"):
                        return actors["echo"].pid
                await anyio.sleep(0.1)
    return anyio.run(poll, backend="trio")


def wait_for_line(head: subprocess.Popen, prefix: str) -> None:
    for line in head.stdout:
        if line.startswith(prefix):
            return
    raise AssertionError(f"the head ended before printing {prefix!r}")


def assert_stopped_cleanly(head: subprocess.Popen, folder: Path, status: int) -> str:
    out, err = head.communicate(timeout=60)
    assert head.returncode == status, err
    assert "Traceback" not in err and "ExceptionGroup" not in err, err
    assert not (folder / "head.json").exists()
    assert_nothing_left(run_tag_for(str(folder.resolve())))
    assert resume_config(folder).run.name == "t", "--resume accepts the folder"
    return out


@pytest.mark.faults   # a kill while loading: the fault matrix, pytest -m faults (CI time)
def test_an_actor_killed_while_it_loads_is_started_again_and_the_run_goes_on(tmp_path):
    folder = tmp_path / "runs" / "t"
    head = start_head(write_config(tmp_path, setup_s=2))
    try:
        os.kill(echo_pid_in_setup(folder), signal.SIGKILL)  # the OOM killer during a model load
        out = assert_stopped_cleanly(head, folder, 0)
    finally:
        head.kill()
    assert '"steps": 3' in out


@pytest.mark.parametrize("how", ["SIGINT", pytest.param("down", marks=pytest.mark.faults)])  # down: the full matrix
def test_a_stop_during_start_up_stops_every_actor_and_leaves_nothing(tmp_path, how):
    folder = tmp_path / "runs" / "t"
    head = start_head(write_config(tmp_path, setup_s=30))
    try:
        echo_pid_in_setup(folder)
        if how == "down":
            assert anyio.run(ask_head, str(folder), SHUTDOWN, backend="trio") is None
        else:
            head.send_signal(signal.SIGINT)  # Ctrl-C
        out = assert_stopped_cleanly(head, folder, 0 if how == "down" else 128 + signal.SIGINT)
    finally:
        head.kill()
    assert "stopped during start-up" in out and "started driver" not in out


def test_sigterm_while_the_driver_runs_ends_the_run_cleanly_with_its_summary(tmp_path):
    folder = tmp_path / "runs" / "t"
    head = start_head(write_config(tmp_path, steps=200, step_s=0.05))
    try:
        wait_for_line(head, "step 1")
        head.send_signal(signal.SIGTERM)
        out = assert_stopped_cleanly(head, folder, 128 + signal.SIGTERM)
    finally:
        head.kill()
    summary, _ = json.JSONDecoder().raw_decode(out[out.index("{"):])
    assert 0 < summary["steps"] < 200, "the driver stopped early, after a whole step"
    assert f"stopped at step {summary['steps']} of 200; resume with `postrain up --resume {folder}`" in out


def test_a_driver_that_does_not_end_within_stop_grace_s_is_stopped_anyway(tmp_path):
    folder = tmp_path / "runs" / "t"
    path = write_config(tmp_path, steps=5, step_s=600)  # a step the driver will not cut short
    path.write_text(path.read_text().replace("[head]\n", "[head]\nstop_grace_s = 1\n"))
    head = start_head(path)
    try:
        wait_for_line(head, "step 0")
        head.send_signal(signal.SIGTERM)
        out = assert_stopped_cleanly(head, folder, 128 + signal.SIGTERM)
    finally:
        head.kill()
    assert "did not end within stop_grace_s = 1 s" in out and '"steps"' not in out
