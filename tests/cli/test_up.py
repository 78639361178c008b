"""`postrain up`, `status` and `down` as a user runs them: real head, real actor processes."""
import json
import os
import stat
import subprocess
import sys

import pytest

from postrain.core.testing import counting_run_config


def postrain(*args, **kw):
    return subprocess.run([sys.executable, "-m", "postrain.cli", *args], capture_output=True,
                          text=True, timeout=600, **kw)   # a hang guard: a loaded machine is slow, not wrong


def write_config(tmp_path, steps=3, step_s=0, driver=True):
    text = counting_run_config(tmp_path / "runs", steps=steps, step_s=step_s)
    if not driver:
        text = text.replace('driver = "driver"\n', "")
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_up_runs_the_driver_to_the_end_and_leaves_a_run_folder(tmp_path):
    result = postrain("up", "--config", str(write_config(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert "step 0" in result.stdout and "step 2" in result.stdout
    assert '"steps": 3' in result.stdout
    folder = tmp_path / "runs" / "t"
    assert (folder / "config.toml").exists() and (folder / "logs" / "echo.log").exists()
    assert not (folder / "head.json").exists(), "a finished run leaves no stale head address"


def test_dry_run_prints_the_placement_plan_and_starts_nothing(tmp_path):
    result = postrain("up", "--config", str(write_config(tmp_path)), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "echo: cores [" in result.stdout and "driver: cores [" in result.stdout
    assert not (tmp_path / "runs").exists()


def test_a_broken_config_or_run_folder_fails_before_anything_starts(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[actors]]\nname = "x"\ncls = "m:C"\ncpus = -1\n')
    result = postrain("up", "--config", str(bad))
    assert result.returncode == 2 and "actors.0.cpus = -1: Input should be greater than 0" in result.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = postrain("up", "--config", str(write_config(tmp_path)), "--run-dir", str(blocker))
    assert result.returncode == 2 and "is not writable" in result.stderr


@pytest.mark.parametrize("bind", ["ipc", pytest.param("tcp", marks=pytest.mark.variants)])
def test_status_and_down_talk_to_a_running_head(tmp_path, bind):
    from postrain.core.transport import free_tcp_port
    folder = tmp_path / "runs" / "t"
    config = write_config(tmp_path, driver=False)
    if bind == "tcp":  # on loopback, Curve all the same; head.json gives `status` the client's keys
        config.write_text(config.read_text().replace(
            "[head]\n", f'[head]\nbind = "tcp://127.0.0.1:{free_tcp_port("127.0.0.1")}"\n'))
    head = subprocess.Popen([sys.executable, "-m", "postrain.cli", "up", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, umask=0o000)
    try:
        for line in head.stdout:  # wait for the head's own word that it serves
            if line.startswith("serving"):
                break
        assert json.loads((folder / "head.json").read_text())["address"].startswith(bind)
        assert stat.S_IMODE((folder / "head.json").stat().st_mode) == 0o600, "it holds the control key"
        status = postrain("status", str(folder), "--json")
        assert status.returncode == 0, status.stderr
        actors = {a["name"]: a for a in json.loads(status.stdout)["actors"]}
        assert actors["echo"]["state"] == "running" and actors["echo"]["pid"] > 0
        assert postrain("down", str(folder)).returncode == 0
        assert head.wait(timeout=60) == 0
    finally:
        head.kill()
    if bind == "tcp":
        return
    result = postrain("status", str(folder))
    assert result.returncode == 0 and "is not running" in result.stdout and "--resume" in result.stdout
    (folder / "summary.json").write_text('{"steps": 3}')
    result = postrain("status", str(folder), "--json")
    assert result.returncode == 0 and json.loads(result.stdout) == {
        "state": "finished", "run_folder": str(folder), "summary": {"steps": 3}}
    result = postrain("down", str(folder))
    assert result.returncode == 0 and "has finished; nothing to stop" in result.stdout
    result = postrain("status", str(tmp_path))
    assert result.returncode == 1 and "holds no run" in result.stderr


def test_resume_takes_a_run_folder_whose_head_is_gone(tmp_path):
    from postrain.core.errors import PostrainError
    from postrain.cli.run_folder import resume_config

    folder = tmp_path / "runs" / "t"
    with pytest.raises(PostrainError, match="holds no config.toml"):
        resume_config(folder)
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(write_config(tmp_path).read_text())
    (folder / "head.json").write_text(json.dumps({"pid": os.getpid()}))
    with pytest.raises(PostrainError, match="still going.*postrain down"):
        resume_config(folder)
    (folder / "head.json").unlink()
    config = resume_config(folder)
    assert (config.run.run_dir, config.run.name) == (str(folder.parent.resolve()), "t")
    (folder / "config.toml").write_text(write_config(tmp_path, driver=False).read_text())
    with pytest.raises(PostrainError, match="names no \\[run\\] driver"):
        resume_config(folder)


def test_an_actor_that_fails_in_setup_is_one_line_naming_it_its_error_and_its_log(tmp_path):
    path = write_config(tmp_path)
    path.write_text(path.read_text().replace('cls = "postrain.core.testing:EchoActor"\n',
                                             'cls = "postrain.core.testing:EchoActor"\n'
                                             'options = { fail_setup = true }\n'))
    result = postrain("up", "--quiet", "--config", str(path))
    assert result.returncode == 1, result.stderr
    log_path = tmp_path / "runs" / "t" / "logs" / "echo.log"
    [line] = [line for line in result.stderr.splitlines() if line.startswith("postrain up:")]
    assert line == (f"postrain up: actor echo (postrain.core.testing:EchoActor) failed to start: exited "
                    f"with code 1 before READY: RuntimeError: setup failed on purpose (options.fail_setup); "
                    f"its log: {log_path}")
    assert "Traceback" not in result.stderr and "ExceptionGroup" not in result.stderr
    assert "setup failed on purpose" in log_path.read_text(), "the log holds the whole traceback"
    assert not (tmp_path / "runs" / "t" / "head.json").exists()


def test_a_bad_import_path_is_one_line_naming_the_actor_before_anything_starts(tmp_path):
    path = write_config(tmp_path)
    path.write_text(path.read_text().replace("postrain.core.testing:EchoActor", "postrain.core.testing:Missing"))
    result = postrain("up", "--quiet", "--config", str(path))
    assert result.returncode == 2, result.stderr
    assert "actors.0(echo).cls = 'postrain.core.testing:Missing'" in result.stderr
    assert "has no attribute 'Missing'" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()


def test_the_run_folder_and_its_logs_are_the_run_users_only(tmp_path):
    """Logs, checkpoints and the run tag's secret live there (issue 32): 0700, also for a folder
    that existed before with looser modes."""
    from postrain.cli.run_folder import prepare_run_folder
    from postrain.cli.config import load_up_config

    config = load_up_config(write_config(tmp_path))
    folder = tmp_path / "runs" / "t"
    (folder / "logs").mkdir(parents=True, mode=0o755)
    os.chmod(folder, 0o755)
    assert prepare_run_folder(config) == folder
    for path in (folder, folder / "logs"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path


def test_up_into_a_folder_that_holds_a_run_refuses_naming_resume_and_overwrite(tmp_path):
    """A second run into a run's folder would mix their metrics, ledgers and logs (issue 33)."""
    path = write_config(tmp_path)
    assert postrain("up", "--quiet", "--config", str(path)).returncode == 0
    folder = tmp_path / "runs" / "t"
    (folder / "ledger.jsonl").write_text('{"old": true}\n')
    (folder / "notes.txt").write_text("mine")
    with open(folder / "logs" / "echo.log", "a") as log:
        log.write("OLD RUN\n")
    for extra in ((), ("--dry-run",)):
        result = postrain("up", "--quiet", "--config", str(path), *extra)
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
        assert (f"run folder {folder} already holds a run" in result.stderr
                and f"postrain up --resume {folder}" in result.stderr and "--overwrite" in result.stderr)
    assert (folder / "ledger.jsonl").read_text() == '{"old": true}\n', "nothing was touched"
    result = postrain("up", "--quiet", "--config", str(path), "--overwrite")
    assert result.returncode == 0, result.stderr
    assert not (folder / "ledger.jsonl").exists() and (folder / "notes.txt").read_text() == "mine"
    assert "OLD RUN" not in (folder / "logs" / "echo.log").read_text(), "the logs start over too"
    result = postrain("up", "--resume", str(folder), "--overwrite")
    assert result.returncode == 2 and "give one of them" in result.stderr


def test_a_module_beside_the_config_is_importable_by_the_head_and_every_actor(tmp_path):
    """The config's folder is on the import path of the head and of the actors it spawns; the
    run records it (source.json) for --resume and `postrain eval RUN_FOLDER`."""
    from postrain.actors.configs.run_config import run_import_dir

    (tmp_path / "my_actors.py").write_text(
        "from postrain.core.testing import EchoActor\n\nclass MyEcho(EchoActor):\n    pass\n")
    path = write_config(tmp_path)
    path.write_text(path.read_text().replace("postrain.core.testing:EchoActor", "my_actors:MyEcho"))
    result = postrain("up", "--quiet", "--config", str(path), cwd="/")
    assert result.returncode == 0, result.stderr
    assert run_import_dir(tmp_path / "runs" / "t") == tmp_path.resolve()
    path.write_text(path.read_text().replace("my_actors:MyEcho", "other_pkg.mod:MyEcho"))
    result = postrain("up", "--quiet", "--config", str(path), "--overwrite", cwd="/")
    assert result.returncode == 2, result.stderr
    assert ("No module named 'other_pkg'; fix: put other_pkg beside the run config" in result.stderr
            and "pip install -e" in result.stderr)


def test_set_changes_the_config_for_this_run_and_the_run_folder_keeps_it_as_run(tmp_path, capsys):
    from postrain.cli.main import main

    path = write_config(tmp_path, steps=3)
    result = postrain("up", "--quiet", "--config", str(path), "--set", "driver.steps=2", "--set", "run.name=short")
    assert result.returncode == 0, result.stderr
    assert '"steps": 2' in result.stdout and "step 2" not in result.stdout
    kept = (tmp_path / "runs" / "short" / "config.toml").read_text()
    assert kept.splitlines()[0] == f"# {path} with --set driver.steps=2 run.name=short (written by postrain up)"
    assert "steps = 2" in kept and 'name = "short"' in kept and path.read_text().count("steps = 3") == 1
    for bad, said in [("driver.stepz=2", "actors.1(driver).options.stepz = 2: unknown field"),
                      ("driver.steps=two", "actors.1(driver).options.steps = 'two': Input should be a valid integer"),
                      ("head.heartbeat_interval_s=0", "head.heartbeat_interval_s = 0: Input should be greater than 0"),
                      ("driver.steps", "--set 'driver.steps': write KEY=VALUE")]:
        assert main(["up", "--config", str(path), "--dry-run", "--set", bad]) == 2
        assert said in capsys.readouterr().err


def test_set_on_resume_changes_only_what_the_run_does_not_depend_on(tmp_path):
    from postrain.core.errors import PostrainError
    from postrain.cli.run_folder import resume_config

    folder = tmp_path / "runs" / "t"
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(write_config(tmp_path).read_text())
    with pytest.raises(PostrainError, match=r"^--set driver.steps with --resume: a resumed run keeps the options it "
                                            r"started with .* start a new run to change the rest$"):
        resume_config(folder, ["driver.steps=5"])
    config = resume_config(folder, ["head.heartbeat_timeout_s=50", "echo.memory_mb=64"])
    assert config.head.heartbeat_timeout_s == 50 and config.actors[0].memory_mb == 64
    result = postrain("up", "--resume", str(folder), "--set", "run.name=x")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert "--set run.name with --resume" in result.stderr
